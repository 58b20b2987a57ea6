"""The learner's state and its jitted updates (policy gradient and SFT).

A ``TrainState`` is a plain pytree: model parameters (an ``nnx.State``), the optax
optimizer state, the step counter and PRNG key data. Updates are built by factories that
close over the model's graphdef, the optimizer and the hyperparameters, so the jitted
function sees only arrays and compiles once per batch shape::

    graphdef, params = init_model(model_config, seed=0)
    hp = RLHyperparams.from_config(cfg)
    optimizer = make_optimizer_from(hp)
    state = create_train_state(graphdef, params, optimizer, seed=0)
    update = make_policy_update(graphdef, optimizer, hp, max_seq_len=model_config.max_seq_len)
    state, metrics = update(state, None, Batch.from_record_batch(rb, pad_id=0, max_seq_len=128))
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from raytunix.config import Config, LearnerConfig, WarmupConfig
from raytunix.inference.sampling import check_sampling_settings
from raytunix.learner.advantages import (
    ADVANTAGE_ESTIMATORS,
    check_finite_rewards,
    episode_advantages,
    gae_advantages,
    last_token_rewards,
    overlong_penalty,
    whiten,
)
from raytunix.learner.batch import ROW_MULTIPLE, Batch, PackedBatch
from raytunix.learner.lora import LoraSpec, init_adapters, merge_adapters
from raytunix.learner.losses import (
    AGGREGATIONS,
    IMPORTANCE_SAMPLING_LEVELS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    clipped_value_loss,
    policy_gradient_loss,
    logprob_mismatch,
    loss_normalizer,
    masked_mean,
    sft_loss,
    token_entropy,
    token_logprobs,
    truncated_importance_weights,
)
from raytunix.learner.sharding import (
    MeshConfig,
    batch_shards,
    constrain,
    place_batch,
    place_rows,
    row_sharding,
)
from raytunix.models.llama import forward, forward_with_hidden

Metrics = dict[str, jax.Array]

OFF_POLICY_CORRECTIONS = ("none", "decoupled_ppo")
OPTIMIZERS = ("adamw", "adam", "sgd")
LR_SCHEDULES = ("constant", "linear", "cosine")

# What the policy update checks before it applies a step: metrics nonfinite_<part>.
NONFINITE_PARTS = ("loss", "gradients", "new_state")

# A reference-policy logprob of -inf (the token is outside the reference's top-k/top-p
# set) is raised to this floor, so the k3 KL term stays a finite penalty.
REF_LOGPROB_FLOOR = -20.0


@flax.struct.dataclass
class TrainState:
    """Everything a learner needs to continue training, as one pytree.

    Attributes:
      params: the model parameters, an ``nnx.State`` (the second half of ``nnx.split``).
      opt_state: the optax optimizer state for ``params``.
      step: int32 scalar, number of optimizer steps applied.
      rng: uint32 PRNG key data (``jax.random.key_data``), so it checkpoints as a plain
        array; turn it back into a key with ``jax.random.wrap_key_data``. The policy and
        SFT updates use no randomness and carry it unchanged.
      value_head: PPO's value head (``advantage_estimator="gae"``), a scalar linear map
        of the model's final hidden state, ``{"kernel": float32[d_model, 1], "bias":
        float32[1]}`` (``add_value_head``); None without GAE, so the policy's ``params``
        and the checkpoints of other runs are unchanged.
      value_opt_state: the optimizer state of ``value_head`` (the same optax optimizer as
        ``params``, its own gradient clipping), or None.
      base: with LoRA (``raytunix.learner.lora``), the frozen base model's parameters, an
        ``nnx.State``; ``params`` then holds the adapters, the only trained parameters
        (``opt_state`` is theirs), and the model is ``policy_params(state)``. None without.
      lora_scale: LoRA's ``alpha / rank`` (static, not an array); 0.0 without LoRA.
    """

    params: nnx.State
    opt_state: optax.OptState
    step: jax.Array
    rng: jax.Array
    value_head: Any = None
    value_opt_state: Any = None
    base: Any = None
    lora_scale: float = flax.struct.field(pytree_node=False, default=0.0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RLHyperparams:
    """Every number of the RL phase's update — optimizer and schedule, advantages (GRPO
    and the other episode estimators, PPO's GAE and value head), the policy loss (PPO
    clip, GSPO, CISPO; KL, entropy), off-policy correction, micro-batches, iterations and
    packing — with the names of the config's ``learner.*`` keys
    (``raytunix.config.LearnerConfig`` documents each and holds its one default, which the
    fields here take). Build with ``from_config``.

    ``temperature``, ``top_k`` and ``top_p`` are the rollout's sampling settings
    (``rollout.*``) and have no default: tokens are scored under the distribution they
    were sampled from, so these must come from the same place as the engine's.
    ``overlong_max_tokens`` is the most tokens an episode can generate
    (``env.max_turns * rollout.max_new_tokens``), the limit of DAPO's overlong penalty.
    ``mesh`` is the learner's device mesh (``learner.mesh_*``; ``Learner`` builds it and
    passes it to ``make_policy_update``); it does not change the numbers.
    """

    temperature: float
    top_k: int
    top_p: float
    rl_steps: int = LearnerConfig.rl_steps
    learning_rate: float = LearnerConfig.learning_rate
    optimizer: str = LearnerConfig.optimizer
    lr_schedule: str = LearnerConfig.lr_schedule
    lr_warmup_steps: int = LearnerConfig.lr_warmup_steps
    weight_decay: float = LearnerConfig.weight_decay
    max_grad_norm: float = LearnerConfig.max_grad_norm
    advantage_estimator: str = LearnerConfig.advantage_estimator
    gae_gamma: float = LearnerConfig.gae_gamma
    gae_lambda: float = LearnerConfig.gae_lambda
    gae_normalize: bool = LearnerConfig.gae_normalize
    value_coef: float = LearnerConfig.value_coef
    value_clip: float = LearnerConfig.value_clip
    normalize_advantages_by_std: bool = LearnerConfig.normalize_advantages_by_std
    policy_loss: str = LearnerConfig.policy_loss
    clip_eps_low: float = LearnerConfig.clip_eps_low
    clip_eps_high: float = LearnerConfig.clip_eps_high
    dual_clip: float = LearnerConfig.dual_clip
    loss_aggregation: str = LearnerConfig.loss_aggregation
    kl_coef: float = LearnerConfig.kl_coef
    kl_estimator: str = LearnerConfig.kl_estimator
    entropy_coef: float = LearnerConfig.entropy_coef
    overlong_buffer_tokens: int = LearnerConfig.overlong_buffer_tokens
    overlong_max_tokens: int = 0
    off_policy_correction: str = LearnerConfig.off_policy_correction
    importance_sampling: str = LearnerConfig.importance_sampling
    importance_cap: float = LearnerConfig.importance_cap
    micro_batch_size: int = LearnerConfig.micro_batch_size
    num_iterations: int = LearnerConfig.num_iterations
    sequence_packing: bool = LearnerConfig.sequence_packing
    pack_width: int = LearnerConfig.pack_width
    lora_rank: int = LearnerConfig.lora_rank
    lora_alpha: float = LearnerConfig.lora_alpha
    lora_target_modules: str = LearnerConfig.lora_target_modules
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)

    @property
    def lora(self) -> LoraSpec:
        """The LoRA adapters to train (rank 0: the whole model trains)."""
        return LoraSpec(self.lora_rank, self.lora_alpha, self.lora_target_modules)

    @classmethod
    def from_config(cls, cfg: Config) -> RLHyperparams:
        """The update's numbers from a run config: every ``learner.*`` key of this class,
        the sampling settings of ``rollout.*`` and the overlong limit."""
        names = {f.name for f in dataclasses.fields(cls)}
        learner = {k: v for k, v in dataclasses.asdict(cfg.learner).items() if k in names}
        return cls(
            temperature=cfg.rollout.temperature,
            top_k=cfg.rollout.top_k,
            top_p=cfg.rollout.top_p,
            overlong_max_tokens=cfg.env.max_turns * cfg.rollout.max_new_tokens,
            mesh=MeshConfig.from_config(cfg),
            **learner,
        )

    def check(self, vocab_size: int | None = None) -> None:
        """Raises ValueError naming a setting outside its allowed values: among them
        sampling settings the learner cannot score finitely or that sample greedily
        (``check_sampling_settings``; ``vocab_size``, the model's, bounds ``top_p``)."""
        try:
            check_sampling_settings(
                self.temperature, self.top_k, self.top_p, allow_greedy=False, vocab_size=vocab_size
            )
        except ValueError as e:
            raise ValueError(
                f"{e} Pass the rollout's sampling settings (rollout.temperature, top_k, "
                "top_p); greedy rollouts cannot be trained on."
            ) from None
        for name, allowed in (
            ("advantage_estimator", ADVANTAGE_ESTIMATORS),
            ("policy_loss", POLICY_LOSSES),
            ("loss_aggregation", AGGREGATIONS),
            ("kl_estimator", KL_ESTIMATORS),
            ("off_policy_correction", OFF_POLICY_CORRECTIONS),
            ("importance_sampling", IMPORTANCE_SAMPLING_LEVELS),
            ("optimizer", OPTIMIZERS),
            ("lr_schedule", LR_SCHEDULES),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"{name}={getattr(self, name)!r} is not supported; use one "
                    f"of {', '.join(allowed)}."
                )
        self.lora.check()
        if not self.importance_cap >= 1.0:
            raise ValueError(
                f"importance_cap={self.importance_cap!r} must be >= 1 (e.g. 2.0); a cap below 1 "
                "down-weights tokens that are exactly on-policy."
            )
        if self.dual_clip and not self.dual_clip > 1.0:
            raise ValueError(f"dual_clip={self.dual_clip!r} must be > 1 (e.g. 3.0), or 0 for none.")
        if not (0.0 <= self.gae_gamma <= 1.0 and 0.0 <= self.gae_lambda <= 1.0):
            raise ValueError(
                f"gae_gamma={self.gae_gamma!r} and gae_lambda={self.gae_lambda!r} "
                "must be in [0, 1]."
            )
        if not (self.value_coef > 0 and self.value_clip > 0):
            raise ValueError(
                f"value_coef={self.value_coef!r} and value_clip={self.value_clip!r} must be > 0."
            )
        if self.num_iterations < 1 or self.micro_batch_size < 0:
            raise ValueError(
                f"num_iterations={self.num_iterations!r} must be >= 1 and "
                f"micro_batch_size={self.micro_batch_size!r} >= 0 (0: whole batch)."
            )
        if self.overlong_buffer_tokens and not (
            0 < self.overlong_buffer_tokens <= self.overlong_max_tokens
        ):
            raise ValueError(
                f"overlong_buffer_tokens={self.overlong_buffer_tokens!r} must be in (0, "
                f"overlong_max_tokens={self.overlong_max_tokens!r}], the most tokens an episode "
                "can generate, or 0 for no overlong penalty."
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class SFTHyperparams:
    """The numbers of the supervised warm start: ``warmup.learning_rate`` and
    ``warmup.warmup_steps`` (the learning rate's linear warmup), and the RL phase's
    ``learner.max_grad_norm``, the LoRA adapters of ``learner.lora_*`` (the warm start
    trains the same adapters as RL) and the learner's device mesh (``learner.mesh_*``); the
    config holds each default. Build with ``from_config``."""

    learning_rate: float = WarmupConfig.learning_rate
    warmup_steps: int = WarmupConfig.warmup_steps
    max_grad_norm: float = LearnerConfig.max_grad_norm
    lora: LoraSpec = LoraSpec(
        LearnerConfig.lora_rank, LearnerConfig.lora_alpha, LearnerConfig.lora_target_modules
    )
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)

    @classmethod
    def from_config(cls, cfg: Config) -> SFTHyperparams:
        learner = cfg.learner
        return cls(
            learning_rate=cfg.warmup.learning_rate,
            warmup_steps=cfg.warmup.warmup_steps,
            max_grad_norm=learner.max_grad_norm,
            lora=LoraSpec(learner.lora_rank, learner.lora_alpha, learner.lora_target_modules),
            mesh=MeshConfig.from_config(cfg),
        )

    def optimizer(self) -> optax.GradientTransformation:
        """AdamW at ``learning_rate`` after ``warmup_steps`` of linear warmup."""
        return make_optimizer(
            self.learning_rate, warmup_steps=self.warmup_steps, max_grad_norm=self.max_grad_norm
        )


def lr_schedule(
    learning_rate: float, *, schedule: str, warmup_steps: int, total_steps: int
) -> float | optax.Schedule:
    """The learning rate at each optimizer step: a linear warmup over ``warmup_steps``
    (step 0 uses ``learning_rate / warmup_steps``), then ``constant``, or a ``linear`` or
    ``cosine`` (Loshchilov & Hutter 2017, SGDR) decay to 0 at ``total_steps``.

    Raises:
      ValueError: an unknown ``schedule``, a negative ``warmup_steps``, or a decaying
        schedule whose ``total_steps`` does not exceed ``warmup_steps``.
    """
    if schedule not in LR_SCHEDULES:
        raise ValueError(
            f"lr_schedule={schedule!r} is not supported; use one of {', '.join(LR_SCHEDULES)}."
        )
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps!r}.")

    def warmup(count):
        return learning_rate * jnp.minimum(1.0, (count + 1) / warmup_steps)

    if schedule == "constant":
        # A plain number keeps the optimizer state free of a schedule counter.
        return warmup if warmup_steps > 0 else learning_rate
    if total_steps <= warmup_steps:
        raise ValueError(
            f"a {schedule} learning-rate decay needs more optimizer steps "
            f"({total_steps}) than warmup steps ({warmup_steps})."
        )
    decay_steps = total_steps - warmup_steps
    if schedule == "linear":
        decay = optax.linear_schedule(learning_rate, 0.0, decay_steps)
    else:
        decay = optax.cosine_decay_schedule(learning_rate, decay_steps)
    if warmup_steps == 0:
        return decay
    return optax.join_schedules([warmup, decay], [warmup_steps])


