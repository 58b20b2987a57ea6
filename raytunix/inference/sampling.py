"""Next-token sampling for a batch of rows, each with its own temperature and PRNG stream.

Pure ``jnp`` functions, meant to run inside the engine's jitted prefill and decode steps.

Each row's randomness comes from its request seed and the index of the token being
sampled (``fold_in(fold_in(key(seed_lo), seed_hi), token_index)``), never from a key
shared by the batch. So a request's samples do not depend on which other requests share
its batch or which slot it sits in, and two requests with different seeds differ.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def split_seed(seed: int) -> tuple[int, int]:
    """Splits a Python int seed into its low and high 32-bit words, as ``uint32`` values.

    Seeds are taken modulo 2**64 (negative seeds wrap around), so any int is accepted.
    """
    seed %= 1 << 64
    return seed & 0xFFFFFFFF, seed >> 32


def row_keys(seed_lo: jax.Array, seed_hi: jax.Array, token_index: jax.Array) -> jax.Array:
    """Per-row PRNG keys.

    Args:
      seed_lo, seed_hi: ``uint32[B]``, the two words of each row's request seed
        (see ``split_seed``).
      token_index: ``int32[B]``, index of the token about to be sampled within its
        request's generation (0 for the first generated token).

    Returns:
      ``B`` typed PRNG keys (``jax.random.key`` keys).
    """

    def one(lo, hi, idx):
        key = jax.random.fold_in(jax.random.key(lo), hi)
        return jax.random.fold_in(key, idx)

    return jax.vmap(one)(seed_lo, seed_hi, token_index)


def sample_tokens(logits: jax.Array, temperature: jax.Array, seed_lo: jax.Array,
                  seed_hi: jax.Array, token_index: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Samples one token per row and returns it with its log-probability.

    A row with ``temperature == 0`` takes the argmax of its logits (greedy) and reports
    ``log_softmax(logits)[token]``; a row with ``temperature > 0`` draws from
    ``softmax(logits / temperature)`` and reports ``log_softmax(logits / temperature)
    [token]``, i.e. the log-probability under the distribution it was sampled from.

    Args:
      logits: ``float32[B, V]`` next-token logits.
      temperature: ``float32[B]``, >= 0.
      seed_lo, seed_hi, token_index: see ``row_keys``; unused by greedy rows.

    Returns:
      ``(tokens int32[B], logprobs float32[B])``, logprobs in nats (<= 0).
    """
    logits = logits.astype(jnp.float32)
    greedy = temperature <= 0.0
    safe_t = jnp.where(greedy, 1.0, temperature).astype(jnp.float32)
    scaled = logits / safe_t[:, None]
    keys = row_keys(seed_lo, seed_hi, token_index)
    drawn = jax.vmap(jax.random.categorical)(keys, scaled)
    tokens = jnp.where(greedy, jnp.argmax(logits, axis=-1), drawn).astype(jnp.int32)
    logprobs = jax.nn.log_softmax(scaled, axis=-1)
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    return tokens, chosen
