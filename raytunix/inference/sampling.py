"""Next-token sampling for a batch of rows, each with its own settings and PRNG stream.

Pure ``jnp`` functions, meant to run inside the engine's jitted prefill and decode steps.

One transformation defines the distribution a token is drawn from, and the learner
scores tokens with the same one (``sampling_logprobs``)::

    logits --/ temperature--> top-k --renormalise--> top-p (nucleus) --renormalise--> p

Nothing here sorts the vocabulary. The kept set of a row is every token whose
log-probability is at least a threshold, and the threshold is found by bisection over the
32 bits of the float (``_kept_tokens``): top-k as the k-th largest log-probability, top-p
as the lowest one whose renormalised top-k mass before it is still below ``top_p``. A
token is then drawn by inverse transform sampling: one uniform number per row against
the cumulative kept mass in vocabulary order.

Each row's random number comes from its request seed and the index of the token being
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
    caller can skip the threshold search at trace time); False for arrays or active
    settings."""
    return _top_k_is_off(top_k) and _top_p_is_off(top_p)


def _top_k_is_off(top_k) -> bool:
    return isinstance(top_k, numbers.Integral) and top_k <= 0


def _top_p_is_off(top_p) -> bool:
    return isinstance(top_p, numbers.Real) and top_p >= 1.0


def _order_keys(x: jax.Array) -> jax.Array:
    """``uint32`` keys in the order of the float32 values ``x`` (-0.0 sorts just below
    +0.0; NaN is not expected). The sign bit decides the half; negative floats flip so a
    larger magnitude gives a smaller key."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def _from_order_keys(keys: jax.Array) -> jax.Array:
    """The float32 bits (as ``uint32``) of the values with these ``_order_keys``."""
    return jnp.where(keys >> 31 == 1, keys & jnp.uint32(0x7FFFFFFF), ~keys)


def _largest_key_where(holds, lead: tuple[int, ...]) -> jax.Array:
    """``uint32[lead]``: per row, the largest key ``t`` for which ``holds(t)`` is true,
    for a ``holds`` that is true up to some key and false above it (0 if it never holds).

    One bit per pass, from the top: 32 calls of ``holds`` (each a reduction over the
    vocabulary) settle every bit, so the answer is exact, not an approximation to some
    tolerance.
    """

    def settle_bit(i, t):
        trial = t | (jnp.uint32(1) << (31 - i).astype(jnp.uint32))
        return jnp.where(holds(trial), trial, t)

    return jax.lax.fori_loop(0, 32, settle_bit, jnp.zeros(lead, jnp.uint32))


def _kept_tokens(logp: jax.Array, top_k: jax.Array | None, top_p: jax.Array | None) -> jax.Array:
    """``bool[..., V]``: the tokens kept by top-k, then top-p over the renormalised top-k.

    ``logp`` is ``float32[..., V]`` (temperature-scaled log-softmax); ``top_k`` int32 and
    ``top_p`` float32 have its leading shape, or are None where the setting is off in every
    row. The kept set is the shortest run of most likely tokens whose renormalised top-k
    mass reaches ``top_p`` (it always holds the most likely token). Tokens tied with the
    last kept one are kept too, so with exactly equal logits the set can hold more than
    ``top_k`` tokens.

    Both truncations are thresholds on ``logp``, found without a sort. Top-k: the k-th
    largest key ``t_k`` is the largest key that at least ``k`` tokens reach. Top-p: a
    token of ``logp`` value v is kept when the mass of the tokens above it is below
    ``top_p * Z`` (``Z`` the mass of the top k, counting ties at ``t_k`` only up to k, as
    a sorted list would); so the cut is the largest key whose mass at or above it still
    reaches ``top_p * Z``. Masses are float32 sums, so a cut that falls exactly on
    ``top_p`` may land one token either side of an exact float64 computation.
    """
    lead, vocab = logp.shape[:-1], logp.shape[-1]
    keys = _order_keys(logp)
    probs = jnp.exp(logp)
    # Rows with top-k off take k = V: the cut then lies at the least likely token.
    k = jnp.full(lead, vocab, jnp.int32) if top_k is None else top_k
    k = jnp.where((k <= 0) | (k > vocab), vocab, k)

    def count_at_or_above(t):
        return jnp.sum(keys >= t[..., None], axis=-1, dtype=jnp.int32)

    def top_k_cut(_):
        return _largest_key_where(lambda t: count_at_or_above(t) >= k, lead)

    if top_k is None:
        cut = jnp.min(keys, axis=-1)
    else:
        active = jnp.any(k < vocab)
        cut = jax.lax.cond(active, top_k_cut, lambda _: jnp.min(keys, axis=-1), None)
    if top_p is None:
        return keys >= cut[..., None]

    above = keys > cut[..., None]
    n_above = jnp.sum(above, axis=-1, dtype=jnp.int32)
    at_cut = jnp.exp(jax.lax.bitcast_convert_type(_from_order_keys(cut), jnp.float32))
    top_k_mass = jnp.sum(jnp.where(above, probs, 0.0), axis=-1) + (k - n_above) * at_cut
    target = top_p * top_k_mass

    def mass_at_or_above(t):
        return jnp.sum(jnp.where(keys >= t[..., None], probs, 0.0), axis=-1)

    def top_p_cut(_):
        found = _largest_key_where(lambda t: mass_at_or_above(t) >= target, lead)
        # top_p >= 1 keeps all of the top k even where float rounding says otherwise.
        return jnp.where(top_p >= 1.0, cut, jnp.maximum(cut, found))

    cut = jax.lax.cond(jnp.any(top_p < 1.0), top_p_cut, lambda _: cut, None)
    return keys >= cut[..., None]


def _truncated(logits, temperature, top_k, top_p) -> tuple[jax.Array, jax.Array | None]:
    """``(logp, kept)``: ``log_softmax(logits / temperature)`` (float32[..., V]) and the
    ``_kept_tokens`` mask, or None when truncation is statically off. Python-number
    settings that turn one truncation off skip its search at trace time; arrays skip it at
    run time when no row has it on (``lax.cond``)."""
    logits = jnp.asarray(logits, jnp.float32)
    lead = logits.shape[:-1]
    temperature = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), lead)
    logp = jax.nn.log_softmax(logits / temperature[..., None], axis=-1)
    if _truncation_is_off(top_k, top_p):
        return logp, None
    k = None if _top_k_is_off(top_k) else jnp.broadcast_to(jnp.asarray(top_k, jnp.int32), lead)
    p = None if _top_p_is_off(top_p) else jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), lead)
    return logp, _kept_tokens(jax.lax.stop_gradient(logp), k, p)


def _renormalised(logp: jax.Array, kept: jax.Array | None) -> jax.Array:
    """``logp`` restricted to ``kept`` and renormalised there (``-inf`` outside)."""
    if kept is None:
        return logp
    mass = jnp.sum(jnp.where(kept, jnp.exp(logp), 0.0), axis=-1, keepdims=True)
    return jnp.where(kept, logp - jnp.log(mass), -jnp.inf)


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
      is ``log_softmax(logits / temperature)``. No sort is traced: the kept set is a
      threshold found by bisection (32 reductions over the vocabulary for each of top-k
      and top-p), skipped at trace time for a Python-number setting that is off, and at
      run time (``lax.cond``) when no row of an array setting has it on.

    Jittable, vmappable and differentiable in ``logits`` (the allowed set carries no
    gradient). Values are not checked here: ``temperature <= 0`` gives inf/NaN; the
    config, the engine and the learner validate settings before they get here.
    """
    return _renormalised(*_truncated(logits, temperature, top_k, top_p))


