"""The engine's pieces that run without a model: its prompt and KV-cache accounting
(``inference.accounting``) and the checks a weight update passes (``inference.weights``).
Every number is counted by hand."""

import collections

import jax.numpy as jnp
import pytest

from raytunix.inference.accounting import kv_stats, prompt_stats
from raytunix.inference.kv_cache import KVCacheManager
from raytunix.inference.weights import check_weight_update


def test_the_prefix_cache_hit_rate_is_its_tokens_over_the_prompt_tokens():
    counters = collections.Counter(
        prompt_tokens=40, prompt_tokens_from_sessions=8, prompt_tokens_from_prefix_cache=12
    )
    assert prompt_stats(counters) == {
        "prompt_tokens": 40,
        "prompt_tokens_from_sessions": 8,
        "prompt_tokens_from_prefix_cache": 12,
        "prefix_cache_hit_rate": 0.3,
    }
    assert prompt_stats(collections.Counter())["prefix_cache_hit_rate"] == 0.0


def test_kv_memory_counts_blocks_in_use_times_their_tokens_times_bytes_per_token():
    kv = KVCacheManager(8, 4, "recompute", collections.Counter())
    kv.pool.allocate()
    kv.pool.allocate()
    # 2 of 8 blocks of 4 tokens, 10 bytes of KV per token
    assert kv_stats(kv, token_bytes=10) == {
        "kv_bytes_in_use": 2 * 4 * 10,
        "kv_bytes_capacity": 8 * 4 * 10,
        "kv_blocks_in_use": 2,
        "kv_blocks_total": 8,
        "sessions_held": 0,
        "prefix_cache_blocks": 0,
    }


def test_a_weight_update_keeps_versions_from_decreasing_and_the_model_the_same():
    current = {"w": jnp.zeros((2, 3), jnp.float32)}
    assert check_weight_update({"w": jnp.ones((2, 3), jnp.float32)}, 3.0, current, 3) == 3
    with pytest.raises(ValueError, match="version 2 is older than the engine's version 3"):
        check_weight_update(current, 2, current, 3)
    for other in (
        {"w": jnp.zeros((3, 2), jnp.float32)},  # shape
        {"w": jnp.zeros((2, 3), jnp.bfloat16)},  # dtype
        {"v": jnp.zeros((2, 3), jnp.float32)},  # structure
    ):
        with pytest.raises(ValueError, match="params do not match the engine's model"):
            check_weight_update(other, 4, current, 3)
