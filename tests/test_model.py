import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from raytunix.models.llama import (
    KVCache,
    ModelConfig,
    Transformer,
    count_params,
    forward,
    init_kv_cache,
    init_model,
)

TINY = ModelConfig(
    vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, max_seq_len=24
)

_jit_forward = jax.jit(forward, static_argnums=0)


def _positions(batch, length):
    return jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))


def _tokens(seed, batch, length, vocab=TINY.vocab_size):
    return jax.random.randint(jax.random.key(seed), (batch, length), 0, vocab, jnp.int32)


def test_output_shapes_without_and_with_cache():
    graphdef, state = init_model(TINY, seed=0)
    tokens = _tokens(1, 3, 7)
    logits, cache = _jit_forward(graphdef, state, tokens, _positions(3, 7))
    assert logits.shape == (3, 7, TINY.vocab_size) and logits.dtype == jnp.float32
    assert cache is None

    empty = init_kv_cache(TINY, batch_size=3)
    assert empty.k.shape == (2, 3, 2, 24, 8) and empty.v.shape == empty.k.shape
    logits, cache = _jit_forward(graphdef, state, tokens, _positions(3, 7), empty)
    assert logits.shape == (3, 7, TINY.vocab_size)
    assert isinstance(cache, KVCache) and cache.k.shape == empty.k.shape
    assert init_kv_cache(TINY, 2, max_len=5).k.shape == (2, 2, 2, 5, 8)


def test_module_call_matches_functional_forward():
    model = Transformer(TINY, rngs=nnx.Rngs(0))
    graphdef, state = init_model(TINY, seed=0)
    tokens = _tokens(2, 2, 5)
    direct, _ = model(tokens, _positions(2, 5))
    functional, _ = forward(graphdef, state, tokens, _positions(2, 5))
    np.testing.assert_allclose(direct, functional, atol=1e-6)


def test_causal_later_tokens_do_not_change_earlier_logits():
    graphdef, state = init_model(TINY, seed=0)
    tokens = _tokens(3, 2, 10)
    changed = tokens.at[:, 6:].set((tokens[:, 6:] + 5) % TINY.vocab_size)
    before, _ = _jit_forward(graphdef, state, tokens, _positions(2, 10))
    after, _ = _jit_forward(graphdef, state, changed, _positions(2, 10))
    np.testing.assert_allclose(before[:, :6], after[:, :6], atol=1e-6)
    assert not np.allclose(before[:, 6:], after[:, 6:], atol=1e-3)


@pytest.mark.parametrize("n_kv_heads", [1, 2, 4])
def test_prefill_then_decode_matches_full_forward(n_kv_heads):
    """Two rows of different lengths share one batch: row 0 is prefilled with 5 tokens,
    row 1 with 3 (its last 2 prefill slots are padding, position -1); both then decode
    one token at a time. Every logit must equal the full forward's logit."""
    config = ModelConfig(
        vocab_size=61,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=n_kv_heads,
        d_ff=48,
        max_seq_len=24,
    )
    graphdef, state = init_model(config, seed=0)
    total = 11
    tokens = _tokens(4, 2, total)
    full, _ = _jit_forward(graphdef, state, tokens, _positions(2, total))

    prompt_lens = [5, 3]
    bucket = 5
    prompt_pos = np.full((2, bucket), -1, np.int32)
    prompt_tok = np.zeros((2, bucket), np.int32)
    for row, n in enumerate(prompt_lens):
        prompt_pos[row, :n] = np.arange(n)
        prompt_tok[row, :n] = tokens[row, :n]
    cache = init_kv_cache(config, batch_size=2)
    logits, cache = _jit_forward(
        graphdef, state, jnp.asarray(prompt_tok), jnp.asarray(prompt_pos), cache
    )
    for row, n in enumerate(prompt_lens):
        np.testing.assert_allclose(logits[row, :n], full[row, :n], atol=1e-4)

    next_pos = np.array(prompt_lens)
    while next_pos.max() < total:
        # A row that has finished decodes with position -1: it must not be disturbed.
        pos = np.where(next_pos < total, next_pos, -1).astype(np.int32)
        tok = np.array([tokens[row, min(p, total - 1)] for row, p in enumerate(next_pos)], np.int32)
        logits, cache = _jit_forward(
            graphdef, state, jnp.asarray(tok[:, None]), jnp.asarray(pos[:, None]), cache
        )
        for row in range(2):
            if pos[row] >= 0:
                np.testing.assert_allclose(logits[row, 0], full[row, pos[row]], atol=1e-4)
        next_pos += 1


def test_negative_positions_leave_the_cache_untouched():
    graphdef, state = init_model(TINY, seed=0)
    cache = init_kv_cache(TINY, batch_size=2, max_len=8)
    tokens = _tokens(5, 2, 4)
    positions = jnp.array([[0, 1, -1, -1], [-1, -1, -1, -1]], jnp.int32)
    _, cache = _jit_forward(graphdef, state, tokens, positions, cache)
    k, v = np.asarray(cache.k), np.asarray(cache.v)
    assert np.abs(k[:, 0, :2]).sum() > 0 and np.abs(v[:, 0, :2]).sum() > 0
    assert not k[:, 0, 2:].any() and not v[:, 0, 2:].any()  # -1 must not wrap to the end
    assert not k[:, 1].any() and not v[:, 1].any()

    # Padding queries see nothing, but their logits are still finite.
    logits, _ = _jit_forward(graphdef, state, tokens, positions, cache)
    assert np.isfinite(np.asarray(logits)).all()


@pytest.mark.slow
def test_untied_head_and_param_count():
    tied = ModelConfig(vocab_size=61, d_model=32, n_layers=1, n_heads=4, n_kv_heads=1, d_ff=48)
    untied = ModelConfig(
        vocab_size=61,
        d_model=32,
        n_layers=1,
        n_heads=4,
        n_kv_heads=1,
        d_ff=48,
        tie_embeddings=False,
    )
    embed = 61 * 32
    attn = 32 * 32 + 2 * 32 * 8 + 32 * 32
    mlp = 3 * 32 * 48
    norms = 3 * 32
    assert count_params(init_model(tied, 0)[1]) == embed + attn + mlp + norms
    graphdef, state = init_model(untied, 0)
    assert count_params(state) == 2 * embed + attn + mlp + norms
    logits, _ = forward(graphdef, state, _tokens(6, 1, 3), _positions(1, 3))
    assert logits.shape == (1, 3, 61)


def test_same_seed_same_weights():
    a = jax.tree.leaves(init_model(TINY, 7)[1])
    b = jax.tree.leaves(init_model(TINY, 7)[1])
    c = jax.tree.leaves(init_model(TINY, 8)[1])
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(vocab_size=0), "vocab_size"),
        (dict(vocab_size=10, n_layers=-1), "n_layers"),
        (dict(vocab_size=10, d_model=30, n_heads=4), "d_model"),
        (dict(vocab_size=10, n_heads=4, n_kv_heads=3), "n_kv_heads"),
        (dict(vocab_size=10, d_model=12, n_heads=4, n_kv_heads=2), "head_dim"),
        (dict(vocab_size=10, rope_theta=0.0), "rope_theta"),
        (dict(vocab_size=10, norm_eps=-1e-5), "norm_eps"),
    ],
)
def test_config_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ModelConfig(**kwargs)


def test_mismatched_cache_is_rejected():
    graphdef, state = init_model(TINY, seed=0)
    wrong = init_kv_cache(TINY, batch_size=3)
    with pytest.raises(ValueError, match="init_kv_cache"):
        forward(graphdef, state, _tokens(0, 2, 3), _positions(2, 3), wrong)
