"""The RL algorithm family as pure functions, against numbers worked out by hand:
advantage estimators (GRPO, Dr. GRPO, RLOO, REINFORCE++ baseline, GAE), DAPO's overlong
penalty, policy losses (PPO clip with dual clip, GSPO, CISPO), KL estimators, the entropy
bonus and the three loss aggregations, with masks and edge cases."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from raytunix.learner.advantages import (
    episode_advantages,
    gae_advantages,
    grpo_advantages,
    overlong_penalty,
    reinforce_pp_advantages,
    rloo_advantages,
)
from raytunix.learner.losses import (
    AGGREGATIONS,
    aggregate_loss,
    policy_gradient_loss,
    kl_estimate,
    loss_normalizer,
)

# Two interleaved groups. Group 0 (rows 0, 2, 4): rewards 1, 2, 3. Group 1 (rows 1, 3): 0, 4.
REWARDS = np.array([1.0, 0.0, 2.0, 4.0, 3.0], np.float32)
GROUPS = np.array([0, 1, 0, 1, 0], np.int32)
# Row 4 failed by infrastructure: group 0 is then rows 0 and 2 (rewards 1, 2).
ROW_4_FAILED = np.array([1, 1, 1, 1, 0], np.float32)


# -- advantages ---------------------------------------------------------------------------------


def test_grpo_with_and_without_std_and_a_failed_member():
    # Group 0 without row 4: mean 1.5, std 0.5; group 1: mean 2, std 2.
    with_std = grpo_advantages(
        REWARDS, GROUPS, 5, normalize_advantages_by_std=True, eps=0.0, valid=ROW_4_FAILED
    )
    np.testing.assert_allclose(with_std, [-1.0, -1.0, 1.0, 1.0, 0.0], rtol=1e-6)
    dr_grpo = grpo_advantages(
        REWARDS, GROUPS, 5, normalize_advantages_by_std=False, valid=ROW_4_FAILED
    )
    np.testing.assert_allclose(dr_grpo, [-0.5, -2.0, 0.5, 2.0, 0.0], rtol=1e-6)


def test_rloo_baseline_is_the_mean_of_the_other_members():
    adv = rloo_advantages(REWARDS, GROUPS, 5)
    # Row 0: 1 - (2 + 3) / 2; row 1: 0 - 4; row 2: 2 - (1 + 3) / 2; ...
    np.testing.assert_allclose(adv, [-1.5, -4.0, 0.0, 4.0, 1.5], rtol=1e-6)
    masked = rloo_advantages(REWARDS, GROUPS, 5, valid=ROW_4_FAILED)
    np.testing.assert_allclose(masked, [-1.0, -4.0, 1.0, 4.0, 0.0], rtol=1e-6)


def test_reinforce_pp_subtracts_the_group_mean_then_normalises_over_the_batch():
    adv = reinforce_pp_advantages(REWARDS, GROUPS, 5, eps=0.0)
    # Centred by group: -1, -2, 0, 2, 1; batch mean 0, std sqrt(10 / 5).
    s = math.sqrt(2.0)
    np.testing.assert_allclose(adv, [-1 / s, -2 / s, 0.0, 2 / s, 1 / s], rtol=1e-6)
    masked = reinforce_pp_advantages(REWARDS, GROUPS, 5, eps=0.0, valid=ROW_4_FAILED)
    # Centred: -0.5, -2, 0.5, 2 (row 4 left out); std sqrt(8.5 / 4).
    s = math.sqrt(8.5 / 4)
    np.testing.assert_allclose(masked, [-0.5 / s, -2 / s, 0.5 / s, 2 / s, 0.0], rtol=1e-6)


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_pp"])
def test_all_equal_rewards_and_single_members_give_zero_advantage(estimator):
    for rewards, groups in [
        (np.full(4, 1e6, np.float32), np.array([0, 0, 1, 1])),
        (np.array([0.3, 7.0], np.float32), np.array([0, 1])),
    ]:
        for std in (True, False):
            adv = episode_advantages(estimator, rewards, groups, 4, normalize_advantages_by_std=std)
            np.testing.assert_array_equal(adv, np.zeros(len(rewards)))


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_pp"])
def test_estimators_jit_and_reject_non_finite_rewards(estimator):
    fn = jax.jit(
        lambda r, g, v: episode_advantages(
            estimator, r, g, 5, valid=v, normalize_advantages_by_std=True
        )
    )
    eager = episode_advantages(
        estimator, REWARDS, GROUPS, 5, valid=ROW_4_FAILED, normalize_advantages_by_std=True
    )
    np.testing.assert_allclose(fn(REWARDS, GROUPS, ROW_4_FAILED), eager, rtol=1e-6)
    with pytest.raises(ValueError, match=r"\[1\]=nan"):
        episode_advantages(
            estimator,
            np.array([0.0, np.nan]),
            np.array([0, 0]),
            1,
            normalize_advantages_by_std=True,
        )


def test_unknown_estimator_names_the_value_and_the_choices():
    with pytest.raises(ValueError, match="advantage_estimator='ppo'.*grpo, rloo, reinforce_pp"):
        episode_advantages("ppo", REWARDS, GROUPS, 5, normalize_advantages_by_std=True)


def test_gae_skips_tokens_the_policy_did_not_generate():
    # Row 0: tokens 1, 3, 4 generated (2 is a tool result); reward 1 on the last.
    # Row 1: nothing generated.
    mask = np.array([[0, 1, 0, 1, 1], [0, 0, 0, 0, 0]], np.float32)
    rewards = np.array([[0, 0, 0, 0, 1.0], [0, 0, 0, 0, 1.0]], np.float32)
    values = np.array([[9.0, 0.5, 7.0, 0.6, 0.8], [1.0] * 5], np.float32)
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    # t=4: 1 - 0.8 = 0.2; t=3: 0.9*0.8 - 0.6 + 0.72*0.2 = 0.264;
    # t=1: 0.9*0.6 - 0.5 + 0.72*0.264 = 0.23008 (the tool token's 7.0 never enters).
    np.testing.assert_allclose(adv[0], [0.0, 0.23008, 0.0, 0.264, 0.2], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(ret[0], [0.0, 0.73008, 0.0, 0.864, 1.0], rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(adv[1], 0.0)
    np.testing.assert_array_equal(ret[1], 0.0)
    # gamma = lam = 1: the advantage is the return to go minus the value.
    adv, _ = gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0)
    np.testing.assert_allclose(adv[0], [0.0, 0.5, 0.0, 0.4, 0.2], rtol=1e-5, atol=1e-7)


def test_gae_single_token_response_is_reward_minus_value():
    adv, ret = gae_advantages(
        np.array([[0.0, 2.0]]), np.array([[5.0, 0.5]]), np.array([[0.0, 1.0]]), gamma=0.99, lam=0.95
    )
    np.testing.assert_allclose(adv, [[0.0, 1.5]], rtol=1e-6)
    np.testing.assert_allclose(ret, [[0.0, 2.0]], rtol=1e-6)


def test_dapo_overlong_penalty_ramps_over_the_buffer():
    got = overlong_penalty(np.array([3, 6, 7, 10, 11]), max_tokens=10, buffer_tokens=4)
    np.testing.assert_allclose(got, [0.0, 0.0, -0.25, -1.0, -1.0], rtol=1e-6)
    with pytest.raises(ValueError, match="buffer_tokens=12"):
        overlong_penalty(np.array([3]), max_tokens=10, buffer_tokens=12)


# -- aggregation ---------------------------------------------------------------------------------

PER_TOKEN = np.array([[1.0, 2.0, np.nan], [3.0, 100.0, 100.0]], np.float32)
AGG_MASK = np.array([[1, 1, 0], [1, 0, 0]], np.float32)


@pytest.mark.parametrize(
    "aggregation,want",
    [
        ("token_mean", (1 + 2 + 3) / 3),
        ("sequence_mean_token_mean", ((1 + 2) / 2 + 3 / 1) / 2),
        ("sequence_mean_token_sum_norm", ((1 + 2) / 4 + 3 / 4) / 2),  # Dr. GRPO, max_tokens 4
    ],
)
def test_aggregations_hand_computed(aggregation, want):
    got = aggregate_loss(PER_TOKEN, AGG_MASK, aggregation=aggregation, max_tokens=4)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    # A sequence without tokens counts in no mode; an empty mask gives 0, not NaN.
    mask = AGG_MASK.copy()
    mask[1] = 0
    alone = aggregate_loss(PER_TOKEN, mask, aggregation=aggregation, max_tokens=4)
    np.testing.assert_allclose(alone, 0.75 if aggregation.endswith("norm") else 1.5, rtol=1e-6)
    assert (
        aggregate_loss(PER_TOKEN, np.zeros_like(mask), aggregation=aggregation, max_tokens=4) == 0.0
    )


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_rows_summed_with_the_whole_batch_normalizer_equal_the_whole_batch(aggregation):
    rng = np.random.default_rng(0)
    per_token = rng.normal(size=(8, 6)).astype(np.float32)
    mask = (rng.random((8, 6)) < 0.6).astype(np.float32)
    mask[3] = 0
    weights, denominator = loss_normalizer(mask, aggregation=aggregation, max_tokens=6)
    parts = [
        jnp.sum(jnp.where(mask[i : i + 2] > 0, per_token[i : i + 2], 0.0) * weights[i : i + 2])
        / denominator
        for i in range(0, 8, 2)
    ]
    np.testing.assert_allclose(
        sum(parts),
        aggregate_loss(per_token, mask, aggregation=aggregation, max_tokens=6),
        rtol=1e-6,
    )


def test_single_token_responses_make_the_sequence_modes_a_token_mean():
    per_token = np.array([[0.0, 2.0], [0.0, 5.0], [0.0, -1.0]], np.float32)
    mask = np.array([[0, 1], [0, 1], [0, 1]], np.float32)
    for aggregation in ("token_mean", "sequence_mean_token_mean"):
        np.testing.assert_allclose(
            aggregate_loss(per_token, mask, aggregation=aggregation, max_tokens=1), 2.0, rtol=1e-6
        )


# -- policy losses -------------------------------------------------------------------------------

# Sequence 0 (A = +1): token ratios 2 and 0.5, then a masked token with junk values.
# Sequence 1 (A = -1): token ratios 5, 2, 0.5.
RATIOS = np.array([[2.0, 0.5, 1e6], [5.0, 2.0, 0.5]], np.float32)
MASK = np.array([[1, 1, 0], [1, 1, 1]], np.float32)
ADV = np.array([1.0, -1.0], np.float32)
OLD = np.full((2, 3), -1.0, np.float32)
NEW = OLD + np.log(RATIOS)
COMMON = {
    "clip_eps_low": 0.2,
    "clip_eps_high": 0.28,
    "dual_clip": 0.0,
    "aggregation": "token_mean",
    "max_tokens": 3,
}


def _loss(policy_loss, new=NEW, **kwargs):
    return policy_gradient_loss(
        new, OLD, ADV, MASK, policy_loss=policy_loss, **{**COMMON, **kwargs}
    )


def test_ppo_clip_and_dual_clip_hand_computed():
    loss, aux = _loss("ppo_clip")
    # Seq 0: -min(2, 1.28) = -1.28, -min(0.5, 0.8) = -0.5.
    # Seq 1: -min(-5, -1.28) = 5, -min(-2, -1.28) = 2, -min(-0.5, -0.8) = 0.8 (clipped).
    np.testing.assert_allclose(loss, (-1.28 - 0.5 + 5 + 2 + 0.8) / 5, rtol=1e-5)
    np.testing.assert_allclose(aux["clip_fraction"], 2 / 5, rtol=1e-6)
    # Dual clip c = 3 bounds the A < 0 token of ratio 5 at 3; the rest is unchanged.
    loss, aux = _loss("ppo_clip", dual_clip=3.0)
    np.testing.assert_allclose(loss, (-1.28 - 0.5 + 3 + 2 + 0.8) / 5, rtol=1e-5)
    np.testing.assert_allclose(aux["clip_fraction"], 3 / 5, rtol=1e-6)
    grads = jax.grad(lambda lp: _loss("ppo_clip", lp, dual_clip=3.0)[0])(jnp.asarray(NEW))
    assert grads[1, 0] == 0.0  # the dual-clipped token gets no gradient
    np.testing.assert_allclose(grads[1, 1], 2.0 / 5, rtol=1e-5)  # d(-rA)/dlogp = -rA / N


def test_gspo_clips_the_length_normalised_sequence_ratio():
    # Seq 0: geometric mean of 2 and 0.5 is 1 -> -1 on each token. Seq 1: (5*2*0.5)^(1/3)
    # = 5^(1/3) = 1.70998, A < 0 -> -min(-1.70998, -1.28) = 1.70998 on each token.
    s1 = 5 ** (1 / 3)
    for aggregation, want in [
        ("sequence_mean_token_mean", (-1 + s1) / 2),
        ("token_mean", (-2 + 3 * s1) / 5),
    ]:
        loss, aux = _loss("gspo", aggregation=aggregation)
        np.testing.assert_allclose(loss, want, rtol=1e-5)
        assert aux["clip_fraction"] == 0.0
    # The gradient reaches every token of a sequence through the mean log ratio:
    # d(-s A)/dlogp_t = -s A / n, then the sequence mean halves it.
    grads = jax.grad(lambda lp: _loss("gspo", lp, aggregation="sequence_mean_token_mean")[0])(
        jnp.asarray(NEW)
    )
    np.testing.assert_allclose(grads[0, :2], [-0.25, -0.25], rtol=1e-5)
    np.testing.assert_allclose(grads[1], [s1 / 6] * 3, rtol=1e-5)
    assert grads[0, 2] == 0.0
    # Sequence 0 with ratio 2 on both tokens and A > 0 is clipped at 1.28.
    new = NEW.copy()
    new[0, :2] = OLD[0, :2] + math.log(2.0)
    loss, aux = _loss("gspo", new, aggregation="sequence_mean_token_mean")
    np.testing.assert_allclose(loss, (-1.28 + s1) / 2, rtol=1e-5)
    np.testing.assert_allclose(aux["clip_fraction"], 2 / 5, rtol=1e-6)


def test_gspo_of_single_token_responses_is_the_token_clip():
    new, mask = NEW[:, :1], MASK[:, :1]
    kwargs = {**COMMON, "aggregation": "sequence_mean_token_mean"}
    gspo = policy_gradient_loss(new, OLD[:, :1], ADV, mask, policy_loss="gspo", **kwargs)[0]
    ppo = policy_gradient_loss(new, OLD[:, :1], ADV, mask, policy_loss="ppo_clip", **kwargs)[0]
    np.testing.assert_allclose(gspo, ppo, rtol=1e-6)


def test_cispo_weights_logprobs_by_the_clipped_ratio_and_keeps_every_gradient():
    loss, aux = _loss("cispo")
    # -clip(r) * A * logp with logp = -1 + log r: weights 1.28, 0.8 | 1.28, 1.28, 0.8.
    logp = np.log(RATIOS) - 1.0
    w = np.array([[1.28, 0.8, 0.0], [1.28, 1.28, 0.8]])
    want = np.sum(np.where(MASK > 0, -w * ADV[:, None] * logp, 0.0)) / 5
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    np.testing.assert_allclose(aux["clip_fraction"], 1.0)  # every ratio is outside [0.8, 1.28]
    grads = jax.grad(lambda lp: _loss("cispo", lp)[0])(jnp.asarray(NEW))
    # The weight is a constant: d/dlogp = -w A / N, also on clipped tokens.
    np.testing.assert_allclose(grads, np.where(MASK > 0, -w * ADV[:, None] / 5, 0.0), rtol=1e-5)


@pytest.mark.parametrize("policy_loss", ["ppo_clip", "gspo", "cispo"])
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_masked_junk_and_an_empty_mask_leave_loss_and_gradients_finite(policy_loss, aggregation):
    new = NEW.copy()
    new[0, 2] = np.nan
    ref = OLD.copy()
    ref[0, 2] = np.inf

    def loss_fn(lp, mask):
        return policy_gradient_loss(
            lp,
            OLD,
            ADV,
            mask,
            policy_loss=policy_loss,
            **{**COMMON, "aggregation": aggregation},
            ref_logprobs=ref,
            kl_coef=0.1,
        )[0]

    loss, grads = jax.value_and_grad(loss_fn)(jnp.asarray(new), MASK)
    assert np.isfinite(loss) and np.all(np.isfinite(grads)) and grads[0, 2] == 0.0
    loss, grads = jax.value_and_grad(loss_fn)(jnp.asarray(new), np.zeros_like(MASK))
    assert loss == 0.0
    np.testing.assert_array_equal(grads, 0.0)


def test_unknown_policy_loss_and_aggregation_name_the_value():
    with pytest.raises(ValueError, match="policy_loss='ppo'.*ppo_clip, gspo, cispo"):
        _loss("ppo")
    with pytest.raises(ValueError, match="aggregation='sequence_mean'"):
        _loss("ppo_clip", aggregation="sequence_mean")
    with pytest.raises(ValueError, match="kl_estimator='k4'"):
        kl_estimate(NEW, OLD, MASK, estimator="k4")


# -- KL and entropy ------------------------------------------------------------------------------


def test_kl_estimators_hand_computed():
    logprobs = np.array([[-1.0, -1.0]], np.float32)
    ref = logprobs + np.array([[math.log(2.0), 0.0]], np.float32)  # pi_ref / pi = 2, then 1
    mask = np.array([[1.0, 1.0]])
    log2 = math.log(2.0)
    for estimator, want in [("k1", -log2), ("k2", log2**2 / 2), ("k3", 2 - 1 - log2)]:
        got = kl_estimate(logprobs, ref, mask, estimator=estimator)
        np.testing.assert_allclose(got, [[want, 0.0]], rtol=1e-6, atol=1e-7)
        loss, aux = policy_gradient_loss(
            logprobs,
            logprobs,
            np.zeros(1),
            mask,
            policy_loss="ppo_clip",
            **COMMON,
            ref_logprobs=ref,
            kl_coef=0.1,
            kl_estimator=estimator,
        )
        np.testing.assert_allclose(aux["kl_ref"], want / 2, rtol=1e-5)
        np.testing.assert_allclose(loss, 0.1 * want / 2, rtol=1e-5)


def test_entropy_bonus_lowers_the_loss_by_the_aggregated_entropy():
    logprobs = np.array([[-1.0, -1.0]], np.float32)
    entropy = jnp.array([[0.5, 1.0]], jnp.float32)
    loss, _ = policy_gradient_loss(
        logprobs,
        logprobs,
        np.zeros(1),
        np.ones((1, 2)),
        policy_loss="ppo_clip",
        **COMMON,
        entropy=entropy,
        entropy_coef=0.1,
    )
    np.testing.assert_allclose(loss, -0.1 * 0.75, rtol=1e-6)
    grad = jax.grad(
        lambda h: policy_gradient_loss(
            logprobs,
            logprobs,
            np.zeros(1),
            np.ones((1, 2)),
            policy_loss="ppo_clip",
            **COMMON,
            entropy=h,
            entropy_coef=0.1,
        )[0]
    )(entropy)
    np.testing.assert_allclose(grad, [[-0.05, -0.05]], rtol=1e-6)
