"""Train state, jitted GRPO/SFT updates on a tiny model, and orbax checkpoints."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from raytunix.learner.advantages import grpo_advantages
from raytunix.learner.checkpoint import Checkpointer
from raytunix.learner.batch import Batch
from raytunix.learner.train_state import (
    RLHyperparams,
    SFTHyperparams,
    TrainState,
    create_train_state,
    logprobs_fn,
    lr_schedule,
    make_optimizer,
    make_policy_update,
    make_sft_update,
)
from raytunix.models.llama import ModelConfig, forward, init_model
from raytunix.rollout.batch import record_batch_to_arrays, trajectories_to_record_batch
from raytunix.types import EpisodeStatus, Trajectory

SAMPLING = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}  # the rollout's settings
# One layer, two query heads sharing one KV head: every update below holds at any size,
# and each jitted update compiles in about two thirds of a two-layer model's time.
CONFIG = ModelConfig(
    vocab_size=16, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32, max_seq_len=64
)


@pytest.fixture(scope="module")
def model():
    return init_model(CONFIG, seed=0)


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


def _grpo_batch():
    """Two interleaved groups of two; in each group one completion is rewarded."""
    trajectories = [
        _trajectory("a", [1, 2], [5, 6, 7], 1.0),
        _trajectory("b", [3], [8, 9, 10, 11], 0.0),
        _trajectory("a", [1, 2], [12, 13, 14], 0.0),
        _trajectory("b", [3], [4, 4, 4, 4], 1.0),
    ]
    return Batch.from_arrays(
        record_batch_to_arrays(trajectories_to_record_batch(trajectories), pad_to_multiple=8)
    )


def _grpo_update(graphdef, optimizer, **settings):
    """The GRPO update with the config's defaults but ``settings`` and plain sampling."""
    hp = RLHyperparams(**{**SAMPLING, **settings})
    return make_policy_update(graphdef, optimizer, hp, max_seq_len=CONFIG.max_seq_len)


def _sequence_logprob(logprobs, batch, row):
    return float(np.sum(np.asarray(logprobs)[row] * batch.loss_mask[row]))


@pytest.mark.slow
def test_logprobs_fn_aligns_logprob_t_with_token_t(model):
    graphdef, params = model
    batch = _grpo_batch()
    got = logprobs_fn(graphdef, **SAMPLING)(params, batch.tokens, batch.loss_mask)
    tokens = jnp.asarray(batch.tokens)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    logits, _ = forward(graphdef, params, tokens, positions)
    logp = jax.nn.log_softmax(logits, axis=-1)
    b, t = 0, 3  # token 3 of row 0 is the second generated token, predicted at position 2
    np.testing.assert_allclose(got[b, t], logp[b, t - 1, batch.tokens[b, t]], rtol=1e-5)
    assert np.all(np.asarray(got)[:, 0] == 0.0)
    assert np.all(np.asarray(got)[batch.loss_mask == 0] == 0.0)


@pytest.mark.slow
def test_grpo_update_raises_probability_of_rewarded_completions(model):
    graphdef, params = model
    optimizer = make_optimizer(3e-3)
    state = create_train_state(graphdef, params, optimizer, seed=0)
    update = _grpo_update(graphdef, optimizer)
    score = logprobs_fn(graphdef, **SAMPLING)
    batch = _grpo_batch()

    before = score(state.params, batch.tokens, batch.loss_mask)
    for i in range(3):
        # On-policy: behaviour logprobs are the current policy's.
        batch = batch._replace(
            logprobs=np.asarray(score(state.params, batch.tokens, batch.loss_mask))
        )
        state, metrics = update(state, None, batch)
        if i == 0:
            np.testing.assert_allclose(metrics["ratio_mean"], 1.0, rtol=1e-5)
            np.testing.assert_allclose(metrics["approx_kl"], 0.0, atol=1e-6)
            assert metrics["clip_fraction"] == 0.0
            assert metrics["num_tokens"] == 14.0
            np.testing.assert_allclose(metrics["reward_mean"], 0.5)
            np.testing.assert_allclose(metrics["advantage_abs_mean"], 1.0, rtol=1e-5)
            assert metrics["entropy"] > 0 and metrics["grad_norm"] > 0
    after = score(state.params, batch.tokens, batch.loss_mask)

    assert int(state.step) == 3
    gains = [
        _sequence_logprob(after, batch, row) - _sequence_logprob(before, batch, row)
        for row in range(4)
    ]
    assert gains[0] > 0.1 and gains[3] > 0.1  # rewarded completions
    assert gains[1] < -0.1 and gains[2] < -0.1  # unrewarded ones


