"""Policy-gradient and supervised losses: pure functions of arrays, jit-safe.

Shapes: B sequences of T tokens over a vocabulary of V. ``loss_mask[b, t] == 1`` marks
a token the loss is computed on (a token the policy generated); every other token
contributes exactly zero to the loss and to its gradients, whatever its logits.
"""

from __future__ import annotations

import math
from typing import Literal

import jax
import jax.numpy as jnp

from raytunix.inference.sampling import sampling_logprobs

Aggregation = Literal["token_mean", "sequence_mean_token_mean", "sequence_mean_token_sum_norm"]
AGGREGATIONS = ("token_mean", "sequence_mean_token_mean", "sequence_mean_token_sum_norm")
PolicyLoss = Literal["ppo_clip", "gspo", "cispo"]
POLICY_LOSSES = ("ppo_clip", "gspo", "cispo")
KLEstimator = Literal["k1", "k2", "k3"]
KL_ESTIMATORS = ("k1", "k2", "k3")
ImportanceSampling = Literal["token_tis", "sequence_tis", "geometric_tis"]
IMPORTANCE_SAMPLING_LEVELS = ("token_tis", "sequence_tis", "geometric_tis")


def token_logprobs(
    logits: jax.Array, targets: jax.Array, *, temperature: float, top_k: int, top_p: float
) -> jax.Array:
    """Log-probability of each target token under the sampling distribution: the
    temperature / top-k / top-p transformation the engine sampled the tokens with
    (``raytunix.inference.sampling.sampling_logprobs``; papers cited there).

    Args:
      logits: float[B, T, V], unnormalized.
      targets: int32[B, T], token ids in ``[0, V)``.
      temperature: the sampling temperature (> 0).
      top_k: top-k truncation, 0 = off.
      top_p: nucleus mass in (0, 1], 1.0 = off.

    Returns:
      float32[B, T] log-probabilities (nats); ``-inf`` for a target outside the
      truncated set (possible only with top-k/top-p on).
    """
    logp = sampling_logprobs(logits, temperature, top_k, top_p)
    return jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]


def token_entropy(logits: jax.Array, *, temperature: float, top_k: int, top_p: float) -> jax.Array:
    """Entropy (nats) of the sampling distribution (see ``token_logprobs``):
    float[B, T, V] -> float32[B, T]. Tokens outside the truncated set add nothing."""
    logp = sampling_logprobs(logits, temperature, top_k, top_p)
    return -jnp.sum(jnp.where(logp > -jnp.inf, jnp.exp(logp) * logp, 0.0), axis=-1)


