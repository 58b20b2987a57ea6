"""Off-policy correction: the decoupled PPO objective, truncated importance sampling at
token and sequence level, and the engine-learner logprob mismatch, against hand-computed
numbers and in a learner step on a tiny model."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from raytunix.config import ConfigError, load_config
from raytunix.learner.advantages import grpo_advantages
from raytunix.learner.learner import Learner, RLHyperparams
from raytunix.learner.losses import (
    policy_gradient_loss,
    logprob_mismatch,
    token_logprobs,
    truncated_importance_weights,
)
from raytunix.learner.batch import Batch
from raytunix.learner.train_state import (
    create_train_state,
    logprobs_fn,
    make_optimizer,
    make_policy_update,
)
from raytunix.models.llama import ModelConfig, forward, init_model
from raytunix.rollout.batch import record_batch_to_arrays, trajectories_to_record_batch
from raytunix.types import EpisodeStatus, Trajectory

LEVELS = ("token_tis", "sequence_tis", "geometric_tis")
PPO = {
    "policy_loss": "ppo_clip",
    "clip_eps_low": 0.2,
    "clip_eps_high": 0.2,
    "dual_clip": 0.0,
    "aggregation": "token_mean",
    "max_tokens": 3,
}  # a symmetric clip, token mean

# Two sequences of three tokens; token [0, 2] is masked out (its values are junk).
MASK = np.array([[1, 1, 0], [1, 1, 1]], np.float32)
ADV = np.array([1.0, -1.0], np.float32)
BEHAV = np.full((2, 3), -2.0, np.float32)
# pi_prox / pi_behav per token: 3, 0.5, (junk) | 1.5, 1.2, 2.5
PROX_OVER_BEHAV = np.array([[3.0, 0.5, 1e9], [1.5, 1.2, 2.5]], np.float32)
PROX = BEHAV + np.log(PROX_OVER_BEHAV)
# pi_theta / pi_prox per token: 1.5 (clipped to 1.2 at A>0), 0.9, (junk) | 0.5, 1.1, 1.0
NEW_OVER_PROX = np.array([[1.5, 0.9, 1e9], [0.5, 1.1, 1.0]], np.float32)
NEW = PROX + np.log(NEW_OVER_PROX)


def _numpy_decoupled_loss(weights, eps_low=0.2, eps_high=0.2):
    """-w * min(r A, clip(r) A), token mean over the mask: the formula by hand."""
    r = NEW_OVER_PROX.astype(np.float64)
    a = ADV[:, None].astype(np.float64)
    surrogate = np.minimum(r * a, np.clip(r, 1 - eps_low, 1 + eps_high) * a)
    per_token = np.where(MASK > 0, -weights * surrogate, 0.0)
    return per_token.sum() / MASK.sum()


# -- truncated importance weights ---------------------------------------------------------------


def test_token_tis_truncates_each_token_at_the_cap():
    weights, aux = truncated_importance_weights(PROX, BEHAV, MASK, level="token_tis", cap=2.0)
    np.testing.assert_allclose(weights, [[2.0, 0.5, 0.0], [1.5, 1.2, 2.0]], rtol=1e-6)
    np.testing.assert_allclose(aux["importance_truncated_fraction"], 2 / 5, rtol=1e-6)
    np.testing.assert_allclose(
        aux["importance_weight_mean"], (2 + 0.5 + 1.5 + 1.2 + 2) / 5, rtol=1e-6
    )


def test_sequence_tis_is_the_truncated_product_of_token_ratios():
    weights, aux = truncated_importance_weights(PROX, BEHAV, MASK, level="sequence_tis", cap=2.0)
    # Sequence 0: 3 * 0.5 = 1.5 (the masked token's 1e9 does not enter); sequence 1:
    # 1.5 * 1.2 * 2.5 = 4.5 -> 2.
    np.testing.assert_allclose(weights, [[1.5, 1.5, 0.0], [2.0, 2.0, 2.0]], rtol=1e-6)
    np.testing.assert_allclose(aux["importance_truncated_fraction"], 3 / 5, rtol=1e-6)


def test_geometric_tis_is_the_truncated_geometric_mean_of_token_ratios():
    weights, _ = truncated_importance_weights(PROX, BEHAV, MASK, level="geometric_tis", cap=1.6)
    g0 = math.sqrt(1.5)  # 1.2247; the second row's 4.5 ** (1 / 3) = 1.6510 is capped at 1.6
    np.testing.assert_allclose(weights, [[g0, g0, 0.0], [1.6, 1.6, 1.6]], rtol=1e-6)


def test_a_long_sequence_product_saturates_at_the_cap_instead_of_overflowing():
    prox = np.zeros((1, 4000), np.float32)
    behav = np.full((1, 4000), -1.0, np.float32)  # ratio e per token: e^4000 in all
    weights, _ = truncated_importance_weights(
        prox, behav, np.ones((1, 4000)), level="sequence_tis", cap=2.0
    )
    np.testing.assert_allclose(weights, 2.0, rtol=1e-6)


@pytest.mark.parametrize("level", LEVELS)
def test_weights_ignore_masked_tokens_whatever_their_values(level):
    prox, behav = PROX.copy(), BEHAV.copy()
    prox[0, 2], behav[0, 2] = np.nan, -np.inf
    got, _ = truncated_importance_weights(prox, behav, MASK, level=level, cap=2.0)
    want, _ = truncated_importance_weights(PROX, BEHAV, MASK, level=level, cap=2.0)
    np.testing.assert_array_equal(got, want)
    assert got[0, 2] == 0.0


def test_importance_weight_arguments_are_checked():
    with pytest.raises(ValueError, match="'sentence'"):
        truncated_importance_weights(PROX, BEHAV, MASK, level="sentence", cap=2.0)
    with pytest.raises(ValueError, match="cap 0.5"):
        truncated_importance_weights(PROX, BEHAV, MASK, level="token_tis", cap=0.5)


# -- the decoupled objective ---------------------------------------------------------------------


@pytest.mark.parametrize("level", LEVELS)
def test_decoupled_ppo_is_the_standard_clip_when_prox_equals_behaviour(level):
    """With pi_prox = pi_behav every weight is 1 and the anchor is the behaviour policy:
    loss and gradient are PPO's."""
    weights, _ = truncated_importance_weights(BEHAV, BEHAV, MASK, level=level, cap=2.0)

    def decoupled(lp):
        return policy_gradient_loss(lp, BEHAV, ADV, MASK, **PPO, importance_weights=weights)[0]

    def standard(lp):
        return policy_gradient_loss(lp, BEHAV, ADV, MASK, **PPO)[0]

    new = jnp.asarray(BEHAV + np.log(NEW_OVER_PROX))
    np.testing.assert_allclose(decoupled(new), standard(new), rtol=1e-6)
    np.testing.assert_allclose(jax.grad(decoupled)(new), jax.grad(standard)(new), rtol=1e-6)