TRUNCATED = {"temperature": 0.7, "top_k": 3, "top_p": 0.95}


@pytest.fixture(scope="module")
def kl_update(model):
    """(optimizer, GRPO update with a KL penalty under top-k / top-p sampling), compiled
    once for the two KL tests."""
    graphdef, _ = model
    optimizer = make_optimizer(1e-3)
    return optimizer, _grpo_update(graphdef, optimizer, kl_coef=0.1, **TRUNCATED)


@pytest.mark.slow
def test_grpo_update_kl_penalty_needs_reference_params(model, kl_update):
    graphdef, params = model
    optimizer, update = kl_update
    state = create_train_state(graphdef, params, optimizer, seed=0)
    batch = _grpo_batch()
    with pytest.raises(ValueError, match="ref_params"):
        update(state, None, batch)
    # Reference == current policy: the k3 KL estimate is exactly zero.
    _, metrics = update(state, params, batch)
    np.testing.assert_allclose(metrics["kl_ref"], 0.0, atol=1e-6)


@pytest.mark.slow
def test_grpo_update_with_truncation_scores_like_the_sampler_and_stays_finite(model, kl_update):
    """With top-k on, completion tokens outside the current policy's top-k set have
    logprob -inf: they get no gradient, are counted, and the loss (with a KL penalty)
    and every metric stay finite."""
    graphdef, params = model
    optimizer, update = kl_update
    state = create_train_state(graphdef, params, optimizer, seed=0)
    batch = _grpo_batch()
    scored = np.asarray(logprobs_fn(graphdef, **TRUNCATED)(params, batch.tokens, batch.loss_mask))
    generated = batch.loss_mask > 0
    outside = np.isneginf(scored) & generated
    assert 0 < outside.sum() < generated.sum()  # some tokens in the set, some out
    # Behaviour logprobs as the engine reports them for tokens it could sample.
    batch = batch._replace(logprobs=np.where(outside, -1.0, scored).astype(np.float32))

    new_state, metrics = update(state, params, batch)

    assert all(np.isfinite(v) for v in metrics.values())
    np.testing.assert_allclose(
        metrics["out_of_support_fraction"], outside.sum() / generated.sum(), rtol=1e-6
    )
    assert metrics["num_tokens"] == generated.sum() - outside.sum()
    # In-support tokens are on-policy: ratio 1, and KL to an identical reference is 0.
    np.testing.assert_allclose(metrics["ratio_mean"], 1.0, rtol=1e-5)
    np.testing.assert_allclose(metrics["kl_ref"], 0.0, atol=1e-6)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(new_state.params))


def test_grpo_update_rejects_bad_arguments(model):
    graphdef, _ = model
    with pytest.raises(ValueError, match="loss_aggregation='sum'"):
        _grpo_update(graphdef, make_optimizer(1e-3), loss_aggregation="sum")
    with pytest.raises(ValueError, match="temperature=0.0"):
        _grpo_update(graphdef, make_optimizer(1e-3), temperature=0.0)
    with pytest.raises(ValueError, match="top_p=1.5"):
        _grpo_update(graphdef, make_optimizer(1e-3), top_p=1.5)
    with pytest.raises(ValueError, match="top_k=-1"):
        _grpo_update(graphdef, make_optimizer(1e-3), top_k=-1)


@pytest.mark.slow
def test_sft_update_overfits_a_tiny_batch(model):
    graphdef, params = model
    optimizer = make_optimizer(1e-2)
    state = create_train_state(graphdef, params, optimizer, seed=0)
    update = make_sft_update(graphdef, optimizer)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, CONFIG.vocab_size, size=(2, 16)).astype(np.int32)
    mask = np.ones((2, 16), np.float32)
    mask[:, :4] = 0.0  # the "prompt" is not a target
    losses = []
    for _ in range(50):
        state, metrics = update(state, tokens, mask)
        losses.append(float(metrics["loss"]))
    assert metrics["num_tokens"] == 24.0
    assert losses[0] > 2.0
    assert losses[-1] < 0.2 * losses[0]


def test_warmup_scales_first_update():
    optimizer = make_optimizer(0.1, warmup_steps=4, max_grad_norm=None)
    params = {"w": jnp.ones(3)}
    updates, _ = optimizer.update({"w": jnp.ones(3)}, optimizer.init(params), params)
    # Adam's first step moves each coordinate by the learning rate: here 0.1 / 4.
    np.testing.assert_allclose(updates["w"], -0.025, rtol=1e-4)


