"""``Transformer.__call__`` refuses arguments that do not fit together or the model, with
a message naming the shapes and how to build the right cache, before any compute."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax.numpy as jnp
import pytest

from raytunix.models.llama import ModelConfig, forward, init_kv_cache, init_kv_pages, init_model

CONFIG = ModelConfig(vocab_size=17, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=24)


@pytest.fixture(scope="module")
def model():
    return init_model(CONFIG, seed=0)


def test_each_misfit_is_named_with_the_shapes_and_the_fix(model):
    tokens = jnp.zeros((2, 3), jnp.int32)
    positions = jnp.zeros((2, 3), jnp.int32)
    with pytest.raises(ValueError, match=r"must both be \[B, T\]"):
        forward(*model, tokens, positions[:, :2])
    with pytest.raises(ValueError, match="drop them for cached inference"):
        forward(*model, tokens, positions, init_kv_cache(CONFIG, 2), segment_ids=tokens)
    with pytest.raises(ValueError, match="build it with init_kv_cache"):
        forward(*model, tokens, positions, init_kv_cache(CONFIG, 3))  # 3 rows for B=2
    pages = init_kv_pages(CONFIG, num_blocks=4, block_size=2)
    with pytest.raises(ValueError, match="pass both"):
        forward(*model, tokens, positions, pages)
    with pytest.raises(ValueError, match=r"\[B=2, NB\]; build the cache with init_kv_pages"):
        forward(*model, tokens, positions, pages, jnp.zeros((3, 2), jnp.int32))