def test_decoupled_ppo_loss_hand_computed():
    weights, _ = truncated_importance_weights(PROX, BEHAV, MASK, level="token_tis", cap=2.0)
    loss, aux = policy_gradient_loss(NEW, PROX, ADV, MASK, **PPO, importance_weights=weights)
    # Per token: -2 * 1.2, -0.5 * 0.9 | 1.5 * 0.8, 1.2 * 1.1, 2 * 1.0 -> sum 1.67 over 5.
    np.testing.assert_allclose(loss, (-2.4 - 0.45 + 1.2 + 1.32 + 2.0) / 5, rtol=1e-5)
    np.testing.assert_allclose(
        loss, _numpy_decoupled_loss(np.asarray(weights, np.float64)), rtol=1e-5
    )
    np.testing.assert_allclose(aux["clip_fraction"], 2 / 5, rtol=1e-6)  # ratios 1.5 and 0.5


@pytest.mark.parametrize("level", LEVELS)
def test_masked_tokens_contribute_zero_to_the_weighted_loss_and_its_gradient(level):
    weights, _ = truncated_importance_weights(PROX, BEHAV, MASK, level=level, cap=2.0)

    def loss_fn(lp):
        return policy_gradient_loss(lp, PROX, ADV, MASK, **PPO, importance_weights=weights)[0]

    new = NEW.copy()
    new[0, 2] = np.nan
    loss, grads = jax.value_and_grad(loss_fn)(jnp.asarray(new))
    np.testing.assert_allclose(
        loss, _numpy_decoupled_loss(np.asarray(weights, np.float64)), rtol=1e-5
    )
    assert np.all(np.isfinite(grads)) and grads[0, 2] == 0.0
    # The gradient of each token's term is -w * A * r where the clip does not bind.
    np.testing.assert_allclose(grads[0, 1], -weights[0, 1] * 1.0 * 0.9 / 5, rtol=1e-5)


