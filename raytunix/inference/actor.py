"""The inference engine as its own Ray actor (``engine.placement: disaggregated``).

This module imports no JAX: Ray imports it in every process that receives a handle to an
engine (the orchestrator, the learner), so the engine's stack loads where the actor runs,
in the methods that use it.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import ray

from raytunix import profiling
from raytunix.cluster import heap

if TYPE_CHECKING:
    from raytunix.learner.lora import PublishedAdapters
    from raytunix.models.llama import ModelConfig


class EngineActor(profiling.ProfiledActor):
    """Hosts one ``InferenceEngine`` replica (run with ``ray.remote``).

    Its first weights are ``init_model(model_config, seed)``, or the Hugging Face model
    folder ``model_path`` when given (read where the actor runs). An actor that Ray
    restarted after a crash (``max_restarts``) takes the current weights and policy version
    from ``weights_source`` (the learner: its ``weights()``) before it serves: the first
    weights are older than every token's version would claim.

    Under LoRA the learner publishes only the adapters (``PublishedAdapters``); the actor
    merges them on its device onto the learner's frozen base, which it fetches from
    ``weights_source`` (``base_weights()``) the first time, again when the learner starts
    a new base (a new phase), and after a restart: the learner's base, which may come
    from ``model.init_from`` or a warm start, not the weights this actor started with.
    """

    def __init__(
        self,
        model_config: ModelConfig,
        seed: int,
        tokenizer,
        engine_kwargs: dict[str, Any],
        model_path: str = "",
        weights_source=None,
    ):
        from raytunix.inference.engine import InferenceEngine
        from raytunix.inference.weights import LoraBase
        from raytunix.learner.lora import PublishedAdapters
        from raytunix.models.llama import init_model

        profiling.configure("engine", "engine")
        if model_path:
            from raytunix.models.hf import load_weights

            graphdef, params = load_weights(model_path, model_config)
        else:
            graphdef, params = init_model(model_config, seed)
        self.engine = InferenceEngine(graphdef, params, model_config, tokenizer, **engine_kwargs)
        self._weights_source = weights_source
        self._lora = LoraBase(model_config.dtype)
        self._updating = asyncio.Lock()  # versions are taken in the order they came
        if weights_source is not None and ray.get_runtime_context().was_current_actor_reconstructed:
            published = ray.get(weights_source.weights.remote())
            if isinstance(published, PublishedAdapters):
                self._take_base(ray.get(weights_source.base_weights.remote()))
            self._receive(published)
        heap.settle()  # the model is built: out of the garbage collector's scans

    async def generate(self, request):
        return await self.engine.generate(request)

    def abort(self, request_id: str) -> bool:
        """Stops one request in flight (its caller gave up); False if none."""
        return self.engine.abort(request_id)

    def end_session(self, session_id: str) -> None:
        """Frees the KV a finished episode's session kept."""
        self.engine.end_session(session_id)

    async def update_weights(self, published: tuple[Any, int] | PublishedAdapters) -> int:
        """Takes what ``LearnerActor.weights`` returns and queues it; returns its policy
        version. ``(numpy params, version)`` replace the weights; LoRA adapters
        (``PublishedAdapters``) are merged onto the learner's base first, which is fetched
        from ``weights_source`` when this actor does not hold that base yet.

        Raises:
          RuntimeError: adapters came and the base they need is not here, with no
            ``weights_source`` to fetch it from.
          ValueError: an older version, or weights of another model
            (``InferenceEngine.update_weights``).
        """
        from raytunix.learner.lora import PublishedAdapters

        async with self._updating:
            if isinstance(published, PublishedAdapters) and published.base_id != self._lora.base_id:
                if self._weights_source is None:
                    raise RuntimeError(
                        f"EngineActor got the LoRA adapters of policy version "
                        f"{published.version} but holds no base to merge them onto: it was "
                        "built without weights_source. Build it with weights_source=<the "
                        "learner actor> (its base_weights() is fetched once per base), or "
                        "publish whole weights (LearnerActor.weights(whole=True))."
                    )
                self._take_base(await self._weights_source.base_weights.remote())
            return self._receive(published)

    def _take_base(self, base_id_and_base: tuple[str, Any]) -> None:
        from raytunix.learner.sharding import tree_nbytes

        base_id, base = base_id_and_base
        args = {"base": True, "bytes": tree_nbytes(base)}
        with profiling.span("weight_receive", "weights", args):
            self._lora.set(base_id, base)

    def _receive(self, published: tuple[Any, int] | PublishedAdapters) -> int:
        import jax

        from raytunix.learner.lora import PublishedAdapters
        from raytunix.learner.sharding import tree_nbytes

        if isinstance(published, PublishedAdapters):
            args = {"version": published.version, "bytes": published.nbytes, "adapters": True}
            with profiling.span("weight_receive", "weights", args):
                self.engine.update_weights(self._lora.merged(published), published.version)
            return published.version
        params, version = published
        args = {"version": version, "bytes": tree_nbytes(params)}
        with profiling.span("weight_receive", "weights", args):
            self.engine.update_weights(jax.device_put(params), version)
        return version

    def engine_stats(self) -> dict:
        return self.engine.stats()

    def warmup(self) -> int:
        """Compiles every program the engine can call; returns how many shapes."""
        shapes = self.engine.warmup()
        heap.settle()  # and so are the compiled programs
        return shapes
