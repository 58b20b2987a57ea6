"""Adaptive concurrency and dynamic sampling in the orchestrator, in-process: the scripted
engine and calculator environments of ``test_orchestrator``, no Ray."""

from __future__ import annotations

import asyncio
import logging
import re
import time

import pytest

from raytunix.rollout.concurrency import ConcurrencyController
from raytunix.rollout.ledger import TaskLedger
from raytunix.types import EngineFailure, FinishReason, GenerationResult

from test_orchestrator import (  # the fakes every orchestrator test shares
    TOKENIZER,
    EnvLeases,
    FakeEngine,
    index_of,
    learner_loop,
    make_orchestrator,
    run,
)

_QUESTION = re.compile(r"Calculate (\d+) \+ (\d+)\.")


class LoadReportingEngine(FakeEngine):
    """The scripted engine, plus ``engine_stats()`` as ``RayEngineClient`` has it: one
    stats dict per replica whose busy seconds grow at ``busy[r]()`` of the wall time since
    the last reading, with ``waiting()`` requests queued.

    Args:
      busy: per replica, a callable giving the busy fraction to report now.
      waiting: requests queued in the engine (> 0: saturated).
      fail_stats: readings that raise ``EngineFailure`` (an engine restarting).
    """

    def __init__(self, busy=(lambda: 0.2,), waiting=lambda: 0, fail_stats=0, **kwargs):
        super().__init__(**kwargs)
        self.busy = list(busy)
        self.waiting = waiting
        self.fail_stats = fail_stats
        self._t0 = time.monotonic()
        self._counters = [{"busy_s": 0.0, "wall_s": 0.0} for _ in self.busy]
        self.readings = 0

    async def engine_stats(self) -> list[dict]:
        self.readings += 1
        if self.fail_stats:
            self.fail_stats -= 1
            raise EngineFailure("engine actor restarting")
        wall = time.monotonic() - self._t0
        out = []
        for busy, counters in zip(self.busy, self._counters):
            counters["busy_s"] += busy() * (wall - counters["wall_s"])
            counters["wall_s"] = wall
            out.append({**counters, "waiting": self.waiting(), "preemptions": 0})
        return out


def adaptive(engine, leases=None, *, initial=4, minimum=4, maximum=32, target=0.9, **kwargs):
    controller = ConcurrencyController(
        initial=initial, minimum=minimum, maximum=maximum, target_busy=target, granularity=2
    )
    args = dict(
        group_size=2,
        groups_per_batch=2,
        max_staleness=15,
        batch_queue_size=2,
        concurrency=controller,
        concurrency_interval_s=0.01,
    )
    args.update(kwargs)
    return make_orchestrator(engine, leases, max_concurrent_episodes=initial, **args)


async def consume_until(orchestrator, engine, done, max_batches=400):
    """The driver's loop until ``done(info)``; returns the infos of every batch."""
    infos = []
    while len(infos) < max_batches:
        [(_, info, _)] = await learner_loop(orchestrator, engine, 1)
        infos.append(info)
        if done(info):
            break
    return infos


# -- adaptive concurrency ------------------------------------------------------------------------


def test_budget_rises_while_the_engine_reports_idle_and_never_exceeds_the_maximum():
    async def main():
        # Each generate call sleeps 20 ms, so episodes wait on the engine and the learner
        # loop keeps up. With a 2 ms engine the producer, the scripted episodes and this loop
        # share one event loop's CPU; at 16 episodes the batch queue was full in 69 of 74
        # readings, the controller rightly read that as the learner falling behind and held
        # the budget (CI saw it stuck at 16 of 32 twice).
        engine = LoadReportingEngine(delay=lambda r: 0.02)
        leases = EnvLeases()
        orchestrator = adaptive(engine, leases, maximum=32)
        infos = await consume_until(
            orchestrator, engine, lambda info: info["max_concurrent_episodes"] == 32
        )
        # Keep going at the maximum a while: it must hold there.
        infos += await consume_until(orchestrator, engine, lambda info: False, max_batches=40)
        stats = orchestrator.stats()
        await orchestrator.stop()
        return infos, leases, stats

    infos, leases, stats = run(main())
    budgets = [info["max_concurrent_episodes"] for info in infos]
    assert budgets[0] >= 4 and budgets[-1] == 32
    assert all(b2 >= b1 for b1, b2 in zip(budgets, budgets[1:]))  # idle engine: never lower
    assert max(budgets) == 32 and leases.max_outstanding <= 32
    assert leases.max_outstanding > 16  # the raised budget was used
    assert all(info["staleness_max"] <= 15 for info in infos)  # admission still applies
    readings = [
        info["engine_busy_fraction_last_window"]
        for info in infos
        if "engine_busy_fraction_last_window" in info
    ]
    assert readings and all(r == pytest.approx(0.2, abs=0.05) for r in readings)
    assert stats["max_concurrent_episodes"] == 32 and stats["concurrency_changes"] == 3