def test_logprob_mismatch_hand_computed():
    learner = BEHAV + np.log(PROX_OVER_BEHAV)
    got = logprob_mismatch(learner, BEHAV, MASK)
    log_r = np.log(np.array([3.0, 0.5, 1.5, 1.2, 2.5]))
    np.testing.assert_allclose(got["mismatch_logprob_abs_mean"], np.abs(log_r).mean(), rtol=1e-5)
    np.testing.assert_allclose(got["mismatch_ratio_max"], 3.0, rtol=1e-5)  # not the masked 1e9
    np.testing.assert_allclose(got["mismatch_kl"], np.mean(np.exp(log_r) - 1 - log_r), rtol=1e-5)
    none = logprob_mismatch(learner, BEHAV, np.zeros_like(MASK))
    assert none["mismatch_ratio_max"] == 0.0 and none["mismatch_logprob_abs_mean"] == 0.0


# -- in the learner's update ---------------------------------------------------------------------

SAMPLING = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
# One layer: the corrections hold at any size, and each jitted update compiles faster.
TINY = ModelConfig(
    vocab_size=16, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32, max_seq_len=64
)


@pytest.fixture(scope="module")
def model():
    return init_model(TINY, seed=0)


def _grpo_update(graphdef, optimizer, **settings):
    """The GRPO update with the config's defaults but ``settings`` and plain sampling."""
    hp = RLHyperparams(**{**SAMPLING, **settings})
    return make_policy_update(graphdef, optimizer, hp, max_seq_len=TINY.max_seq_len)


def _trajectory(group, prompt, completion, reward):
    return Trajectory(
        task_id=group,
        group_id=group,
        token_ids=prompt + completion,
        loss_mask=[0] * len(prompt) + [1] * len(completion),
        logprobs=[0.0] * (len(prompt) + len(completion)),
        policy_versions=[-1] * len(prompt) + [0] * len(completion),
        reward=reward,
        status=EpisodeStatus.COMPLETED,
        num_turns=1,
    )


def _trajectories():
    return [
        _trajectory("a", [1, 2], [5, 6, 7], 1.0),
        _trajectory("b", [3], [8, 9, 10, 11], 0.0),
        _trajectory("a", [1, 2], [12, 13, 14], 0.0),
        _trajectory("b", [3], [4, 4, 4, 4], 1.0),
    ]


def _off_policy_batch(graphdef, params):
    """A batch whose behaviour logprobs are the learner's, shifted by known amounts."""
    batch = Batch.from_arrays(
        record_batch_to_arrays(trajectories_to_record_batch(_trajectories()), pad_to_multiple=8)
    )
    learner = np.asarray(logprobs_fn(graphdef, **SAMPLING)(params, batch.tokens, batch.loss_mask))
    shift = np.where(np.arange(batch.tokens.shape[1]) % 2 == 0, 0.3, -1.2).astype(np.float32)
    batch = batch._replace(
        logprobs=np.where(batch.loss_mask > 0, learner + shift, 0.0).astype(np.float32)
    )
    return batch, learner, shift


