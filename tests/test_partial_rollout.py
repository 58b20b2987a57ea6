"""Per-token staleness (drop / mask / accept) and partial rollouts (on, or restart from the
prompt) in the orchestrator, on scripted scenarios with an in-process engine whose policy
versions the test controls. No Ray."""

from __future__ import annotations

import asyncio
import random

import pytest
from test_orchestrator import FakeEngine, EnvLeases, index_of, learner_loop, make_orchestrator, run

from raytunix.config import ConfigError, load_config


class GatedEngine(FakeEngine):
    """A ``FakeEngine`` whose chosen requests wait for the weights to change.

    Args:
      gate: (group id, turn, version when the request arrived) -> the version to wait
        for before generating, or None to answer at once. Tokens are stamped with the
        version the engine holds when it generates them.
    """

    def __init__(self, gate, **kwargs):
        super().__init__(**kwargs)
        self.gate = gate

    async def generate(self, request):
        group_id, _, turn = request.request_id.split("/")
        wait_for = self.gate(group_id, int(turn), self.version)
        while wait_for is not None and self.version < wait_for:
            await asyncio.sleep(0.001)
        return await super().generate(request)


def straggler(group_id, turn, version, *, group="g0", until=3):
    """Group ``group``'s answer turn waits until the learner reached version ``until``."""
    return until if group_id == group and turn == 1 else None


def generated(t):
    """(position, version) of every loss-mask token of a trajectory."""
    return [(i, v) for i, (v, m) in enumerate(zip(t.policy_versions, t.loss_mask)) if m]


def assert_staleness_bound(consumed, max_staleness):
    for trajectories, info, version in consumed:
        assert info["consume_version"] == version
        for t in trajectories:
            for _, v in generated(t):
                assert 0 <= version - v <= max_staleness, (t.group_id, version, v)


def _straggler_run(policy, num_batches=6, **kwargs):
    async def main():
        engine = GatedEngine(straggler)
        orchestrator = make_orchestrator(
            engine,
            group_size=2,
            groups_per_batch=2,
            max_concurrent_episodes=8,
            max_staleness=1,
            stale_token_policy=policy,
            **kwargs,
        )
        consumed = await learner_loop(orchestrator, engine, num_batches, train_s=0.002)
        await orchestrator.stop()
        return consumed, orchestrator.state()["counters"]

    return run(main())


def _of_group(consumed, group_id):
    return [
        (t, info, version)
        for trajectories, info, version in consumed
        for t in trajectories
        if t.group_id == group_id
    ]


# -- staleness policies ----------------------------------------------------------------------


def test_drop_filters_a_group_with_tokens_older_than_the_bound():
    consumed, counters = _straggler_run("drop")
    assert not _of_group(consumed, "g0")
    assert counters["groups_filtered_stale"] == 1
    assert counters.get("stale_tokens_masked", 0) == 0
    assert_staleness_bound(consumed, 1)


def test_mask_zeroes_the_loss_mask_of_stale_segments_and_keeps_the_fresh_ones():
    consumed, counters = _straggler_run("mask")
    members = _of_group(consumed, "g0")
    assert len(members) == 2  # the group is trained on, not dropped
    assert counters.get("groups_filtered_stale", 0) == 0
    masked = 0
    for t, info, version in members:
        # Turn 0 (the tool call) ran at version 0, turn 1 (the answer) at version 3.
        turn0 = [i for i, (v, m) in enumerate(zip(t.policy_versions, t.loss_mask)) if v == 0]
        turn1 = [i for i, (v, m) in enumerate(zip(t.policy_versions, t.loss_mask)) if v == 3]
        assert turn0 and turn1
        assert all(t.loss_mask[i] == 0 for i in turn0)
        assert all(t.loss_mask[i] == 1 for i in turn1)
        assert version >= 3
        masked += len(turn0)
    # Counted per batch and in the run's counters.
    [info] = {id(info): info for _, info, _ in members}.values()
    assert info["stale_tokens_masked"] == masked == counters["stale_tokens_masked"]
    assert_staleness_bound(consumed, 1)