def make_optimizer(
    learning_rate: float,
    *,
    optimizer: str = LearnerConfig.optimizer,
    schedule: str = LearnerConfig.lr_schedule,
    warmup_steps: int = LearnerConfig.lr_warmup_steps,
    total_steps: int = 0,
    weight_decay: float = LearnerConfig.weight_decay,
    max_grad_norm: float | None = LearnerConfig.max_grad_norm,
    b1: float = 0.9,
    b2: float = 0.999,
) -> optax.GradientTransformation:
    """An optax optimizer after global-norm gradient clipping: ``adamw`` (Loshchilov &
    Hutter 2019), ``adam`` (Kingma & Ba 2015) or plain ``sgd``, on the learning-rate
    schedule of ``lr_schedule``.

    Args:
      learning_rate: peak learning rate (> 0).
      optimizer: ``adamw``, ``adam`` or ``sgd``.
      schedule, warmup_steps, total_steps: see ``lr_schedule``; ``total_steps`` (optimizer
        steps in the run) matters only for a decaying schedule.
      weight_decay: AdamW's decoupled weight decay, applied to matrices only (parameters
        with ndim >= 2), never to norm scales or biases; must be 0 for the others.
      max_grad_norm: clip the global gradient norm to this; None or <= 0 disables it.
      b1, b2: Adam moment decay rates.

    Raises:
      ValueError: a non-positive learning rate, an unknown optimizer or schedule, or a
        weight decay with an optimizer that has none.
    """
    if not learning_rate > 0:
        raise ValueError(f"learning_rate must be > 0, got {learning_rate!r}.")
    if optimizer not in OPTIMIZERS:
        raise ValueError(
            f"optimizer={optimizer!r} is not supported; use one of {', '.join(OPTIMIZERS)}."
        )
    if weight_decay and optimizer != "adamw":
        raise ValueError(
            f"weight_decay={weight_decay!r} is applied by adamw only; use "
            f"optimizer adamw or weight_decay 0 with {optimizer}."
        )
    rate = lr_schedule(
        learning_rate, schedule=schedule, warmup_steps=warmup_steps, total_steps=total_steps
    )
    if optimizer == "adamw":
        inner = optax.adamw(
            rate,
            b1=b1,
            b2=b2,
            weight_decay=weight_decay,
            mask=lambda params: jax.tree.map(lambda p: p.ndim >= 2, params),
        )
    elif optimizer == "adam":
        inner = optax.adam(rate, b1=b1, b2=b2)
    else:
        inner = optax.sgd(rate)
    if max_grad_norm is None or max_grad_norm <= 0:
        return inner
    return optax.chain(optax.clip_by_global_norm(max_grad_norm), inner)