@pytest.mark.parametrize(
    "correction,level", [("none", "token_tis")] + [("decoupled_ppo", level) for level in LEVELS]
)
@pytest.mark.slow
def test_a_learner_step_runs_in_every_mode_with_finite_metrics_and_the_mismatch(
    model, correction, level
):
    graphdef, params = model
    optimizer = make_optimizer(1e-3)
    state = create_train_state(graphdef, params, optimizer, seed=0)
    update = _grpo_update(
        graphdef,
        optimizer,
        off_policy_correction=correction,
        importance_sampling=level,
        importance_cap=2.0,
    )
    batch, learner, shift = _off_policy_batch(graphdef, params)
    new_state, metrics = update(state, None, batch)

    assert all(np.isfinite(float(v)) for v in metrics.values()), metrics
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(new_state.params))
    on = batch.loss_mask > 0
    # learner - behaviour = -shift on every trained token.
    delta = -np.broadcast_to(shift, on.shape)[on]
    np.testing.assert_allclose(
        metrics["mismatch_logprob_abs_mean"], np.abs(delta).mean(), rtol=1e-4
    )
    np.testing.assert_allclose(metrics["mismatch_ratio_max"], math.exp(1.2), rtol=1e-4)
    np.testing.assert_allclose(
        metrics["mismatch_kl"], np.mean(np.exp(delta) - 1 - delta), rtol=1e-4
    )
    if correction == "decoupled_ppo":
        # Anchored at the proximal policy, which is the one the gradient is taken at.
        np.testing.assert_allclose(metrics["ratio_mean"], 1.0, rtol=1e-5)
        assert metrics["clip_fraction"] == 0.0
        # The weights are those of the learner's logprobs against the engine's.
        _, want = truncated_importance_weights(
            learner[:, 1:], batch.logprobs[:, 1:], batch.loss_mask[:, 1:], level=level, cap=2.0
        )
        for key in ("importance_weight_mean", "importance_truncated_fraction"):
            np.testing.assert_allclose(metrics[key], want[key], rtol=1e-4)
        if level != "geometric_tis":  # e^1.2 per token, or a product of many: some hit 2
            assert metrics["importance_truncated_fraction"] > 0.0
    else:
        assert metrics["clip_fraction"] > 0.0  # ratios e^1.2 and e^-0.3 to the behaviour
        assert "importance_weight_mean" not in metrics


@pytest.mark.slow
def test_decoupled_step_equals_one_computed_with_a_separate_no_grad_proximal_pass(model):
    """The update takes its proximal logprobs from the gradient's own forward pass; the
    step must be the one a separate no-grad forward at the starting parameters gives."""
    graphdef, params = model
    optimizer = optax.sgd(1.0)
    state = create_train_state(graphdef, params, optimizer, seed=0)
    update = _grpo_update(
        graphdef,
        optimizer,
        off_policy_correction="decoupled_ppo",
        importance_sampling="token_tis",
        importance_cap=2.0,
        clip_eps_low=0.2,
        clip_eps_high=0.28,
    )
    batch, _, _ = _off_policy_batch(graphdef, params)
    new_state, _ = update(state, None, batch)

    tokens = jnp.asarray(batch.tokens)
    mask = jnp.asarray(batch.loss_mask)[:, 1:]
    behav = jnp.asarray(batch.logprobs)[:, 1:]
    prox = jax.lax.stop_gradient(
        logprobs_fn(graphdef, **SAMPLING)(params, tokens, batch.loss_mask)
    )[:, 1:]
    weights, _ = truncated_importance_weights(prox, behav, mask, level="token_tis", cap=2.0)
    advantages = grpo_advantages(
        jnp.asarray(batch.rewards),
        jnp.asarray(batch.group_ids),
        tokens.shape[0],
        normalize_advantages_by_std=True,
    )

    def loss_fn(p):
        inputs = tokens[:, :-1]
        positions = jnp.broadcast_to(jnp.arange(inputs.shape[1]), inputs.shape)
        logits, _ = forward(graphdef, p, inputs, positions)
        lp = token_logprobs(logits.astype(jnp.float32), tokens[:, 1:], **SAMPLING)
        return policy_gradient_loss(
            lp, prox, advantages, mask, **{**PPO, "clip_eps_high": 0.28}, importance_weights=weights
        )[0]

    grads = jax.jit(jax.grad(loss_fn))(params)  # eagerly, each op dispatches alone
    expected = jax.tree.map(lambda p, g: p - g, params, grads)
    for got, want in zip(jax.tree.leaves(new_state.params), jax.tree.leaves(expected)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_on_policy_data_gives_every_mode_the_same_step(model):
    """Behaviour logprobs equal to the learner's: weights 1, anchors equal, so decoupled
    PPO with any weight level takes exactly the standard step, and the mismatch is 0."""
    graphdef, params = model
    batch, learner, _ = _off_policy_batch(graphdef, params)
    batch = batch._replace(logprobs=learner)
    steps = {}
    for correction, level in [("none", "token_tis")] + [("decoupled_ppo", lv) for lv in LEVELS]:
        optimizer = make_optimizer(1e-3)
        state = create_train_state(graphdef, params, optimizer, seed=0)
        update = _grpo_update(
            graphdef, optimizer, off_policy_correction=correction, importance_sampling=level
        )
        new_state, metrics = update(state, None, batch)
        steps[(correction, level)] = new_state.params
        np.testing.assert_allclose(metrics["mismatch_logprob_abs_mean"], 0.0, atol=1e-6)
        np.testing.assert_allclose(metrics["mismatch_kl"], 0.0, atol=1e-6)
        np.testing.assert_allclose(metrics["mismatch_ratio_max"], 1.0, rtol=1e-5)
    reference = steps[("none", "token_tis")]
    for key, got in steps.items():
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(reference)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7, err_msg=str(key))