def _last_positive(weights: jax.Array) -> jax.Array:
    """``int32[B]``: the index of each row's last positive weight (0 if none)."""
    n = weights.shape[-1]
    return n - 1 - jnp.argmax(weights[:, ::-1] > 0.0, axis=-1)


def _first_above(running: jax.Array, weights: jax.Array, target: jax.Array) -> jax.Array:
    """``int32[B]``: the first index of positive weight whose running sum exceeds
    ``target``; the last positive weight where rounding leaves none above it."""
    hit = (running > target[:, None]) & (weights > 0.0)
    return jnp.where(jnp.any(hit, axis=-1), jnp.argmax(hit, axis=-1), _last_positive(weights))


def _inverse_cdf(weights: jax.Array, u: jax.Array, block: int = 128) -> jax.Array:
    """``int32[B]``: per row, the first token whose cumulative weight (vocabulary order)
    exceeds ``u`` times the row's total.

    ``weights`` is ``float32[B, V]`` (>= 0, unnormalised, some positive), ``u``
    ``float32[B]`` in [0, 1). Token j is drawn with probability ``weights[j] / total`` up
    to float32 rounding of the running sums (about 6e-8 of the total). The running sum is
    taken in two levels, over blocks of ``block`` tokens and then within the one block
    the target falls in, because a cumulative sum over the whole vocabulary is many times
    the cost of a reduction on a CPU. Zero-weight tokens are never drawn.
    """
    batch, vocab = weights.shape
    padded = jnp.pad(weights, ((0, 0), (0, -vocab % block))).reshape(batch, -1, block)
    block_mass = jnp.sum(padded, axis=-1)
    running = jnp.cumsum(block_mass, axis=-1)
    target = u * running[:, -1]
    j = _first_above(running, block_mass, target)
    before = jnp.take_along_axis(running - block_mass, j[:, None], axis=-1)[:, 0]
    inner = jnp.take_along_axis(padded, j[:, None, None], axis=1)[:, 0]
    i = _first_above(jnp.cumsum(inner, axis=-1), inner, target - before)
    return j * block + i


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
    with ``sampling_logprobs`` and the same settings gets the same number. The draw is
    inverse transform sampling with one uniform number per row (``_inverse_cdf``), so its
    cost is a few passes over ``[B, V]`` rather than a random number per token. A row
    with ``temperature == 0`` takes the argmax of its logits (greedy; top-k/top-p cannot
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
        logp, kept = _truncated(logits, safe_t, 0, 1.0)  # static "off": nothing to search
    else:
        top_k = jnp.zeros((batch,), jnp.int32) if top_k is None else jnp.asarray(top_k, jnp.int32)
        top_p = (
            jnp.ones((batch,), jnp.float32) if top_p is None else jnp.asarray(top_p, jnp.float32)
        )
        top_k = jnp.where(greedy, 0, top_k)
        top_p = jnp.where(greedy, 1.0, top_p)
        logp, kept = _truncated(logits, safe_t, top_k, top_p)
    logprobs = _renormalised(logp, kept)
    # The draw weighs tokens by exp(logp) before renormalisation: the same distribution,
    # and a row's weights do not depend on whether a batch-mate made the kept set a mask.
    weights = jnp.exp(logp) if kept is None else jnp.where(kept, jnp.exp(logp), 0.0)
    keys = row_keys(seed_lo, seed_hi, token_index)
    u = jax.vmap(lambda key: jax.random.uniform(key, (), jnp.float32))(keys)
    drawn = _inverse_cdf(weights, u)
    tokens = jnp.where(greedy, jnp.argmax(logits, axis=-1), drawn).astype(jnp.int32)
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    return tokens, chosen
