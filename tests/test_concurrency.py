"""The adaptive concurrency controller and the engine load meter, fed synthetic numbers:
no Ray, no engine."""

from __future__ import annotations

import math
import re
import random

import pytest

from raytunix.rollout.concurrency import ConcurrencyController, EngineLoadMeter


def controller(**kwargs) -> ConcurrencyController:
    args = dict(initial=4, minimum=4, maximum=256, target_busy=0.9, granularity=4)
    args.update(kwargs)
    return ConcurrencyController(**args)


def saturating_engine(episodes: int, scale: float = 30.0) -> float:
    """Busy fraction of an engine whose episodes spend most of their time on tools: it
    grows with the episodes in flight and saturates (1 - exp(-n / scale))."""
    return 1.0 - math.exp(-episodes / scale)


def test_rises_while_the_engine_idles_and_stops_at_the_maximum():
    c = controller(maximum=64)
    budgets = [c.update(0.1) for _ in range(30)]
    assert budgets[-1] == 64
    assert all(b2 >= b1 for b1, b2 in zip(budgets, budgets[1:]))
    assert max(budgets) == 64
    # Doubling at most per change, so 4 -> 64 takes four changes.
    assert c.changes == 4


def test_one_low_reading_is_not_enough_and_the_reading_after_a_change_is_ignored():
    c = controller(patience=2)
    assert c.update(0.1) == 4  # one reading below the band: hold
    assert c.update(0.1) == 8  # two in a row: raise
    assert c.update(0.1) == 8  # straddles the change: ignored
    assert c.update(0.1) == 8  # one clean reading
    assert c.update(0.1) == 16


def test_a_reading_inside_the_dead_band_resets_the_streak():
    c = controller(patience=2)
    for busy in (0.1, 0.88, 0.1, 0.92, 0.1, 0.9):
        assert c.update(busy) == 4
    assert c.changes == 0


def test_settles_near_the_target_on_a_saturating_engine_without_oscillating():
    rng = random.Random(0)
    c = controller()
    history = []
    for _ in range(60):
        busy = min(1.0, max(0.0, saturating_engine(c.budget) + rng.uniform(-0.02, 0.02)))
        history.append((c.update(busy), busy))
    settled = history[-30:]
    assert len({b for b, _ in settled}) <= 2  # at most one late nudge, no swinging
    final = history[-1][0]
    assert abs(saturating_engine(final) - 0.9) <= 0.05 + 0.02
    # Never far above what the target needs (about 69 episodes on this engine).
    assert max(b for b, _ in history) <= 80


def test_falls_when_saturated_and_never_below_the_minimum():
    c = controller(initial=128, minimum=16)
    budgets = [c.update(1.0) for _ in range(60)]
    assert budgets[1] < 128
    assert all(b2 <= b1 for b1, b2 in zip(budgets, budgets[1:]))
    assert budgets[-1] == 16


def test_a_lowering_step_is_proportional_and_at_most_a_halving():
    c = controller(initial=100, granularity=1, patience=1)
    assert c.update(1.0) == 90  # 100 * 0.9 / 1.0
    c = controller(initial=100, granularity=1, patience=1, target_busy=0.4, dead_band=0.05)
    assert c.update(1.0) == 50  # 0.4 would be 40: clipped to a halving


def test_does_not_wind_up_when_the_budget_is_not_what_holds_episodes_back():
    c = controller()
    for _ in range(10):
        assert c.update(0.1, limit_reached=False) == 4  # staleness admission held them
        assert c.update(0.1, backpressure=True) == 4  # learner or engine queue full
    # Backpressure never stops a lowering.
    c = controller(initial=64)
    c.update(1.0, backpressure=True, limit_reached=False)
    assert c.update(1.0, backpressure=True, limit_reached=False) < 64


def test_budget_moves_in_whole_groups_within_the_bounds():
    c = controller(initial=8, minimum=8, maximum=40, granularity=8)
    rng = random.Random(1)
    for _ in range(200):
        budget = c.update(rng.random())
        assert 8 <= budget <= 40
        assert budget % 8 == 0 or budget == 40


@pytest.mark.parametrize(
    "kwargs,name",
    [
        (dict(initial=0), "initial"),
        (dict(minimum=8, initial=4), "minimum <= initial"),
        (dict(maximum=2), "initial <= maximum"),
        (dict(target_busy=1.5), "target_busy"),
        (dict(target_busy=0.0), "target_busy"),
        (dict(dead_band=0.95), "dead_band"),
        (dict(max_step=1.0), "max_step"),
        (dict(patience=0), "patience"),
    ],
)
def test_bad_arguments_are_named(kwargs, name):
    with pytest.raises(ValueError, match=name):
        controller(**kwargs)


