"""The learner's state and its jitted updates (GRPO and SFT).

A ``TrainState`` is a plain pytree: model parameters (an ``nnx.State``), the optax
optimizer state, the step counter and PRNG key data. Updates are built by factories that
close over the model's graphdef, the optimizer and the loss hyperparameters, so the
jitted function sees only arrays and compiles once per batch shape::

    graphdef, params = init_model(model_config, seed=0)
    optimizer = make_optimizer(1e-6, warmup_steps=10)
    state = create_train_state(graphdef, params, optimizer, seed=0)
    update = make_grpo_update(graphdef, optimizer, kl_coef=0.0, temperature=1.0, top_k=0,
                              top_p=1.0)
    state, metrics = update(state, None, record_batch_to_arrays(batch))
"""

from __future__ import annotations

from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from raytunix.inference.sampling import check_sampling_settings
from raytunix.learner.advantages import check_finite_rewards, grpo_advantages
from raytunix.learner.losses import (
    AGGREGATIONS,
    IMPORTANCE_SAMPLING_LEVELS,
    grpo_policy_loss,
    logprob_mismatch,
    masked_mean,
    sft_loss,
    token_entropy,
    token_logprobs,
    truncated_importance_weights,
)
from raytunix.models.llama import forward

Batch = dict[str, Any]
Metrics = dict[str, jax.Array]

GRPO_BATCH_KEYS = ("tokens", "loss_mask", "logprobs", "rewards", "group_ids")
OFF_POLICY_CORRECTIONS = ("none", "decoupled_ppo")

# A reference-policy logprob of -inf (the token is outside the reference's top-k/top-p
# set) is raised to this floor, so the k3 KL term stays a finite penalty.
REF_LOGPROB_FLOOR = -20.0


@flax.struct.dataclass
class TrainState:
    """Everything a learner needs to continue training, as one pytree.

    Attributes:
      params: the model parameters, an ``nnx.State`` (the second half of ``nnx.split``).
      opt_state: the optax optimizer state for ``params``.
      step: int32 scalar, number of updates applied.
      rng: uint32 PRNG key data (``jax.random.key_data``), so it checkpoints as a plain
        array; turn it back into a key with ``jax.random.wrap_key_data``. The GRPO and
        SFT updates use no randomness and carry it unchanged.
    """

    params: nnx.State
    opt_state: optax.OptState
    step: jax.Array
    rng: jax.Array


def make_optimizer(
    learning_rate: float,
    *,
    weight_decay: float = 0.0,
    max_grad_norm: float | None = 1.0,
    warmup_steps: int = 0,
    b1: float = 0.9,
    b2: float = 0.999,
) -> optax.GradientTransformation:
    """AdamW (Loshchilov & Hutter 2019) after global-norm gradient clipping.

    Args:
      learning_rate: peak learning rate.
      weight_decay: decoupled weight decay; applied to matrices only (parameters with
        ndim >= 2), never to norm scales or biases.
      max_grad_norm: clip the global gradient norm to this; None or <= 0 disables it.
      warmup_steps: the learning rate rises linearly, reaching ``learning_rate`` at
        update ``warmup_steps`` (first update uses ``learning_rate / warmup_steps``),
        then stays constant; 0 disables warmup.
      b1, b2: Adam moment decay rates.

    Raises:
      ValueError: for a non-positive learning rate or a negative ``warmup_steps``.
    """
    if not learning_rate > 0:
        raise ValueError(f"learning_rate must be > 0, got {learning_rate!r}.")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps!r}.")
    schedule: float | optax.Schedule = learning_rate
    if warmup_steps > 0:

        def schedule(count):
            return learning_rate * jnp.minimum(1.0, (count + 1) / warmup_steps)

    adamw = optax.adamw(
        schedule,
        b1=b1,
        b2=b2,
        weight_decay=weight_decay,
        mask=lambda params: jax.tree.map(lambda p: p.ndim >= 2, params),
    )
    if max_grad_norm is None or max_grad_norm <= 0:
        return adamw
    return optax.chain(optax.clip_by_global_norm(max_grad_norm), adamw)


def create_train_state(
    graphdef: nnx.GraphDef, params: nnx.State, optimizer: optax.GradientTransformation, seed: int
) -> TrainState:
    """A fresh ``TrainState`` at step 0 for ``params`` of the model ``graphdef``.

    Raises:
      ValueError: if ``params`` does not fit ``graphdef`` (from another model).
    """
    try:
        nnx.merge(graphdef, params)
    except Exception as e:  # flax raises several types for a mismatched state
        raise ValueError(
            f"create_train_state: params do not match the model graphdef ({e}); pass the "
            "state returned together with this graphdef by init_model / nnx.split."
        ) from e
    return TrainState(
        params=params,
        opt_state=optimizer.init(params),
        step=jnp.zeros((), jnp.int32),
        rng=jax.random.key_data(jax.random.key(seed)),
    )


