"""The learner: owns the policy's weights, its optimizer and the policy version counter.

A plain class (no Ray): ``raytunix.learner.actor`` wraps it in an actor, alone or together
with an inference engine. Two phases share one model:

* warm start: supervised steps on demonstration tokens (``sft_steps``);
* RL: GRPO updates on trajectory batches (``train_step``), each bumping the version.

Each phase runs on the device mesh its hyperparameters name (``hp.mesh``, a
``raytunix.learner.sharding.MeshConfig``; the config's ``learner.mesh_*``): params and
optimizer state split by the partition rules, batches split by rows. The default, data
parallel over every device, is the plain single-device update on one device.
"""

from __future__ import annotations

import math
import threading
import time
import uuid
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pyarrow as pa

from raytunix.learner.batch import (
    Batch,
    PackedBatch,
    generated_tokens_cut,
    pack_demonstrations,
    widest_packed_row,
)
from raytunix.learner.checkpoint import Checkpointer
from raytunix.learner.sharding import (
    batch_shards,
    gather_to_host,
    place_rows,
    shard_tree,
)
from raytunix.learner.train_state import (
    RLHyperparams,
    SFTHyperparams,
    TrainState,
    add_value_head,
    create_train_state,
    make_optimizer_from,
    make_policy_update,
    make_sft_update,
    packed_row_multiple,
    policy_params,
)
from raytunix.learner.lora import LoraSpec, PublishedAdapters
from raytunix.models.llama import ModelConfig, cast_params, init_model

__all__ = ["Learner", "RLHyperparams", "SFTHyperparams"]

# A warm-start step's packed rows come in multiples of this (or of its batch size, if
# smaller): 32 demonstrations of the default task pack into 16 or 20 rows, two programs.
SFT_ROW_MULTIPLE = 4


def update_arrays(
    batch: pa.RecordBatch,
    hp: RLHyperparams,
    *,
    pad_id: int,
    max_seq_len: int,
    mesh: jax.sharding.Mesh | None,
) -> tuple[Batch | PackedBatch, int]:
    """A trajectory batch as the update's arrays, and the widest row they can have.

    Padded to one of a few widths (``raytunix.learner.batch.padding_buckets`` of
    ``max_seq_len``) as a ``Batch``; with ``hp.sequence_packing`` packed into rows of at
    most ``hp.pack_width`` tokens (``PackedBatch``; the row count a multiple of
    ``packed_row_multiple`` of the micro-batch size and the mesh's batch shards), the width
    then ``widest_packed_row``.
    """
    if not hp.sequence_packing:
        arrays = Batch.from_record_batch(batch, pad_id=pad_id, max_seq_len=max_seq_len)
        return arrays, max_seq_len
    packed = PackedBatch.from_record_batch(
        batch,
        pad_id=pad_id,
        max_seq_len=max_seq_len,
        pack_width=hp.pack_width,
        row_multiple=packed_row_multiple(hp.micro_batch_size, batch_shards(mesh)),
    )
    return packed, widest_packed_row(hp.pack_width, max_seq_len)