def _assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert np.asarray(x).dtype == np.asarray(y).dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def trainer(model):
    """(fresh state, jitted GRPO update, batch), compiled once for the checkpoint tests."""
    graphdef, params = model
    optimizer = make_optimizer(1e-2, weight_decay=0.01, warmup_steps=2)
    update = _grpo_update(graphdef, optimizer)
    return create_train_state(graphdef, params, optimizer, seed=7), update, _grpo_batch()


def _trained_state(trainer, steps):
    state, update, batch = trainer
    for _ in range(steps):
        state, _ = update(state, None, batch)
    return state


@pytest.mark.slow
def test_checkpoint_round_trip(trainer, tmp_path):
    state = _trained_state(trainer, 2)
    ckpt = Checkpointer(str(tmp_path / "ckpt"))
    extras = {"data_position": 12, "policy_version": 2, "orchestrator": {"in_flight": ["t1"]}}
    ckpt.save(2, state, extras)
    assert ckpt.latest_step() == 2

    abstract = jax.eval_shape(lambda: state)
    restored, restored_extras = ckpt.restore(None, abstract)
    assert isinstance(restored, TrainState)
    _assert_trees_equal(restored, state)
    assert restored_extras == extras
    assert ckpt.read_extras() == ckpt.read_extras(2) == extras  # without the model

    with pytest.raises(ValueError, match="already exists"):
        ckpt.save(2, state, extras)
    with pytest.raises(FileNotFoundError, match="step 5"):
        ckpt.restore(5, abstract)
    with pytest.raises(FileNotFoundError, match="step 5"):
        ckpt.read_extras(5)


@pytest.mark.slow
def test_resume_then_step_equals_uninterrupted(trainer, tmp_path):
    fresh, update, batch = trainer
    uninterrupted = _trained_state(trainer, 4)

    saver = Checkpointer(str(tmp_path))
    saver.save(2, _trained_state(trainer, 2), {})
    saver.close()  # the save is asynchronous: close waits for it
    resumed, _ = Checkpointer(str(tmp_path)).restore(None, fresh)
    assert int(resumed.step) == 2
    for _ in range(2):
        resumed, _ = update(resumed, None, batch)
    _assert_trees_equal(resumed, uninterrupted)


def test_corrupt_latest_checkpoint_falls_back_to_previous(trainer, tmp_path, caplog):
    state1 = _trained_state(trainer, 1)
    state2 = _trained_state(trainer, 2)
    ckpt = Checkpointer(str(tmp_path))
    ckpt.save(1, state1, {"policy_version": 1})
    ckpt.save(2, state2, {"policy_version": 2})
    ckpt.wait_until_finished()
    for path in (tmp_path / "2" / "state").rglob("*"):
        if path.is_file():
            path.write_bytes(b"garbage")

    with caplog.at_level(logging.WARNING):
        restored, extras = ckpt.restore(None, state1)
    assert extras == {"policy_version": 1}
    _assert_trees_equal(restored, state1)
    assert "step 2" in caplog.text
    # The bad checkpoint is moved aside, not deleted, and the resumed run can save step 2.
    assert ckpt.all_steps() == [1]
    assert any(
        p.name.startswith("2-") for p in (tmp_path.parent / f"{tmp_path.name}-corrupt").iterdir()
    )
    ckpt.save(2, state2, {"policy_version": 2})
    assert ckpt.restore(None, state1)[1] == {"policy_version": 2}


def test_restore_without_checkpoint_names_directory(trainer, tmp_path):
    state = trainer[0]
    ckpt = Checkpointer(str(tmp_path / "empty"))
    assert ckpt.latest_step() is None
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "empty")):
        ckpt.restore(None, state)


# -- update mechanics: micro-batches, iterations, skipped batches, optimizers ----------------------


def _off_policy(batch):
    """The batch with behaviour logprobs that make ratios differ from 1 (clips bind)."""
    shift = np.where(np.arange(batch.tokens.shape[1]) % 2 == 0, -1.5, -3.0)
    return batch._replace(logprobs=np.where(batch.loss_mask > 0, shift, 0.0).astype(np.float32))


def _assert_trees_close(a, b, rtol=1e-5, atol=1e-7):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


