"""Next-token sampling for a batch of rows, each with its own settings and PRNG stream.

Pure ``jnp`` functions, meant to run inside the engine's jitted prefill and decode steps.

One transformation defines the distribution a token is drawn from, and the learner
scores tokens with the same one (``sampling_logprobs``)::

    logits --/ temperature--> top-k --renormalise--> top-p (nucleus) --renormalise--> p

Each row's randomness comes from its request seed and the index of the token being
sampled (``fold_in(fold_in(key(seed_lo), seed_hi), token_index)``), never from a key
shared by the batch. So a request's samples do not depend on which other requests share
its batch or which slot it sits in, and two requests with different seeds differ.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp

from raytunix.inference.sampling_checks import (  # noqa: F401 - part of this API
    MIN_TEMPERATURE,
    check_sampling_settings,
    greedy_top_p_bound,
)


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


def _truncation_is_off(top_k, top_p) -> bool:
    """True when both settings are Python numbers that turn truncation off (so the
    caller can skip the sort at trace time); False for arrays or active settings."""
    return (
        isinstance(top_k, numbers.Integral)
        and top_k <= 0
        and isinstance(top_p, numbers.Real)
        and top_p >= 1.0
    )


def _allowed_tokens(logp: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """``bool[..., V]``: the tokens kept by top-k, then top-p over the renormalised top-k.

    ``logp`` is ``float32[..., V]`` (temperature-scaled log-softmax); ``top_k`` int32 and
    ``top_p`` float32 broadcast to its leading dims. The kept set is the shortest prefix
    of the tokens sorted by probability whose renormalised top-k mass reaches ``top_p``
    (it always holds the most likely token). Tokens tied with the last kept one are kept
    too, so with exactly equal logits the set can hold more than ``top_k`` tokens.
    """
    vocab = logp.shape[-1]
    ranked = -jnp.sort(-logp, axis=-1)  # descending
    rank = jnp.arange(vocab, dtype=jnp.int32)
    k = jnp.where((top_k <= 0) | (top_k > vocab), vocab, top_k)[..., None]
    in_top_k = rank < k
    top_k_logp = jnp.where(in_top_k, ranked, -jnp.inf)
    probs = jnp.exp(top_k_logp - jax.nn.logsumexp(top_k_logp, axis=-1, keepdims=True))
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    p = top_p[..., None]
    # p >= 1 keeps every top-k token even where float rounding lets mass_before reach 1.
    keep = in_top_k & ((mass_before < p) | (p >= 1.0))
    n_keep = jnp.maximum(jnp.sum(keep, axis=-1, keepdims=True), 1)
    threshold = jnp.take_along_axis(ranked, n_keep - 1, axis=-1)
    return logp >= threshold


def sampling_logprobs(logits: jax.Array, temperature, top_k, top_p) -> jax.Array:
    """Log-probabilities of the distribution tokens are sampled from: the one transformation
    that the engine's sampler and the learner's scoring both use.

    In order: ``softmax(logits / temperature)``; keep the ``top_k`` most likely tokens
    and renormalise (Fan et al. 2018, arXiv:1805.04833); keep the smallest set of most
    likely tokens whose renormalised mass is >= ``top_p`` and renormalise again (nucleus
    sampling, Holtzman et al. 2019, arXiv:1904.09751). The order (temperature, top-k,
    top-p) is that of Hugging Face ``generate`` and vLLM. Tokens tied with the last
    kept one are kept as well.

    Args:
      logits: ``float[..., V]`` unnormalised next-token logits (computed in float32).
      temperature: float, > 0: a Python number or an array broadcastable to
        ``logits.shape[:-1]`` (e.g. ``float32[B]`` for per-row settings).
      top_k: int, 0 (or >= V) = off; a Python int or an int array like ``temperature``.
      top_p: float in (0, 1], 1.0 = off; a Python number or a float array like
        ``temperature``.

    Returns:
      ``float32[..., V]`` log-probabilities (nats) that sum to one over the allowed
      tokens; ``-inf`` for tokens the truncation removed. With both truncations off this
      is ``log_softmax(logits / temperature)``. When ``top_k``/``top_p`` are Python
      numbers that turn truncation off, no sort is traced; with arrays the sort runs
      only if some row has truncation on (``lax.cond``).

    Jittable, vmappable and differentiable in ``logits`` (the allowed set carries no
    gradient). Values are not checked here: ``temperature <= 0`` gives inf/NaN; the
    config, the engine and the learner validate settings before they get here.
    """
    logits = jnp.asarray(logits, jnp.float32)
    lead = logits.shape[:-1]
    temperature = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), lead)
    logp = jax.nn.log_softmax(logits / temperature[..., None], axis=-1)
    if _truncation_is_off(top_k, top_p):
        return logp
    static = not isinstance(top_k, jax.Array) and not isinstance(top_p, jax.Array)
    top_k = jnp.broadcast_to(jnp.asarray(top_k, jnp.int32), lead)
    top_p = jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), lead)

    def truncate(logp):
        allowed = _allowed_tokens(jax.lax.stop_gradient(logp), top_k, top_p)
        kept = jnp.where(allowed, logp, -jnp.inf)
        return kept - jax.nn.logsumexp(kept, axis=-1, keepdims=True)

    if static:
        return truncate(logp)
    active = ((top_k > 0) & (top_k < logits.shape[-1])) | (top_p < 1.0)
    return jax.lax.cond(jnp.any(active), truncate, lambda x: x, logp)


def sample_tokens(
    logits: jax.Array,
    temperature: jax.Array,
    seed_lo: jax.Array,
    seed_hi: jax.Array,
    token_index: jax.Array,
    top_k: jax.Array | None = None,
    top_p: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Samples one token per row and returns it with its log-probability.

    A row with ``temperature > 0`` draws from the distribution of ``sampling_logprobs``
    (temperature, then top-k, then top-p, renormalised) and reports the token's
    log-probability under that same distribution, so a learner that scores the token
    with ``sampling_logprobs`` and the same settings gets the same number. A row with
    ``temperature == 0`` takes the argmax of its logits (greedy; top-k/top-p cannot
    change the argmax) and reports ``log_softmax(logits)[token]``, the raw model
    log-probability at temperature 1 (greedy rows are for evaluation, never scored).

    Args:
      logits: ``float32[B, V]`` next-token logits.
      temperature: ``float32[B]``, >= 0.
      seed_lo, seed_hi, token_index: see ``row_keys``; unused by greedy rows.
      top_k: ``int32[B]``, 0 = off for that row; None = off for all rows.
      top_p: ``float32[B]`` in (0, 1], 1.0 = off for that row; None = off for all rows.

    Returns:
      ``(tokens int32[B], logprobs float32[B])``, logprobs in nats (<= 0).
    """
    logits = logits.astype(jnp.float32)
    batch = logits.shape[0]
    greedy = temperature <= 0.0
    safe_t = jnp.where(greedy, 1.0, temperature).astype(jnp.float32)
    if top_k is None and top_p is None:
        # Static "off": no sort over the vocabulary is traced (a cheaper program).
        logprobs = sampling_logprobs(logits, safe_t, 0, 1.0)
    else:
        top_k = jnp.zeros((batch,), jnp.int32) if top_k is None else jnp.asarray(top_k, jnp.int32)
        top_p = (
            jnp.ones((batch,), jnp.float32) if top_p is None else jnp.asarray(top_p, jnp.float32)
        )
        top_k = jnp.where(greedy, 0, top_k)
        top_p = jnp.where(greedy, 1.0, top_p)
        logprobs = sampling_logprobs(logits, safe_t, top_k, top_p)
    keys = row_keys(seed_lo, seed_hi, token_index)
    drawn = jax.vmap(jax.random.categorical)(keys, logprobs)
    tokens = jnp.where(greedy, jnp.argmax(logits, axis=-1), drawn).astype(jnp.int32)
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    return tokens, chosen