def test_budget_does_not_wind_up_while_the_staleness_rule_holds_groups_back():
    async def main():
        engine = LoadReportingEngine(delay=lambda r: 0.002)
        # Zero staleness: at most one batch (2 groups = 4 episodes) may start per version,
        # so a budget of 4 never binds and the idle engine is no reason to raise it.
        orchestrator = adaptive(engine, max_staleness=0, initial=4, maximum=64)
        infos = await consume_until(orchestrator, engine, lambda info: False, max_batches=60)
        readings = engine.readings
        await orchestrator.stop()
        return infos, readings

    infos, readings = run(main())
    assert readings >= 5  # the controller did look, several times
    assert {info["max_concurrent_episodes"] for info in infos} == {4}
    assert all(info["staleness_max"] == 0 for info in infos)


def test_budget_falls_to_the_minimum_when_the_engine_is_saturated():
    async def main():
        engine = LoadReportingEngine(busy=(lambda: 1.0,), waiting=lambda: 5, delay=lambda r: 0.002)
        orchestrator = adaptive(engine, initial=32, minimum=8, maximum=64)
        infos = await consume_until(
            orchestrator, engine, lambda info: info["max_concurrent_episodes"] == 8
        )
        infos += await consume_until(orchestrator, engine, lambda info: False, max_batches=20)
        await orchestrator.stop()
        return infos

    budgets = [info["max_concurrent_episodes"] for info in run(main())]
    assert budgets[-1] == 8 and min(budgets) == 8
    assert all(b2 <= b1 for b1, b2 in zip(budgets, budgets[1:]))


def test_engine_queueing_stops_a_raise_even_below_the_target():
    async def main():
        engine = LoadReportingEngine(busy=(lambda: 0.6,), waiting=lambda: 3, delay=lambda r: 0.002)
        orchestrator = adaptive(engine, initial=8, maximum=64)
        infos = await consume_until(orchestrator, engine, lambda info: False, max_batches=60)
        await orchestrator.stop()
        return infos, engine.readings

    infos, readings = run(main())
    assert readings >= 5
    assert {info["max_concurrent_episodes"] for info in infos} == {8}


def test_several_replicas_are_averaged_and_a_fleet_at_target_holds_the_budget():
    async def main(busy):
        engine = LoadReportingEngine(busy=busy, delay=lambda r: 0.002)
        orchestrator = adaptive(engine, initial=8, maximum=64)
        infos = await consume_until(orchestrator, engine, lambda info: False, max_batches=60)
        await orchestrator.stop()
        return infos

    # Two replicas at 0.88 and 0.92: the fleet is at its target, nothing moves.
    held = run(main((lambda: 0.88, lambda: 0.92)))
    assert {info["max_concurrent_episodes"] for info in held} == {8}
    readings = [
        info["engine_busy_fraction_last_window"]
        for info in held
        if "engine_busy_fraction_last_window" in info
    ]
    assert readings and all(r == pytest.approx(0.9, abs=0.01) for r in readings)
    # One replica busy, one idle: the mean (0.5) is below target, so the budget grows.
    grown = run(main((lambda: 0.9, lambda: 0.1)))
    assert grown[-1]["max_concurrent_episodes"] > 8