@pytest.mark.parametrize(
    "aggregation,settings",
    [
        ("token_mean", {}),
        ("sequence_mean_token_mean", {}),
        ("sequence_mean_token_sum_norm", {}),
        ("sequence_mean_token_mean", {"policy_loss": "gspo"}),
        (
            "token_mean",
            {"kl_coef": 0.1, "entropy_coef": 0.01, "off_policy_correction": "decoupled_ppo"},
        ),
    ],
)
@pytest.mark.slow
def test_four_micro_batches_make_the_whole_batch_update(model, aggregation, settings):
    graphdef, params = model
    optimizer = optax.sgd(0.5)  # the step is the gradient itself: nothing hides a mismatch
    state = create_train_state(graphdef, params, optimizer, seed=0)
    batch = _off_policy(_grpo_batch())
    ref = jax.tree.map(lambda p: p * 1.01, params)
    whole, whole_metrics = _grpo_update(
        graphdef, optimizer, loss_aggregation=aggregation, **settings
    )(state, ref, batch)
    micro, micro_metrics = _grpo_update(
        graphdef, optimizer, loss_aggregation=aggregation, micro_batch_size=1, **settings
    )(state, ref, batch)
    assert whole_metrics["clip_fraction"] > 0 or settings
    _assert_trees_close(micro.params, whole.params)
    for key in whole_metrics:
        np.testing.assert_allclose(
            micro_metrics[key], whole_metrics[key], rtol=1e-5, atol=1e-7, err_msg=key
        )
    # Rows that do not divide: 4 rows in micro-batches of 3 (two empty rows padded).
    odd, odd_metrics = _grpo_update(
        graphdef, optimizer, loss_aggregation=aggregation, micro_batch_size=3, **settings
    )(state, ref, batch)
    _assert_trees_close(odd.params, whole.params)
    np.testing.assert_allclose(odd_metrics["reward_mean"], whole_metrics["reward_mean"])


@pytest.mark.slow
def test_iterations_without_correction_anchor_every_step_at_the_behaviour_policy(model):
    graphdef, params = model
    optimizer = optax.sgd(0.5)
    state = create_train_state(graphdef, params, optimizer, seed=0)
    batch = _off_policy(_grpo_batch())
    twice, metrics = _grpo_update(graphdef, optimizer, num_iterations=2)(state, None, batch)
    once = _grpo_update(graphdef, optimizer)
    expected, first = once(state, None, batch)
    expected, second = once(expected, None, batch)
    assert int(twice.step) == 2
    _assert_trees_close(twice.params, expected.params)
    np.testing.assert_allclose(metrics["loss"], first["loss"], rtol=1e-5)
    np.testing.assert_allclose(metrics["loss_last"], second["loss"], rtol=1e-5)
    np.testing.assert_allclose(metrics["clip_fraction_last"], second["clip_fraction"], rtol=1e-5)


@pytest.mark.slow
def test_iterations_with_decoupled_ppo_keep_the_proximal_policy_of_the_batch_start(model):
    from raytunix.learner.losses import (
        policy_gradient_loss,
        token_logprobs,
        truncated_importance_weights,
    )

    graphdef, params = model
    optimizer = optax.sgd(0.5)
    state = create_train_state(graphdef, params, optimizer, seed=0)
    batch = _off_policy(_grpo_batch())
    settings = {"off_policy_correction": "decoupled_ppo", "importance_cap": 2.0}
    twice, _ = _grpo_update(graphdef, optimizer, num_iterations=2, **settings)(state, None, batch)
    once = _grpo_update(graphdef, optimizer, **settings)
    after_one, _ = once(state, None, batch)

    # The second step by hand: the anchor and the importance weights use the logprobs of
    # the parameters before the first step.
    tokens, mask = jnp.asarray(batch.tokens), jnp.asarray(batch.loss_mask)[:, 1:]
    prox = logprobs_fn(graphdef, **SAMPLING)(params, tokens, batch.loss_mask)[:, 1:]
    weights, _ = truncated_importance_weights(
        prox, batch.logprobs[:, 1:], mask, level="token_tis", cap=2.0
    )
    advantages = grpo_advantages(
        batch.rewards, batch.group_ids, 4, normalize_advantages_by_std=True
    )

    def loss_fn(p):
        logits, _ = forward(
            graphdef,
            p,
            tokens[:, :-1],
            jnp.broadcast_to(jnp.arange(tokens.shape[1] - 1), tokens[:, :-1].shape),
        )
        lp = token_logprobs(logits.astype(jnp.float32), tokens[:, 1:], **SAMPLING)
        return policy_gradient_loss(
            lp,
            prox,
            advantages,
            mask,
            policy_loss="ppo_clip",
            clip_eps_low=0.2,
            clip_eps_high=0.28,
            dual_clip=0.0,
            aggregation="token_mean",
            max_tokens=CONFIG.max_seq_len,
            importance_weights=weights,
        )[0]

    grads = jax.jit(jax.grad(loss_fn))(after_one.params)  # eagerly, each op dispatches alone
    expected = jax.tree.map(lambda p, g: p - 0.5 * g, after_one.params, grads)
    _assert_trees_close(twice.params, expected, rtol=1e-4, atol=1e-6)
    # Calling the one-step update again re-anchors at the new parameters: another step.
    again, _ = once(after_one, None, batch)
    assert any(
        not np.allclose(a, b, rtol=1e-4, atol=1e-6)
        for a, b in zip(jax.tree.leaves(again.params), jax.tree.leaves(expected))
    )


