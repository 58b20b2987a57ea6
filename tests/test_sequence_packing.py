"""Sequence packing: several trajectories per learner row (segment ids, restarting
positions) give the same model outputs and the same GRPO update as one per padded row."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from raytunix.learner.batch import Batch, PackedBatch, pack_batch, pack_rows, packed_width
from raytunix.learner.train_state import (
    RLHyperparams,
    create_train_state,
    make_optimizer,
    make_policy_update,
    packed_row_multiple,
)
from raytunix.models.llama import ModelConfig, forward, init_model
from raytunix.rollout.batch import trajectories_to_record_batch
from raytunix.types import EpisodeStatus, Trajectory

WIDTH = 32
CONFIG = ModelConfig(
    vocab_size=16, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32, max_seq_len=WIDTH
)
SAMPLING = {"temperature": 0.9, "top_k": 0, "top_p": 1.0}


def _trajectories(seed=0, num=12):
    """``num`` trajectories of 3..WIDTH tokens in groups of 4, random behaviour logprobs;
    one exactly WIDTH tokens long, one with no trained token."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(3, WIDTH, size=num)
    lengths[0] = WIDTH
    out = []
    for i, n in enumerate(lengths):
        prompt = int(rng.integers(1, 4))
        mask = [0] * prompt + [1] * (n - prompt)
        if i == 5:
            mask = [0] * n
        out.append(
            Trajectory(
                task_id=str(i // 4),
                group_id=str(i // 4),
                token_ids=rng.integers(1, CONFIG.vocab_size, size=n).tolist(),
                loss_mask=mask,
                logprobs=[float(-rng.uniform(0.5, 4.0)) if m else 0.0 for m in mask],
                policy_versions=[0 if m else -1 for m in mask],
                reward=float(rng.normal()),
                status=EpisodeStatus.COMPLETED,
                num_turns=1,
            )
        )
    return out


@pytest.fixture(scope="module")
def record_batch():
    return trajectories_to_record_batch(_trajectories())


@pytest.fixture(scope="module")
def models():
    graphdef, params = init_model(CONFIG, seed=0)
    _, ref_params = init_model(CONFIG, seed=1)
    return graphdef, params, ref_params


def test_packing_invariants(record_batch):
    lengths = np.diff(record_batch.column("token_ids").offsets.to_numpy())
    batch = Batch.from_record_batch(record_batch, pad_id=0, max_seq_len=WIDTH)
    packed = PackedBatch.from_record_batch(record_batch, pad_id=0, max_seq_len=WIDTH)
    assert packed.tokens.shape[1] == WIDTH and packed.tokens.shape[0] % 8 == 0
    assert packed.tokens.shape[0] < len(lengths)  # fewer rows than one per trajectory
    seen = []
    for r in range(packed.tokens.shape[0]):
        seg = packed.segment_ids[r]
        used = int(np.sum(seg > 0))
        assert np.all(seg[:used] > 0) and np.all(seg[used:] == 0)  # padding only at the end
        assert used <= WIDTH
        for k in np.unique(seg[seg > 0]):
            where = np.flatnonzero(seg == k)
            assert np.all(np.diff(where) == 1)  # a segment is contiguous
            i = int(packed.trajectory_index[r, where[0]])
            assert np.all(packed.trajectory_index[r, where] == i)
            assert len(where) == lengths[i]
            np.testing.assert_array_equal(packed.positions[r, where], np.arange(len(where)))
            np.testing.assert_array_equal(packed.tokens[r, where], batch.tokens[i, : lengths[i]])
            np.testing.assert_array_equal(
                packed.loss_mask[r, where[1:]], batch.loss_mask[i, 1 : lengths[i]]
            )
            assert packed.loss_mask[r, where[0]] == 0  # never scored across segments
            seen.append(i)
    assert sorted(seen) == list(range(len(lengths)))  # every trajectory exactly once
    np.testing.assert_array_equal(packed.rewards, batch.rewards)
    # Every trained token of the padded batch is trained in the packed one.
    assert packed.loss_mask[:, 1:].sum() == batch.loss_mask[:, 1:].sum()


def test_pack_rows_first_fit_decreasing_and_cuts():
    assert pack_rows(np.array([5, 8, 3, 4]), 8) == [[1], [0, 2], [3]]
    with pytest.raises(ValueError, match="lengths must be in"):
        pack_rows(np.array([9]), 8)
    # A trajectory longer than the width is cut to it; a zero-length one takes no room.
    batch = Batch(
        tokens=np.arange(1, 21, dtype=np.int32).reshape(2, 10),
        loss_mask=np.ones((2, 10), np.float32),
        logprobs=np.zeros((2, 10), np.float32),
        policy_versions=np.zeros((2, 10), np.int32),
        rewards=np.zeros(2, np.float32),
        group_ids=np.zeros(2, np.int32),
        valid=np.ones(2, np.float32),
    )
    packed = pack_batch(batch, np.array([10, 0]), 6, row_multiple=3)
    assert packed.tokens.shape == (3, 6)
    np.testing.assert_array_equal(packed.tokens[0], np.arange(1, 7))
    np.testing.assert_array_equal(packed.segment_ids[1:], 0)
    with pytest.raises(ValueError, match="width"):
        pack_batch(batch, np.array([3, 3]), 1)


def test_packed_width_takes_the_bucket_with_fewest_tokens():
    rng = np.random.default_rng(0)
    # Short trajectories with one long one: pairs and triples in full-context rows.
    mixed = np.concatenate([[128], rng.integers(40, 61, size=127)])
    assert packed_width(mixed, 128) == 128
    # All 40-64 tokens: rows of 64 hold them in as many tokens as pairs in rows of 128,
    # with cheaper attention.
    assert packed_width(rng.integers(40, 65, size=128), 128) == 64
    assert packed_width(np.array([5, 7]), 128) == 32  # the narrowest bucket that holds them


@pytest.mark.slow
def test_packed_logits_equal_per_trajectory(models, record_batch):
    graphdef, params, _ = models
    packed = PackedBatch.from_record_batch(record_batch, pad_id=0, max_seq_len=WIDTH)
    batch = Batch.from_record_batch(record_batch, pad_id=0, max_seq_len=WIDTH)
    lengths = np.diff(record_batch.column("token_ids").offsets.to_numpy())
    packed_logits, _ = jax.jit(forward, static_argnums=0)(
        graphdef,
        params,
        jnp.asarray(packed.tokens),
        jnp.asarray(packed.positions),
        segment_ids=jnp.asarray(packed.segment_ids),
    )
    positions = np.broadcast_to(np.arange(WIDTH, dtype=np.int32), batch.tokens.shape)
    logits, _ = forward(graphdef, params, jnp.asarray(batch.tokens), jnp.asarray(positions))
    for i, n in enumerate(lengths):
        r, cols = np.nonzero((packed.trajectory_index == i) & (packed.segment_ids > 0))
        np.testing.assert_allclose(
            np.asarray(packed_logits)[r, cols], np.asarray(logits)[i, :n], rtol=1e-5, atol=1e-5
        )
    # Segment ids are for the cache-free (training) forward only.
    with pytest.raises(ValueError, match="segment_ids"):
        forward(
            graphdef,
            params,
            jnp.asarray(packed.tokens),
            jnp.asarray(packed.positions),
            segment_ids=jnp.asarray(packed.segment_ids[:, :5]),
        )


# Four updates cover every mode (each case compiles two programs, so they are few):
# aggregations, GSPO / CISPO / dual clip, KL k1 / k2 / k3, entropy, the three importance
# weight levels, micro-batches and several iterations.
CASES = {
    "ppo_dual_clip_token_mean_kl_k1_entropy_micro_batches": {
        "dual_clip": 3.0,
        "kl_coef": 0.1,
        "kl_estimator": "k1",
        "entropy_coef": 0.01,
        "micro_batch_size": 4,
    },
    "gspo_seq_mean_kl_k2_sequence_tis_overlong": {
        "policy_loss": "gspo",
        "clip_eps_low": 3e-4,
        "clip_eps_high": 4e-4,
        "loss_aggregation": "sequence_mean_token_mean",
        "kl_coef": 0.1,
        "kl_estimator": "k2",
        "off_policy_correction": "decoupled_ppo",
        "importance_sampling": "sequence_tis",
        "importance_cap": 1e6,
        "overlong_buffer_tokens": 8,
        "overlong_max_tokens": 24,
    },
    "cispo_sum_norm_kl_k3_geometric_tis_iterations": {
        "policy_loss": "cispo",
        "loss_aggregation": "sequence_mean_token_sum_norm",
        "kl_coef": 0.1,
        "kl_estimator": "k3",
        "off_policy_correction": "decoupled_ppo",
        "importance_sampling": "geometric_tis",
        "num_iterations": 2,
    },
    "ppo_seq_mean_token_tis_micro_batches_iterations": {
        "loss_aggregation": "sequence_mean_token_mean",
        "off_policy_correction": "decoupled_ppo",
        "importance_sampling": "token_tis",
        "micro_batch_size": 8,
        "num_iterations": 2,
    },
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_packed_update_equals_padded(models, record_batch, name):
    graphdef, params, ref_params = models
    hp = RLHyperparams(**SAMPLING, **CASES[name])
    # Plain SGD: Adam's first step is ~sign(g), which float rounding of a tiny gradient
    # entry could flip; SGD keeps the comparison a comparison of gradients.
    optimizer = make_optimizer(0.5, optimizer="sgd")
    update = make_policy_update(graphdef, optimizer, hp, max_seq_len=WIDTH)
    state = create_train_state(graphdef, params, optimizer, seed=0)
    ref = ref_params if hp.kl_coef > 0 else None
    padded = Batch.from_record_batch(record_batch, pad_id=0, max_seq_len=WIDTH)
    packed = PackedBatch.from_record_batch(
        record_batch,
        pad_id=0,
        max_seq_len=WIDTH,
        row_multiple=packed_row_multiple(hp.micro_batch_size),
    )
    assert packed.tokens.shape[0] < padded.tokens.shape[0]
    state_a, metrics_a = update(state, ref, padded)
    state_b, metrics_b = update(state, ref, packed)
    assert set(metrics_a) == set(metrics_b)
    for key in metrics_a:
        np.testing.assert_allclose(
            float(metrics_b[key]), float(metrics_a[key]), rtol=2e-4, atol=1e-6, err_msg=key
        )
    assert float(metrics_a["grad_norm"]) > 0
    changes = jax.tree.map(
        lambda a, b: float(jnp.max(jnp.abs(a - b))), state_a.params, state.params
    )
    assert max(jax.tree.leaves(changes)) > 1e-3  # the update moved the weights
    for a, b in zip(jax.tree.leaves(state_a.params), jax.tree.leaves(state_b.params)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-6)


def test_packed_batch_without_trained_tokens_is_skipped(models, record_batch):
    graphdef, params, _ = models
    optimizer = make_optimizer(0.5, optimizer="sgd")
    update = make_policy_update(graphdef, optimizer, RLHyperparams(**SAMPLING), max_seq_len=WIDTH)
    state = create_train_state(graphdef, params, optimizer, seed=0)
    packed = PackedBatch.from_record_batch(record_batch, pad_id=0, max_seq_len=WIDTH)
    empty = packed._replace(loss_mask=np.zeros_like(packed.loss_mask))
    same, metrics = update(state, None, empty)
    assert same is state and metrics["update_skipped"] == 1.0
    # Rows that micro-batches cannot split evenly are refused with the fix named.
    split = make_policy_update(
        graphdef, optimizer, RLHyperparams(**SAMPLING, micro_batch_size=3), max_seq_len=WIDTH
    )
    with pytest.raises(ValueError, match="row_multiple=24"):
        split(state, None, packed)
