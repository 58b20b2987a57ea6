"""Advantages and losses against hand-computed numbers, and masking guarantees."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from raytunix.learner.advantages import grpo_advantages
from raytunix.learner.losses import (
    AGGREGATIONS,
    policy_gradient_loss,
    policy_surrogate,
    ratio_statistics,
    sft_loss,
    token_logprobs,
)


# Two interleaved groups. Group 0: rewards 1, 2, 3 -> mean 2, population std sqrt(2/3).
# Group 1: rewards 0, 4 -> mean 2, std 2.
REWARDS = np.array([1.0, 0.0, 2.0, 4.0, 3.0], np.float32)
GROUPS = np.array([0, 1, 0, 1, 0], np.int32)


def test_grpo_advantages_interleaved_groups_hand_computed():
    adv = grpo_advantages(REWARDS, GROUPS, num_groups=5, normalize_advantages_by_std=True, eps=0.0)
    s = math.sqrt(2.0 / 3.0)
    np.testing.assert_allclose(adv, [-1 / s, -1.0, 0.0, 1.0, 1 / s], rtol=1e-6)


def test_dr_grpo_advantages_only_subtract_group_mean():
    adv = grpo_advantages(REWARDS, GROUPS, num_groups=2, normalize_advantages_by_std=False)
    np.testing.assert_allclose(adv, [-1.0, -2.0, 0.0, 2.0, 1.0], rtol=1e-6)


def test_equal_rewards_and_singleton_groups_get_zero_advantage():
    adv = grpo_advantages(
        np.array([0.5, 0.5, 7.0]),
        np.array([1, 1, 0]),
        num_groups=3,
        normalize_advantages_by_std=True,
    )
    np.testing.assert_array_equal(adv, [0.0, 0.0, 0.0])


def test_grpo_advantages_jit_with_static_num_groups():
    fn = jax.jit(grpo_advantages, static_argnums=2, static_argnames="normalize_advantages_by_std")
    np.testing.assert_allclose(
        fn(REWARDS, GROUPS, 5, normalize_advantages_by_std=True),
        grpo_advantages(REWARDS, GROUPS, 5, normalize_advantages_by_std=True),
        rtol=1e-6,
    )


OFF = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}  # plain softmax of the logits


def test_token_logprobs_hand_computed_with_temperature():
    logits = jnp.array([[[0.0, math.log(3.0)]]])  # probs 1/4, 3/4
    targets = jnp.array([[1]])
    np.testing.assert_allclose(
        token_logprobs(logits, targets, **OFF), [[math.log(0.75)]], rtol=1e-6
    )
    # Temperature 2 halves the logits: probs 1/(1+sqrt 3), sqrt 3/(1+sqrt 3).
    expected = math.log(math.sqrt(3) / (1 + math.sqrt(3)))
    got = token_logprobs(logits, targets, temperature=2.0, top_k=0, top_p=1.0)
    np.testing.assert_allclose(got, [[expected]], rtol=1e-6)


# Sequence 0 (A = +1): ratios 1.5 (clipped to 1.2), 0.5 (kept), then a masked token.
# Sequence 1 (A = -1): ratios 0.5 (clipped to 0.8), 1.5 (kept), 1.0.
RATIOS = np.array([[1.5, 0.5, 1e6], [0.5, 1.5, 1.0]], np.float32)
MASK = np.array([[1, 1, 0], [1, 1, 1]], np.float32)
ADV = np.array([1.0, -1.0], np.float32)
OLD = np.full((2, 3), -1.0, np.float32)
NEW = OLD + np.log(RATIOS)
# The update's defaults (learner.* in the config) but a symmetric clip.
PPO = {
    "policy_loss": "ppo_clip",
    "clip_eps_low": 0.2,
    "clip_eps_high": 0.2,
    "dual_clip": 0.0,
    "aggregation": "token_mean",
    "max_tokens": 3,
}


def test_clipped_surrogate_token_mean_hand_computed():
    loss, aux = policy_gradient_loss(NEW, OLD, ADV, MASK, **PPO)
    # Per-token losses: -1.2, -0.5 | 0.8, 1.5, 1.0 -> sum 1.6 over 5 tokens.
    np.testing.assert_allclose(loss, 0.32, rtol=1e-5)
    np.testing.assert_allclose(aux["clip_fraction"], 0.4, rtol=1e-6)
    np.testing.assert_allclose(aux["ratio_mean"], 1.0, rtol=1e-5)
    np.testing.assert_allclose(aux["num_tokens"], 5.0)
    # k3: r - 1 - log r; 0.0945349 for r = 1.5, 0.1931472 for r = 0.5, 0 for r = 1.
    np.testing.assert_allclose(aux["approx_kl"], (2 * 0.0945349 + 2 * 0.1931472) / 5, rtol=1e-5)
    assert "kl_ref" not in aux


def test_policy_surrogate_per_token_hand_computed_and_weighted():
    clip = {"clip_eps_low": 0.2, "clip_eps_high": 0.2, "dual_clip": 0.0}
    logprobs = np.where(MASK > 0, NEW, 0.0)
    per_token, clipped, log_ratio = policy_surrogate(
        logprobs, OLD, ADV, MASK, policy_loss="ppo_clip", **clip
    )
    # The same per-token numbers as above, before any aggregation.
    np.testing.assert_allclose(per_token * MASK, [[-1.2, -0.5, 0], [0.8, 1.5, 1.0]], rtol=1e-5)
    np.testing.assert_array_equal(clipped * (MASK > 0), [[1, 0, 0], [1, 0, 0]])
    np.testing.assert_allclose(log_ratio, np.where(MASK > 0, np.log(RATIOS), 0.0), rtol=1e-5)
    weights = np.array([[2.0, 0.0, 9.0], [1.0, 0.5, 1.0]], np.float32)
    weighted, _, _ = policy_surrogate(
        logprobs, OLD, ADV, MASK, policy_loss="ppo_clip", importance_weights=weights, **clip
    )
    np.testing.assert_allclose(weighted, [[-2.4, 0.0, 0.0], [0.8, 0.75, 1.0]], rtol=1e-5)


def test_ratio_statistics_are_token_means_over_the_mask():
    log_ratio = np.log(np.array([[2.0, 1.0, 7.0]], np.float32))
    stats = ratio_statistics(log_ratio, np.array([[True, False, True]]), np.array([[1, 1, 0]]))
    np.testing.assert_allclose(stats["clip_fraction"], 0.5)
    np.testing.assert_allclose(stats["ratio_mean"], 1.5, rtol=1e-6)
    np.testing.assert_allclose(stats["approx_kl"], (1.0 - math.log(2.0)) / 2, rtol=1e-5)
    np.testing.assert_allclose(stats["num_tokens"], 2.0)


def test_clipped_surrogate_sequence_mean_hand_computed():
    loss, _ = policy_gradient_loss(
        NEW, OLD, ADV, MASK, **{**PPO, "aggregation": "sequence_mean_token_mean"}
    )
    # Sequence means: (-1.2 - 0.5) / 2 = -0.85 and (0.8 + 1.5 + 1.0) / 3 = 1.1.
    np.testing.assert_allclose(loss, (-0.85 + 1.1) / 2, rtol=1e-5)


def test_sequence_mean_ignores_sequences_without_tokens():
    mask = MASK.copy()
    mask[1] = 0.0
    loss, aux = policy_gradient_loss(
        NEW, OLD, ADV, mask, **{**PPO, "aggregation": "sequence_mean_token_mean"}
    )
    np.testing.assert_allclose(loss, -0.85, rtol=1e-5)
    np.testing.assert_allclose(aux["num_tokens"], 2.0)


def test_asymmetric_clip_higher():
    loss, _ = policy_gradient_loss(NEW, OLD, ADV, MASK, **{**PPO, "clip_eps_high": 0.28})
    # Only the upper bound moved: the first token now scores -1.28 instead of -1.2.
    np.testing.assert_allclose(loss, (-1.28 - 0.5 + 0.8 + 1.5 + 1.0) / 5, rtol=1e-5)


def test_kl_penalty_k3_hand_computed():
    logprobs = np.full((1, 2), -1.0, np.float32)
    ref = logprobs + np.array([[math.log(2.0), 0.0]], np.float32)
    loss, aux = policy_gradient_loss(
        logprobs, logprobs, np.zeros(1), np.ones((1, 2)), **PPO, ref_logprobs=ref, kl_coef=0.1
    )
    # k3 with pi_ref / pi = 2: 2 - log 2 - 1 = 0.3068528; the other token has 0.
    np.testing.assert_allclose(aux["kl_ref"], 0.3068528 / 2, rtol=1e-5)
    np.testing.assert_allclose(loss, 0.1 * 0.3068528 / 2, rtol=1e-5)


def test_unknown_aggregation_raises():
    with pytest.raises(ValueError, match="aggregation"):
        policy_gradient_loss(NEW, OLD, ADV, MASK, **{**PPO, "aggregation": "sum"})


def test_masked_nan_logprobs_give_finite_loss_and_zero_grads():
    new = NEW.copy()
    new[0, 2] = np.nan
    ref = OLD.copy()
    ref[0, 2] = np.inf

    def loss_fn(lp):
        return policy_gradient_loss(lp, OLD, ADV, MASK, **PPO, ref_logprobs=ref, kl_coef=0.1)[0]

    loss, grads = jax.value_and_grad(loss_fn)(jnp.asarray(new))
    assert np.isfinite(loss)
    assert np.all(np.isfinite(grads))
    assert grads[0, 2] == 0.0


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_perturbing_masked_logits_changes_neither_loss_nor_grads(aggregation):
    rng = np.random.default_rng(0)
    b, t, v = 2, 5, 7
    logits = rng.normal(size=(b, t, v)).astype(np.float32)
    targets = rng.integers(0, v, size=(b, t)).astype(np.int32)
    mask = np.array([[0, 1, 1, 0, 0], [1, 0, 1, 1, 0]], np.float32)
    old = rng.normal(size=(b, t)).astype(np.float32) - 2.0
    ref = rng.normal(size=(b, t)).astype(np.float32) - 2.0
    adv = np.array([0.7, -1.3], np.float32)

    def loss_fn(lg):
        lp = token_logprobs(lg, targets, **OFF)
        return policy_gradient_loss(
            lp,
            old,
            adv,
            mask,
            **{**PPO, "aggregation": aggregation, "max_tokens": t},
            ref_logprobs=ref,
            kl_coef=0.05,
        )[0]

    noise = 50.0 * rng.normal(size=logits.shape).astype(np.float32)
    perturbed = logits + noise * (1 - mask)[..., None]
    loss_a, grad_a = jax.value_and_grad(loss_fn)(jnp.asarray(logits))
    loss_b, grad_b = jax.value_and_grad(loss_fn)(jnp.asarray(perturbed))
    np.testing.assert_array_equal(loss_a, loss_b)
    np.testing.assert_array_equal(grad_a, grad_b)
    np.testing.assert_array_equal(grad_a * (1 - mask)[..., None], 0.0)

    sft_value_and_grad = jax.value_and_grad(lambda lg: sft_loss(lg, targets, mask)[0])
    sft_a, sft_grad_a = sft_value_and_grad(jnp.asarray(logits))
    sft_b, sft_grad_b = sft_value_and_grad(jnp.asarray(perturbed))
    np.testing.assert_array_equal(sft_a, sft_b)
    np.testing.assert_array_equal(sft_grad_a, sft_grad_b)


def test_sft_loss_hand_computed():
    logits = jnp.log(jnp.array([[[0.25, 0.75], [0.5, 0.5], [0.9, 0.1]]]))
    targets = jnp.array([[1, 0, 1]])
    mask = jnp.array([[1.0, 0.0, 1.0]])
    loss, aux = sft_loss(logits, targets, mask)
    np.testing.assert_allclose(loss, -(math.log(0.75) + math.log(0.1)) / 2, rtol=1e-6)
    np.testing.assert_allclose(aux["num_tokens"], 2.0)
    np.testing.assert_allclose(aux["accuracy"], 0.5)