def test_accept_keeps_stale_tokens_and_counts_them():
    consumed, counters = _straggler_run("accept")
    members = _of_group(consumed, "g0")
    assert len(members) == 2
    stale = sum(1 for t, _, version in members for _, v in generated(t) if version - v > 1)
    assert stale > 0
    [info] = {id(info): info for _, info, _ in members}.values()
    assert info["stale_tokens_accepted"] == stale == counters["stale_tokens_accepted"]
    assert info["staleness_max"] >= 3
    assert counters.get("groups_filtered_stale", 0) == 0


@pytest.mark.parametrize("policy", ["mask", "drop"])
def test_the_staleness_bound_holds_for_every_consumed_token_across_a_checkpoint_restore(policy):
    """Run, checkpoint (``state()``) with episodes in flight, resume at another policy
    version (the checkpoint's, behind the engine's last one), run on: under mask and
    drop no consumed token is ever older than the bound, before or after the restore."""
    max_staleness = 1

    def gate(group_id, turn, version):
        # Every seventh group straggles: its answer waits two weight updates, so its first
        # turn is past the bound when it is packed. (Not more often: a straggler holds its
        # admission slot, and a window full of them would wait for updates that cannot come.)
        if turn != 1 or index_of(group_id) % 7 != 3:
            return None
        return version + max_staleness + 1

    settings = dict(
        group_size=2,
        groups_per_batch=3,
        max_concurrent_episodes=16,
        max_staleness=max_staleness,
        stale_token_policy=policy,
        episode_timeout_s=10.0,
    )

    async def first_run(engine):
        orchestrator = make_orchestrator(engine, **settings)
        consumed = await learner_loop(orchestrator, engine, 5, train_s=0.002)
        state = orchestrator.state()  # the checkpoint, taken with groups in flight
        await orchestrator.stop()
        return consumed, state

    async def resumed_run(engine, state, version):
        orchestrator = make_orchestrator(engine, **settings, state=state, policy_version=version)
        consumed = await learner_loop(orchestrator, engine, 6, train_s=0.002)
        await orchestrator.stop()
        return consumed, orchestrator.state()

    rng = random.Random(7)
    engine = GatedEngine(gate, delay=lambda r: rng.choice([0.0, 0.0, 0.001, 0.004]))
    consumed, state = run(first_run(engine))
    assert state["pending"]  # groups were in flight at the checkpoint
    # The learner restores its checkpoint: the engine gets those weights, and the
    # orchestrator resumes at a version it never started at (not 0).
    restored_version = engine.version - 1
    engine.version = restored_version
    consumed_after, state_after = run(resumed_run(engine, state, restored_version))

    assert not state_after["counters"].get("groups_retried_timeout")  # no stall on the gate
    assert consumed_after[0][1]["consume_version"] == restored_version
    assert_staleness_bound(consumed, max_staleness)
    assert_staleness_bound(consumed_after, max_staleness)
    counters = state_after["counters"]  # carried over from the checkpoint, then added to
    if policy == "mask":
        assert counters["stale_tokens_masked"] > state["counters"].get("stale_tokens_masked", 0)
    else:
        assert counters["groups_filtered_stale"] > state["counters"].get("groups_filtered_stale", 0)


def test_bad_stale_token_policy_is_refused():
    with pytest.raises(ValueError, match="stale_token_policy='keep'"):
        make_orchestrator(FakeEngine(), stale_token_policy="keep")
    with pytest.raises(ConfigError, match="rollout.stale_token_policy='keep'"):
        load_config(None, ["rollout.stale_token_policy=keep"])
    cfg = load_config(None)
    assert cfg.rollout.stale_token_policy == "drop" and cfg.rollout.partial_rollout is True


# -- partial rollouts ----------------------------------------------------------------------


def _partial_run(partial_rollout, gate, num_batches=4, delay=lambda request: 0.0, **kwargs):
    async def main():
        engine = GatedEngine(gate, delay=delay)
        leases = EnvLeases()
        args = dict(
            group_size=2,
            groups_per_batch=2,
            max_concurrent_episodes=8,
            max_staleness=4,
            partial_rollout=partial_rollout,
        )
        args.update(kwargs)
        orchestrator = make_orchestrator(engine, leases, **args)
        consumed = await learner_loop(orchestrator, engine, num_batches, train_s=0.002)
        await orchestrator.stop()
        return consumed, orchestrator.state()["counters"], leases

    return run(main())