def test_an_engine_that_cannot_report_leaves_the_budget_and_the_run_alone():
    async def main():
        engine = LoadReportingEngine(fail_stats=10**6, delay=lambda r: 0.001)
        orchestrator = adaptive(engine, initial=4)
        infos = await consume_until(orchestrator, engine, lambda info: False, max_batches=30)
        await orchestrator.stop()
        return infos, engine.readings

    infos, readings = run(main())
    assert readings >= 3 and len(infos) == 30
    assert {info["max_concurrent_episodes"] for info in infos} == {4}
    assert not any("engine_busy_fraction_last_window" in info for info in infos)  # no reading


def test_an_engine_client_without_stats_is_refused_with_a_clear_error():
    async def main():
        orchestrator = adaptive(FakeEngine())
        await orchestrator.next_batch()

    with pytest.raises(TypeError, match="adaptive_concurrency=false"):
        run(main())


def test_a_controller_that_does_not_start_at_max_concurrent_episodes_is_refused():
    controller = ConcurrencyController(initial=8, minimum=4, maximum=32)
    with pytest.raises(ValueError, match="max_concurrent_episodes=4"):
        make_orchestrator(FakeEngine(), max_concurrent_episodes=4, concurrency=controller)


def test_without_a_controller_the_budget_stays_fixed_and_is_reported():
    async def main():
        engine = FakeEngine()
        orchestrator = make_orchestrator(engine, max_concurrent_episodes=6)
        consumed = await learner_loop(orchestrator, engine, 3)
        await orchestrator.stop()
        return [info for _, info, _ in consumed]

    infos = run(main())
    assert [info["max_concurrent_episodes"] for info in infos] == [6, 6, 6]
    assert "engine_busy_fraction_last_window" not in infos[0]


# -- dynamic sampling (DAPO) ---------------------------------------------------------------------


class RewardScriptedEngine(FakeEngine):
    """Answers ``Calculate A + B.`` directly, right or wrong per group member:
    ``correct(task index, member) -> bool``. Reward 1 for right, 0 for wrong."""

    def __init__(self, correct, group_size: int):
        super().__init__()
        self.correct = correct
        self.group_size = group_size

    async def generate(self, request):
        await asyncio.sleep(0.001)
        group_id, seed, _ = request.request_id.split("/")
        member = int(seed) % self.group_size  # the orchestrator seeds member j as i * G + j
        a, b = map(int, _QUESTION.search(TOKENIZER.decode(list(request.prompt_ids))).groups())
        answer = a + b if self.correct(index_of(group_id), member) else a + b + 1
        ids = TOKENIZER.encode(f"<answer>{answer}</answer>") + [TOKENIZER.end_id]
        return GenerationResult(
            request_id=request.request_id,
            token_ids=tuple(ids),
            logprobs=(-0.25,) * len(ids),
            policy_versions=(self.version,) * len(ids),
            finish_reason=FinishReason.STOP,
        )


def degenerate(index: int) -> bool:
    """Tasks whose every member gets the same reward: all right or all wrong."""
    return index % 3 != 2


def mixed_rewards(index: int, member: int) -> bool:
    if index % 3 == 0:
        return True  # all right
    if index % 3 == 1:
        return False  # all wrong
    return member == 0  # one right, the rest wrong


def ledger(consumed, state) -> tuple[set[int], set[int], set[int]]:
    """(trained, filtered, pending) task indices; checks each handed-out task is exactly one."""
    trained = [
        index_of(g) for trajectories, _, _ in consumed for g in {t.group_id for t in trajectories}
    ]
    assert len(trained) == len(set(trained)), "a task was trained twice"
    pending = set(state["pending"])
    handed_out = set(range(state["next_index"]))
    assert not set(trained) & pending and set(trained) | pending <= handed_out
    filtered = handed_out - set(trained) - pending
    return set(trained), filtered, pending