def masked_mean(values: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean of ``values`` over entries where ``mask`` is nonzero; 0.0 when none are.

    Masked-out entries are replaced before summing, so a NaN or inf there is harmless.
    """
    on = mask > 0
    total = jnp.sum(jnp.where(on, values, 0.0))
    return total / jnp.maximum(jnp.sum(on), 1)


def sequence_sum(
    values: jax.Array, sequence_index: jax.Array | None = None, num_sequences: int = 0
) -> jax.Array:
    """Each sequence's sum of ``values`` float[B, T], for each of its tokens.

    With ``sequence_index`` None a row is one sequence: float32[B, 1]. With
    ``sequence_index`` int32[B, T] (sequence packing: several sequences to a row,
    ``raytunix.learner.batch.PackedBatch.trajectory_index``) the sums are segment sums
    over the ``num_sequences`` sequences, gathered back to float32[B, T]. Either way it
    broadcasts against ``[B, T]``.
    """
    if sequence_index is None:
        return jnp.sum(values, axis=-1, keepdims=True)
    sums = jax.ops.segment_sum(
        values.reshape(-1), sequence_index.reshape(-1), num_segments=num_sequences
    )
    return sums[sequence_index]


def _check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not supported; use one of {', '.join(allowed)}.")


def loss_normalizer(
    loss_mask: jax.Array,
    *,
    aggregation: Aggregation,
    max_tokens: int,
    sequence_index: jax.Array | None = None,
    num_sequences: int = 0,
) -> tuple[jax.Array, jax.Array]:
    """How per-token losses are summed into one number: ``(weights, denominator)`` with
    ``loss = sum(weights * per_token) / denominator``.

    ``token_mean``: every masked token of the batch counts once, ``weights = mask`` and
    the denominator is their number. ``sequence_mean_token_mean``: the mean over each
    sequence's masked tokens, then over the sequences that have any (``weights = mask /
    tokens_in_sequence``; the denominator is that count of sequences).
    ``sequence_mean_token_sum_norm``: Dr. GRPO's (Liu et al. 2025, arXiv:2503.20783)
    constant normalisation, each sequence's token sum divided by ``max_tokens`` rather
    than by its own length (which favours long wrong answers), then the mean over
    sequences with tokens.

    The weights depend on the whole batch's mask only, so a batch split into micro-batches
    along B, each summing ``weights * per_token / denominator`` over its rows, adds up
    to the same loss as the whole batch.

    Args:
      loss_mask: float[B, T], nonzero on the tokens the loss is computed on.
      aggregation: one of ``AGGREGATIONS``.
      max_tokens: the constant of ``sequence_mean_token_sum_norm`` (> 0), e.g. the
        model's context length; ignored by the other modes.
      sequence_index, num_sequences: for packed rows, the sequence of each token and
        how many there are (``sequence_sum``); None: a row is a sequence.

    Returns:
      ``weights`` float32[B, T] (0 off the mask) and a float32 scalar ``denominator``
      (>= 1, so an empty mask gives a zero loss, not NaN).

    Raises:
      ValueError: an unknown ``aggregation``.
    """
    _check_choice("aggregation", aggregation, AGGREGATIONS)
    on = (loss_mask > 0).astype(jnp.float32)
    if aggregation == "token_mean":
        return on, jnp.maximum(jnp.sum(on), 1.0)
    if sequence_index is None:
        tokens_per_seq = jnp.sum(on, axis=-1, keepdims=True)
        sequences = jnp.sum(tokens_per_seq > 0)
    else:
        counts = jax.ops.segment_sum(
            on.reshape(-1), sequence_index.reshape(-1), num_segments=num_sequences
        )
        tokens_per_seq, sequences = counts[sequence_index], jnp.sum(counts > 0)
    sequences = jnp.maximum(sequences, 1).astype(jnp.float32)
    if aggregation == "sequence_mean_token_mean":
        return on / jnp.maximum(tokens_per_seq, 1.0), sequences
    return on, sequences * float(max_tokens)


def aggregate_loss(
    per_token: jax.Array, loss_mask: jax.Array, *, aggregation: Aggregation, max_tokens: int
) -> jax.Array:
    """Per-token losses float[B, T] -> a float32 scalar by ``aggregation`` (see
    ``loss_normalizer``); masked-out entries are ignored, NaN included."""
    weights, denominator = loss_normalizer(
        loss_mask, aggregation=aggregation, max_tokens=max_tokens
    )
    return jnp.sum(jnp.where(loss_mask > 0, per_token, 0.0) * weights) / denominator


def kl_estimate(
    logprobs: jax.Array, ref_logprobs: jax.Array, loss_mask: jax.Array, *, estimator: KLEstimator
) -> jax.Array:
    """Per-token *value* estimate of KL(pi || pi_ref) from tokens sampled by pi (Schulman
    2020, "Approximating KL divergence"). With ``log_r = ref_logprobs - logprobs``::

        k1 = -log_r                 unbiased, high variance, can be negative
        k2 = log_r ** 2 / 2         biased (E_pi[k2] != KL), low variance, >= 0
        k3 = exp(log_r) - 1 - log_r unbiased, low variance, >= 0 (GRPO's choice)

    What the ``kl_ref`` metric reports. Do not differentiate it as a loss: its gradient is
    not the KL's (``kl_penalty`` is the loss term).

    Args:
      logprobs, ref_logprobs: float32[B, T], the policy's and the reference's (nats).
      loss_mask: float[B, T]; the estimate is 0 off the mask (NaN/inf there harmless).
      estimator: ``"k1"``, ``"k2"`` or ``"k3"``.

    Returns:
      float32[B, T] (nats).

    Raises:
      ValueError: an unknown ``estimator``.
    """
    _check_choice("kl_estimator", estimator, KL_ESTIMATORS)
    log_r = jnp.where(loss_mask > 0, ref_logprobs - logprobs, 0.0)
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r**2
    return jnp.exp(log_r) - log_r - 1.0


def kl_penalty(
    logprobs: jax.Array,
    ref_logprobs: jax.Array,
    anchor_logprobs: jax.Array,
    loss_mask: jax.Array,
    *,
    estimator: KLEstimator,
    importance_weights: jax.Array | None = None,
) -> jax.Array:
    """The per-token KL loss term of ``estimator``, built so that its gradient is, in
    expectation over the sampled tokens, the gradient of KL(pi || pi_ref), on- and
    off-policy.

    The tokens were sampled by a behaviour policy mu (the engine, possibly stale). With
    ``r = w * pi / pi_anchor`` the importance ratio pi / mu (``w`` the constant
    ``importance_weights`` ~ pi_anchor / mu, 1 when the anchor is the behaviour policy),
    differentiated through pi, and the score-function identity ``E_pi[grad log pi] = 0``::

        grad KL(pi || pi_ref) = E_pi[(log pi - log pi_ref) grad log pi]
                              = E_mu[r (log pi - log pi_ref) grad log pi]

    Each estimator's term has that gradient (the k1 term's up to ``r grad log pi``,
    whose expectation is 0)::

        k1:  r * k1       (an unbiased value estimate, weighted: E_mu[grad(r k)] = grad E_pi[k])
        k2:  sg(r) * k2   (k2 is biased, so only its plain on-policy gradient is right)
        k3:  r * k3       (DeepSeek-V3.2's "unbiased KL estimate", arXiv:2512.02556, Sec. 3.1)

    Used plainly as a loss, the estimators are wrong (allenai/open-instruct#534,
    THUDM/slime#1004): k1's gradient is ``grad log pi``, zero in expectation; k3's is
    ``(1 - pi_ref / pi) grad log pi``, on-policy the gradient of the other divergence,
    KL(pi_ref || pi); k2's is right on-policy only. k3's term is computed as
    ``w exp(ref - anchor) - r (1 + ref - logprobs)`` (the same number), whose gradient has
    no cancellation of large terms where pi_ref >> pi.

    Args:
      logprobs: float32[B, T], the current policy's log-probabilities, with their gradient.
      ref_logprobs: float32[B, T], the reference policy's (no gradient).
      anchor_logprobs: float32[B, T], the policy the ratio is taken to: the behaviour
        policy's, or a proximal policy's (then ``importance_weights`` carry it to the
        behaviour policy).
      loss_mask: float[B, T]; the term is 0 off the mask (NaN/inf there harmless).
      estimator: ``"k1"``, ``"k2"`` or ``"k3"``.
      importance_weights: float32[B, T] >= 0, per-token pi_anchor / mu (e.g. truncated),
        constants; None for 1.

    Returns:
      float32[B, T] (nats), at ``r = 1`` (on-policy) the value of ``kl_estimate``.

    Raises:
      ValueError: an unknown ``estimator``.
    """
    _check_choice("kl_estimator", estimator, KL_ESTIMATORS)
    on = loss_mask > 0
    logprobs = jnp.where(on, logprobs, 0.0)
    ref = jax.lax.stop_gradient(jnp.where(on, ref_logprobs, 0.0))
    anchor = jax.lax.stop_gradient(jnp.where(on, anchor_logprobs, 0.0))
    w = (
        jnp.ones_like(logprobs)
        if importance_weights is None
        else jax.lax.stop_gradient(jnp.where(on, importance_weights, 0.0))
    )
    ratio = w * jnp.exp(logprobs - anchor)
    log_r = ref - logprobs
    if estimator == "k1":
        term = -ratio * log_r
    elif estimator == "k2":
        term = jax.lax.stop_gradient(ratio) * 0.5 * log_r**2
    else:
        term = w * jnp.exp(ref - anchor) - ratio * (1.0 + log_r)
    return jnp.where(on, term, 0.0)


def ppo_clip_loss(
    log_ratio: jax.Array,
    advantages: jax.Array,
    *,
    clip_eps_low: float,
    clip_eps_high: float,
    dual_clip: float,
) -> tuple[jax.Array, jax.Array]:
    """PPO's clipped surrogate (Schulman et al. 2017, arXiv:1707.06347) per token, with
    separate lower and upper clip ranges ("clip-higher", DAPO: Yu et al. 2025,
    arXiv:2503.14476) and an optional dual clip (Ye et al. 2020, "Mastering Complex
    Control in MOBA Games with Deep RL", arXiv:1912.09729). With ``rho = exp(log_ratio)``::

        loss_t = -min(rho * A, clip(rho, 1 - clip_eps_low, 1 + clip_eps_high) * A)
        dual clip, A < 0:  loss_t = min(loss_t, -dual_clip * A)

    The dual clip bounds the loss of a negative-advantage token whose ratio has grown
    huge (a token far more likely now than when sampled).

    Args:
      log_ratio: float32[B, T], ``log pi - log pi_old`` (0 off the mask).
      advantages: float32[B, 1] or [B, T].
      clip_eps_low, clip_eps_high: the clip range.
      dual_clip: the constant ``c > 1`` of the dual clip, or 0 for none.

    Returns:
      ``(per_token float32[B, T], clipped bool[B, T])``, ``clipped`` where a clip is the
      active term (the token gets no gradient).
    """
    ratio = jnp.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = jnp.clip(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high) * advantages
    per_token = -jnp.minimum(unclipped, clipped)
    active = clipped < unclipped
    if dual_clip > 0:
        floor = -dual_clip * advantages
        dual = (advantages < 0) & (per_token > floor)
        per_token = jnp.where(dual, floor, per_token)
        active = active | dual
    return per_token, active


def gspo_loss(
    log_ratio: jax.Array,
    advantages: jax.Array,
    loss_mask: jax.Array,
    *,
    clip_eps_low: float,
    clip_eps_high: float,
    sequence_index: jax.Array | None = None,
    num_sequences: int = 0,
) -> tuple[jax.Array, jax.Array]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071):
    the clipped surrogate on the sequence's length-normalised likelihood ratio::

        s_i    = exp(mean_t log_ratio_{i,t})     (over the sequence's masked tokens)
        loss_i = -min(s_i * A_i, clip(s_i, 1 - clip_eps_low, 1 + clip_eps_high) * A_i)

    every masked token of sequence i carrying ``loss_i``. With the aggregation
    ``sequence_mean_token_mean`` the loss is GSPO's mean over sequences; the paper's clip
    ranges are small (3e-4 and 4e-4), since a sequence ratio moves less than a token's.

    Args:
      log_ratio: float32[B, T] (0 off the mask). advantages: float32[B, 1] (or [B, T],
        constant along each sequence). loss_mask: float[B, T].
      clip_eps_low, clip_eps_high: the clip range.
      sequence_index, num_sequences: packed rows (``sequence_sum``); None: row = sequence.

    Returns:
      ``(per_token float32[B, T], clipped bool[B, T])``, both constant along a sequence.
    """
    on = loss_mask > 0
    tokens = jnp.maximum(sequence_sum(on.astype(jnp.float32), sequence_index, num_sequences), 1)
    seq_log_ratio = (
        sequence_sum(jnp.where(on, log_ratio, 0.0), sequence_index, num_sequences) / tokens
    )
    per_seq, clipped = ppo_clip_loss(
        seq_log_ratio,
        advantages,
        clip_eps_low=clip_eps_low,
        clip_eps_high=clip_eps_high,
        dual_clip=0.0,
    )
    return jnp.broadcast_to(per_seq, log_ratio.shape), jnp.broadcast_to(clipped, log_ratio.shape)


def cispo_loss(
    logprobs: jax.Array,
    log_ratio: jax.Array,
    advantages: jax.Array,
    *,
    clip_eps_low: float,
    clip_eps_high: float,
) -> tuple[jax.Array, jax.Array]:
    """CISPO (MiniMax-M1, MiniMax 2025, arXiv:2506.13585): REINFORCE with a clipped,
    stop-gradient importance weight, so that no token is dropped from the gradient
    (PPO's clip zeroes the gradient of clipped tokens)::

        loss_t = -sg(clip(rho_t, 1 - clip_eps_low, 1 + clip_eps_high)) * A * logprobs_t

    MiniMax-M1 leaves the lower bound off (a large ``clip_eps_low``) and tunes the upper.

    Args:
      logprobs: float32[B, T] under the current policy (0 off the mask).
      log_ratio: float32[B, T], ``log pi - log pi_old`` (0 off the mask).
      advantages: float32[B, 1] or [B, T]. clip_eps_low, clip_eps_high: the weight's range.

    Returns:
      ``(per_token float32[B, T], clipped bool[B, T])``, ``clipped`` where the weight hit
      a bound (those tokens still get a gradient).
    """
    ratio = jax.lax.stop_gradient(jnp.exp(log_ratio))
    weight = jnp.clip(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high)
    return -weight * advantages * logprobs, weight != ratio


def policy_surrogate(
    logprobs: jax.Array,
    old_logprobs: jax.Array,
    advantages: jax.Array,
    loss_mask: jax.Array,
    *,
    policy_loss: PolicyLoss,
    clip_eps_low: float,
    clip_eps_high: float,
    dual_clip: float,
    importance_weights: jax.Array | None = None,
    sequence_index: jax.Array | None = None,
    num_sequences: int = 0,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The per-token policy surrogate ``w_t * surrogate_t`` of ``policy_loss``:
    ``ppo_clip_loss`` (with ``dual_clip``), ``gspo_loss`` or ``cispo_loss``, with
    ``old_logprobs`` as the anchor of the ratio and ``w_t`` the ``importance_weights``.

    Args:
      logprobs: float32[B, T], the current policy's log-probabilities, 0 off the mask.
      old_logprobs: float32[B, T], under the policy the ratio is taken to: the behaviour
        policy that sampled the tokens, or a proximal policy.
      advantages: float32[B], one per sequence, or float32[B, T], one per token (GAE).
      loss_mask: float[B, T], nonzero on tokens that count.
      policy_loss: one of ``POLICY_LOSSES``.
      clip_eps_low, clip_eps_high: the ratio (or CISPO's weight) is clipped to
        ``[1 - clip_eps_low, 1 + clip_eps_high]``.
      dual_clip: ``ppo_clip``'s dual-clip constant (> 1), 0 for none.
      importance_weights: float32[B, T] >= 0 multiplying each token's surrogate, treated
        as constants (no gradient); None for all 1.
      sequence_index, num_sequences: packed rows (several sequences to a row, see
        ``sequence_sum``), for GSPO's sequence ratio; ``advantages`` is then per token.

    Returns:
      ``(per_token float32[B, T], clipped bool[B, T], log_ratio float32[B, T])``: the
      surrogate, where a clip is active, and ``log pi - log pi_old`` (0 off the mask).

    Raises:
      ValueError: an unknown ``policy_loss``.
    """
    _check_choice("policy_loss", policy_loss, POLICY_LOSSES)
    on = loss_mask > 0
    log_ratio = jnp.where(on, logprobs - old_logprobs, 0.0)
    adv = jnp.asarray(advantages, jnp.float32)
    adv = adv[:, None] if adv.ndim == 1 else adv
    clip = {"clip_eps_low": clip_eps_low, "clip_eps_high": clip_eps_high}
    if policy_loss == "ppo_clip":
        per_token, clipped = ppo_clip_loss(log_ratio, adv, dual_clip=dual_clip, **clip)
    elif policy_loss == "gspo":
        per_token, clipped = gspo_loss(
            log_ratio,
            adv,
            loss_mask,
            sequence_index=sequence_index,
            num_sequences=num_sequences,
            **clip,
        )
    else:
        per_token, clipped = cispo_loss(logprobs, log_ratio, adv, **clip)
    if importance_weights is not None:
        weights = jax.lax.stop_gradient(jnp.asarray(importance_weights, jnp.float32))
        per_token = jnp.where(on, weights, 0.0) * per_token
    return per_token, clipped, log_ratio


def ratio_statistics(
    log_ratio: jax.Array, clipped: jax.Array, loss_mask: jax.Array
) -> dict[str, jax.Array]:
    """Token means over the masked tokens of the importance ratio ``exp(log_ratio)``:
    float32 scalars ``clip_fraction`` (share of tokens where ``clipped``), ``approx_kl``
    (k3 estimate of KL(old || current), Schulman 2020), ``ratio_mean`` and ``num_tokens``
    (the masked tokens' count). ``log_ratio`` float32[B, T], ``clipped`` bool[B, T]."""
    on = loss_mask > 0
    ratio = jnp.exp(log_ratio)
    return {
        "clip_fraction": masked_mean(clipped.astype(jnp.float32), on),
        "approx_kl": masked_mean(ratio - 1.0 - log_ratio, on),
        "ratio_mean": masked_mean(ratio, on),
        "num_tokens": jnp.sum(on).astype(jnp.float32),
    }


def policy_gradient_loss(
    logprobs: jax.Array,
    old_logprobs: jax.Array,
    advantages: jax.Array,
    loss_mask: jax.Array,
    *,
    policy_loss: PolicyLoss,
    clip_eps_low: float,
    clip_eps_high: float,
    dual_clip: float,
    aggregation: Aggregation,
    max_tokens: int,
    ref_logprobs: jax.Array | None = None,
    kl_coef: float = 0.0,
    kl_estimator: KLEstimator = "k3",
    importance_weights: jax.Array | None = None,
    kl_importance_weights: jax.Array | None = None,
    entropy: jax.Array | None = None,
    entropy_coef: float = 0.0,
    normalizer: tuple[jax.Array, jax.Array] | None = None,
    sequence_index: jax.Array | None = None,
    num_sequences: int = 0,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The policy-gradient loss of one batch (PPO/GRPO, GSPO or CISPO), aggregated::

        loss_t = w_t * surrogate_t + kl_coef * KL_t - entropy_coef * H_t
        loss   = sum_t weights_t * loss_t / denominator          (``loss_normalizer``)

    ``w_t * surrogate_t`` is ``policy_surrogate`` (whose Args these share); ``KL_t`` is
    ``kl_penalty`` (``kl_estimator``) to ``ref_logprobs`` float32[B, T] (None: no KL), its
    ratio taken to the behaviour policy by ``kl_importance_weights`` (``pi_old / pi_behav``,
    None for 1); ``H_t`` is ``entropy`` float32[B, T] (nats, with its gradient; None: no
    bonus). ``normalizer`` replaces ``loss_normalizer``'s (a micro-batch passes its rows of
    the whole batch's). Masked-out tokens add exactly zero to the loss and its gradients.

    Returns ``(loss, aux)``: a float32 scalar and ``ratio_statistics``' scalars, plus
    ``kl_ref`` (``kl_estimate``'s token mean) with ``ref_logprobs``. ValueError: an unknown
    ``policy_loss``, ``aggregation`` or ``kl_estimator``."""
    on = loss_mask > 0
    logprobs = jnp.where(on, logprobs, 0.0)
    per_token, clipped, log_ratio = policy_surrogate(
        logprobs,
        old_logprobs,
        advantages,
        loss_mask,
        policy_loss=policy_loss,
        clip_eps_low=clip_eps_low,
        clip_eps_high=clip_eps_high,
        dual_clip=dual_clip,
        importance_weights=importance_weights,
        sequence_index=sequence_index,
        num_sequences=num_sequences,
    )
    aux = ratio_statistics(log_ratio, clipped, loss_mask)
    if ref_logprobs is not None:
        per_token = per_token + kl_coef * kl_penalty(
            logprobs,
            ref_logprobs,
            old_logprobs,
            loss_mask,
            estimator=kl_estimator,
            importance_weights=kl_importance_weights,
        )
        kl_ref = kl_estimate(logprobs, ref_logprobs, loss_mask, estimator=kl_estimator)
        aux["kl_ref"] = masked_mean(kl_ref, on)
    if entropy is not None:
        per_token = per_token - entropy_coef * entropy
    if normalizer is None:
        normalizer = loss_normalizer(
            loss_mask,
            aggregation=aggregation,
            max_tokens=max_tokens,
            sequence_index=sequence_index,
            num_sequences=num_sequences,
        )
    else:
        _check_choice("aggregation", aggregation, AGGREGATIONS)
    token_weights, denominator = normalizer
    loss = jnp.sum(jnp.where(on, per_token, 0.0) * token_weights) / denominator
    return loss, jax.tree.map(jax.lax.stop_gradient, aux)


# The name from when this loss was GRPO's only; tests and shared cases still call it.
grpo_policy_loss = policy_gradient_loss


def clipped_value_loss(
    values: jax.Array,
    old_values: jax.Array,
    returns: jax.Array,
    loss_mask: jax.Array,
    *,
    value_clip: float,
    normalizer: tuple[jax.Array, jax.Array],
) -> tuple[jax.Array, jax.Array]:
    """PPO's clipped value loss (Schulman et al. 2017, arXiv:1707.06347; as in OpenAI
    baselines' ppo2): the new value may not move the loss's target fit by more than
    ``value_clip`` from the value the returns were computed with::

        V_clip = V_old + clip(V - V_old, -value_clip, value_clip)
        loss_t = 0.5 * max((V - R)^2, (V_clip - R)^2)

    aggregated like the policy loss, ``sum(weights * loss_t) / denominator``.

    Args:
      values: float32[B, T], the value head's current estimate (with its gradient).
      old_values: float32[B, T], the estimate at the batch's start (no gradient).
      returns: float32[B, T], the targets (``gae_advantages``' returns).
      loss_mask: float[B, T], nonzero on the tokens that count.
      value_clip: > 0; ``inf`` turns the clip off.
      normalizer: ``(weights float32[B, T], denominator scalar)`` of ``loss_normalizer``.

    Returns:
      ``(loss, clipped)``: a float32 scalar and the bool[B, T] tokens where the clipped
      term is the larger (masked).
    """
    on = loss_mask > 0
    old_values = jax.lax.stop_gradient(old_values)
    returns = jax.lax.stop_gradient(returns)
    clipped_values = old_values + jnp.clip(values - old_values, -value_clip, value_clip)
    plain = (values - returns) ** 2
    clipped = (clipped_values - returns) ** 2
    per_token = 0.5 * jnp.maximum(plain, clipped)
    weights, denominator = normalizer
    loss = jnp.sum(jnp.where(on, per_token, 0.0) * weights) / denominator
    return loss, on & (clipped > plain)


def truncated_importance_weights(
    prox_logprobs: jax.Array,
    behaviour_logprobs: jax.Array,
    loss_mask: jax.Array,
    *,
    level: ImportanceSampling,
    cap: float,
    sequence_index: jax.Array | None = None,
    num_sequences: int = 0,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Truncated importance weights ``pi_prox / pi_behav`` of sampled tokens.

    With per-token log-ratios ``d_t = prox_t - behav_t`` over the masked tokens of a
    sequence (n of them)::

        token_tis:     w_t = min(exp(d_t), cap)
        sequence_tis:  w_t = min(exp(sum_t d_t), cap)        (product of token ratios)
        geometric_tis: w_t = min(exp(sum_t d_t / n), cap)    (their geometric mean)

    the sequence levels giving every token of a sequence the same weight. Truncation
    bounds the variance at the price of a bias (Ionides 2008, "Truncated importance
    sampling"). Token-level truncated weights of the engine/learner mismatch are "TIS"
    (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL
    training"); the product is the exact sequence likelihood ratio; the geometric mean
    is GSPO's length-normalised sequence ratio (Zheng et al. 2025, arXiv:2507.18071).
    Computed in log space, so a long sequence cannot overflow.

    Args:
      prox_logprobs: float32[B, T], the proximal policy's log-probabilities (nats).
      behaviour_logprobs: float32[B, T], the behaviour policy's (the engine's).
      loss_mask: float[B, T], nonzero on the tokens that count; the rest get weight 0
        and do not enter a sequence's product or mean (NaN/inf there are harmless).
      level: ``"token_tis"``, ``"sequence_tis"`` or ``"geometric_tis"``.
      cap: the truncation, >= 1 (1 would weight every token at most as on-policy).
      sequence_index, num_sequences: packed rows (``sequence_sum``); None: row = sequence.

    Returns:
      ``(weights, aux)``: float32[B, T] weights (0 off the mask) and float32 scalars
      ``importance_weight_mean`` and ``importance_truncated_fraction`` (share of
      masked tokens whose weight hit ``cap``), token means.

    Raises:
      ValueError: an unknown ``level`` or a ``cap`` below 1.
    """
    if level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(
            f"importance sampling level {level!r} is not one of "
            f"{', '.join(IMPORTANCE_SAMPLING_LEVELS)}."
        )
    if not cap >= 1.0:
        raise ValueError(
            f"importance cap {cap!r} must be >= 1 (e.g. 2.0): a cap below 1 "
            "down-weights tokens that are exactly on-policy."
        )
    on = loss_mask > 0
    log_ratio = jnp.where(on, prox_logprobs - behaviour_logprobs, 0.0)
    if level == "token_tis":
        log_weight = log_ratio
    else:
        total = sequence_sum(log_ratio, sequence_index, num_sequences)
        if level == "geometric_tis":
            total = total / jnp.maximum(
                sequence_sum(on.astype(jnp.float32), sequence_index, num_sequences), 1
            )
        log_weight = jnp.broadcast_to(total, log_ratio.shape)
    log_cap = math.log(cap)
    weights = jnp.where(on, jnp.exp(jnp.minimum(log_weight, log_cap)), 0.0)
    aux = {
        "importance_weight_mean": masked_mean(weights, on),
        "importance_truncated_fraction": masked_mean(
            (log_weight >= log_cap).astype(jnp.float32), on
        ),
    }
    return jax.lax.stop_gradient(weights), jax.tree.map(jax.lax.stop_gradient, aux)


def logprob_mismatch(
    learner_logprobs: jax.Array, behaviour_logprobs: jax.Array, loss_mask: jax.Array
) -> dict[str, jax.Array]:
    """How far the engine's (behaviour) logprobs are from the learner's on the same tokens.

    Even with equal weights the two differ (other kernels, precision, batch shapes), and
    stale tokens add the policy's own change; the gap is what off-policy correction
    corrects (Yao et al. 2025, "Your efficient RL framework secretly brings you
    off-policy RL training").

    Args:
      learner_logprobs: float32[B, T], the learner's log-probabilities (nats).
      behaviour_logprobs: float32[B, T], the engine's for the same tokens.
      loss_mask: float[B, T], nonzero on the tokens compared.

    Returns:
      float32 scalars: ``mismatch_logprob_abs_mean`` (mean |learner - behaviour|, nats),
      ``mismatch_ratio_max`` (largest ``pi_learner / pi_behav``; 0 with no token) and
      ``mismatch_kl`` (k3 estimate of KL(behaviour || learner) from the behaviour's
      samples, Schulman 2020 "Approximating KL divergence").
    """
    on = loss_mask > 0
    log_ratio = jnp.where(on, learner_logprobs - behaviour_logprobs, 0.0)
    return jax.tree.map(
        jax.lax.stop_gradient,
        {
            "mismatch_logprob_abs_mean": masked_mean(jnp.abs(log_ratio), on),
            "mismatch_ratio_max": jnp.exp(jnp.max(jnp.where(on, log_ratio, -jnp.inf))),
            "mismatch_kl": masked_mean(jnp.exp(log_ratio) - 1.0 - log_ratio, on),
        },
    )


def sft_loss(
    logits: jax.Array, targets: jax.Array, loss_mask: jax.Array
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Masked mean negative log-likelihood (nats per target token).

    Args:
      logits: float[B, T, V]; ``logits[b, t]`` predicts ``targets[b, t]``.
      targets: int32[B, T].
      loss_mask: float[B, T], nonzero on the tokens to learn.

    Returns:
      ``(loss, aux)``: a float32 scalar (0.0 when no token is masked in) and float32
      scalars ``num_tokens`` and ``accuracy`` (share of masked targets that are the
      argmax).
    """
    on = loss_mask > 0
    nll = -token_logprobs(logits, targets, temperature=1.0, top_k=0, top_p=1.0)
    correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
    aux = {"num_tokens": jnp.sum(on).astype(jnp.float32), "accuracy": masked_mean(correct, on)}
    return masked_mean(nll, on), jax.tree.map(jax.lax.stop_gradient, aux)