def _next_token_logits(graphdef: nnx.GraphDef, params: nnx.State, tokens: jax.Array) -> jax.Array:
    """Logits at positions 0..T-2 of ``tokens`` int32[B, T]: float32[B, T-1, V], where
    entry t predicts ``tokens[:, t + 1]``."""
    inputs = tokens[:, :-1]
    positions = jnp.broadcast_to(jnp.arange(inputs.shape[1], dtype=jnp.int32), inputs.shape)
    logits, _ = forward(graphdef, params, inputs, positions)
    return logits.astype(jnp.float32)


def _scored_tokens(graphdef: nnx.GraphDef, params: nnx.State, tokens: jax.Array, *,
                   temperature: float, top_k: int, top_p: float) -> tuple[jax.Array, jax.Array]:
    """How the learner scores sampled tokens, shared by the GRPO update and
    ``logprobs_fn``: ``(logprobs float32[B, T-1], logits float32[B, T-1, V])``, entry t
    of the logprobs scoring ``tokens[:, t + 1]`` under the sampling distribution
    (``token_logprobs``, the transformation the engine samples with)."""
    logits = _next_token_logits(graphdef, params, tokens)
    logprobs = token_logprobs(logits, tokens[:, 1:], temperature=temperature, top_k=top_k,
                              top_p=top_p)
    return logprobs, logits


def _apply_gradients(
    optimizer: optax.GradientTransformation, state: TrainState, grads: nnx.State
) -> TrainState:
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    return state.replace(
        params=optax.apply_updates(state.params, updates),
        opt_state=opt_state,
        step=state.step + 1,
    )