def test_make_policy_update_rejects_unknown_modes_and_a_cap_below_one(model):
    graphdef, _ = model
    opt = make_optimizer(1e-3)
    with pytest.raises(ValueError, match="off_policy_correction='ppo'"):
        _grpo_update(graphdef, opt, off_policy_correction="ppo")
    with pytest.raises(ValueError, match="importance_sampling='token'"):
        _grpo_update(graphdef, opt, importance_sampling="token")
    with pytest.raises(ValueError, match="importance_cap=0.9"):
        _grpo_update(graphdef, opt, importance_cap=0.9)


# -- config and the Learner --------------------------------------------------------------------


def test_config_keys_reach_the_learner_and_bad_values_name_the_key():
    cfg = load_config(
        None,
        [
            "learner.off_policy_correction=decoupled_ppo",
            "learner.importance_sampling=geometric_tis",
            "learner.importance_cap=3",
        ],
    )
    hp = RLHyperparams.from_config(cfg)
    assert (hp.off_policy_correction, hp.importance_sampling, hp.importance_cap) == (
        "decoupled_ppo",
        "geometric_tis",
        3.0,
    )
    default = RLHyperparams.from_config(load_config(None))
    assert default.off_policy_correction == "none"  # today's objective stays the default
    with pytest.raises(ConfigError, match="learner.off_policy_correction='aeral'"):
        load_config(None, ["learner.off_policy_correction=aeral"])
    with pytest.raises(ConfigError, match="learner.importance_sampling='seq'"):
        load_config(None, ["learner.importance_sampling=seq"])
    with pytest.raises(ConfigError, match="learner.importance_cap=0.5"):
        load_config(None, ["learner.importance_cap=0.5"])
    with pytest.raises(ConfigError, match="learner.importance_cap=inf"):
        load_config(None, ["learner.importance_cap=.inf"])


@pytest.mark.parametrize(
    "correction,level", [("none", "token_tis"), ("decoupled_ppo", "sequence_tis")]
)
@pytest.mark.slow
def test_learner_train_step_reports_the_mismatch(correction, level):
    learner = Learner(TINY, seed=0, pad_id=0)
    learner.start_rl(
        RLHyperparams(
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            learning_rate=1e-3,
            off_policy_correction=correction,
            importance_sampling=level,
        )
    )
    trajectories = _trajectories()
    for t in trajectories:  # behaviour logprobs an engine might have reported
        t.logprobs = [-2.5 if m else 0.0 for m in t.loss_mask]
    metrics = learner.train_step(trajectories_to_record_batch(trajectories))
    for key in ("mismatch_logprob_abs_mean", "mismatch_ratio_max", "mismatch_kl", "update_s"):
        assert np.isfinite(metrics[key]) and metrics[key] > 0, key
    assert metrics["policy_version"] == 1
