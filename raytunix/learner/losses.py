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

Aggregation = Literal["token_mean", "sequence_mean"]
ImportanceSampling = Literal["token_tis", "sequence_tis", "geometric_tis"]
IMPORTANCE_SAMPLING_LEVELS = ("token_tis", "sequence_tis", "geometric_tis")


def token_logprobs(logits: jax.Array, targets: jax.Array, *, temperature: float, top_k: int,
                   top_p: float) -> jax.Array:
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


def token_entropy(logits: jax.Array, *, temperature: float, top_k: int, top_p: float
                  ) -> jax.Array:
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


def _aggregate(per_token: jax.Array, on: jax.Array, aggregation: str) -> jax.Array:
    per_token = jnp.where(on, per_token, 0.0)
    if aggregation == "token_mean":
        return jnp.sum(per_token) / jnp.maximum(jnp.sum(on), 1)
    if aggregation == "sequence_mean":
        tokens_per_seq = jnp.sum(on, axis=-1)
        seq_means = jnp.sum(per_token, axis=-1) / jnp.maximum(tokens_per_seq, 1)
        has_tokens = tokens_per_seq > 0
        return jnp.sum(jnp.where(has_tokens, seq_means, 0.0)) / jnp.maximum(jnp.sum(has_tokens), 1)
    raise ValueError(
        f"aggregation={aggregation!r} is not supported; use 'token_mean' or 'sequence_mean'."
    )


