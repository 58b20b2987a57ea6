"""Train state, jitted GRPO/SFT updates on a tiny model, and orbax checkpoints."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from raytunix.learner.checkpoint import Checkpointer
from raytunix.learner.train_state import (
    TrainState,
    create_train_state,
    logprobs_fn,
    make_grpo_update,
    make_optimizer,
    make_sft_update,
)
from raytunix.models.llama import ModelConfig, forward, init_model
from raytunix.rollout.batch import record_batch_to_arrays, trajectories_to_record_batch
from raytunix.types import EpisodeStatus, Trajectory

SAMPLING = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}  # the rollout's settings
CONFIG = ModelConfig(
    vocab_size=16, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=64
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
    return record_batch_to_arrays(trajectories_to_record_batch(trajectories), pad_to_multiple=8)


def _sequence_logprob(logprobs, batch, row):
    return float(np.sum(np.asarray(logprobs)[row] * batch["loss_mask"][row]))


def test_logprobs_fn_aligns_logprob_t_with_token_t(model):
    graphdef, params = model
    batch = _grpo_batch()
    got = logprobs_fn(graphdef, **SAMPLING)(params, batch["tokens"], batch["loss_mask"])
    tokens = jnp.asarray(batch["tokens"])
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    logits, _ = forward(graphdef, params, tokens, positions)
    logp = jax.nn.log_softmax(logits, axis=-1)
    b, t = 0, 3  # token 3 of row 0 is the second generated token, predicted at position 2
    np.testing.assert_allclose(got[b, t], logp[b, t - 1, batch["tokens"][b, t]], rtol=1e-5)
    assert np.all(np.asarray(got)[:, 0] == 0.0)
    assert np.all(np.asarray(got)[batch["loss_mask"] == 0] == 0.0)


def test_grpo_update_raises_probability_of_rewarded_completions(model):
    graphdef, params = model
    optimizer = make_optimizer(3e-3)
    state = create_train_state(graphdef, params, optimizer, seed=0)
    update = make_grpo_update(graphdef, optimizer, **SAMPLING)
    score = logprobs_fn(graphdef, **SAMPLING)
    batch = _grpo_batch()

    before = score(state.params, batch["tokens"], batch["loss_mask"])
    for i in range(3):
        # On-policy: behaviour logprobs are the current policy's.
        batch["logprobs"] = np.asarray(
            score(state.params, batch["tokens"], batch["loss_mask"])
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
    after = score(state.params, batch["tokens"], batch["loss_mask"])

    assert int(state.step) == 3
    gains = [
        _sequence_logprob(after, batch, row) - _sequence_logprob(before, batch, row)
        for row in range(4)
    ]
    assert gains[0] > 0.1 and gains[3] > 0.1  # rewarded completions
    assert gains[1] < -0.1 and gains[2] < -0.1  # unrewarded ones


def test_grpo_update_kl_penalty_needs_reference_params(model):
    graphdef, params = model
    optimizer = make_optimizer(1e-3)
    state = create_train_state(graphdef, params, optimizer, seed=0)
    update = make_grpo_update(graphdef, optimizer, kl_coef=0.1, aggregation="sequence_mean_token_mean",
                              **SAMPLING)
    batch = _grpo_batch()
    with pytest.raises(ValueError, match="ref_params"):
        update(state, None, batch)
    # Reference == current policy: the k3 KL estimate is exactly zero.
    _, metrics = update(state, params, batch)
    np.testing.assert_allclose(metrics["kl_ref"], 0.0, atol=1e-6)


def test_grpo_update_with_truncation_scores_like_the_sampler_and_stays_finite(model):
    """With top-k on, completion tokens outside the current policy's top-k set have
    logprob -inf: they get no gradient, are counted, and the loss (with a KL penalty)
    and every metric stay finite."""
    graphdef, params = model
    sampling = {"temperature": 0.7, "top_k": 3, "top_p": 0.95}
    optimizer = make_optimizer(1e-3)
    state = create_train_state(graphdef, params, optimizer, seed=0)
    update = make_grpo_update(graphdef, optimizer, kl_coef=0.1, **sampling)
    batch = _grpo_batch()
    scored = np.asarray(logprobs_fn(graphdef, **sampling)(params, batch["tokens"],
                                                          batch["loss_mask"]))
    generated = batch["loss_mask"] > 0
    outside = np.isneginf(scored) & generated
    assert 0 < outside.sum() < generated.sum()  # some tokens in the set, some out
    # Behaviour logprobs as the engine reports them for tokens it could sample.
    batch["logprobs"] = np.where(outside, -1.0, scored).astype(np.float32)

    new_state, metrics = update(state, params, batch)

    assert all(np.isfinite(v) for v in metrics.values())
    np.testing.assert_allclose(metrics["out_of_support_fraction"],
                               outside.sum() / generated.sum(), rtol=1e-6)
    assert metrics["num_tokens"] == generated.sum() - outside.sum()
    # In-support tokens are on-policy: ratio 1, and KL to an identical reference is 0.
    np.testing.assert_allclose(metrics["ratio_mean"], 1.0, rtol=1e-5)
    np.testing.assert_allclose(metrics["kl_ref"], 0.0, atol=1e-6)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(new_state.params))


def test_grpo_update_rejects_bad_arguments(model):
    graphdef, _ = model
    with pytest.raises(ValueError, match="aggregation"):
        make_grpo_update(graphdef, make_optimizer(1e-3), aggregation="sum", **SAMPLING)
    with pytest.raises(ValueError, match="temperature=0.0"):
        make_grpo_update(graphdef, make_optimizer(1e-3), temperature=0.0, top_k=0, top_p=1.0)
    with pytest.raises(ValueError, match="top_p=1.5"):
        make_grpo_update(graphdef, make_optimizer(1e-3), temperature=1.0, top_k=0, top_p=1.5)
    with pytest.raises(ValueError, match="top_k=-1"):
        make_grpo_update(graphdef, make_optimizer(1e-3), temperature=1.0, top_k=-1, top_p=1.0)


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
    update = make_grpo_update(graphdef, optimizer, **SAMPLING)
    return create_train_state(graphdef, params, optimizer, seed=7), update, _grpo_batch()


def _trained_state(trainer, steps):
    state, update, batch = trainer
    for _ in range(steps):
        state, _ = update(state, None, batch)
    return state


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


def test_resume_then_step_equals_uninterrupted(trainer, tmp_path):
    fresh, update, batch = trainer
    uninterrupted = _trained_state(trainer, 4)

    Checkpointer(str(tmp_path)).save(2, _trained_state(trainer, 2), {})
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
    assert any(p.name.startswith("2-") for p in (tmp_path.parent / f"{tmp_path.name}-corrupt").iterdir())
    ckpt.save(2, state2, {"policy_version": 2})
    assert ckpt.restore(None, state1)[1] == {"policy_version": 2}


def test_restore_without_checkpoint_names_directory(trainer, tmp_path):
    state = trainer[0]
    ckpt = Checkpointer(str(tmp_path / "empty"))
    assert ckpt.latest_step() is None
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "empty")):
        ckpt.restore(None, state)