def make_optimizer_from(hp: RLHyperparams) -> optax.GradientTransformation:
    """The RL optimizer ``hp`` names; a decaying schedule reaches 0 after the run's
    ``rl_steps * num_iterations`` optimizer steps."""
    return make_optimizer(
        hp.learning_rate,
        optimizer=hp.optimizer,
        schedule=hp.lr_schedule,
        warmup_steps=hp.lr_warmup_steps,
        total_steps=hp.rl_steps * hp.num_iterations,
        weight_decay=hp.weight_decay,
        max_grad_norm=hp.max_grad_norm,
    )


def create_train_state(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    optimizer: optax.GradientTransformation,
    seed: int,
    lora: LoraSpec | None = None,
) -> TrainState:
    """A fresh ``TrainState`` at step 0 for ``params`` of the model ``graphdef``. With
    ``lora`` enabled (rank > 0), ``params`` become the frozen ``base`` and fresh adapters
    (``init_adapters``, from ``seed``) the trained ``params``, the optimizer state theirs
    alone.

    Raises:
      ValueError: if ``params`` does not fit ``graphdef`` (from another model), or
        ``lora`` is invalid or names no layer of the model (``init_adapters``).
    """
    try:
        nnx.merge(graphdef, params)
    except Exception as e:  # flax raises several types for a mismatched state
        raise ValueError(
            f"create_train_state: params do not match the model graphdef ({e}); pass the "
            "state returned together with this graphdef by init_model / nnx.split."
        ) from e
    rng = jax.random.key_data(jax.random.key(seed))
    step = jnp.zeros((), jnp.int32)
    if lora is None or not lora.enabled:
        return TrainState(params=params, opt_state=optimizer.init(params), step=step, rng=rng)
    adapters = init_adapters(params, lora, seed)
    return TrainState(
        params=adapters,
        opt_state=optimizer.init(adapters),
        step=step,
        rng=rng,
        base=params,
        lora_scale=lora.scale,
    )


def model_params(params: Any, base: nnx.State | None, lora_scale: float) -> nnx.State:
    """The model's parameters: ``params`` themselves, or with a LoRA ``base`` the base
    with the adapters ``params`` merged in (``merge_adapters``; differentiable in them)."""
    return params if base is None else merge_adapters(base, params, lora_scale)


def policy_params(state: TrainState) -> nnx.State:
    """The policy's full parameters, an ``nnx.State`` like ``init_model``'s: what an
    engine is served and an export writes (with LoRA, base + adapters merged)."""
    return model_params(state.params, state.base, state.lora_scale)


def init_value_head(d_model: int) -> dict[str, jax.Array]:
    """PPO's value head for a model of width ``d_model``: ``{"kernel": float32[d_model,
    1], "bias": float32[1]}``, zeros, so every value starts at 0 (the first GAE
    advantages are discounted returns)."""
    return {"kernel": jnp.zeros((d_model, 1), jnp.float32), "bias": jnp.zeros((1,), jnp.float32)}


def add_value_head(
    state: TrainState, optimizer: optax.GradientTransformation, d_model: int
) -> TrainState:
    """``state`` with a fresh value head (``init_value_head``) and its optimizer state,
    what ``make_policy_update`` needs for ``advantage_estimator="gae"``; ``d_model`` is the
    model's width (``ModelConfig.d_model``)."""
    head = init_value_head(d_model)
    return state.replace(value_head=head, value_opt_state=optimizer.init(head))


def value_estimates(value_head: dict[str, jax.Array], hidden: jax.Array) -> jax.Array:
    """The value head on hidden states ``[..., d_model]``: float32[...]."""
    return (hidden.astype(jnp.float32) @ value_head["kernel"])[..., 0] + value_head["bias"][0]


def _next_token_logits(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    tokens: jax.Array,
    positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    *,
    with_hidden: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Logits at positions 0..T-2 of ``tokens`` int32[B, T]: float32[B, T-1, V], where
    entry t predicts ``tokens[:, t + 1]``. Packed rows pass their ``positions`` and
    ``segment_ids`` int32[B, T] (``PackedBatch``); then entry t at a segment's last
    token predicts the next segment's first token, which is never trained."""
    inputs = tokens[:, :-1]
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(inputs.shape[1], dtype=jnp.int32), inputs.shape)
    else:
        positions = positions[:, :-1]
    if segment_ids is not None:
        segment_ids = segment_ids[:, :-1]
    if with_hidden:  # + the final hidden state [B, T-1, D] the value head reads
        return forward_with_hidden(graphdef, params, inputs, positions, segment_ids)
    logits, _ = forward(graphdef, params, inputs, positions, segment_ids=segment_ids)
    return logits.astype(jnp.float32)


def _scored_tokens(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    tokens: jax.Array,
    *,
    temperature: float,
    top_k: int,
    top_p: float,
    positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    value_head: dict[str, jax.Array] | None = None,
) -> tuple[jax.Array, jax.Array] | tuple[jax.Array, jax.Array, jax.Array]:
    """How the learner scores sampled tokens, shared by the policy update and
    ``logprobs_fn``: ``(logprobs float32[B, T-1], logits float32[B, T-1, V])``, entry t
    of the logprobs scoring ``tokens[:, t + 1]`` under the sampling distribution
    (``token_logprobs``, the transformation the engine samples with). ``positions`` and
    ``segment_ids``: packed rows (see ``_next_token_logits``). With a ``value_head``
    also the values float32[B, T-1], entry t the value of the state that generates
    ``tokens[:, t + 1]``, from the same forward pass."""
    if value_head is None:
        logits = _next_token_logits(graphdef, params, tokens, positions, segment_ids)
    else:
        logits, hidden = _next_token_logits(
            graphdef, params, tokens, positions, segment_ids, with_hidden=True
        )
    logprobs = token_logprobs(
        logits, tokens[:, 1:], temperature=temperature, top_k=top_k, top_p=top_p
    )
    if value_head is None:
        return logprobs, logits
    return logprobs, logits, value_estimates(value_head, hidden)


def _all_finite(tree) -> jax.Array:
    """bool scalar: every float leaf of ``tree`` is finite (integer leaves always are)."""
    checks = [
        jnp.all(jnp.isfinite(x))
        for x in jax.tree.leaves(tree)
        if jnp.issubdtype(jnp.result_type(x), jnp.inexact)
    ]
    return jnp.all(jnp.stack(checks)) if checks else jnp.asarray(True)


def _apply_gradients(
    optimizer: optax.GradientTransformation, state: TrainState, grads: nnx.State
) -> TrainState:
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    return state.replace(
        params=optax.apply_updates(state.params, updates),
        opt_state=opt_state,
        step=state.step + 1,
    )


# ------------------------------------------------------------------ the policy update
# The update is composed of the pure pieces below, in the order the jitted program runs
# them (optax's transforms, RLlib's compute-loss / compute-gradients / apply seams):
# rewards -> targets and advantages -> micro-batches -> per micro-batch policy and value
# loss -> gradients summed over micro-batches -> optimizer apply -> non-finite guard.


def shaped_rewards(
    batch: Batch | PackedBatch, hp: RLHyperparams, num_rows: jax.Array
) -> tuple[jax.Array, Metrics]:
    """The rewards the advantages see: ``batch.rewards`` float32[N], plus DAPO's overlong
    penalty (Yu et al. 2025, arXiv:2503.14476; ``overlong_penalty``) when
    ``hp.overlong_buffer_tokens > 0``, over each trajectory's generated tokens (those
    with a policy version >= 0; in packed rows a segment sum by ``trajectory_index``).

    ``num_rows`` (float32 scalar) counts the real trajectories; rows past it are padding.
    Returns ``(rewards float32[N], metrics)``, metrics ``overlong_penalty_mean`` (over the
    real trajectories) with the penalty, else empty."""
    if hp.overlong_buffer_tokens <= 0:
        return batch.rewards, {}
    size = batch.rewards.shape[0]
    sampled = batch.policy_versions >= 0
    lengths = (
        jax.ops.segment_sum(
            sampled.reshape(-1).astype(jnp.int32),
            batch.trajectory_index.reshape(-1),
            num_segments=size,
        )
        if isinstance(batch, PackedBatch)
        else jnp.sum(sampled, axis=-1)
    )
    penalty = overlong_penalty(
        lengths, max_tokens=hp.overlong_max_tokens, buffer_tokens=hp.overlong_buffer_tokens
    )
    real = (jnp.arange(size) < num_rows).astype(jnp.float32)
    return batch.rewards + penalty, {"overlong_penalty_mean": jnp.sum(penalty * real) / num_rows}