class Learner:
    """Policy weights, optimizer state and the version counter.

    Args:
      model_config: the model to build.
      seed: model init and the learner's PRNG.
      pad_id: token id used to pad batches.
      model: ``(graphdef, params)`` of ``model_config`` to start from (a Hugging Face
        checkpoint's, ``raytunix.models.hf.load_weights``); None: ``init_model`` with
        ``seed``.
    """

    def __init__(
        self,
        model_config: ModelConfig,
        seed: int = 0,
        pad_id: int = 0,
        model: tuple[Any, Any] | None = None,
    ):
        self.model_config = model_config
        self.seed = seed
        self.pad_id = pad_id
        self.graphdef, params = model if model is not None else init_model(model_config, seed)
        self.version = 0
        self.rl_step = 0
        self._params = params
        self._state: TrainState | None = None
        # The update runs in a worker thread while engines ask for weights on the actor's
        # loop: parameters and their policy version change together under this lock.
        self._policy_lock = threading.Lock()
        self._update = None
        self._ref_params = None
        self._hp: RLHyperparams | None = None
        self.updates_skipped = 0
        self.updates_skipped_nonfinite = 0
        self.nonfinite_updates_in_a_row = 0
        self.sft_nonfinite_in_a_row = 0
        self._sft_rng = np.random.default_rng(seed)
        self.mesh: jax.sharding.Mesh | None = None
        # Names the current LoRA base ("" without one): engines refetch it when it changes.
        self.base_id = ""

    @property
    def params(self):
        """The current model parameters (an ``nnx.State`` of jax arrays; split over
        ``mesh`` once a phase has started); with LoRA the base with the adapters merged
        in (``policy_params``)."""
        return policy_params(self._state) if self._state is not None else self._params

    def _fresh_state(self, optimizer, mesh_config, lora: LoraSpec) -> TrainState:
        """A new ``TrainState`` for the current params on the mesh of ``mesh_config``
        (``self.mesh``), params placed before the optimizer state is made from them; with
        ``lora`` enabled they are its frozen base, fresh adapters trained over them (a
        warm start's adapters are merged in first)."""
        self.mesh = mesh_config.build()
        params = shard_tree(self.params, self.mesh)
        self.base_id = uuid.uuid4().hex if lora.enabled else ""
        return shard_tree(
            create_train_state(self.graphdef, params, optimizer, self.seed, lora), self.mesh
        )

    def _saved(self) -> TrainState:
        """What a checkpoint holds: the state without a LoRA base (the base is the model
        the phase started from, rebuilt by the run, never changed by it)."""
        state: Any = self._state  # flax's replace is not visible to mypy
        return state.replace(base=None)

    def _restored(self, checkpointer: Checkpointer, step: int | None, **kw) -> tuple[Any, dict]:
        """``checkpointer.restore`` into the current state (``_saved``'s form), the LoRA
        base and scale put back."""
        current: Any = self._state
        restored: tuple[Any, dict] = checkpointer.restore(step, self._saved(), **kw)
        state, extras = restored
        # The checkpoint rebuilds a TrainState without its static lora_scale.
        return state.replace(base=current.base, lora_scale=current.lora_scale), extras

    # ------------------------------------------------------------------ warm start
    def start_warmup(self, hp: SFTHyperparams) -> None:
        """A fresh optimizer for supervised steps (``sft_steps``), as ``hp`` says."""
        optimizer = hp.optimizer()
        self._state = self._fresh_state(optimizer, hp.mesh, hp.lora)
        # No buffer donation: a colocated engine may still hold the previous params.
        self._update = jax.jit(make_sft_update(self.graphdef, optimizer, mesh=self.mesh))

    def sft_steps(
        self, tokens: np.ndarray, loss_mask: np.ndarray, num_steps: int, batch_size: int
    ) -> dict[str, float]:
        """Runs ``num_steps`` supervised steps on random rows of the demonstrations.

        Args:
          tokens: int32[N, T] demonstration tokens (right-padded).
          loss_mask: float32[N, T], 1 on the tokens to learn (the assistant's).
          batch_size: demonstrations per step, drawn with replacement; packed several
            to a row (``pack_demonstrations``: the same loss, about half the rows) and
            padded with empty rows to a multiple of the mesh's data x fsdp devices.
        Returns: mean ``loss`` over the steps, ``loss_last``, ``steps_per_s``,
        ``updates_skipped_nonfinite`` (steps of this call not applied because something was
        not finite: ``make_sft_update``'s ``update_nonfinite``) and
        ``nonfinite_updates_in_a_row`` (such steps ending this call, across calls).
        """
        if self._update is None:
            raise RuntimeError("call start_warmup before sft_steps")
        if len(tokens) == 0 or batch_size < 1:
            raise ValueError(
                f"sft_steps needs demonstrations (got {len(tokens)}) and "
                f"batch_size >= 1 (got {batch_size!r})."
            )
        t0 = time.monotonic()
        losses, skipped = [], []
        # Few packed row counts (each compiles once), rows split evenly over the devices.
        multiple = math.lcm(batch_shards(self.mesh), min(SFT_ROW_MULTIPLE, batch_size))
        for _ in range(num_steps):
            rows = self._sft_rng.integers(0, len(tokens), size=batch_size)
            packed = pack_demonstrations(tokens[rows], loss_mask[rows], row_multiple=multiple)
            self._state, metrics = self._update(
                self._state,
                *(
                    place_rows(packed[key], self.mesh)
                    for key in ("tokens", "loss_mask", "positions", "segment_ids")
                ),
            )
            losses.append(metrics["loss"])
            skipped.append(metrics["update_nonfinite"])
        # One transfer for the chunk's metrics, not one per step.
        losses, skipped = (
            np.asarray(x, dtype=np.float64) for x in jax.device_get((losses, skipped))
        )
        for flag in skipped:
            self.sft_nonfinite_in_a_row = self.sft_nonfinite_in_a_row + 1 if flag else 0
        return {
            "loss": float(np.mean(losses)),
            "loss_last": float(losses[-1]),
            "steps_per_s": num_steps / (time.monotonic() - t0),
            "updates_skipped_nonfinite": float(np.sum(skipped)),
            "nonfinite_updates_in_a_row": self.sft_nonfinite_in_a_row,
        }

    # ------------------------------------------------------------------ RL
    def start_rl(self, hp: RLHyperparams) -> None:
        """Fresh optimizer for RL; the current weights become the KL reference if used.

        Raises:
          ValueError: a setting of ``hp`` outside its allowed values (``hp.check``), among
            them sampling settings that cannot be scored finitely or sample greedily with
            this model's vocabulary.
        """
        hp.check(vocab_size=self.model_config.vocab_size)
        optimizer = make_optimizer_from(hp)
        self._hp = hp
        self._state = self._fresh_state(optimizer, hp.mesh, hp.lora)
        if hp.advantage_estimator == "gae":  # PPO's value head, beside the policy's params
            self._state = shard_tree(
                add_value_head(self._state, optimizer, self.model_config.d_model), self.mesh
            )
        self._ref_params = None
        if hp.kl_coef > 0:  # LoRA's frozen base is the reference, no copy needed
            base = self._state.base
            self._ref_params = (
                base
                if base is not None
                else shard_tree(jax.tree.map(jnp.copy, self.params), self.mesh)
            )
        # Jitted inside; the host part checks rewards, skips empty batches, pads rows.
        self._update = make_policy_update(
            self.graphdef, optimizer, hp, max_seq_len=self.model_config.max_seq_len, mesh=self.mesh
        )

    def train_step(self, batch: pa.RecordBatch) -> dict[str, float]:
        """One update on a trajectory batch (``hp.num_iterations`` optimizer steps); bumps
        the policy version, unless the batch has no trainable token or the update is not
        finite (its loss, gradients or new parameters; ``make_policy_update``): then nothing
        changes but ``rl_step``, and ``updates_skipped`` counts it (the non-finite ones
        also ``updates_skipped_nonfinite``, and ``nonfinite_updates_in_a_row`` until an
        update is applied; the driver stops the run at
        ``learner.max_consecutive_nonfinite_updates``).

        The batch is padded to one of a few widths (``raytunix.learner.batch.
        padding_buckets`` of the model's context), so the update compiles a few times;
        with ``hp.sequence_packing`` its trajectories are packed into rows of at most
        ``hp.pack_width`` tokens instead (``PackedBatch``, ``packed_width``; the row count
        rounded up to a multiple of 8, of the micro-batch size and of the mesh's batch
        shards).

        Returns the update's metrics (see ``make_policy_update``; among them the
        engine-learner logprob mismatch ``mismatch_*`` and ``update_skipped``) as floats,
        plus ``update_s`` (seconds), ``policy_version``, ``updates_skipped``,
        ``updates_skipped_nonfinite`` (so far), ``nonfinite_updates_in_a_row``,
        ``staleness_max`` (versions between the oldest trained token and the update),
        ``batch_tokens`` (padded) and ``generated_tokens_dropped_seq_len`` /
        ``_first_position`` (generated tokens the rows cannot train on:
        ``raytunix.learner.batch.generated_tokens_cut``).

        Raises:
          RuntimeError: before ``start_rl``.
          ValueError: a non-finite reward in the batch.
        """
        if self._hp is None:
            raise RuntimeError("call start_rl before train_step")
        arrays, width = update_arrays(
            batch,
            self._hp,
            pad_id=self.pad_id,
            max_seq_len=self.model_config.max_seq_len,
            mesh=self.mesh,
        )
        dropped = generated_tokens_cut(batch, width)
        versions = arrays.policy_versions[arrays.loss_mask > 0]
        t0 = time.monotonic()
        state, metrics = self._update(self._state, self._ref_params, arrays)
        metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
        skipped = metrics["update_skipped"] > 0
        nonfinite = metrics.get("update_nonfinite", 0.0) > 0
        with self._policy_lock:
            self._state = state
            self.version += 0 if skipped else 1
        self.updates_skipped += int(skipped)
        self.updates_skipped_nonfinite += int(nonfinite)
        if nonfinite:
            self.nonfinite_updates_in_a_row += 1
        elif not skipped:  # a batch with nothing to train on neither breaks nor extends a run
            self.nonfinite_updates_in_a_row = 0
        self.rl_step += 1
        metrics["update_s"] = time.monotonic() - t0
        metrics["policy_version"] = self.version
        metrics["updates_skipped"] = self.updates_skipped
        metrics["updates_skipped_nonfinite"] = self.updates_skipped_nonfinite
        metrics["nonfinite_updates_in_a_row"] = self.nonfinite_updates_in_a_row
        metrics["staleness_max"] = (
            float(self.version - 1 - versions.min()) if versions.size else 0.0
        )
        metrics["batch_tokens"] = int(arrays.tokens.size)
        metrics.update({f"generated_tokens_dropped_{k}": v for k, v in dropped.items()})
        # Tokens the learner's sampling transform gives probability 0 leave the loss too.
        scored = int(np.count_nonzero(np.asarray(arrays.loss_mask)[:, 1:]))
        metrics["generated_tokens_dropped_out_of_support"] = int(
            round(metrics.get("out_of_support_fraction", 0.0) * scored)
        )
        return metrics

    def policy(self) -> tuple[Any, int]:
        """``(params, policy_version)`` read together, the parameters those of that version
        even while an update runs in another thread, in the model's compute dtype
        (``model_config.dtype``): what an engine is given."""
        with self._policy_lock:
            return cast_params(self.params, self.model_config.dtype), self.version

    def weights_numpy(self, master: bool = False):
        """The parameters as a pytree of full numpy arrays: in the compute dtype, what is
        shipped to engine actors, or with ``master`` the float32 master weights (what
        checkpoints hold and an export writes). With a mesh over several processes, every
        process must call it (``sharding.gather_to_host``)."""
        params = self.params if master else cast_params(self.params, self.model_config.dtype)
        return gather_to_host(params)

    def adapters_numpy(self) -> dict[str, dict[str, Any]]:
        """The LoRA adapters as full float32 numpy arrays, ``{layer path: {"lora_A":
        [rank, d_in], "lora_B": [d_out, rank]}}`` (``raytunix.learner.lora``); every
        process of a mesh must call it (``sharding.gather_to_host``).

        Raises:
          RuntimeError: the learner trains the whole model (``learner.lora_rank=0``), or no
            phase has started.
        """
        state, _, _ = self._lora_state("adapters", "export its weights with export_checkpoint")
        return gather_to_host(state.params)

    def versioned_weights_numpy(self) -> tuple[Any, int]:
        """``(weights_numpy(), policy_version)`` of one and the same update (``policy``)."""
        params, version = self.policy()
        return gather_to_host(params), version

    @property
    def has_adapters(self) -> bool:
        """Whether the current phase trains LoRA adapters over a frozen base."""
        return self._state is not None and self._state.base is not None

    def versioned_adapters_numpy(self) -> PublishedAdapters:
        """The adapters of one policy version, float32 numpy (``adapters_numpy``'s
        layout), with the scale and the base's id: what a LoRA learner publishes to an
        engine in another process, which merges them onto ``base_weights_numpy()``. Every
        process of a mesh must call it.

        Raises:
          RuntimeError: no LoRA adapters (``has_adapters`` is False).
        """
        state, version, base_id = self._lora_state(
            "adapters to publish", "publish its whole weights (versioned_weights_numpy)"
        )
        return PublishedAdapters(gather_to_host(state.params), state.lora_scale, version, base_id)

    def base_weights_numpy(self) -> tuple[str, Any]:
        """``(base_id, base)``: the frozen LoRA base the adapters are merged onto, as full
        numpy arrays in the compute dtype (``model_config.dtype``; the params' tree). An
        engine fetches it once per base, not per version. Every process of a mesh must
        call it.

        Raises:
          RuntimeError: no LoRA base (``has_adapters`` is False).
        """
        state, _, base_id = self._lora_state(
            "base", "engines take its whole weights (versioned_weights_numpy)"
        )
        return base_id, gather_to_host(cast_params(state.base, self.model_config.dtype))

    def _lora_state(self, missing: str, instead: str) -> tuple[TrainState, int, str]:
        """``(state, policy version, base_id)`` of one and the same update, for a phase
        that trains LoRA adapters.

        Raises:
          RuntimeError: no LoRA adapters (``has_adapters`` is False); the message names
            what is ``missing`` and ends with ``instead``, what to do without it.
        """
        with self._policy_lock:
            state, version, base_id = self._state, self.version, self.base_id
        if state is None or state.base is None:
            raise RuntimeError(
                f"this learner has no LoRA {missing} (learner.lora_rank=0 trains the whole "
                f"model, or no phase has started); {instead}."
            )
        return state, version, base_id

    # ------------------------------------------------------------------ checkpoints
    def save(
        self,
        checkpointer: Checkpointer,
        extras: dict[str, Any],
        metrics: dict[str, float] | None = None,
    ) -> None:
        """Starts saving params, optimizer state, step and RNG with ``extras`` (data
        position...) as checkpoint ``rl_step``; asynchronous (``Checkpointer.save``), so
        the next ``train_step`` may run while it is written. ``metrics``: for
        ``Checkpointer``'s ``keep_best_by``."""
        extras = dict(
            extras,
            policy_version=self.version,
            rl_step=self.rl_step,
            updates_skipped=self.updates_skipped,
            updates_skipped_nonfinite=self.updates_skipped_nonfinite,
        )
        checkpointer.save(self.rl_step, self._saved(), extras, metrics)

    def save_warmup(self, checkpointer: Checkpointer, steps: int, extras: dict[str, Any]) -> None:
        """Starts saving the warm start's state after ``steps`` supervised steps as
        checkpoint ``steps`` (asynchronous, ``Checkpointer.save``): params, the SFT
        optimizer state, step and RNG, with ``extras`` and the demonstration-row sampler's
        state, so a resumed warm start (``restore_warmup``) draws the rows it would have.

        Raises:
          RuntimeError: before ``start_warmup``.
          ValueError: checkpoint ``steps`` already exists.
        """
        if self._state is None or self._hp is not None:
            raise RuntimeError("save_warmup is for the warm start: call start_warmup first")
        extras = dict(extras, sft_rows_rng=self._sft_rng.bit_generator.state)
        checkpointer.save(steps, self._saved(), extras)

    def restore_warmup(self, checkpointer: Checkpointer) -> dict[str, Any] | None:
        """Restores the newest warm-start checkpoint (``save_warmup``) into the SFT state
        ``start_warmup`` made; returns its extras, or None when ``checkpointer`` has none
        (nothing changes then).

        Raises:
          RuntimeError: before ``start_warmup``, or no checkpoint could be restored.
        """
        if self._state is None or self._hp is not None:
            raise RuntimeError("restore_warmup is for the warm start: call start_warmup first")
        if checkpointer.latest_step() is None:
            return None
        self._state, extras = self._restored(checkpointer, None)
        self._sft_rng.bit_generator.state = extras.pop("sft_rows_rng")
        return extras

    def save_reference(self, checkpointer: Checkpointer) -> None:
        """Saves the KL reference policy (the weights at ``start_rl``) once, so that a
        resumed run penalizes KL to the same policy. No-op without a KL penalty, and with
        LoRA, whose reference is the frozen base the run rebuilds."""
        if self._state is not None and self._state.base is not None:
            return
        if self._ref_params is not None and checkpointer.latest_step() is None:
            checkpointer.save(0, self._state.replace(params=self._ref_params), {"reference": True})
            checkpointer.wait_until_finished()

    def restore(
        self,
        checkpointer: Checkpointer,
        step: int | None = None,
        reference: Checkpointer | None = None,
        among: list[int] | None = None,
    ) -> dict[str, Any]:
        """Restores the latest (or ``step``) checkpoint into the RL state; returns extras.
        ``among``: only these steps are candidates (a learner group's steps that every
        host can read; ``Checkpointer.restore``).

        Raises:
          RuntimeError: before ``start_rl``, or a KL penalty is on and ``reference`` holds
            no reference policy.
        """
        if self._hp is None:
            raise RuntimeError("call start_rl (with the run's hyperparameters) before restore")
        state, extras = self._restored(checkpointer, step, among=among)
        with self._policy_lock:
            self._state = state
            self.version = int(extras["policy_version"])
        self.rl_step = int(extras["rl_step"])
        self.updates_skipped = int(extras.get("updates_skipped", 0))
        self.updates_skipped_nonfinite = int(extras.get("updates_skipped_nonfinite", 0))
        if self._hp.kl_coef > 0 and state.base is not None:
            self._ref_params = state.base
        elif self._hp.kl_coef > 0:
            if reference is None or reference.latest_step() is None:
                raise RuntimeError(
                    "learner.kl_coef > 0 but the run has no saved reference policy; resume "
                    "with learner.kl_coef=0 or start a new run."
                )
            self._ref_params = reference.restore(0, self._state)[0].params
        return extras
