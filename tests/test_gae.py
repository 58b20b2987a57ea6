"""GAE (Schulman et al. 2016) for PPO with a value head: the estimator by hand, the value
head's update on a tiny model, and the config keys."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np
import optax
import pytest

from raytunix.config import ConfigError, load_config
from raytunix.learner.advantages import gae_advantages, last_token_rewards, whiten
from raytunix.learner.batch import Batch, PackedBatch
from raytunix.learner.losses import policy_gradient_loss, loss_normalizer
from raytunix.learner.train_state import (
    RLHyperparams,
    add_value_head,
    create_train_state,
    logprobs_fn,
    make_policy_update,
)
from raytunix.models.llama import ModelConfig, init_model
from raytunix.rollout.batch import trajectories_to_record_batch
from raytunix.types import EpisodeStatus, Trajectory

SAMPLING = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
# One layer: the estimator and the value head's update hold at any size, and each jitted
# update compiles faster than a two-layer model's.
CONFIG = ModelConfig(
    vocab_size=16, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32, max_seq_len=64
)


# ---------------------------------------------------------------- the estimator by hand
def test_gamma_and_lambda_one_give_reward_minus_value():
    mask = np.array([[0, 1, 1, 1, 0]], np.float32)  # prompt, three generated, padding
    rewards = last_token_rewards(np.array([2.0]), mask)
    np.testing.assert_array_equal(rewards, [[0, 0, 0, 2.0, 0]])
    values = np.array([[7.0, 0.5, 1.0, 1.5, 9.0]], np.float32)
    adv, ret = gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0)
    np.testing.assert_allclose(adv, [[0.0, 1.5, 1.0, 0.5, 0.0]], rtol=1e-6)
    np.testing.assert_allclose(ret, [[0.0, 2.0, 2.0, 2.0, 0.0]], rtol=1e-6)


def test_a_masked_gap_between_two_turns_is_skipped():
    # Turn 1 generates tokens 1-2, a tool result fills 3-4 (values 50 and 60 must not
    # enter), turn 2 generates 5-6; reward 1 on token 6; gamma 0.9, lambda 0.5.
    mask = np.array([[0, 1, 1, 0, 0, 1, 1, 0]], np.float32)
    values = np.array([[3.0, 0.2, 0.4, 50.0, 60.0, 0.6, 0.8, 70.0]], np.float32)
    rewards = last_token_rewards(np.array([1.0]), mask)
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.5)
    # t6: 1 - 0.8 = 0.2
    # t5: 0.9*0.8 - 0.6 + 0.45*0.2 = 0.21
    # t2: 0.9*0.6 - 0.4 + 0.45*0.21 = 0.2345   (next step is t5, across the gap)
    # t1: 0.9*0.4 - 0.2 + 0.45*0.2345 = 0.265525
    want = [0.0, 0.265525, 0.2345, 0.0, 0.0, 0.21, 0.2, 0.0]
    np.testing.assert_allclose(adv[0], want, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(ret[0], np.array(want) + values[0] * mask[0], rtol=1e-5, atol=1e-7)


def test_single_token_response_and_padding_rows():
    mask = np.array([[0, 0, 1, 0], [0, 0, 0, 0]], np.float32)  # row 1: padding only
    values = np.array([[1.0, 1.0, 0.25, 4.0], [3.0, 3.0, 3.0, 3.0]], np.float32)
    rewards = last_token_rewards(np.array([1.0, 5.0]), mask)
    np.testing.assert_array_equal(rewards, [[0, 0, 1.0, 0], [0, 0, 0, 0]])
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.99, lam=0.95)
    np.testing.assert_allclose(adv, [[0, 0, 0.75, 0], [0, 0, 0, 0]], rtol=1e-6)
    np.testing.assert_allclose(ret, [[0, 0, 1.0, 0], [0, 0, 0, 0]], rtol=1e-6)


def test_packed_segments_are_separate_chains():
    # Two episodes in one row (segments 1 and 2, then padding) equal their own rows.
    seg = np.array([[1, 1, 1, 2, 2, 2, 0]])
    mask = np.array([[0, 1, 1, 0, 1, 1, 0]], np.float32)
    index = np.array([[0, 0, 0, 1, 1, 1, 0]])
    values = np.array([[0.0, 0.3, 0.1, 0.0, 0.7, 0.5, 0.0]], np.float32)
    rewards = last_token_rewards(np.array([1.0, -1.0]), mask, index)
    np.testing.assert_array_equal(rewards, [[0, 0, 1.0, 0, 0, -1.0, 0]])
    adv, _ = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8, segment_ids=seg)
    alone, _ = gae_advantages(
        rewards.reshape(1, 7)[:, :3], values[:, :3], mask[:, :3], gamma=0.9, lam=0.8
    )
    second, _ = gae_advantages(rewards[:, 3:6], values[:, 3:6], mask[:, 3:6], gamma=0.9, lam=0.8)
    np.testing.assert_allclose(adv[:, :3], alone, rtol=1e-6)
    np.testing.assert_allclose(adv[:, 3:6], second, rtol=1e-6)
    # Without the segments the first episode's chain would run into the second's.
    joined, _ = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    assert not np.allclose(joined[:, :3], alone)


# ---------------------------------------------------------------- the update
def _trajectory(group, tokens, mask, reward):
    return Trajectory(
        task_id=group,
        group_id=group,
        token_ids=tokens,
        loss_mask=mask,
        logprobs=[-2.5 * m for m in mask],
        policy_versions=[0 if m else -1 for m in mask],
        reward=reward,
        status=EpisodeStatus.COMPLETED,
        num_turns=2,
    )


def _record_batch():
    return trajectories_to_record_batch(
        [
            _trajectory("a", [1, 2, 5, 6, 3, 3, 7], [0, 0, 1, 1, 0, 0, 1], 1.0),  # two turns
            _trajectory("a", [1, 2, 8], [0, 0, 1], 0.0),  # one generated token
            _trajectory("b", [3, 9, 10, 11], [0, 1, 1, 1], 0.5),
            _trajectory("b", [3, 4, 4], [0, 1, 1], 0.0),
        ]
    )


@pytest.fixture(scope="module")
def model():
    return init_model(CONFIG, seed=0)


def _setup(model, **settings):
    graphdef, params = model
    optimizer = optax.adam(1e-2)
    hp = RLHyperparams(**{**SAMPLING, "advantage_estimator": "gae", **settings})
    state = add_value_head(
        create_train_state(graphdef, params, optimizer, seed=0), optimizer, CONFIG.d_model
    )
    update = make_policy_update(graphdef, optimizer, hp, max_seq_len=CONFIG.max_seq_len)
    return graphdef, state, update, hp


@pytest.fixture(scope="module")
def default_update(model):
    """``_setup`` with the defaults, its update jitted once for the tests that share it."""
    return _setup(model)


@pytest.mark.slow
def test_first_update_loss_is_ppo_on_gae_advantages_plus_the_value_loss(default_update):
    graphdef, state, update, _ = default_update
    batch = Batch.from_record_batch(_record_batch(), pad_id=0, max_seq_len=64)
    _, metrics = update(state, None, batch)
    # By hand: the value head starts at 0, so the returns are the (gamma = 1) rewards,
    # the advantages the whitened returns, and the value loss 0.5 * mean(R^2).
    mask = batch.loss_mask[:, 1:]
    logprobs = np.asarray(
        logprobs_fn(graphdef, **SAMPLING)(state.params, batch.tokens, batch.loss_mask)
    )[:, 1:]
    rewards = last_token_rewards(batch.rewards, mask)
    adv, ret = gae_advantages(rewards, np.zeros(mask.shape), mask, gamma=1.0, lam=0.95)
    adv = whiten(adv, mask)
    normalizer = loss_normalizer(mask, aggregation="token_mean", max_tokens=64)
    policy, _ = policy_gradient_loss(
        logprobs,
        batch.logprobs[:, 1:],
        adv,
        mask,
        policy_loss="ppo_clip",
        clip_eps_low=0.2,
        clip_eps_high=0.28,
        dual_clip=0.0,
        aggregation="token_mean",
        max_tokens=64,
        normalizer=normalizer,
    )
    value_loss = 0.5 * np.sum(np.asarray(ret) ** 2 * mask) / mask.sum()
    np.testing.assert_allclose(float(metrics["value_loss"]), value_loss, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["loss"]), float(policy) + 0.5 * value_loss, rtol=1e-4)
    assert float(metrics["value_mean"]) == 0.0
    np.testing.assert_allclose(
        float(metrics["return_mean"]), np.sum(np.asarray(ret) * mask) / mask.sum(), rtol=1e-6
    )


@pytest.mark.slow
def test_value_head_moves_toward_the_returns(default_update):
    _, state, update, _ = default_update
    batch = Batch.from_record_batch(_record_batch(), pad_id=0, max_seq_len=64)
    losses = []
    for _ in range(6):
        state, metrics = update(state, None, batch)
        losses.append(float(metrics["value_loss"]))
    assert losses[-1] < 0.5 * losses[0], losses
    assert float(metrics["value_grad_norm"]) > 0


@pytest.mark.slow
def test_micro_batches_and_packing_give_the_whole_padded_update(model, default_update):
    _, state, whole, _ = default_update
    batch = Batch.from_record_batch(_record_batch(), pad_id=0, max_seq_len=64)
    want, want_m = whole(state, None, batch)
    _, _, micro, _ = _setup(model, micro_batch_size=2)
    got, got_m = micro(state, None, batch)
    packed = PackedBatch.from_record_batch(_record_batch(), pad_id=0, max_seq_len=64)
    got_p, got_pm = whole(state, None, packed)
    for other, metrics in ((got, got_m), (got_p, got_pm)):
        for key in ("loss", "value_loss", "return_mean", "advantage_abs_mean"):
            np.testing.assert_allclose(
                float(metrics[key]), float(want_m[key]), rtol=2e-5, atol=1e-6, err_msg=key
            )
        np.testing.assert_allclose(
            np.asarray(other.value_head["kernel"]),
            np.asarray(want.value_head["kernel"]),
            rtol=1e-4,
            atol=1e-6,
        )


def test_update_without_a_value_head_says_how_to_add_one():
    graphdef, params = init_model(CONFIG, seed=0)
    optimizer = optax.adam(1e-2)
    hp = RLHyperparams(**SAMPLING, advantage_estimator="gae")
    update = make_policy_update(graphdef, optimizer, hp, max_seq_len=64)
    batch = Batch.from_record_batch(_record_batch(), pad_id=0, max_seq_len=64)
    with pytest.raises(ValueError, match="add_value_head"):
        update(create_train_state(graphdef, params, optimizer, seed=0), None, batch)


# ---------------------------------------------------------------- config
def test_config_keys_reach_the_hyperparameters_and_bad_values_are_named():
    cfg = load_config(
        None,
        [
            "learner.advantage_estimator=gae",
            "learner.gae_gamma=0.99",
            "learner.gae_lambda=0.9",
            "learner.value_coef=0.25",
            "learner.value_clip=0.5",
            "learner.gae_normalize=false",
        ],
    )
    hp = RLHyperparams.from_config(cfg)
    assert (
        hp.advantage_estimator,
        hp.gae_gamma,
        hp.gae_lambda,
        hp.value_coef,
        hp.value_clip,
        hp.gae_normalize,
    ) == ("gae", 0.99, 0.9, 0.25, 0.5, False)
    default = load_config(None).learner
    assert (
        default.gae_gamma,
        default.gae_lambda,
        default.value_coef,
        default.value_clip,
        default.gae_normalize,
    ) == (1.0, 0.95, 0.5, 0.2, True)
    for override, named in [
        ("learner.gae_gamma=1.5", "learner.gae_gamma=1.5 must be in"),
        ("learner.gae_lambda=-0.1", "learner.gae_lambda=-0.1 must be in"),
        ("learner.value_coef=0", "learner.value_coef=0.0 must be > 0"),
        ("learner.value_clip=-1", "learner.value_clip=-1.0 must be > 0"),
    ]:
        with pytest.raises(ConfigError, match=named):
            load_config(None, ["learner.advantage_estimator=gae", override])
    with pytest.raises(ValueError, match="gae_gamma=2"):
        RLHyperparams(**SAMPLING, gae_gamma=2).check()