def grpo_policy_loss(
    logprobs: jax.Array,
    old_logprobs: jax.Array,
    advantages: jax.Array,
    loss_mask: jax.Array,
    *,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
    ref_logprobs: jax.Array | None = None,
    kl_coef: float = 0.0,
    aggregation: Aggregation = "token_mean",
    importance_weights: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Clipped surrogate policy loss with an optional KL penalty to a reference policy.

    Per masked token, with ratio ``rho = exp(logprobs - old_logprobs)``, the
    sequence's advantage ``A`` broadcast over its tokens and an importance weight ``w``
    (1 unless ``importance_weights`` is given)::

        loss_t = -w * min(rho * A, clip(rho, 1 - clip_eps_low, 1 + clip_eps_high) * A)
                 + kl_coef * (exp(ref - logprobs) - (ref - logprobs) - 1)

    The clipped surrogate is PPO's (Schulman et al. 2017, arXiv:1707.06347); separate
    lower and upper clip ranges ("clip-higher") are DAPO's (Yu et al. 2025,
    arXiv:2503.14476); the KL term is the k3 estimator of KL(pi || pi_ref) (Schulman
    2020, "Approximating KL divergence"), as used by GRPO (arXiv:2402.03300).

    With ``old_logprobs`` the behaviour policy's and no weights this is PPO/GRPO as
    usual. The decoupled objective (Hilton et al. 2021, arXiv:2110.00641; AReaL,
    arXiv:2505.24298) passes the proximal policy's logprobs as ``old_logprobs`` (the
    clip's anchor) and ``truncated_importance_weights(prox, behaviour, ...)`` as
    ``importance_weights``.

    Args:
      logprobs: float32[B, T], log-probabilities of the tokens under the current policy.
      old_logprobs: float32[B, T], under the policy the ratio is clipped around: the
        behaviour policy that sampled the tokens, or a proximal policy.
      advantages: float32[B], one per sequence.
      loss_mask: float[B, T], nonzero on tokens that count. Masked-out tokens contribute
        exactly zero to the loss and its gradients, even if their logprobs are NaN/inf.
      clip_eps_low, clip_eps_high: the ratio is clipped to
        ``[1 - clip_eps_low, 1 + clip_eps_high]``.
      ref_logprobs: float32[B, T] under the reference policy, or None for no KL term.
      kl_coef: weight of the KL penalty; ignored when ``ref_logprobs`` is None.
      aggregation: ``"token_mean"``: sum over all masked tokens / their number in the
        batch; ``"sequence_mean"``: mean over each sequence's masked tokens, then mean
        over the sequences that have any.
      importance_weights: float32[B, T] >= 0 multiplying each token's clipped surrogate
        (not the KL term), treated as constants (no gradient); None for all 1.

    Returns:
      ``(loss, aux)``: a float32 scalar and float32 scalars ``clip_fraction`` (share of
      masked tokens whose clipped term is the active one, i.e. get no gradient),
      ``approx_kl`` (k3 estimate of KL(old || current)), ``ratio_mean``,
      ``num_tokens``, and ``kl_ref`` when ``ref_logprobs`` is given. All token statistics
      are token means.

    Raises:
      ValueError: for an unknown ``aggregation``.
    """
    on = loss_mask > 0
    log_ratio = jnp.where(on, logprobs - old_logprobs, 0.0)
    ratio = jnp.exp(log_ratio)
    adv = jnp.asarray(advantages, jnp.float32)[:, None]
    unclipped = ratio * adv
    clipped = jnp.clip(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high) * adv
    per_token = -jnp.minimum(unclipped, clipped)
    if importance_weights is not None:
        weights = jax.lax.stop_gradient(jnp.asarray(importance_weights, jnp.float32))
        per_token = jnp.where(on, weights, 0.0) * per_token

    aux = {}
    if ref_logprobs is not None:
        ref_log_ratio = jnp.where(on, ref_logprobs - logprobs, 0.0)
        kl = jnp.exp(ref_log_ratio) - ref_log_ratio - 1.0
        per_token = per_token + kl_coef * kl
        aux["kl_ref"] = masked_mean(kl, on)

    loss = _aggregate(per_token, on, aggregation)
    aux.update(
        clip_fraction=masked_mean((clipped < unclipped).astype(jnp.float32), on),
        approx_kl=masked_mean(ratio - 1.0 - log_ratio, on),
        ratio_mean=masked_mean(ratio, on),
        num_tokens=jnp.sum(on).astype(jnp.float32),
    )
    return loss, jax.tree.map(jax.lax.stop_gradient, aux)


def truncated_importance_weights(
    prox_logprobs: jax.Array,
    behaviour_logprobs: jax.Array,
    loss_mask: jax.Array,
    *,
    level: ImportanceSampling,
    cap: float,
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

    Returns:
      ``(weights, aux)``: float32[B, T] weights (0 off the mask) and float32 scalars
      ``importance_weight_mean`` and ``importance_truncated_fraction`` (share of
      masked tokens whose weight hit ``cap``), token means.

    Raises:
      ValueError: an unknown ``level`` or a ``cap`` below 1.
    """
    if level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(f"importance sampling level {level!r} is not one of "
                         f"{', '.join(IMPORTANCE_SAMPLING_LEVELS)}.")
    if not cap >= 1.0:
        raise ValueError(f"importance cap {cap!r} must be >= 1 (e.g. 2.0): a cap below 1 "
                         "down-weights tokens that are exactly on-policy.")
    on = loss_mask > 0
    log_ratio = jnp.where(on, prox_logprobs - behaviour_logprobs, 0.0)
    if level == "token_tis":
        log_weight = log_ratio
    else:
        total = jnp.sum(log_ratio, axis=-1, keepdims=True)
        if level == "geometric_tis":
            total = total / jnp.maximum(jnp.sum(on, axis=-1, keepdims=True), 1)
        log_weight = jnp.broadcast_to(total, log_ratio.shape)
    log_cap = math.log(cap)
    weights = jnp.where(on, jnp.exp(jnp.minimum(log_weight, log_cap)), 0.0)
    aux = {
        "importance_weight_mean": masked_mean(weights, on),
        "importance_truncated_fraction": masked_mean(
            (log_weight >= log_cap).astype(jnp.float32), on),
    }
    return jax.lax.stop_gradient(weights), jax.tree.map(jax.lax.stop_gradient, aux)


def logprob_mismatch(learner_logprobs: jax.Array, behaviour_logprobs: jax.Array,
                     loss_mask: jax.Array) -> dict[str, jax.Array]:
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
    return jax.tree.map(jax.lax.stop_gradient, {
        "mismatch_logprob_abs_mean": masked_mean(jnp.abs(log_ratio), on),
        "mismatch_ratio_max": jnp.exp(jnp.max(jnp.where(on, log_ratio, -jnp.inf))),
        "mismatch_kl": masked_mean(jnp.exp(log_ratio) - 1.0 - log_ratio, on),
    })


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
