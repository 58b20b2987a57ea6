"""Failed episodes carry the right signal into the update: an infrastructure failure is
left out of its group's statistics, a failure the policy caused is scored as its outcome,
groups of equal rewards get exactly zero advantage at any scale, and a non-finite reward
is rejected before it reaches an update."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import math  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from raytunix.learner.advantages import check_finite_rewards, grpo_advantages  # noqa: E402
from raytunix.rollout.batch import record_batch_to_arrays, trajectories_to_record_batch  # noqa: E402
from raytunix.types import EpisodeStatus, Trajectory, is_infrastructure_failure  # noqa: E402

STD = {"normalize_advantages_by_std": True}  # GRPO's advantage, the default


@pytest.mark.parametrize("value", [0.1, 0.35, 12.3, 100.1, -7.7, 1e4 + 0.1])
@pytest.mark.parametrize("normalize_advantages_by_std", [True, False])
def test_all_equal_group_has_zero_advantage_at_any_scale(value, normalize_advantages_by_std):
    adv = np.asarray(
        grpo_advantages(
            np.full(8, value, np.float32),
            np.zeros(8, np.int32),
            1,
            normalize_advantages_by_std=normalize_advantages_by_std,
        )
    )
    np.testing.assert_array_equal(adv, np.zeros(8))


def test_known_values_and_singleton():
    rewards = np.array([1] + [0] * 7 + [0.5], np.float32)
    adv = np.asarray(grpo_advantages(rewards, np.array([0] * 8 + [1], np.int32), 2, **STD))
    assert abs(adv[0] - np.sqrt(7)) < 1e-3 and adv[8] == 0.0
    np.testing.assert_allclose(adv[1:8], -1 / np.sqrt(7), rtol=1e-4)


def test_a_large_reward_offset_does_not_change_the_advantages():
    rewards = np.array([0.0, 1.0, 1.0, 0.0], np.float32)
    base = np.asarray(grpo_advantages(rewards, np.zeros(4, np.int32), 1, **STD))
    shifted = np.asarray(grpo_advantages(rewards + 1000.0, np.zeros(4, np.int32), 1, **STD))
    np.testing.assert_allclose(base, [-1, 1, 1, -1], rtol=1e-5)
    np.testing.assert_allclose(shifted, base, rtol=1e-5)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_reward_is_rejected_naming_it(bad):
    rewards = np.array([1.0, 0.0, bad, 1.0], np.float32)
    with pytest.raises(ValueError, match=r"1 of 4 rewards are not finite \(\[2\]="):
        grpo_advantages(rewards, np.array([0, 0, 1, 1], np.int32), 2, **STD)
    with pytest.raises(ValueError, match="verifier"):
        check_finite_rewards(rewards)


def test_an_infrastructure_failure_neither_shifts_the_baseline_nor_gets_advantage():
    # 7 equal successes + 1 env_error placeholder (reward 0): nobody has anything to learn.
    rewards = np.array([1.0] * 7 + [0.0], np.float32)
    valid = np.array([1] * 7 + [0], np.float32)
    adv = np.asarray(grpo_advantages(rewards, np.zeros(8, np.int32), 1, **STD, valid=valid))
    np.testing.assert_array_equal(adv, np.zeros(8))
    # Without the exclusion the failure would hand each success a fake advantage.
    assert np.asarray(grpo_advantages(rewards, np.zeros(8, np.int32), 1, **STD))[0] > 0.3


def test_statistics_use_the_valid_members_only_hand_computed():
    # Group 0: valid rewards 1, 0, 0 (mean 1/3, std sqrt(2)/3); the invalid member's 5.0
    # is ignored. Group 1: valid 2, 4 (mean 3, std 1); its invalid member gets 0.
    rewards = np.array([1.0, 0.0, 5.0, 2.0, 0.0, 4.0, 9.0], np.float32)
    groups = np.array([0, 0, 0, 1, 0, 1, 1], np.int32)
    valid = np.array([1, 1, 0, 1, 1, 1, 0], np.float32)
    adv = np.asarray(grpo_advantages(rewards, groups, 2, **STD, valid=valid, eps=0.0))
    s = math.sqrt(2) / 3
    np.testing.assert_allclose(
        adv, [(2 / 3) / s, (-1 / 3) / s, 0.0, -1.0, (-1 / 3) / s, 1.0, 0.0], rtol=1e-5
    )
    dr = np.asarray(
        grpo_advantages(rewards, groups, 2, valid=valid, normalize_advantages_by_std=False)
    )
    np.testing.assert_allclose(
        dr, [2 / 3, -1 / 3, 0.0, -1.0, -1 / 3, 1.0, 0.0], rtol=1e-5, atol=1e-6
    )


def test_valid_members_under_jit_match_eager():
    rewards = np.array([1.0, 0.0, 5.0, 2.0, 0.0, 4.0], np.float32)
    groups = np.array([0, 0, 0, 1, 0, 1], np.int32)
    valid = np.array([1, 1, 0, 1, 1, 0], np.float32)
    jitted = jax.jit(lambda r, g, v: grpo_advantages(r, g, 6, **STD, valid=v))
    np.testing.assert_allclose(
        jitted(rewards, groups, valid),
        grpo_advantages(rewards, groups, 6, **STD, valid=valid),
        rtol=1e-6,
    )


def _trajectory(i: int, reward: float, status: EpisodeStatus) -> Trajectory:
    return Trajectory(
        "t", "g0", [10 + i] * 6, [0, 0, 1, 1, 1, 1], [-1.0] * 6, [0] * 6, reward, status, 1
    )


def test_the_batch_marks_infrastructure_failures_invalid_and_policy_failures_valid():
    statuses = list(EpisodeStatus)
    arrays = record_batch_to_arrays(
        trajectories_to_record_batch([_trajectory(i, 0.0, s) for i, s in enumerate(statuses)])
    )
    expected = [
        0.0 if s in (EpisodeStatus.TIMEOUT, EpisodeStatus.ENV_ERROR, EpisodeStatus.ABORTED) else 1.0
        for s in statuses
    ]
    np.testing.assert_array_equal(arrays["valid"], expected)
    assert [is_infrastructure_failure(s) for s in statuses] == [v == 0.0 for v in expected]


def test_a_policy_failure_keeps_its_place_in_the_group_and_gets_a_negative_advantage():
    trajectories = [
        _trajectory(0, 1.0, EpisodeStatus.COMPLETED),
        _trajectory(1, 1.0, EpisodeStatus.COMPLETED),
        _trajectory(2, 0.0, EpisodeStatus.TOOL_ERROR_LIMIT),
        _trajectory(3, 0.0, EpisodeStatus.ENV_ERROR),
    ]
    arrays = record_batch_to_arrays(trajectories_to_record_batch(trajectories))
    adv = np.asarray(
        grpo_advantages(arrays["rewards"], arrays["group_ids"], 4, **STD, valid=arrays["valid"])
    )
    # Valid rewards 1, 1, 0: mean 2/3, std sqrt(2)/3.
    np.testing.assert_allclose(
        adv[:3], [1 / math.sqrt(2), 1 / math.sqrt(2), -math.sqrt(2)], rtol=1e-4
    )
    assert adv[3] == 0.0


# -- through the orchestrator ------------------------------------------------------------------

import asyncio  # noqa: E402

from raytunix.agents import ToolAgent  # noqa: E402
from raytunix.models.tokenizer import Tokenizer  # noqa: E402
from raytunix.rollout.batch import record_batch_to_trajectories  # noqa: E402
from raytunix.rollout.env_pool import LocalEnv  # noqa: E402
from raytunix.rollout.faults import Backoff  # noqa: E402
from raytunix.rollout.orchestrator import RolloutOrchestrator  # noqa: E402
from raytunix.types import FinishReason, GenerationResult, SamplingParams, Task  # noqa: E402

TOK = Tokenizer.byte_level()


class HalfMalformedEngine:
    """Sample 0 of every group writes only malformed tool calls; sample 1 answers right."""

    async def generate(self, request):
        _, seed, _ = request.request_id.split("/")
        text = (
            '<tool_call>{"name": calculator}</tool_call>'
            if int(seed) % 2 == 0
            else "<answer>2</answer>"
        )
        ids = TOK.encode(text) + [TOK.end_id]
        return GenerationResult(
            request.request_id, tuple(ids), (-0.3,) * len(ids), (0,) * len(ids), FinishReason.STOP
        )


def test_a_policy_that_emits_only_malformed_calls_stops_at_the_limit_and_gets_a_negative_advantage():
    async def main():
        orchestrator = RolloutOrchestrator(
            tasks=[Task("t", "Calculate 1 + 1.", "2")],
            agent_factory=lambda: ToolAgent(TOK),
            engine=HalfMalformedEngine(),
            env_provider=lambda g: (
                LocalEnv("calculator_math", {"max_tool_errors": 2}),
                lambda: None,
            ),
            group_size=2,
            groups_per_batch=1,
            max_concurrent_episodes=2,
            max_staleness=0,
            max_turns=8,
            max_context_tokens=2048,
            sampling=SamplingParams(max_new_tokens=64),
            retry_backoff=Backoff(0.001, 0.004),
        )
        [batch], info = await orchestrator.next_batch()
        await orchestrator.stop()
        return batch, info, orchestrator.counters

    batch, info, counters = asyncio.run(main())
    trajectories = record_batch_to_trajectories(batch)
    bad = next(t for t in trajectories if t.status == EpisodeStatus.TOOL_ERROR_LIMIT)
    good = next(t for t in trajectories if t.status == EpisodeStatus.COMPLETED)
    assert bad.num_turns == 3  # 2 tool errors tolerated, the 3rd ends it
    assert sum(bad.loss_mask) > 0  # its own tokens keep their gradient
    arrays = record_batch_to_arrays(batch)
    adv = np.asarray(
        grpo_advantages(arrays["rewards"], arrays["group_ids"], 2, **STD, valid=arrays["valid"])
    )
    assert adv[trajectories.index(bad)] < 0 < adv[trajectories.index(good)]
    assert info["valid_trajectories"] == 2 and info["tool_errors_mean"] == 1.5
    assert info["tool_error_fraction"] == 0.5 and info["zero_variance_group_fraction"] == 0.0
    assert counters["episodes_failed_policy"] == 1 and counters["tool_errors_bad_json"] == 3


# -- in the GRPO update ------------------------------------------------------------------------

from raytunix.learner.batch import Batch  # noqa: E402
from raytunix.learner.train_state import (  # noqa: E402
    RLHyperparams,
    create_train_state,
    make_optimizer,
    make_policy_update,
)
from raytunix.models.llama import ModelConfig, init_model  # noqa: E402

CFG = ModelConfig(
    vocab_size=64, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32, max_seq_len=32
)


def _update():
    """``(update(state, ref_params, arrays), state)``: the default GRPO update, plain
    softmax scoring, on the arrays of ``record_batch_to_arrays``."""
    graphdef, params = init_model(CFG, 0)
    optimizer = make_optimizer(1e-3)
    hp = RLHyperparams(temperature=1.0, top_k=0, top_p=1.0)
    update = make_policy_update(graphdef, optimizer, hp, max_seq_len=CFG.max_seq_len)
    return (
        lambda state, ref, arrays: update(state, ref, Batch.from_arrays(arrays)),
        create_train_state(graphdef, params, optimizer, 0),
    )


def _member(i, reward, status, masked):
    toks = [10 + (i * 7 + k) % 50 for k in range(12)]
    mask = [0] * 4 + [0 if masked else 1] * 8
    return Trajectory("t", "g0", toks, mask, [-1.0] * 12, [0] * 12, reward, status, 1)


@pytest.mark.slow
def test_failed_member_excluded_from_group_baseline():
    update, state = _update()
    trajectories = [_member(i, 1.0, EpisodeStatus.COMPLETED, False) for i in range(7)]
    trajectories.append(_member(7, 0.0, EpisodeStatus.ENV_ERROR, True))
    arrays = record_batch_to_arrays(trajectories_to_record_batch(trajectories))
    _, metrics = update(state, None, arrays)
    assert float(metrics["grad_norm"]) < 1e-7


@pytest.mark.slow
def test_an_infrastructure_failure_changes_nothing_in_the_update():
    update, state = _update()
    valid = [
        _member(0, 1.0, EpisodeStatus.COMPLETED, False),
        _member(1, 0.0, EpisodeStatus.COMPLETED, False),
        _member(2, 0.0, EpisodeStatus.TOOL_ERROR_LIMIT, False),
    ]
    _, alone = update(state, None, record_batch_to_arrays(trajectories_to_record_batch(valid)))
    for status in (EpisodeStatus.ENV_ERROR, EpisodeStatus.TIMEOUT, EpisodeStatus.ABORTED):
        failed = _member(3, 0.0, status, True)
        _, with_failure = update(
            state, None, record_batch_to_arrays(trajectories_to_record_batch(valid + [failed]))
        )
        for key in ("loss", "grad_norm", "advantage_abs_mean"):
            scale = 3 / 4 if key == "advantage_abs_mean" else 1.0  # a mean over 4, not 3
            np.testing.assert_allclose(
                float(with_failure[key]),
                float(alone[key]) * scale,
                rtol=1e-5,
                err_msg=f"{status.value}: {key}",
            )
    assert float(alone["grad_norm"]) > 0  # the valid members do teach something


def test_the_update_rejects_a_non_finite_reward():
    update, state = _update()
    trajectories = [
        _member(0, 1.0, EpisodeStatus.COMPLETED, False),
        _member(1, 0.0, EpisodeStatus.COMPLETED, False),
    ]
    arrays = record_batch_to_arrays(trajectories_to_record_batch(trajectories))
    arrays["rewards"] = np.array([1.0, np.nan], np.float32)
    with pytest.raises(ValueError, match="not finite"):
        update(state, None, arrays)
