"""The warm start packs its demonstrations several to a row (they average under half the
widest one's tokens): the supervised step must see the same targets and give the same
loss, metrics and update as with one demonstration per row."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np
import pytest

from raytunix.learner.batch import pack_demonstrations
from raytunix.learner.learner import Learner, SFTHyperparams
from raytunix.learner.train_state import create_train_state, make_optimizer, make_sft_update
from raytunix.models.llama import ModelConfig, init_model

# One layer: packing is checked at any depth, and each step's program compiles faster.
CONFIG = ModelConfig(
    vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64, max_seq_len=48
)


def _demonstrations(n, width, seed=0):
    """Right-padded rows of 3..width tokens, targets after a prompt of 1..4 tokens, and
    some unmasked tail tokens (an end mark that is not trained) before the padding."""
    rng = np.random.default_rng(seed)
    tokens = np.zeros((n, width), np.int32)
    mask = np.zeros((n, width), np.float32)
    for i in range(n):
        length = int(rng.integers(3, width + 1))
        prompt = int(rng.integers(1, min(4, length - 1) + 1))
        tail = int(rng.integers(0, 2)) if length - prompt > 1 else 0
        tokens[i, :length] = rng.integers(1, CONFIG.vocab_size, size=length)
        mask[i, prompt : length - tail] = 1.0
    return tokens, mask


def test_packing_keeps_every_target_in_order_with_its_context():
    tokens, mask = _demonstrations(40, 48)
    packed = pack_demonstrations(tokens, mask, row_multiple=4)
    rows = packed["tokens"].shape[0]
    assert rows % 4 == 0 and rows < 40
    assert packed["loss_mask"].sum() == mask.sum()
    # Each demonstration's tokens, cut after its last target, appear as one segment whose
    # positions count from 0 and whose targets are the demonstration's.
    found = []
    for r in range(rows):
        for k in range(1, packed["segment_ids"][r].max() + 1):
            cols = np.flatnonzero(packed["segment_ids"][r] == k)
            assert np.array_equal(packed["positions"][r, cols], np.arange(len(cols)))
            found.append((tuple(packed["tokens"][r, cols]), tuple(packed["loss_mask"][r, cols])))
    expected = []
    for i in range(40):
        end = np.flatnonzero(mask[i])[-1] + 1
        expected.append((tuple(tokens[i, :end]), tuple(mask[i, :end])))
    assert sorted(found) == sorted(expected)


def test_a_row_without_targets_takes_no_room():
    tokens, mask = _demonstrations(6, 48)
    mask[2] = 0.0
    packed = pack_demonstrations(tokens, mask, row_multiple=1)
    assert packed["loss_mask"].sum() == mask.sum()
    assert packed["segment_ids"].max(axis=1).sum() == 5  # 5 segments, none for row 2


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="one \\[N, T\\] shape"):
        pack_demonstrations(np.zeros((2, 8), np.int32), np.zeros((2, 9), np.float32))
    with pytest.raises(ValueError, match="row_multiple=0"):
        pack_demonstrations(
            np.zeros((2, 8), np.int32), np.zeros((2, 8), np.float32), row_multiple=0
        )


@pytest.mark.slow
def test_a_packed_step_equals_the_padded_step():
    graphdef, params = init_model(CONFIG, seed=0)
    optimizer = make_optimizer(1e-2)
    update = make_sft_update(graphdef, optimizer)
    tokens, mask = _demonstrations(24, 48, seed=1)
    packed = pack_demonstrations(tokens, mask, row_multiple=4)
    assert packed["tokens"].shape[0] < 24
    padded_state, padded = update(
        create_train_state(graphdef, params, optimizer, seed=0), tokens, mask
    )
    packed_state, got = update(
        create_train_state(graphdef, params, optimizer, seed=0),
        packed["tokens"],
        packed["loss_mask"],
        packed["positions"],
        packed["segment_ids"],
    )
    for key in ("loss", "grad_norm", "num_tokens", "accuracy"):
        np.testing.assert_allclose(float(got[key]), float(padded[key]), rtol=2e-5, err_msg=key)
    for a, b in zip(jax.tree.leaves(packed_state.params), jax.tree.leaves(padded_state.params)):
        np.testing.assert_allclose(
            np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5
        )  # Adam: ~lr * sign


@pytest.mark.slow
@pytest.mark.parametrize("batch_size", [1, 5])
def test_learner_warm_start_steps_train_on_packed_rows(batch_size):
    learner = Learner(CONFIG, seed=0)
    learner.start_warmup(SFTHyperparams(learning_rate=1e-2, warmup_steps=0))
    tokens, mask = _demonstrations(4, 48, seed=2)
    # A step's loss is measured before its update: 64 draws of 4 rows ~ the whole set.
    before = learner.sft_steps(tokens, mask, num_steps=1, batch_size=64)
    trained = learner.sft_steps(tokens, mask, num_steps=40, batch_size=batch_size)
    after = learner.sft_steps(tokens, mask, num_steps=1, batch_size=64)
    assert trained["updates_skipped_nonfinite"] == 0
    assert after["loss"] < 0.7 * before["loss"]


def test_ids_past_int32_and_empty_inputs_are_refused():
    with pytest.raises(ValueError, match=r"token ids in \[0, 2\^31\)"):
        pack_demonstrations(np.array([[1, 2**40 + 5]]), np.ones((1, 2), np.float32))
    learner = Learner(CONFIG, seed=0)
    learner.start_warmup(SFTHyperparams(learning_rate=1e-2, warmup_steps=0))
    tokens, mask = _demonstrations(4, 48)
    with pytest.raises(ValueError, match=r"batch_size >= 1 \(got 0\)"):
        learner.sft_steps(tokens, mask, num_steps=1, batch_size=0)
    with pytest.raises(ValueError, match=r"needs demonstrations \(got 0\)"):
        learner.sft_steps(tokens[:0], mask[:0], num_steps=1, batch_size=4)