def make_grpo_update(
    graphdef: nnx.GraphDef,
    optimizer: optax.GradientTransformation,
    *,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
    kl_coef: float = 0.0,
    temperature: float,
    top_k: int,
    top_p: float,
    aggregation: str = "token_mean",
    normalize_adv_by_std: bool = True,
    off_policy_correction: str = "none",
    importance_sampling: str = "token_tis",
    importance_cap: float = 2.0,
) -> Callable[[TrainState, nnx.State | None, Batch], tuple[TrainState, Metrics]]:
    """Builds ``update(state, ref_params, batch) -> (state, metrics)``: one GRPO step.

    ``batch`` is the dict of ``record_batch_to_arrays`` (extra keys are ignored):
    ``tokens`` int32[B, T], ``loss_mask`` float32[B, T] (1 where token t was generated by
    the policy), ``logprobs`` float32[B, T] (behaviour logprob of token t), ``rewards``
    float32[B], ``group_ids`` int32[B] (dense, < B), and optionally ``valid`` float32[B]
    (0 for infrastructure failures, left out of group statistics; default all 1). Logits
    at position t - 1 score token t. Advantages are group-relative over valid members
    (``grpo_advantages``) and the loss is ``grpo_policy_loss``; see those for the
    formulas and papers.

    ``temperature``, ``top_k`` and ``top_p`` are the rollout's sampling settings
    (``rollout.*`` in the config): tokens are scored under the distribution they were
    sampled from (``token_logprobs``). With top-k/top-p on, a token the behaviour policy
    sampled can fall outside the current policy's truncated set (logprob -inf, ratio 0):
    the clipped objective gives it no gradient, so it is left out of the loss and
    counted in ``out_of_support_fraction``. A reference logprob of -inf is raised to
    ``REF_LOGPROB_FLOOR`` so the KL penalty stays finite.

    ``ref_params`` are the reference policy's parameters for the KL penalty (same model),
    or None when ``kl_coef == 0`` (then they are ignored anyway).

    Off-policy correction. ``off_policy_correction="none"`` clips the ratio around the
    behaviour policy (the engine's logprobs in the batch), as PPO and GRPO do.
    ``"decoupled_ppo"`` is the decoupled objective (Hilton et al. 2021, arXiv:2110.00641;
    AReaL, arXiv:2505.24298): the ratio is clipped around the proximal policy, the
    learner's parameters at the start of this update, and the behaviour policy enters
    only through the weight ``pi_prox / pi_behav``, truncated at ``importance_cap`` per
    token (``importance_sampling="token_tis"``) or per sequence (``"sequence_tis"``:
    product of token ratios; ``"geometric_tis"``: their geometric mean); see
    ``truncated_importance_weights``. The proximal logprobs are the no-grad values of the
    very forward pass the gradient is taken through: this update takes one gradient step
    per batch, so those are the parameters at the update's start, and a second forward
    pass would compute the same numbers. (At that point the ratio to the proximal policy
    is 1, so the clip does not bind; the update is the truncated-importance-weighted
    policy gradient.)

    Metrics (float32 scalars): ``loss``, ``grad_norm`` (before clipping),
    ``clip_fraction``, ``approx_kl`` (k3, to the policy the clip is anchored at),
    ``ratio_mean``, ``reward_mean``, ``advantage_abs_mean``, ``num_tokens``, ``entropy``
    (masked mean token entropy of the sampling distribution, nats),
    ``out_of_support_fraction`` (share of loss-mask tokens outside the current policy's
    top-k/top-p set, 0 with truncation off), the engine-learner logprob mismatch on the
    trained tokens at the update's start (``mismatch_logprob_abs_mean`` in nats,
    ``mismatch_ratio_max``, ``mismatch_kl``; see ``logprob_mismatch``), ``kl_ref`` when
    ``kl_coef > 0``, and with ``decoupled_ppo`` ``importance_weight_mean`` and
    ``importance_truncated_fraction``.

    Raises:
      ValueError: here, for an unknown ``aggregation``, ``off_policy_correction`` or
        ``importance_sampling``, an ``importance_cap`` below 1, or bad sampling settings
        (a temperature that is not > 0, ``top_k < 0``, ``top_p`` outside (0, 1]); from
        ``update``, for a batch missing a key, a non-finite reward, or ``kl_coef > 0``
        without ``ref_params``.
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(
            f"aggregation={aggregation!r} is not supported; use one of {', '.join(AGGREGATIONS)}.")
    if off_policy_correction not in OFF_POLICY_CORRECTIONS:
        raise ValueError(
            f"off_policy_correction={off_policy_correction!r} is not supported; use one of "
            f"{', '.join(OFF_POLICY_CORRECTIONS)}.")
    if importance_sampling not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(
            f"importance_sampling={importance_sampling!r} is not supported; use one of "
            f"{', '.join(IMPORTANCE_SAMPLING_LEVELS)}.")
    if not importance_cap >= 1.0:
        raise ValueError(
            f"importance_cap={importance_cap!r} must be >= 1 (e.g. 2.0); a cap below 1 "
            "down-weights tokens that are exactly on-policy.")
    decoupled = off_policy_correction == "decoupled_ppo"
    try:
        check_sampling_settings(temperature, top_k, top_p, allow_greedy=False)
    except ValueError as e:
        raise ValueError(
            f"make_grpo_update: {e} Pass the rollout's sampling settings; greedy (temperature "
            "0) rollouts cannot be trained on."
        ) from None
    use_ref = kl_coef > 0
    sampling = {"temperature": temperature, "top_k": top_k, "top_p": top_p}

    @jax.jit
    def _update(state, ref_params, tokens, loss_mask, old_logprobs, rewards, group_ids, valid):
        generated = loss_mask[:, 1:]
        old = old_logprobs[:, 1:]
        advantages = grpo_advantages(
            rewards, group_ids, tokens.shape[0], normalize_advantages_by_std=normalize_adv_by_std,
            valid=valid,
        )
        ref = None
        if ref_params is not None:
            ref, _ = _scored_tokens(graphdef, ref_params, tokens, **sampling)
            ref = jax.lax.stop_gradient(jnp.maximum(ref, REF_LOGPROB_FLOOR))

        def loss_fn(params):
            logprobs, logits = _scored_tokens(graphdef, params, tokens, **sampling)
            # -inf only where truncation removed the token; NaN still propagates.
            out_of_support = jnp.isneginf(jax.lax.stop_gradient(logprobs))
            mask = jnp.where(out_of_support, 0.0, generated)
            logprobs = jnp.where(out_of_support, 0.0, logprobs)
            # The learner's logprobs before this step's change: the proximal policy.
            prox = jax.lax.stop_gradient(logprobs)
            weights, weight_aux = None, {}
            if decoupled:
                weights, weight_aux = truncated_importance_weights(
                    prox, old, mask, level=importance_sampling, cap=importance_cap)
            loss, aux = grpo_policy_loss(
                logprobs,
                prox if decoupled else old,
                advantages,
                mask,
                policy_loss="ppo_clip",
                dual_clip=0.0,
                max_tokens=tokens.shape[1] - 1,
                clip_eps_low=clip_eps_low,
                clip_eps_high=clip_eps_high,
                ref_logprobs=ref,
                kl_coef=kl_coef,
                aggregation=aggregation,
                importance_weights=weights,
            )
            aux.update(weight_aux, **logprob_mismatch(prox, old, mask))
            entropy = token_entropy(jax.lax.stop_gradient(logits), **sampling)
            aux["entropy"] = masked_mean(entropy, mask)
            aux["out_of_support_fraction"] = masked_mean(
                out_of_support.astype(jnp.float32), generated)
            return loss, aux

        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        metrics = {
            "loss": loss,
            "grad_norm": optax.tree.norm(grads),
            "reward_mean": jnp.mean(rewards),
            "advantage_abs_mean": jnp.mean(jnp.abs(advantages)),
            **aux,
        }
        return _apply_gradients(optimizer, state, grads), metrics

    def update(state: TrainState, ref_params: nnx.State | None, batch: Batch):
        missing = [k for k in GRPO_BATCH_KEYS if k not in batch]
        if missing:
            raise ValueError(
                f"GRPO batch is missing {missing}; build it with record_batch_to_arrays "
                f"(got keys {sorted(batch)})."
            )
        if use_ref and ref_params is None:
            raise ValueError(
                f"kl_coef={kl_coef} needs the reference policy's params; pass ref_params "
                "or set kl_coef=0."
            )
        if not isinstance(batch["rewards"], jax.core.Tracer):  # under an outer jit: the caller checks
            check_finite_rewards(batch["rewards"])
        # Infrastructure failures (valid 0) are left out of their group's statistics.
        valid = batch.get("valid")
        if valid is None:
            valid = jnp.ones(len(batch["rewards"]), jnp.float32)
        return _update(
            state,
            ref_params if use_ref else None,
            jnp.asarray(batch["tokens"], jnp.int32),
            jnp.asarray(batch["loss_mask"], jnp.float32),
            jnp.asarray(batch["logprobs"], jnp.float32),
            jnp.asarray(batch["rewards"], jnp.float32),
            jnp.asarray(batch["group_ids"], jnp.int32),
            jnp.asarray(valid, jnp.float32),
        )

    return update


def make_sft_update(
    graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation
) -> Callable[[TrainState, jax.Array, jax.Array], tuple[TrainState, Metrics]]:
    """Builds jitted ``update(state, tokens, loss_mask) -> (state, metrics)``: one
    supervised step on next-token NLL.

    Args of ``update``: ``tokens`` int32[B, T]; ``loss_mask`` float32[B, T], 1 where
    token t is a target (predicted from tokens 0..t-1); position 0 is never a target.

    Metrics (float32 scalars): ``loss`` (nats per target token), ``grad_norm`` (before
    clipping), ``num_tokens``, ``accuracy`` (argmax hits among targets).
    """

    @jax.jit
    def update(state: TrainState, tokens: jax.Array, loss_mask: jax.Array):
        def loss_fn(params):
            logits = _next_token_logits(graphdef, params, tokens)
            return sft_loss(logits, tokens[:, 1:], loss_mask[:, 1:])

        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), **aux}
        return _apply_gradients(optimizer, state, grads), metrics

    return update


def logprobs_fn(
    graphdef: nnx.GraphDef, *, temperature: float, top_k: int, top_p: float
) -> Callable[[nnx.State, jax.Array, jax.Array], jax.Array]:
    """Builds jitted ``fn(params, tokens, loss_mask) -> float32[B, T]``.

    Entry ``[b, t]`` is the log-probability (nats) of ``tokens[b, t]`` given the tokens
    before it under the sampling distribution of (``temperature``, ``top_k``, ``top_p``)
    — scored exactly as the GRPO update scores it — where ``loss_mask[b, t]`` is nonzero,
    and 0.0 elsewhere (always at position 0): the layout of behaviour logprobs in a
    ``Trajectory``. -inf marks a masked-in token outside the top-k/top-p set. Used for
    reference-policy logprobs and to recompute behaviour logprobs.

    Raises:
      ValueError: bad sampling settings (see ``make_grpo_update``).
    """
    check_sampling_settings(temperature, top_k, top_p, allow_greedy=False)
    sampling = {"temperature": temperature, "top_k": top_k, "top_p": top_p}

    @jax.jit
    def fn(params, tokens, loss_mask):
        logprobs, _ = _scored_tokens(graphdef, params, tokens, **sampling)
        logprobs = jnp.where(loss_mask[:, 1:] > 0, logprobs, 0.0)
        return jnp.pad(logprobs, ((0, 0), (1, 0)))

    return fn