def split_micro_batches(tree: Any, rows: int) -> Any:
    """Every leaf ``[R, ...]`` of ``tree`` as ``[R // rows, rows, ...]``: micro-batches of
    ``rows`` rows along a new leading axis. ``R`` must be a multiple of ``rows`` (the
    update pads or checks the batch before)."""
    return jax.tree.map(lambda x: x.reshape((x.shape[0] // rows, rows) + x.shape[1:]), tree)


def episode_advantage_targets(
    batch: Batch | PackedBatch, rewards: jax.Array, hp: RLHyperparams, num_rows: jax.Array
) -> tuple[dict[str, jax.Array], Metrics]:
    """Per-episode advantages by ``hp.advantage_estimator`` (``episode_advantages``:
    ``grpo``, ``rloo``, ``reinforce_pp``; each cites its source there) over the whole
    batch, failed members (``valid`` 0) left out of group statistics.

    Returns ``({"advantages": ...}, metrics)``: float32[N] per trajectory for a ``Batch``,
    or gathered to the tokens, float32[R, T-1], for a ``PackedBatch``; metrics
    ``advantage_abs_mean`` over the ``num_rows`` real trajectories."""
    size = batch.rewards.shape[0]
    advantages = episode_advantages(
        hp.advantage_estimator,
        rewards,
        batch.group_ids,
        size,
        valid=batch.valid,
        normalize_advantages_by_std=hp.normalize_advantages_by_std,
    )
    real = (jnp.arange(size) < num_rows).astype(jnp.float32)
    per_token = (
        advantages[batch.trajectory_index[:, 1:]] if isinstance(batch, PackedBatch) else advantages
    )
    return {"advantages": per_token}, {
        "advantage_abs_mean": jnp.sum(jnp.abs(advantages) * real) / num_rows
    }


def start_values(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    value_head: dict[str, jax.Array],
    inputs: dict[str, jax.Array],
    rows: int,
) -> jax.Array:
    """The value head's estimates at the batch's start, float32[R, T-1] (entry t the value
    of the state that generates ``tokens[:, t + 1]``), without gradient: one forward pass
    per micro-batch of ``rows`` rows. ``inputs``: ``tokens`` int32[R, T], and for packed
    rows ``positions`` and ``segment_ids``."""

    def values(mb):
        packing = {k: mb[k] for k in ("positions", "segment_ids") if k in mb}
        _, hidden = _next_token_logits(graphdef, params, mb["tokens"], **packing, with_hidden=True)
        return value_estimates(value_head, hidden)

    tokens = inputs["tokens"]
    old = jax.lax.stop_gradient(jax.lax.map(values, split_micro_batches(inputs, rows)))
    return old.reshape((tokens.shape[0], tokens.shape[1] - 1))


def gae_targets(
    batch: Batch | PackedBatch, rewards: jax.Array, old_values: jax.Array, hp: RLHyperparams
) -> tuple[dict[str, jax.Array], Metrics]:
    """PPO's targets by GAE (Schulman et al. 2016, arXiv:1506.02438; ``gae_advantages``,
    ``hp.gae_gamma`` / ``gae_lambda``): each episode's reward on its last generated token
    (``last_token_rewards``), chains per segment in packed rows, over the generated tokens
    of valid trajectories; whitened over them when ``hp.gae_normalize``.

    ``old_values`` float32[R, T-1] are ``start_values``. Returns the float32[R, T-1]
    arrays ``advantages``, ``old_values``, ``returns`` and ``value_mask`` (the tokens the
    value loss trains), and metrics ``return_mean``, ``advantage_abs_mean`` over them."""
    packed = isinstance(batch, PackedBatch)
    generated = batch.loss_mask[:, 1:]
    index = batch.trajectory_index[:, 1:] if packed else None
    valid = (batch.valid > 0).astype(jnp.float32)
    value_mask = generated * (valid[index] if packed else valid[:, None])
    advantages, returns = gae_advantages(
        last_token_rewards(rewards, value_mask, index),
        old_values,
        value_mask,
        gamma=hp.gae_gamma,
        lam=hp.gae_lambda,
        segment_ids=batch.segment_ids[:, 1:] if packed else None,
    )
    if hp.gae_normalize:
        advantages = whiten(advantages, value_mask)
    on = value_mask > 0
    tokens = jnp.maximum(jnp.sum(on), 1)
    return (
        {
            "advantages": advantages,
            "old_values": old_values,
            "returns": returns,
            "value_mask": value_mask,
        },
        {
            "return_mean": jnp.sum(jnp.where(on, returns, 0.0)) / tokens,
            "advantage_abs_mean": jnp.sum(jnp.abs(advantages) * on) / tokens,
        },
    )


def micro_batches(
    graphdef: nnx.GraphDef,
    state: TrainState,
    batch: Batch | PackedBatch,
    hp: RLHyperparams,
    num_rows: jax.Array,
    *,
    max_seq_len: int,
) -> tuple[dict[str, jax.Array], jax.Array, Metrics]:
    """Everything the loss reads, split into micro-batches of ``hp.micro_batch_size`` rows
    (0: one micro-batch): ``tokens``, ``generated`` (the loss mask past position 0),
    ``old`` (behaviour logprobs), ``weights`` and the ``denominator`` of the whole batch's
    ``loss_normalizer`` (``hp.loss_aggregation``; ``max_seq_len`` is Dr. GRPO's constant),
    ``positions`` / ``segment_ids`` for packed rows, and the targets of
    ``shaped_rewards`` then ``gae_targets`` or ``episode_advantage_targets``.

    Returns ``(micro-batches, denominator, metrics)``: every leaf ``[M, rows, ...]``."""
    packed = isinstance(batch, PackedBatch)
    generated = batch.loss_mask[:, 1:]
    # Packed rows: sequence-level sums go by trajectory (segment sums), not by row.
    seqs = (
        {"sequence_index": batch.trajectory_index[:, 1:], "num_sequences": batch.rewards.shape[0]}
        if packed
        else {}
    )
    rewards, extra = shaped_rewards(batch, hp, num_rows)
    weights, denominator = loss_normalizer(
        generated, aggregation=hp.loss_aggregation, max_tokens=max_seq_len, **seqs
    )
    rows = hp.micro_batch_size or batch.tokens.shape[0]
    mbs = {
        "tokens": batch.tokens,
        "generated": generated,
        "old": batch.logprobs[:, 1:],
        "weights": weights,
    }
    if packed:
        mbs.update(positions=batch.positions, segment_ids=batch.segment_ids)
    if hp.advantage_estimator == "gae":
        inputs = {k: v for k, v in mbs.items() if k in ("tokens", "positions", "segment_ids")}
        old_values = start_values(graphdef, policy_params(state), state.value_head, inputs, rows)
        targets, metrics = gae_targets(batch, rewards, old_values, hp)
    else:
        targets, metrics = episode_advantage_targets(batch, rewards, hp, num_rows)
    mbs.update(targets)
    return split_micro_batches(mbs, rows), denominator, {**extra, **metrics}


def packed_sequence_index(segment_ids: jax.Array) -> dict[str, Any]:
    """For a micro-batch of packed rows (``segment_ids`` int32[B, T-1], 0 = padding): the
    ``sequence_index`` int32[B, T-1] and ``num_sequences`` of the sequence-level loss
    sums, each (row, segment) one trajectory. The stride exceeds the most segments a row
    can hold, so indices never collide."""
    stride = segment_ids.shape[1] + 2
    return {
        "sequence_index": jnp.arange(segment_ids.shape[0])[:, None] * stride + segment_ids,
        "num_sequences": segment_ids.shape[0] * stride,
    }


def decoupled_importance_weights(
    prox: jax.Array,
    behaviour: jax.Array,
    mask: jax.Array,
    hp: RLHyperparams,
    *,
    with_kl: bool,
    seqs: dict[str, Any],
) -> tuple[jax.Array, jax.Array | None, dict[str, jax.Array]]:
    """Decoupled PPO's (Hilton et al. 2021, arXiv:2110.00641) constant weights from the
    proximal policy ``prox`` to the ``behaviour`` policy (both float32[B, T-1] logprobs):
    ``truncated_importance_weights`` at ``hp.importance_sampling`` capped at
    ``hp.importance_cap``, for the surrogate; token by token for the KL term (when
    ``with_kl``, else None), so that its gradient is KL(pi || pi_ref)'s.

    Returns ``(weights, kl_weights, aux)``, aux the weights' float32 scalar statistics.
    """
    weights, aux = truncated_importance_weights(
        prox, behaviour, mask, level=hp.importance_sampling, cap=hp.importance_cap, **seqs
    )
    kl_weights = None
    if with_kl:
        kl_weights = (
            weights
            if hp.importance_sampling == "token_tis"
            else truncated_importance_weights(
                prox, behaviour, mask, level="token_tis", cap=hp.importance_cap
            )[0]
        )
    return weights, kl_weights, aux


def token_sums(
    aux: dict[str, jax.Array], generated: jax.Array, out_of_support: jax.Array
) -> dict[str, jax.Array]:
    """A micro-batch's token means ``aux`` (with its ``num_tokens``) turned into token
    sums, so that micro-batches add up: ``mismatch_ratio_max`` stays a max; plus the
    counts of ``generated`` tokens (float[B, T-1] > 0) and of those ``out_of_support``
    (bool[B, T-1], logprob -inf under the current truncated sampling distribution)."""
    aux = dict(aux)
    tokens = aux.pop("num_tokens")
    sums = {k: v if k == "mismatch_ratio_max" else v * tokens for k, v in aux.items()}
    sums.update(
        num_tokens=tokens,
        generated=jnp.sum(generated > 0),
        out_of_support=jnp.sum((generated > 0) & out_of_support),
    )
    return sums


def policy_loss_terms(
    logprobs: jax.Array,
    logits: jax.Array,
    ref: jax.Array | None,
    mb: dict[str, jax.Array],
    denominator: jax.Array,
    anchor: tuple[jax.Array, jax.Array] | None,
    hp: RLHyperparams,
    *,
    max_seq_len: int,
    seqs: dict[str, Any],
) -> tuple[jax.Array, dict, Any]:
    """The policy loss of one micro-batch ``mb`` (``policy_gradient_loss``: ``hp.policy_loss``
    ppo_clip / GSPO / CISPO, clip, KL to ``ref``, entropy bonus), normalised by the whole
    batch's ``(mb["weights"], denominator)``, and token *sums* of its statistics.

    ``logprobs`` float32[B, T-1] and ``logits`` float32[B, T-1, V] are the current
    policy's scores (``_scored_tokens``); ``ref`` the reference's (floored at
    ``REF_LOGPROB_FLOOR``, no gradient) or None. A token outside the current truncated
    set (logprob -inf) leaves the loss, not the normaliser. ``anchor`` is None on the
    first iteration, else ``(proximal logprobs, support)`` kept from it: with
    ``decoupled_ppo`` (Hilton et al. 2021, arXiv:2110.00641) the ratio goes to the
    proximal policy, the behaviour policy entering through ``truncated_importance_weights``
    (the KL term's always token by token, so its gradient is KL(pi || pi_ref)'s).

    Returns ``(loss, sums, (prox, support))``; ``sums["mismatch_ratio_max"]`` is a max."""
    out_of_support = jnp.isneginf(jax.lax.stop_gradient(logprobs))  # NaN still propagates
    support = ~out_of_support if anchor is None else ~out_of_support & anchor[1]
    mask = jnp.where(support, mb["generated"], 0.0)
    logprobs = jnp.where(support, logprobs, 0.0)
    # The learner's logprobs at the batch's start: the proximal policy.
    prox = jax.lax.stop_gradient(logprobs) if anchor is None else anchor[0]
    decoupled = hp.off_policy_correction == "decoupled_ppo"
    weights, kl_weights = None, None
    weight_aux: dict[str, jax.Array] = {}
    if decoupled:
        weights, kl_weights, weight_aux = decoupled_importance_weights(
            prox, mb["old"], mask, hp, with_kl=ref is not None, seqs=seqs
        )
    sampling = {"temperature": hp.temperature, "top_k": hp.top_k, "top_p": hp.top_p}
    entropy = token_entropy(
        logits if hp.entropy_coef > 0 else jax.lax.stop_gradient(logits), **sampling
    )
    loss, aux = policy_gradient_loss(
        logprobs,
        prox if decoupled else mb["old"],
        mb["advantages"],
        mask,
        policy_loss=hp.policy_loss,
        clip_eps_low=hp.clip_eps_low,
        clip_eps_high=hp.clip_eps_high,
        dual_clip=hp.dual_clip,
        aggregation=hp.loss_aggregation,
        max_tokens=max_seq_len,
        ref_logprobs=ref,
        kl_coef=hp.kl_coef,
        kl_estimator=hp.kl_estimator,
        importance_weights=weights,
        kl_importance_weights=kl_weights,
        entropy=entropy if hp.entropy_coef > 0 else None,
        entropy_coef=hp.entropy_coef,
        normalizer=(mb["weights"], denominator),
        **seqs,
    )
    aux.update(
        weight_aux,
        **logprob_mismatch(prox, mb["old"], mask),
        entropy=masked_mean(jax.lax.stop_gradient(entropy), mask),
    )
    return loss, token_sums(aux, mb["generated"], out_of_support), (prox, support)


def value_loss_terms(
    values: jax.Array, mb: dict[str, jax.Array], denominator: jax.Array, hp: RLHyperparams
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """PPO's clipped value loss of one micro-batch (``clipped_value_loss``, Schulman et al.
    2017, arXiv:1707.06347, as in openai/baselines; ``hp.value_clip``), aggregated like the
    policy loss over ``mb["value_mask"]``. ``values`` float32[B, T-1] are the value head's
    current estimates; ``mb`` holds ``old_values``, ``returns`` (``gae_targets``).

    Returns ``(value_loss, sums)``, sums of ``value_loss``, ``value_clip_fraction``,
    ``value_mean`` and ``value_tokens`` over the micro-batch's trained tokens."""
    value_loss, clipped = clipped_value_loss(
        values,
        mb["old_values"],
        mb["returns"],
        mb["value_mask"],
        value_clip=hp.value_clip,
        normalizer=(mb["weights"], denominator),
    )
    on = mb["value_mask"] > 0
    return value_loss, {
        "value_loss": value_loss,
        "value_clip_fraction": jnp.sum(clipped).astype(jnp.float32),
        "value_mean": jnp.sum(jnp.where(on, jax.lax.stop_gradient(values), 0.0)),
        "value_tokens": jnp.sum(on).astype(jnp.float32),
    }


def micro_batch_loss(
    trainable: tuple[nnx.State, Any],
    ref_params: nnx.State | None,
    mb: dict[str, jax.Array],
    denominator: jax.Array,
    anchor: tuple[jax.Array, jax.Array] | None,
    *,
    graphdef: nnx.GraphDef,
    hp: RLHyperparams,
    max_seq_len: int,
    base: nnx.State | None = None,
    lora_scale: float = 0.0,
) -> tuple[jax.Array, tuple]:
    """The loss of one micro-batch (one row-slice of ``micro_batches``): one forward pass
    of the policy (and of the value head on its hidden state when ``trainable`` is
    ``(params, value_head)`` with a head), one of the reference when ``ref_params`` are
    given, then ``policy_loss_terms`` + ``hp.value_coef`` x ``value_loss_terms``.
    With a LoRA ``base``, ``trainable``'s params are the adapters, merged into it
    (``model_params``). Differentiable in ``trainable``; returns ``(loss, (sums, prox,
    support))``."""
    params, value_head = trainable
    params = model_params(params, base, lora_scale)
    packing = {k: mb[k] for k in ("positions", "segment_ids") if k in mb}
    seqs = packed_sequence_index(mb["segment_ids"][:, 1:]) if packing else {}
    sampling = {"temperature": hp.temperature, "top_k": hp.top_k, "top_p": hp.top_p}
    scored = _scored_tokens(
        graphdef, params, mb["tokens"], **sampling, **packing, value_head=value_head
    )
    ref = None
    if ref_params is not None:
        ref = _scored_tokens(graphdef, ref_params, mb["tokens"], **sampling, **packing)[0]
        ref = jax.lax.stop_gradient(jnp.maximum(ref, REF_LOGPROB_FLOOR))
    loss, sums, anchors = policy_loss_terms(
        scored[0], scored[1], ref, mb, denominator, anchor, hp, max_seq_len=max_seq_len, seqs=seqs
    )
    if value_head is not None:
        value_loss, value_sums = value_loss_terms(scored[-1], mb, denominator, hp)  # with a head
        loss = loss + hp.value_coef * value_loss
        sums.update(value_sums)
    sums["loss"] = loss
    return loss, (sums, *anchors)


def accumulate_gradients(
    grad_fn: Callable,
    trainable: Any,
    ref_params: nnx.State | None,
    mbs: dict[str, jax.Array],
    denominator: jax.Array,
    anchors: Any,
) -> tuple[Any, dict[str, jax.Array], jax.Array, jax.Array]:
    """Gradients and statistic sums over the micro-batches (the leading axis ``M`` of every
    leaf of ``mbs``): ``grad_fn(trainable, ref_params, mb, denominator, anchor)`` is
    ``jax.grad(micro_batch_loss, has_aux=True)``; each micro-batch is normalised by the
    whole batch's denominator, so the summed gradient is the whole batch's (gradient
    accumulation). ``sums`` add up, except ``mismatch_ratio_max``, a max.

    Returns ``(grads, sums, prox float32[M, rows, T-1], support bool[M, rows, T-1])``; one
    micro-batch runs without a ``lax.scan``."""
    first = jax.tree.map(lambda x: x[0], mbs)
    first_anchor = None if anchors is None else jax.tree.map(lambda x: x[0], anchors)
    if jax.tree.leaves(mbs)[0].shape[0] == 1:
        grads, (sums, prox, support) = grad_fn(
            trainable, ref_params, first, denominator, first_anchor
        )
        return grads, sums, prox[None], support[None]

    def accumulate(carry, xs):
        grads, sums = carry
        mb, anchor = xs
        g, (s, prox, support) = grad_fn(trainable, ref_params, mb, denominator, anchor)
        sums = {
            k: jnp.maximum(sums[k], v) if k == "mismatch_ratio_max" else sums[k] + v
            for k, v in s.items()
        }
        return (jax.tree.map(jnp.add, grads, g), sums), (prox, support)

    shapes = jax.eval_shape(grad_fn, trainable, ref_params, first, denominator, first_anchor)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), (shapes[0], shapes[1][0]))
    (grads, sums), (prox, support) = jax.lax.scan(accumulate, zeros, (mbs, anchors))
    return grads, sums, prox, support


_SUMMED = (
    "loss",
    "num_tokens",
    "generated",
    "out_of_support",
    "mismatch_ratio_max",
    "value_loss",
    "value_clip_fraction",
    "value_mean",
    "value_tokens",
)


def step_metrics(sums: dict[str, jax.Array], grads: Any, value_grads: Any) -> Metrics:
    """An optimizer step's metrics from ``accumulate_gradients``'s sums: token means of
    the per-token statistics, ``loss``, ``num_tokens``, ``mismatch_ratio_max``,
    ``grad_norm`` (global, before clipping), ``out_of_support_fraction``; with a value
    head (``value_grads`` not None) ``value_loss``, ``value_clip_fraction``,
    ``value_mean``, ``value_grad_norm``. All float32 scalars."""
    tokens = jnp.maximum(sums["num_tokens"], 1.0)
    metrics = {k: v / tokens for k, v in sums.items() if k not in _SUMMED}
    metrics.update(
        loss=sums["loss"],
        num_tokens=sums["num_tokens"],
        mismatch_ratio_max=sums["mismatch_ratio_max"],
        grad_norm=optax.tree.norm(grads),
        out_of_support_fraction=sums["out_of_support"] / jnp.maximum(sums["generated"], 1),
    )
    if value_grads is not None:
        value_tokens = jnp.maximum(sums["value_tokens"], 1.0)
        metrics.update(
            value_loss=sums["value_loss"],
            value_clip_fraction=sums["value_clip_fraction"] / value_tokens,
            value_mean=sums["value_mean"] / value_tokens,
            value_grad_norm=optax.tree.norm(value_grads),
        )
    return metrics


def apply_policy_gradients(
    optimizer: optax.GradientTransformation, state: TrainState, grads: nnx.State, value_grads: Any
) -> tuple[TrainState, jax.Array]:
    """One optimizer step: ``grads`` on ``state.params`` (the step counter +1) and, when
    ``value_grads`` is not None, the value head's own step with the same optimizer.
    Returns ``(new_state, finite)``, ``finite`` a bool scalar: every float leaf of the new
    params, optimizer states and value head is finite (``NONFINITE_PARTS``'s
    ``new_state``); the caller decides whether to keep it (``keep_if_finite``)."""
    new_state = _apply_gradients(optimizer, state, grads)
    if value_grads is not None:
        updates, value_opt_state = optimizer.update(
            value_grads, state.value_opt_state, state.value_head
        )
        new_state = new_state.replace(
            value_head=optax.apply_updates(state.value_head, updates),
            value_opt_state=value_opt_state,
        )
    return new_state, _all_finite(
        (new_state.params, new_state.opt_state, new_state.value_head, new_state.value_opt_state)
    )


def keep_if_finite(
    finite: dict[str, jax.Array], new: TrainState, start: TrainState
) -> tuple[TrainState, jax.Array]:
    """The non-finite guard: ``new`` when every check of ``finite`` (bool scalars keyed
    by ``NONFINITE_PARTS``) holds, else ``start`` bit for bit (params, optimizer moments,
    step), a select per leaf inside the jitted program. Returns ``(state, applied)``."""
    applied = finite["loss"] & finite["gradients"] & finite["new_state"]
    return jax.tree.map(lambda n, o: jnp.where(applied, n, o), new, start), applied


def optimizer_step(
    state: TrainState,
    ref_params: nnx.State | None,
    mbs: dict[str, jax.Array],
    denominator: jax.Array,
    anchors: Any,
    *,
    grad_fn: Callable,
    optimizer: optax.GradientTransformation,
    gae: bool,
) -> tuple[TrainState, Metrics, tuple[jax.Array, jax.Array]]:
    """compute-gradients then apply: ``accumulate_gradients`` over ``mbs``, then
    ``apply_policy_gradients``. Returns ``(new_state, metrics, (prox, support))``, the
    metrics of ``step_metrics`` plus bool ``finite_<part>`` for each of
    ``NONFINITE_PARTS`` (the new state is not yet checked against them)."""
    trainable = (state.params, state.value_head if gae else None)
    (grads, value_grads), sums, prox, support = accumulate_gradients(
        grad_fn, trainable, ref_params, mbs, denominator, anchors
    )
    metrics = step_metrics(sums, grads, value_grads if gae else None)
    new_state, finite_state = apply_policy_gradients(
        optimizer, state, grads, value_grads if gae else None
    )
    metrics.update(
        finite_loss=jnp.isfinite(sums["loss"]),
        finite_gradients=jnp.isfinite(metrics["grad_norm"])
        & (jnp.isfinite(metrics["value_grad_norm"]) if gae else True),
        finite_new_state=finite_state,
    )
    return new_state, metrics, (prox, support)


def iterate_and_guard(
    step: Callable, state: TrainState, num_iterations: int
) -> tuple[TrainState, Metrics]:
    """``num_iterations`` optimizer steps on one batch, ``step(state, anchors) -> (state,
    metrics, anchors)`` (``optimizer_step`` bound to its micro-batches): the first with
    ``anchors`` None, the later ones (a ``lax.scan``) anchored at the first's proximal
    logprobs and support. Then ``keep_if_finite`` over every iteration's checks.

    Returns ``(state, metrics)``: the first iteration's metrics, ``loss_last``,
    ``clip_fraction_last``, ``approx_kl_last`` with more than one iteration, and float32
    ``update_skipped``, ``update_nonfinite``, ``nonfinite_<part>`` (1 = not finite in some
    iteration)."""
    start = state
    state, metrics, anchors = step(state, None)
    finite = {k: metrics.pop(f"finite_{k}") for k in NONFINITE_PARTS}
    if num_iterations > 1:

        def iteration(state, _):
            state, m, _ = step(state, anchors)
            return state, {
                k: m[k]
                for k in (
                    "loss",
                    "clip_fraction",
                    "approx_kl",
                    *(f"finite_{p}" for p in NONFINITE_PARTS),
                )
            }

        state, later = jax.lax.scan(iteration, state, None, length=num_iterations - 1)
        finite = {k: v & jnp.all(later.pop(f"finite_{k}")) for k, v in finite.items()}
        metrics.update({f"{k}_last": v[-1] for k, v in later.items()})
    state, applied = keep_if_finite(finite, state, start)
    skipped = 1.0 - applied.astype(jnp.float32)
    metrics.update(
        update_skipped=skipped,
        update_nonfinite=skipped,
        **{f"nonfinite_{k}": 1.0 - v.astype(jnp.float32) for k, v in finite.items()},
    )
    return state, metrics


def _prepare_batch(
    batch: Batch | PackedBatch, hp: RLHyperparams, shards: int
) -> Batch | PackedBatch | None:
    """The host-side checks of a batch before the jitted update: its rewards finite, its
    rows a multiple of the micro-batch size and the mesh's batch shards (a padded
    ``Batch`` is padded here; a packed one must come so). None: the batch has no
    trainable token and is skipped. A traced batch (under an outer jit) is only checked
    for its row count; the caller checks the rest."""
    if isinstance(batch.rewards, jax.core.Tracer):
        if len(batch.tokens) % (hp.micro_batch_size or shards):
            raise ValueError(
                f"a traced batch of {len(batch.rewards)} rows must be a multiple "
                f"of micro_batch_size={hp.micro_batch_size} and of the mesh's "
                f"{shards} batch shards; pad it with Batch.pad_rows first."
            )
        return batch
    check_finite_rewards(batch.rewards)
    if not np.any(np.asarray(batch.loss_mask)[:, 1:] > 0):
        return None
    if isinstance(batch, PackedBatch):
        token_rows = len(batch.tokens)
        if token_rows % math.lcm(hp.micro_batch_size or 1, shards):
            raise ValueError(
                f"a packed batch of {token_rows} rows cannot be split into micro-batches of "
                f"{hp.micro_batch_size} rows over {shards} batch shards; pack it with "
                f"row_multiple={packed_row_multiple(hp.micro_batch_size, shards)}."
            )
        return batch
    if hp.micro_batch_size or shards > 1:
        return batch.pad_rows(hp.micro_batch_size or shards)
    return batch


def _placed_batch(
    batch: Batch | PackedBatch, num_rows: int, mesh: jax.sharding.Mesh | None
) -> tuple[Batch | PackedBatch, jax.Array | np.float32]:
    """The batch as device arrays (split by rows over ``mesh``) and its real row count,
    float32: what the jitted update takes."""
    if mesh is None or isinstance(batch.rewards, jax.core.Tracer):
        return jax.tree.map(jnp.asarray, batch), jnp.asarray(num_rows, jnp.float32)
    if isinstance(batch, PackedBatch):  # token rows split over the devices, the rest whole
        return PackedBatch(
            **{
                k: _replicated(v, mesh)
                if k in ("rewards", "group_ids", "valid")
                else place_rows(v, mesh)
                for k, v in batch._asdict().items()
            }
        ), np.float32(num_rows)
    # Global arrays, so that several processes can each pass their full copy.
    return place_batch(batch, mesh), np.float32(num_rows)


def _check_update_inputs(
    state: TrainState, ref_params: nnx.State | None, batch: Batch | PackedBatch, hp: RLHyperparams
) -> None:
    """Raises TypeError for a batch that is not a ``Batch`` / ``PackedBatch``, ValueError
    for GAE without a value head or ``kl_coef > 0`` without ``ref_params``."""
    if not isinstance(batch, (Batch, PackedBatch)):
        raise TypeError(
            f"the policy update takes a Batch or PackedBatch, got "
            f"{type(batch).__name__}; build it with Batch.from_record_batch "
            "(or PackedBatch.from_record_batch)."
        )
    if hp.advantage_estimator == "gae" and state.value_head is None:
        raise ValueError(
            "advantage_estimator='gae' needs a value head in the TrainState; "
            "add one with add_value_head(state, optimizer, d_model)."
        )
    if hp.kl_coef > 0 and ref_params is None:
        raise ValueError(
            f"kl_coef={hp.kl_coef} needs the reference policy's params; pass "
            "ref_params or set kl_coef=0."
        )


def micro_batch_shards(hp: RLHyperparams, mesh: jax.sharding.Mesh | None) -> int:
    """How many devices each micro-batch's rows are split over: the mesh's data x fsdp
    devices (``batch_shards``), 1 without a mesh.

    Raises:
      ValueError: a ``hp.micro_batch_size`` those devices do not divide.
    """
    shards = batch_shards(mesh) if mesh is not None else 1
    if hp.micro_batch_size % shards:
        raise ValueError(
            f"micro_batch_size={hp.micro_batch_size} cannot be split over the mesh's data x "
            f"fsdp = {shards} devices; set learner.micro_batch_size to a multiple of {shards} "
            "(or 0, the whole batch)."
        )
    return shards


def _rows_split_within_micro_batches(mbs: Any, mesh: jax.sharding.Mesh) -> Any:
    """Stacked micro-batches ``[M, rows, ...]`` constrained so that each micro-batch is
    split over the mesh's devices (its rows), not the micro-batches across them."""
    return jax.tree.map(
        lambda x: jax.lax.with_sharding_constraint(x, row_sharding(mesh, x.ndim, leading=1)),
        mbs,
    )


def skipped_update_metrics(batch: Batch | PackedBatch) -> dict[str, float]:
    """The metrics of an update skipped for a batch with no trainable token: the state is
    unchanged, ``update_skipped`` 1, ``num_tokens`` 0 and the batch's ``reward_mean``."""
    return {
        "update_skipped": 1.0,
        "num_tokens": 0.0,
        "reward_mean": float(np.mean(batch.rewards)),
    }


def _optimizer_step_of(
    loss: Callable, optimizer: optax.GradientTransformation, hp: RLHyperparams, base, lora_scale
) -> Callable:
    """``optimizer_step`` bound to the gradient of ``loss`` (``micro_batch_loss`` with its
    model and settings) in the trainable params, a LoRA ``base`` (or None) a constant."""
    grad_fn = jax.grad(functools.partial(loss, base=base, lora_scale=lora_scale), has_aux=True)
    return functools.partial(
        optimizer_step, grad_fn=grad_fn, optimizer=optimizer, gae=hp.advantage_estimator == "gae"
    )


def make_policy_update(
    graphdef: nnx.GraphDef,
    optimizer: optax.GradientTransformation,
    hp: RLHyperparams,
    *,
    max_seq_len: int,
    mesh: jax.sharding.Mesh | None = None,
) -> Callable[[TrainState, nnx.State | None, Batch], tuple[TrainState, Metrics]]:
    """Builds ``update(state, ref_params, batch) -> (state, metrics)``: the policy-gradient
    update of one ``Batch`` or ``PackedBatch`` (``hp.sequence_packing``; rows a multiple of
    ``packed_row_multiple``), as ``hp`` configures it: GRPO / RLOO / PPO with GAE
    (``advantage_estimator``), ppo_clip / GSPO / CISPO (``policy_loss``), decoupled PPO.

    Per batch, in one jitted program (each row count compiles once): ``micro_batches``
    (``shaped_rewards``, then ``gae_targets`` or ``episode_advantage_targets``, the
    normaliser), then ``iterate_and_guard``: ``hp.num_iterations`` times
    ``optimizer_step`` (``accumulate_gradients`` of ``micro_batch_loss`` =
    ``policy_loss_terms`` + ``value_loss_terms``, then ``apply_policy_gradients``), a
    non-finite update never applied (``keep_if_finite``). Tokens are scored under the
    rollout's sampling distribution (``hp.temperature``, ``top_k``, ``top_p``).

    A batch with no trainable token (checked on the host, for a concrete batch) is
    skipped: state unchanged, metrics ``update_skipped`` 1, ``num_tokens`` 0,
    ``reward_mean``. ``ref_params``: the reference policy's parameters for the KL penalty,
    or None when ``hp.kl_coef == 0``. A LoRA state (``create_train_state`` with
    ``hp.lora``) trains its adapters only; its ``base`` is the reference at no extra
    memory (pass ``state.base``). With a ``mesh``, ``state`` and ``ref_params`` come
    split by ``shard_train_state`` / ``shard_tree`` and the state goes back so; the rows
    are split over its data x fsdp devices (each micro-batch too), the result equal to
    the single-device one up to float32 rounding.

    Metrics (float32 scalars), of the first iteration: those of ``step_metrics`` and of
    ``policy_loss_terms`` (``clip_fraction``, ``approx_kl``, ``ratio_mean``, ``entropy``,
    ``mismatch_*``, ``kl_ref``, ``importance_*``), ``reward_mean``, those of
    ``micro_batches`` and of ``iterate_and_guard``.

    Raises:
      ValueError: here, for a setting of ``hp`` outside its choices or bad sampling
        settings (``hp.check``), or a ``micro_batch_size`` the mesh's data x fsdp devices
        do not divide; from ``update``, a non-finite reward, GAE without a value head,
        ``kl_coef > 0`` without ``ref_params``, or rows that do not split.
      TypeError: from ``update``, for a batch that is not a ``Batch``.
    """
    hp.check()
    shards = micro_batch_shards(hp, mesh)
    loss = functools.partial(micro_batch_loss, graphdef=graphdef, hp=hp, max_seq_len=max_seq_len)

    @jax.jit
    def _update(state, ref_params, batch, num_rows):
        mbs, denominator, extra = micro_batches(
            graphdef, state, batch, hp, num_rows, max_seq_len=max_seq_len
        )
        if mesh is not None:
            mbs = _rows_split_within_micro_batches(mbs, mesh)
        # A LoRA base is a constant of the loss, never in the optimizer or the guard's select.
        base, state = state.base, state.replace(base=None)
        step = _optimizer_step_of(loss, optimizer, hp, base, state.lora_scale)
        state, metrics = iterate_and_guard(
            lambda s, anchors: step(s, ref_params, mbs, denominator, anchors),
            state,
            hp.num_iterations,
        )
        state = state.replace(base=base)
        real = (jnp.arange(batch.rewards.shape[0]) < num_rows).astype(jnp.float32)
        metrics.update(extra, reward_mean=jnp.sum(batch.rewards * real) / num_rows)
        return (constrain(state, mesh) if mesh is not None else state), metrics

    def update(state: TrainState, ref_params: nnx.State | None, batch: Batch | PackedBatch):
        _check_update_inputs(state, ref_params, batch, hp)
        num_rows = len(batch.rewards)
        prepared = _prepare_batch(batch, hp, shards)
        if prepared is None:
            return state, skipped_update_metrics(batch)
        placed, rows = _placed_batch(prepared, num_rows, mesh)
        return _update(state, ref_params if hp.kl_coef > 0 else None, placed, rows)

    return update


def _replicated(array, mesh: jax.sharding.Mesh) -> jax.Array:
    """A host array (the same on every process) as a global array whole on every device."""
    host = np.asarray(array)
    whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.make_array_from_callback(host.shape, whole, lambda index: host[index])


def packed_row_multiple(micro_batch_size: int, shards: int = 1) -> int:
    """The row multiple a ``PackedBatch`` needs (``pack_batch``'s ``row_multiple``):
    ``ROW_MULTIPLE`` (8), the micro-batch size (rows) and the mesh's batch shards all
    divide it."""
    return math.lcm(ROW_MULTIPLE, micro_batch_size or 1, shards)


def make_sft_update(
    graphdef: nnx.GraphDef,
    optimizer: optax.GradientTransformation,
    *,
    mesh: jax.sharding.Mesh | None = None,
) -> Callable[[TrainState, jax.Array, jax.Array], tuple[TrainState, Metrics]]:
    """Builds jitted ``update(state, tokens, loss_mask, positions=None, segment_ids=None)
    -> (state, metrics)``: one supervised step on next-token NLL.

    Args of ``update``: ``tokens`` int32[B, T]; ``loss_mask`` float32[B, T], 1 where
    token t is a target (predicted from tokens 0..t-1); position 0 is never a target.
    Packed rows (``raytunix.learner.batch.pack_demonstrations``) also pass ``positions``
    and ``segment_ids`` int32[B, T]: a token attends only within its segment, and a
    segment's first token is never a target.

    Metrics (float32 scalars): ``loss`` (nats per target token), ``grad_norm`` (before
    clipping), ``num_tokens``, ``accuracy`` (argmax hits among targets), and
    ``update_nonfinite`` (1.0: the loss, the gradients or the new parameters or optimizer
    state were not finite, and ``state`` came back unchanged, as in the RL update's
    ``keep_if_finite``).

    With a ``mesh``, ``state`` is expected split by ``shard_train_state`` and comes back
    so; pass ``tokens`` and ``loss_mask`` placed by ``sharding.place_rows`` (B a multiple
    of the mesh's data x fsdp devices; rows with a zero mask change nothing).
    """

    @jax.jit
    def update(
        state: TrainState,
        tokens: jax.Array,
        loss_mask: jax.Array,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
    ):
        if mesh is not None:
            tokens, loss_mask, positions, segment_ids = (
                None if x is None else jax.lax.with_sharding_constraint(x, row_sharding(mesh, 2))
                for x in (tokens, loss_mask, positions, segment_ids)
            )

        # A LoRA base is a constant of the loss, never in the optimizer or the guard's select.
        base, state = state.base, state.replace(base=None)

        def loss_fn(params):
            params = model_params(params, base, state.lora_scale)
            logits = _next_token_logits(graphdef, params, tokens, positions, segment_ids)
            return sft_loss(logits, tokens[:, 1:], loss_mask[:, 1:])

        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        grad_norm = optax.tree.norm(grads)
        new_state = _apply_gradients(optimizer, state, grads)
        finite = {
            "loss": jnp.isfinite(loss),
            "gradients": jnp.isfinite(grad_norm),
            "new_state": _all_finite((new_state.params, new_state.opt_state)),
        }
        state, applied = keep_if_finite(finite, new_state, state)
        state = state.replace(base=base)
        metrics = {
            "loss": loss,
            "grad_norm": grad_norm,
            **aux,
            "update_nonfinite": 1.0 - applied.astype(jnp.float32),
        }
        return (constrain(state, mesh) if mesh is not None else state), metrics

    return update


def logprobs_fn(
    graphdef: nnx.GraphDef, *, temperature: float, top_k: int, top_p: float
) -> Callable[[nnx.State, jax.Array, jax.Array], jax.Array]:
    """Builds jitted ``fn(params, tokens, loss_mask) -> float32[B, T]``.

    Entry ``[b, t]`` is the log-probability (nats) of ``tokens[b, t]`` given the tokens
    before it under the sampling distribution of (``temperature``, ``top_k``, ``top_p``)
    — scored exactly as the policy update scores it — where ``loss_mask[b, t]`` is nonzero,
    and 0.0 elsewhere (always at position 0): the layout of behaviour logprobs in a
    ``Trajectory``. -inf marks a masked-in token outside the top-k/top-p set. Used for
    reference-policy logprobs and to recompute behaviour logprobs.

    Raises:
      ValueError: bad sampling settings (see ``make_policy_update``).
    """
    check_sampling_settings(temperature, top_k, top_p, allow_greedy=False)
    sampling = {"temperature": temperature, "top_k": top_k, "top_p": top_p}

    @jax.jit
    def fn(params, tokens, loss_mask):
        logprobs, _ = _scored_tokens(graphdef, params, tokens, **sampling)
        logprobs = jnp.where(loss_mask[:, 1:] > 0, logprobs, 0.0)
        return jnp.pad(logprobs, ((0, 0), (1, 0)))

    return fn


# The name before the update was split (it holds PPO and GAE settings too); kept so that
# code outside raytunix which imports it keeps working.
GRPOHyperparams = RLHyperparams