@pytest.mark.slow
def test_a_batch_without_trainable_tokens_changes_nothing_and_is_counted():
    from raytunix.learner.learner import RLHyperparams as LearnerHyperparams
    from raytunix.learner.learner import Learner
    from raytunix.rollout.batch import trajectories_to_record_batch

    learner = Learner(CONFIG, seed=0, pad_id=0)
    learner.start_rl(LearnerHyperparams(**SAMPLING, learning_rate=1e-2, weight_decay=0.1))
    before = jax.device_get(learner._state)
    empty = [_trajectory("a", [1, 2, 3], [], r) for r in (1.0, 0.0)]
    metrics = learner.train_step(trajectories_to_record_batch(empty))
    assert metrics["update_skipped"] == 1.0 and metrics["updates_skipped"] == 1
    assert metrics["policy_version"] == 0 and learner.version == 0 and learner.rl_step == 1
    _assert_trees_equal(jax.device_get(learner._state), before)  # params, AdamW moments, step

    trained = learner.train_step(
        trajectories_to_record_batch(
            [_trajectory("a", [1, 2], [5, 6], 1.0), _trajectory("a", [1, 2], [7, 8], 0.0)]
        )
    )
    assert trained["update_skipped"] == 0.0 and trained["policy_version"] == 1
    assert int(learner._state.step) == 1


def test_learning_rate_schedules_hand_computed():
    def rates(schedule, warmup):
        fn = lr_schedule(1.0, schedule=schedule, warmup_steps=warmup, total_steps=6)
        return [float(fn(i)) if callable(fn) else fn for i in range(6)]

    np.testing.assert_allclose(rates("constant", 2), [0.5, 1, 1, 1, 1, 1])
    np.testing.assert_allclose(rates("linear", 2), [0.5, 1, 1, 0.75, 0.5, 0.25])
    c = [0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(4)]
    np.testing.assert_allclose(rates("cosine", 2), [0.5, 1] + c, rtol=1e-6)
    np.testing.assert_allclose(
        rates("linear", 0), [1, 5 / 6, 4 / 6, 3 / 6, 2 / 6, 1 / 6], rtol=1e-6
    )
    with pytest.raises(ValueError, match="lr_schedule='step'"):
        lr_schedule(1.0, schedule="step", warmup_steps=0, total_steps=6)
    with pytest.raises(ValueError, match="more optimizer steps"):
        lr_schedule(1.0, schedule="cosine", warmup_steps=6, total_steps=6)


@pytest.mark.parametrize("name,first_step", [("sgd", -0.1 * 2.0), ("adam", -0.1), ("adamw", -0.1)])
def test_optimizers_by_name_take_their_first_step(name, first_step):
    optimizer = make_optimizer(0.1, optimizer=name, max_grad_norm=None)
    params = {"w": jnp.ones(3)}
    updates, _ = optimizer.update({"w": jnp.full(3, 2.0)}, optimizer.init(params), params)
    np.testing.assert_allclose(updates["w"], first_step, rtol=1e-4)
    with pytest.raises(ValueError, match="optimizer='lamb'"):
        make_optimizer(0.1, optimizer="lamb")
    if name != "adamw":
        with pytest.raises(ValueError, match="weight_decay=0.01 is applied by adamw only"):
            make_optimizer(0.1, optimizer=name, weight_decay=0.01)


