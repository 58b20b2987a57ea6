"""Nothing the policy generated is dropped silently between the engine and the loss: every
way generated tokens are kept from the loss (a failed member's mask, a dropped or filtered
group, stale tokens, a restarted episode, the learner's row width) is counted by kind in
the step's ``generated_tokens_dropped_<kind>`` and shown in the report. No Ray."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_orchestrator import (
    TOKENIZER,
    EnvLeases,
    FakeEngine,
    index_of,
    learner_loop,
    make_orchestrator,
    run,
)
from test_partial_rollout import _partial_run, _straggler_run, straggler

from raytunix.learner.batch import Batch, PackedBatch, generated_tokens_cut
from raytunix.profiling.report import render_report
from raytunix.rollout.batch import trajectories_to_record_batch
from raytunix.rollout.recorder import DROPPED_TOKEN_KINDS
from raytunix.types import EnvFailure, EpisodeStatus, Trajectory

KEY = "generated_tokens_dropped_"


def _generated(t: Trajectory) -> int:
    """Tokens the engine generated in ``t`` (they carry a policy version)."""
    return sum(v >= 0 for v in t.policy_versions)


def test_every_batch_says_how_many_generated_tokens_of_each_kind_it_lost():
    async def main():
        engine = FakeEngine()
        orchestrator = make_orchestrator(engine)
        consumed = await learner_loop(orchestrator, engine, 2)
        await orchestrator.stop()
        return consumed

    for _, info, _ in run(main()):
        assert {k for k in info if k.startswith(KEY)} == {KEY + k for k in DROPPED_TOKEN_KINDS}
        assert all(info[KEY + k] == 0 for k in DROPPED_TOKEN_KINDS)  # nothing failed here


def test_a_failed_member_s_zeroed_loss_mask_is_counted_by_its_status():
    async def main():
        engine = FakeEngine()
        orchestrator = make_orchestrator(
            engine, EnvLeases(lambda g, member: member == 0), group_size=3, groups_per_batch=1
        )
        [batch], info = await orchestrator.next_batch()
        await orchestrator.stop()
        return batch, info, orchestrator.stats()["counters"]

    from raytunix.rollout.batch import record_batch_to_trajectories

    batch, info, counters = run(main())
    failed = [t for t in record_batch_to_trajectories(batch) if t.status == EpisodeStatus.ENV_ERROR]
    assert len(failed) == 1 and set(failed[0].loss_mask) == {0}
    # Every group's member 0 failed after its tool call, each as long as this one's (the
    # first tasks' numbers have as many digits); groups that finished before the batch was
    # taken count in it too.
    per_episode = _generated(failed[0])
    assert per_episode > 0 and info[KEY + "failed_env_error"] % per_episode == 0
    assert counters[KEY + "failed_env_error"] == per_episode * counters["episodes_env_error"]


def test_a_dropped_failed_group_and_a_group_whose_members_all_failed_are_counted():
    async def main(**kwargs):
        engine = FakeEngine()
        orchestrator = make_orchestrator(
            engine,
            group_size=2,
            groups_per_batch=1,
            max_concurrent_episodes=2,
            max_group_retries=0,
            **kwargs,
        )
        await learner_loop(orchestrator, engine, 2)
        await orchestrator.stop()
        return orchestrator.stats()["counters"]

    one_fails = EnvLeases(lambda g, member: member == 1 and index_of(g) % 2 == 0)
    counters = run(main(env_provider=one_fails, drop_failed_groups=True))
    assert counters["groups_filtered_failed_episode"] >= 1
    assert counters[KEY + "failed_group_dropped"] > 0
    all_fail = EnvLeases(lambda g, member: index_of(g) % 2 == 0)
    counters = run(main(env_provider=all_fail))
    assert counters["groups_filtered_env_error"] >= 1
    # Each member generated its tool call before its step failed.
    tool_call = (
        len(
            TOKENIZER.encode(
                '<tool_call>{"name": "calculator", "arguments": '
                '{"expression": "10 + 20"}}</tool_call>'
            )
        )
        + 1
    )
    assert counters[KEY + "group_failed"] >= 2 * tool_call


def test_groups_filtered_by_dynamic_sampling_are_counted():
    async def main():
        engine = FakeEngine()  # always right: every group has one reward
        orchestrator = make_orchestrator(
            engine, dynamic_sampling=True, dynamic_sampling_max_filtered=2
        )
        consumed = await learner_loop(orchestrator, engine, 1)
        await orchestrator.stop()
        return consumed, orchestrator.stats()["counters"]

    [(_, info, _)], counters = run(main())
    assert counters["groups_filtered_zero_variance"] >= 2
    assert info[KEY + "zero_variance"] == counters[KEY + "zero_variance"] > 0


@pytest.mark.parametrize("policy, kind", [("drop", "stale_group"), ("mask", "stale_masked")])
def test_stale_tokens_dropped_or_masked_are_counted(policy, kind):
    consumed, counters = _straggler_run(policy)
    assert counters[KEY + kind] > 0
    if policy == "mask":
        assert counters[KEY + kind] == counters["stale_tokens_masked"]
    assert sum(info[KEY + kind] for _, info, _ in consumed) <= counters[KEY + kind]


def test_tokens_of_an_episode_restarted_for_new_weights_are_counted():
    consumed, counters, _ = _partial_run(
        False,
        lambda g, turn, v: straggler(g, turn, v, until=1),
        num_batches=6,
        delay=lambda r: 0.0 if r.request_id.startswith("g0/") else 0.003,
    )
    # g0's members each threw away their tool call (turn 0) and their answer (turn 1).
    tool_call = (
        len(
            TOKENIZER.encode(
                '<tool_call>{"name": "calculator", "arguments": '
                '{"expression": "10 + 20"}}</tool_call>'
            )
        )
        + 1
    )
    answer = len(TOKENIZER.encode("<answer>30</answer>")) + 1
    assert counters["episodes_restarted_weight_update"] >= 2
    assert counters[KEY + "restarted_weight_update"] >= 2 * (tool_call + answer)


class _HostDiesOnce(EnvLeases):
    """Member 0 of group g0 finds its env actor dead at its first step, once."""

    def __call__(self, group_id):
        env, release = super().__call__(group_id)
        if group_id == "g0" and self.leases_per_group[group_id] == 1:

            async def step(action):
                raise EnvFailure("the env actor died", retryable=True)

            env.step = step
        return env, release


def test_tokens_of_an_episode_re_run_after_its_env_actor_died_are_counted():
    async def main():
        engine = FakeEngine()
        orchestrator = make_orchestrator(engine, _HostDiesOnce(), group_size=2, groups_per_batch=1)
        await learner_loop(orchestrator, engine, 1)
        await orchestrator.stop()
        return orchestrator.stats()["counters"]

    counters = run(main())
    tool_call = (
        len(
            TOKENIZER.encode(
                '<tool_call>{"name": "calculator", "arguments": '
                '{"expression": "10 + 20"}}</tool_call>'
            )
        )
        + 1
    )
    assert counters["episodes_restarted_env_error"] == 1
    assert counters[KEY + "restarted_env_failure"] == tool_call


def _trajectory(n_prompt: int, n_generated: int, first_generated: bool = False) -> Trajectory:
    mask = [0] * n_prompt + [1] * n_generated
    if first_generated:
        mask[0] = 1
    n = len(mask)
    return Trajectory(
        "t",
        "g",
        list(range(10, 10 + n)),
        mask,
        [-0.5 * m for m in mask],
        [0 if m else -1 for m in mask],
        1.0,
        EpisodeStatus.COMPLETED,
        1,
    )


@pytest.mark.parametrize("packed", [False, True])
def test_the_learner_counts_generated_tokens_its_rows_cannot_hold(packed):
    trajectories = [
        _trajectory(10, 30),
        _trajectory(20, 60),
        _trajectory(4, 4, first_generated=True),
    ]
    batch = trajectories_to_record_batch(trajectories)
    width = 48
    cut = generated_tokens_cut(batch, width)
    # By hand: row 0 has 40 tokens (none past 48); row 1 has 80, its generated tokens
    # 48..79 are past the width: 32; row 2 starts with a generated token.
    assert cut == {"seq_len": 32, "first_position": 1}
    total = sum(sum(t.loss_mask) for t in trajectories)
    if packed:
        rows = PackedBatch.from_record_batch(batch, pad_id=0, max_seq_len=width)
        trained = float(np.asarray(rows.loss_mask).sum())
    else:
        rows = Batch.from_record_batch(batch, pad_id=0, max_seq_len=width)
        trained = float(np.asarray(rows.loss_mask)[:, 1:].sum())  # column 0 is never scored
    assert trained + cut["seq_len"] + cut["first_position"] == total


def test_the_report_shows_dropped_tokens_and_env_errors_by_kind(tmp_path):
    def step(n, **extra):
        return {"phase": "rl", "step": n, "window_s": 1.0, **extra}

    records = [
        step(
            1,
            generated_tokens_dropped_failed_env_error=12,
            generated_tokens_dropped_seq_len=0,
            env_errors={"MyEnv.step:KeyError": 2},
        ),
        step(
            2,
            generated_tokens_dropped_failed_env_error=5,
            generated_tokens_dropped_stale_group=7,
            env_errors={"MyEnv.step:KeyError": 1, "MyEnv.step:reward_NoneType": 4},
        ),
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "env_errors.jsonl").write_text(
        json.dumps({"kind": "MyEnv.step:KeyError", "location": "/src/my_env.py:42"}) + "\n"
    )
    text, _ = render_report(str(tmp_path))
    assert "Generated tokens kept from the loss, over the RL steps: 24" in text
    assert "  failed_env_error                   17" in text
    assert "  stale_group                        7" in text
    assert "  seq_len                            0" in text
    lines = text.splitlines()
    (keyerror,) = [line for line in lines if "MyEnv.step:KeyError" in line]
    assert keyerror.split()[1] == "3" and keyerror.endswith("at /src/my_env.py:42")
    (none,) = [line for line in lines if "MyEnv.step:reward_NoneType" in line]
    assert none.split()[1] == "4"


@pytest.mark.slow
def test_a_learner_step_reports_what_its_rows_cut_and_what_lies_outside_its_support():
    import os

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from raytunix.learner.learner import Learner, RLHyperparams
    from raytunix.models.llama import ModelConfig

    config = ModelConfig(
        vocab_size=TOKENIZER.vocab_size,
        d_model=16,
        n_layers=1,
        n_heads=2,
        n_kv_heads=1,
        d_ff=32,
        max_seq_len=64,
    )
    learner = Learner(config, seed=0, pad_id=TOKENIZER.pad_id)
    # top_k=2: only the learner's two most likely tokens are in its support, so most of the
    # random tokens below are out of it and leave the loss.
    learner.start_rl(
        RLHyperparams(
            temperature=1.0, top_k=2, top_p=1.0, learning_rate=1e-3, sequence_packing=False
        )
    )
    rows = [_trajectory(10, 70), _trajectory(10, 20), _trajectory(8, 30), _trajectory(8, 12)]
    for i, t in enumerate(rows):
        t.group_id, t.reward = f"g{i // 2}", float(i % 2)
    metrics = learner.train_step(trajectories_to_record_batch(rows))
    assert metrics["generated_tokens_dropped_seq_len"] == 80 - 64
    assert metrics["generated_tokens_dropped_first_position"] == 0
    scored = 64 - 10 + 20 + 30 + 12
    expected = round(metrics["out_of_support_fraction"] * scored)
    assert metrics["generated_tokens_dropped_out_of_support"] == expected > scored // 2