def test_a_busy_fraction_outside_zero_one_is_refused():
    with pytest.raises(ValueError, match="busy_fraction=1.5"):
        controller().update(1.5)
    with pytest.raises(ValueError, match="busy_fraction=nan"):
        controller().update(float("nan"))


# -- the meter ----------------------------------------------------------------------------------


def stats(busy_s, wall_s, waiting=0, preemptions=0):
    return {
        "busy_s": busy_s,
        "wall_s": wall_s,
        "waiting": waiting,
        "preemptions": preemptions,
        "busy_fraction": busy_s / wall_s if wall_s else 0.0,
    }


def test_meter_reports_the_window_mean_over_replicas_not_the_run_average():
    meter = EngineLoadMeter()
    assert meter.update([stats(10.0, 100.0), stats(0.0, 100.0)]) is None  # no window yet
    load = meter.update([stats(11.8, 102.0), stats(1.0, 102.0)])  # 0.9 and 0.5 busy
    assert load.busy_fraction == pytest.approx(0.7)
    assert load.window_s == pytest.approx(2.0)
    assert not load.saturated


def test_meter_sees_saturation_in_waiting_requests_or_preemptions():
    meter = EngineLoadMeter()
    meter.update([stats(0.0, 1.0)])
    assert meter.update([stats(0.9, 2.0, waiting=3)]).saturated
    assert meter.update([stats(1.8, 3.0, preemptions=1)]).saturated
    assert not meter.update([stats(2.7, 4.0, preemptions=1)]).saturated


def test_meter_restarts_its_window_after_a_replica_restart_or_a_new_replica():
    meter = EngineLoadMeter()
    meter.update([stats(5.0, 10.0)])
    assert meter.update([stats(0.1, 0.5)]) is None  # counters went back: restarted
    assert meter.update([stats(0.6, 1.5)]).busy_fraction == pytest.approx(0.5)
    assert meter.update([stats(1.0, 2.5), stats(0.0, 0.0)]) is None  # a second replica came
    load = meter.update([stats(1.5, 3.5), stats(0.0, 0.0)])
    assert load.busy_fraction == pytest.approx(0.25)  # the unused replica counts as idle


def test_meter_rejects_stats_without_the_counters_it_needs():
    with pytest.raises(ValueError, match="busy_s"):
        EngineLoadMeter().update([{"wall_s": 1.0, "waiting": 0, "preemptions": 0}])
    with pytest.raises(ValueError, match="no replica"):
        EngineLoadMeter().update([])


# -- from the config -------------------------------------------------------------------------------


def test_from_config_starts_at_max_concurrent_episodes_with_bounds_from_the_run():
    from raytunix.config import load_config

    rollout = load_config(
        overrides=[
            "rollout.max_concurrent_episodes=16",
            "rollout.group_size=4",
            "rollout.groups_per_batch=8",
            "rollout.max_staleness=2",
        ]
    ).rollout
    c = ConcurrencyController.from_config(rollout)
    assert (c.budget, c.minimum, c.granularity, c.target_busy) == (16, 4, 4, 0.9)
    assert c.maximum == 3 * 8 * 4  # the most the staleness rule ever admits
    rollout.adaptive_min_episodes, rollout.adaptive_max_episodes = 8, 40
    c = ConcurrencyController.from_config(rollout)
    assert (c.minimum, c.maximum) == (8, 40)


@pytest.mark.parametrize(
    "override,message",
    [
        ("rollout.target_engine_busy=1.2", "rollout.target_engine_busy=1.2"),
        ("rollout.target_engine_busy=0", "rollout.target_engine_busy=0"),
        ("rollout.adaptive_min_episodes=512", "rollout.adaptive_min_episodes=512"),
        ("rollout.adaptive_max_episodes=64", "rollout.adaptive_max_episodes=64"),
        ("rollout.adaptive_interval_s=0", "rollout.adaptive_interval_s=0"),
        ("rollout.dynamic_sampling_max_filtered=-1", "rollout.dynamic_sampling_max_filtered=-1"),
    ],
)
def test_bad_adaptive_and_dynamic_sampling_keys_are_named(override, message):
    from raytunix.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(overrides=[override])