def test_dynamic_sampling_drops_zero_variance_groups_and_still_fills_every_batch():
    async def main():
        engine = RewardScriptedEngine(mixed_rewards, group_size=3)
        orchestrator = make_orchestrator(
            engine,
            group_size=3,
            groups_per_batch=2,
            max_concurrent_episodes=6,
            max_staleness=1,
            dynamic_sampling=True,
        )
        consumed = await learner_loop(orchestrator, engine, 4)
        await orchestrator.stop()
        return consumed, orchestrator.state()

    consumed, state = run(main())
    for trajectories, info, _ in consumed:
        assert info["num_trajectories"] == 6  # full batches: 2 groups of 3
        groups: dict[str, list[float]] = {}
        for t in trajectories:
            groups.setdefault(t.group_id, []).append(t.reward)
        assert all(sorted(r) == [0.0, 0.0, 1.0] for r in groups.values())
    trained, filtered, pending = ledger(consumed, state)
    assert len(trained) == 8 and not any(degenerate(i) for i in trained)
    assert filtered and all(degenerate(i) for i in filtered)
    counters = state["counters"]
    assert counters["groups_filtered_zero_variance"] == len(filtered)
    assert sum(v for k, v in counters.items() if k.startswith("groups_filtered_")) == len(filtered)
    assert (
        consumed[-1][1]["groups_filtered_zero_variance"]
        == counters["groups_filtered_zero_variance"]
    )
    # Filtered tasks are final, with their reason in the saved ledger: a resumed run does
    # not start them again.
    assert not filtered & set(state["pending"])
    saved = TaskLedger.from_json(state["ledger"])
    assert all(saved.outcome(i) == "filtered:zero_variance" for i in filtered)
    assert all(saved.outcome(i) == "trained" for i in trained)


def test_every_group_degenerate_is_capped_warned_and_trained_not_looped_forever(caplog):
    async def main():
        engine = RewardScriptedEngine(lambda index, member: True, group_size=2)
        orchestrator = make_orchestrator(
            engine,
            group_size=2,
            groups_per_batch=2,
            max_concurrent_episodes=4,
            max_staleness=1,
            dynamic_sampling=True,
            dynamic_sampling_max_filtered=3,
        )
        consumed = await asyncio.wait_for(learner_loop(orchestrator, engine, 3), timeout=30)
        await orchestrator.stop()
        return consumed, orchestrator.state(), orchestrator.stats()["batches_formed"]

    with caplog.at_level(logging.WARNING, logger="raytunix.rollout.packer"):
        consumed, state, batches_formed = run(main())
    counters = state["counters"]
    assert len(consumed) == 3
    # While each batch fills (those formed, and the one filling now), at most 3 groups are
    # filtered; the batch is then made of kept ones.
    assert 3 * 3 <= counters["groups_filtered_zero_variance"] <= 3 * (batches_formed + 1)
    assert counters["groups_kept_zero_variance"] >= 2 * batches_formed
    assert any("dynamic_sampling_max_filtered" in r.getMessage() for r in caplog.records)
    trained, filtered, _ = ledger(consumed, state)
    assert len(trained) == 6
    assert len(filtered) == counters["groups_filtered_zero_variance"]


def test_a_failed_member_adds_no_variance_and_off_by_default_nothing_is_filtered():
    def flaky(group_id, member):  # member 0 of every group dies: env_error, reward 0
        return member == 0

    async def main(dynamic_sampling):
        engine = RewardScriptedEngine(lambda index, member: index % 2 == 0, group_size=3)
        orchestrator = make_orchestrator(
            engine,
            EnvLeases(flaky),
            group_size=3,
            groups_per_batch=2,
            max_concurrent_episodes=6,
            dynamic_sampling=dynamic_sampling,
        )
        consumed = await learner_loop(orchestrator, engine, 2)
        await orchestrator.stop()
        return consumed, orchestrator.state()

    # Valid members all right (even tasks) or all wrong (odd ones): zero variance each,
    # although the failed member's reward of 0 differs. Past the cap (8), they are kept.
    consumed, state = run(main(True))
    assert state["counters"]["groups_filtered_zero_variance"] >= 8
    consumed, state = run(main(False))
    assert "groups_filtered_zero_variance" not in state["counters"]
    assert len(ledger(consumed, state)[0]) == 4
