"""Ray actors around the learner: alone (``LearnerActor``), or colocated with an inference
engine in one process (``PolicyActor``), which is what small runs on a few CPU cores want:
one JAX process, weights handed to the engine by reference, no copies.

Device work (updates, decode steps) runs in worker threads so the actor's event loop keeps
accepting generation requests while an update is computed.

This module imports no JAX: Ray imports an actor's module in every process that receives
a handle to it (the orchestrator holds the engines', env actors none), so the learner's
stack loads where the actor runs, in the methods that use it.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from raytunix import profiling
from raytunix.cluster import heap

if TYPE_CHECKING:
    from raytunix.learner.checkpoint import Checkpointer
    from raytunix.learner.learner import RLHyperparams, SFTHyperparams
    from raytunix.learner.lora import PublishedAdapters
    from raytunix.models.llama import ModelConfig

logger = logging.getLogger(__name__)


class LearnerActor(profiling.ProfiledActor):
    """The learner as an actor (run with ``ray.remote``); the only writer of weights and of
    the policy version.

    ``model_path``: a Hugging Face model folder to start from (read where the actor runs,
    with ``raytunix.models.hf.load_weights``); "" for a fresh model of ``model_config``.
    """

    def __init__(
        self,
        model_config: ModelConfig,
        seed: int,
        pad_id: int,
        model_path: str = "",
        init_from: str = "",
    ):
        from raytunix.learner.learner import Learner

        profiling.configure("learner", "learner")
        self.model_path = model_path
        model = _load(model_path, model_config, init_from, seed)
        self.learner = Learner(model_config, seed=seed, pad_id=pad_id, model=model)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="learner")
        self._demos = None
        self._checkpointers: dict[str, Checkpointer] = {}
        # The model is built: out of the garbage collector's scans (young collections as
        # Python sets them: a cycle here can hold a batch or parameters).
        heap.settle(young_threshold=None)

    async def _in_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _publish(self) -> None:
        """Hook: colocated actors hand the new weights to their engine."""

    def _checkpointer(
        self,
        directory: str,
        max_to_keep: int = 3,
        keep_best_by: str = "",
        keep_best_mode: str = "max",
    ) -> Checkpointer:
        from raytunix.learner.checkpoint import Checkpointer

        if directory not in self._checkpointers:
            self._checkpointers[directory] = Checkpointer(
                directory,
                max_to_keep=max_to_keep,
                keep_best_by=keep_best_by,
                keep_best_mode=keep_best_mode,
            )
        return self._checkpointers[directory]

    # warm start -------------------------------------------------------------------------
    def set_demonstrations(self, tokens, loss_mask) -> int:
        self._demos = (tokens, loss_mask)
        return len(tokens)

    def start_warmup(self, hp: SFTHyperparams) -> None:
        self.learner.start_warmup(hp)

    async def sft_steps(self, num_steps: int, batch_size: int) -> dict[str, float]:
        if self._demos is None:
            raise RuntimeError("set_demonstrations must come before sft_steps")
        with profiling.span("sft_update", "learner", {"steps": num_steps}):
            metrics = await self._in_thread(
                self.learner.sft_steps, *self._demos, num_steps, batch_size
            )
        self._publish_timed()
        return metrics

    # RL ----------------------------------------------------------------------------------
    def start_rl(self, hp: RLHyperparams) -> None:
        self.learner.start_rl(hp)

    async def train_step(self, batch_refs: list) -> dict[str, float]:
        """One GRPO update on the batch behind ``batch_refs[0]`` (an ObjectRef in a list,
        so that Ray hands the reference over instead of the data)."""
        with profiling.span("object_store_get", "learner"):
            batch = await batch_refs[0]
        with profiling.span("update", "learner", {"trajectories": batch.num_rows}) as args:
            metrics = await self._in_thread(self.learner.train_step, batch)
            args["policy_version"] = metrics.get("policy_version")
        self._publish_timed()
        return metrics

    def _publish_timed(self) -> None:
        with profiling.span("weight_publish", "learner", {"version": self.learner.version}):
            self._publish()

    def weights(self, whole: bool = False) -> tuple[Any, int] | PublishedAdapters:
        """What a weight publish ships to engines in other processes: ``(numpy parameter
        pytree in the compute dtype, policy version)``, or under LoRA only the adapters
        (``PublishedAdapters``, float32), which an engine merges onto ``base_weights()``.
        ``whole``: the merged parameters even under LoRA."""
        from raytunix.learner.sharding import tree_nbytes

        with profiling.span("weights_to_host", "learner", {"version": self.learner.version}) as a:
            if self.learner.has_adapters and not whole:
                adapters = self.learner.versioned_adapters_numpy()
                a["bytes"] = adapters.nbytes
                return adapters
            params, version = self.learner.versioned_weights_numpy()
            a["bytes"] = tree_nbytes(params)
            return params, version

    def base_weights(self) -> tuple[str, Any]:
        """``(base_id, numpy base pytree in the compute dtype)``: the frozen LoRA base an
        engine merges published adapters onto (``Learner.base_weights_numpy``); fetched
        once per base.

        Raises:
          RuntimeError: the learner trains no LoRA adapters.
        """
        from raytunix.learner.sharding import tree_nbytes

        with profiling.span("weights_to_host", "learner", {"base": True}) as args:
            base_id, base = self.learner.base_weights_numpy()
            args["bytes"] = tree_nbytes(base)
            return base_id, base

    def policy_version(self) -> int:
        return self.learner.version

    def device_count(self) -> int:
        """The devices the learner's mesh spans (``jax.device_count()``: every process's,
        in a multi-host group)."""
        import jax

        return jax.device_count()

    async def export(self, out_dir: str) -> list[str]:
        """Writes the current policy to ``out_dir`` as a Hugging Face model folder (with
        the tokenizer files of the folder the model came from, if any); returns the file
        names (``raytunix.models.hf.export_checkpoint``)."""
        from raytunix.models.hf import export_checkpoint

        return await self._in_thread(
            lambda: export_checkpoint(
                out_dir,
                self.learner.model_config,
                self.learner.params,
                source=self.model_path or None,
            )
        )

    # Whether this process writes exports: in a multi-host group, rank 0 alone.
    writes_exports = True

    async def export_adapters(self, out_dir: str, alpha: float) -> list[str]:
        """Writes the LoRA adapters to ``out_dir`` as a ``peft`` folder over ``model_path``
        (``raytunix.models.hf.export_adapters``); returns the file names ([] where
        ``writes_exports`` is False: every host of a group gathers, rank 0 writes).

        Raises:
          RuntimeError: the learner has no adapters (``Learner.adapters_numpy``).
        """
        from raytunix.models.hf import export_adapters

        adapters = await self._in_thread(self.learner.adapters_numpy)
        if not self.writes_exports:
            return []
        return await self._in_thread(
            lambda: export_adapters(out_dir, adapters, alpha=alpha, base_model=self.model_path)
        )

    # checkpoints ------------------------------------------------------------------------------
    async def save(
        self,
        directory: str,
        extras: dict[str, Any],
        max_to_keep: int = 3,
        metrics: dict[str, float] | None = None,
        keep_best_by: str = "",
        keep_best_mode: str = "max",
    ) -> int:
        """Starts checkpoint ``rl_step`` (returned) in ``directory`` and returns once its
        arrays are copied: the files are written while the next updates run. The save
        before it is committed by then (``Checkpointer.save``)."""
        ckpt = self._checkpointer(directory, max_to_keep, keep_best_by, keep_best_mode)
        with profiling.span("checkpoint", "learner", {"rl_step": self.learner.rl_step}):
            await self._in_thread(self.learner.save, ckpt, extras, metrics)
        return self.learner.rl_step

    async def finish_checkpoints(self) -> None:
        """Returns once every checkpoint save in flight is committed on disk."""
        for ckpt in list(self._checkpointers.values()):
            await self._in_thread(ckpt.wait_until_finished)

    async def save_warmup(self, directory: str, steps: int, extras: dict[str, Any]) -> None:
        """Starts the warm start's checkpoint after ``steps`` steps in ``directory`` (the
        newest one kept); ``Learner.save_warmup``."""
        ckpt = self._checkpointer(directory, 1)
        with profiling.span("checkpoint", "learner", {"warmup_step": steps}):
            await self._in_thread(self.learner.save_warmup, ckpt, steps, extras)

    async def restore_warmup(self, directory: str) -> dict[str, Any] | None:
        """The newest warm-start checkpoint in ``directory`` restored (and published to a
        colocated engine); its extras, or None when there is none
        (``Learner.restore_warmup``)."""
        extras = await self._in_thread(
            self.learner.restore_warmup, self._checkpointer(directory, 1)
        )
        if extras is not None:
            self._publish_timed()
        return extras

    async def save_reference(self, directory: str) -> None:
        await self._in_thread(self.learner.save_reference, self._checkpointer(directory, 1))

    async def checkpoint_steps(
        self,
        directory: str,
        max_to_keep: int = 3,
        keep_best_by: str = "",
        keep_best_mode: str = "max",
    ) -> list[int]:
        """The committed checkpoint steps this process sees in ``directory``, ascending (a
        learner group restores only a step every host sees)."""
        ckpt = self._checkpointer(directory, max_to_keep, keep_best_by, keep_best_mode)
        return await self._in_thread(ckpt.all_steps)

    async def restore(
        self,
        directory: str,
        max_to_keep: int = 3,
        reference_directory: str | None = None,
        keep_best_by: str = "",
        keep_best_mode: str = "max",
        among: list[int] | None = None,
    ) -> dict[str, Any]:
        """The newest checkpoint in ``directory`` that restores (of ``among`` when given;
        ``Checkpointer.restore``) into the RL state, published to a colocated engine;
        returns its extras (data position, policy version, ``rl_step``...)."""
        reference = self._checkpointer(reference_directory, 1) if reference_directory else None
        ckpt = self._checkpointer(directory, max_to_keep, keep_best_by, keep_best_mode)
        extras = await self._in_thread(
            lambda: self.learner.restore(ckpt, None, reference, among=among)
        )
        self._publish_timed()
        return extras


class PolicyActor(LearnerActor):
    """Learner and inference engine in one process (``engine.placement: colocated``)."""

    def __init__(
        self,
        model_config: ModelConfig,
        seed: int,
        tokenizer,
        engine_kwargs: dict[str, Any],
        model_path: str = "",
        init_from: str = "",
    ):
        super().__init__(model_config, seed, tokenizer.pad_id, model_path, init_from)
        profiling.configure("policy (learner + engine)", "policy")
        from raytunix.inference.engine import InferenceEngine

        self.engine = InferenceEngine(
            self.learner.graphdef,
            self.learner.params,
            model_config,
            tokenizer,
            policy_version=self.learner.version,
            **engine_kwargs,
        )
        heap.settle(young_threshold=None)  # and so is the engine

    def _publish(self) -> None:
        self.engine.update_weights(*self.learner.policy())

    async def generate(self, request):
        return await self.engine.generate(request)

    def abort(self, request_id: str) -> bool:
        return self.engine.abort(request_id)

    def end_session(self, session_id: str) -> None:
        self.engine.end_session(session_id)

    def engine_stats(self) -> dict:
        return self.engine.stats()


def _load(model_path: str, model_config: ModelConfig, init_from: str = "", seed: int = 0):
    """``(graphdef, params)`` to start from: the Hugging Face folder ``model_path``'s (else
    a fresh ``init_model`` with ``seed``) with, when ``init_from`` names a checkpoint
    directory (``model.init_from``'s), the parameters of its newest readable checkpoint
    in their place; None when both are "" (the learner inits the model itself).

    Raises:
      FileNotFoundError: ``init_from`` holds no checkpoint.
      CheckpointMismatch: its checkpoint holds another model shape.
    """
    import jax
    import jax.numpy as jnp

    from raytunix.learner.checkpoint import Checkpointer

    if not model_path and not init_from:
        return None
    if model_path:
        from raytunix.models.hf import load_weights

        graphdef, params = load_weights(model_path, model_config)
    else:
        from raytunix.models.llama import init_model

        graphdef, params = init_model(model_config, seed)
    if init_from:
        checkpointer = Checkpointer(init_from)
        try:
            restored, step = checkpointer.restore_params(params)
        finally:
            checkpointer.close()
        params = jax.tree.map(lambda new, old: jnp.asarray(new, old.dtype), restored, params)
        logger.info("policy weights from %s, step %d", init_from, step)
    return graphdef, params