def test_partial_rollouts_carry_an_episode_across_a_weight_update():
    consumed, counters, leases = _partial_run(
        True,
        lambda g, turn, v: straggler(g, turn, v, until=1),
        num_batches=6,
        delay=lambda r: 0.0 if r.request_id.startswith("g0/") else 0.003,
    )
    members = _of_group(consumed, "g0")
    assert len(members) == 2
    for t, _, _ in members:
        assert {v for _, v in generated(t)} == {0, 1}  # the tool call at 0, the answer at 1
    assert counters.get("episodes_restarted_weight_update", 0) == 0
    assert leases.leases_per_group["g0"] == 2


def test_without_partial_rollouts_an_interrupted_episode_restarts_from_its_prompt():
    # The other groups are slower, so the restarted g0 is packed early, well within the bound.
    consumed, counters, leases = _partial_run(
        False,
        lambda g, turn, v: straggler(g, turn, v, until=1),
        num_batches=6,
        delay=lambda r: 0.0 if r.request_id.startswith("g0/") else 0.003,
    )
    members = _of_group(consumed, "g0")
    assert len(members) == 2
    for t, info, version in members:
        assert {v for _, v in generated(t)} == {1}  # all of it generated by one policy
        assert t.reward == 1.0 and t.num_turns == 2  # a whole episode, not a fragment
    # Both members restarted once, each on a fresh environment (reset again). (Other
    # groups may restart too when an update falls between their turns.)
    assert leases.leases_per_group["g0"] == 4
    assert counters["episodes_restarted_weight_update"] >= 2
    assert counters.get("episodes_accepted_mixed_versions", 0) == 0
    assert_staleness_bound(consumed, 4)


def test_restarts_are_bounded_so_a_faster_learner_cannot_livelock_an_episode():
    """Group g0's answer always waits for the next weight update: every try would span
    two versions. After ``max_weight_update_restarts`` restarts it is accepted."""

    def always_interrupted(group_id, turn, version):
        return version + 1 if group_id == "g0" and turn == 1 else None

    # accept: however late g0 is packed, it is consumed and can be looked at.
    consumed, counters, leases = _partial_run(
        False,
        always_interrupted,
        num_batches=8,
        max_weight_update_restarts=2,
        stale_token_policy="accept",
    )
    assert leases.leases_per_group["g0"] == 2 * 3  # 2 members x (1 try + 2 restarts)
    assert counters["episodes_restarted_weight_update"] >= 2 * 2
    assert counters["episodes_accepted_mixed_versions"] == 2  # only g0's ran out of restarts
    members = _of_group(consumed, "g0")
    assert len(members) == 2
    for t, _, _ in members:
        assert len({v for _, v in generated(t)}) == 2


class SlowToolEnvs(EnvLeases):
    """``EnvLeases`` whose environments for group ``g1`` answer a step only once the
    engine holds version 1 or later (a slow tool during which the weights change)."""

    def __init__(self, engine):
        super().__init__()
        self.engine = engine

    def __call__(self, group_id):
        env, release = super().__call__(group_id)
        if group_id != "g1":
            return env, release
        engine, step = self.engine, env.step

        async def slow_step(action):
            while engine.version < 1:
                await asyncio.sleep(0.001)
            return await step(action)

        env.step = slow_step
        return env, release


def test_restart_checks_the_version_before_spending_a_generation():
    """An episode that learns of new weights while it waits for a tool restarts before
    it asks the engine for a turn whose tokens it would throw away."""

    async def main():
        engine = FakeEngine()
        leases = SlowToolEnvs(engine)
        orchestrator = make_orchestrator(
            engine,
            leases,
            group_size=2,
            groups_per_batch=1,
            max_concurrent_episodes=4,
            max_staleness=1,
            partial_rollout=False,
        )
        consumed = await learner_loop(orchestrator, engine, 3)
        await orchestrator.stop()
        return engine, consumed, orchestrator.state()["counters"]

    engine, consumed, counters = run(main())
    assert counters["episodes_restarted_weight_update"] >= 2
    turns = [r.request_id.split("/")[2] for r in engine.requests if r.request_id.startswith("g1/")]
    # Each member: its first turn twice (the first try, then the restart), its answer turn
    # once: the first try's answer turn was never sent.
    assert sorted(turns) == ["0", "0", "0", "0", "1", "1"]
    members = _of_group(consumed, "g1")
    assert len(members) == 2
    assert all({v for _, v in generated(t)} == {1} for t, _, _ in members)