def test_config_keys_reach_the_update_and_bad_values_are_named():
    from raytunix.config import ConfigError, load_config

    cfg = load_config(
        None,
        [
            "learner.advantage_estimator=rloo",
            "learner.policy_loss=cispo",
            "learner.loss_aggregation=sequence_mean_token_sum_norm",
            "learner.kl_estimator=k2",
            "learner.entropy_coef=0.01",
            "learner.overlong_buffer_tokens=16",
            "learner.micro_batch_size=8",
            "learner.num_iterations=2",
            "learner.optimizer=sgd",
            "learner.lr_schedule=cosine",
            "learner.lr_warmup_steps=5",
        ],
    )
    hp = RLHyperparams.from_config(cfg)
    for key, value in cfg.learner.__dict__.items():
        if hasattr(hp, key):
            assert getattr(hp, key) == value, key
    assert hp.overlong_max_tokens == cfg.env.max_turns * cfg.rollout.max_new_tokens
    hp.check()
    # The defaults are today's GRPO: token mean, std-normalised advantages, clip 0.2/0.28.
    default = RLHyperparams.from_config(load_config(None))
    assert (
        default.advantage_estimator,
        default.normalize_advantages_by_std,
        default.policy_loss,
        default.loss_aggregation,
        default.clip_eps_low,
        default.clip_eps_high,
        default.kl_coef,
        default.num_iterations,
        default.micro_batch_size,
    ) == ("grpo", True, "ppo_clip", "token_mean", 0.2, 0.28, 0.0, 1, 0)
    assert RLHyperparams(**SAMPLING).clip_eps_high == default.clip_eps_high  # one default
    sft = SFTHyperparams.from_config(
        load_config(
            None,
            ["warmup.learning_rate=0.01", "warmup.warmup_steps=7", "learner.max_grad_norm=0.5"],
        )
    )
    assert (sft.learning_rate, sft.warmup_steps, sft.max_grad_norm) == (0.01, 7, 0.5)
    assert SFTHyperparams() == SFTHyperparams.from_config(load_config(None))
    for override, named in [
        ("learner.policy_loss=ppo", "learner.policy_loss='ppo' is not one of ppo_clip, gspo"),
        ("learner.advantage_estimator=ppo", "learner.advantage_estimator='ppo'"),
        ("learner.kl_estimator=k4", "learner.kl_estimator='k4'"),
        ("learner.dual_clip=0.5", "learner.dual_clip=0.5 must be > 1"),
        ("learner.num_iterations=0", "learner.num_iterations=0 must be > 0"),
        ("learner.micro_batch_size=-1", "learner.micro_batch_size=-1 must be >= 0"),
    ]:
        with pytest.raises(ConfigError, match=named):
            load_config(None, [override])
    for overrides, named in [
        (
            ["learner.advantage_estimator=rloo", "learner.normalize_advantages_by_std=false"],
            "applies to learner.advantage_estimator=grpo only",
        ),
        (["learner.optimizer=adam", "learner.weight_decay=0.1"], "adamw only"),
        (["learner.overlong_buffer_tokens=1000"], "exceeds the most tokens"),
        (["learner.lr_schedule=linear", "learner.lr_warmup_steps=40"], "must exceed"),
    ]:
        with pytest.raises(ConfigError, match=named):
            load_config(None, overrides)


def test_padding_widths_come_from_a_few_buckets():
    from raytunix.learner.batch import bucket_width, padding_buckets
    from raytunix.rollout.batch import trajectories_to_record_batch

    assert padding_buckets(128) == (32, 64, 96, 128)  # the widths of a default run
    assert padding_buckets(4096) == (
        32,
        64,
        96,
        128,
        192,
        256,
        384,
        512,
        768,
        1024,
        1536,
        2048,
        3072,
        4096,
    )
    assert [bucket_width(n, 128) for n in (1, 32, 33, 65, 97, 500)] == [32, 32, 64, 96, 128, 128]
    rows = [_trajectory("a", [1] * 60, [2] * 10, 1.0), _trajectory("a", [1], [2], 0.0)]
    batch = Batch.from_record_batch(trajectories_to_record_batch(rows), pad_id=0, max_seq_len=128)
    assert batch.tokens.shape == (2, 96) and batch.loss_mask[0].sum() == 10
    long = [_trajectory("a", [1] * 150, [2] * 10, 1.0)]
    cut = Batch.from_record_batch(trajectories_to_record_batch(long), pad_id=0, max_seq_len=128)
    assert cut.tokens.shape == (1, 128) and cut.loss_mask.sum() == 0
    with pytest.raises(ValueError, match=r"needs \['valid'\]"):
        Batch.from_arrays({k: v for k, v in batch._asdict().items() if k != "valid"})
