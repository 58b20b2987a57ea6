"""The inference engine as its own Ray actor (``engine.placement: disaggregated``)."""

from __future__ import annotations

from typing import Any

import jax
import ray

from raytunix import profiling
from raytunix.cluster import heap
from raytunix.inference.engine import InferenceEngine
from raytunix.models.llama import ModelConfig, init_model


class EngineActor(profiling.ProfiledActor):
    """Hosts one ``InferenceEngine`` replica (run with ``ray.remote``).

    Its first weights are ``init_model(model_config, seed)``, or the Hugging Face model
    folder ``model_path`` when given (read where the actor runs). An actor that Ray
    restarted after a crash (``max_restarts``) takes the current weights and policy version
    from ``weights_source`` (the learner: its ``weights()``) before it serves: the first
    weights are older than every token's version would claim.
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
        profiling.configure("engine", "engine")
        if model_path:
            from raytunix.models.hf import load_weights

            graphdef, params = load_weights(model_path, model_config)
        else:
            graphdef, params = init_model(model_config, seed)
        self.engine = InferenceEngine(graphdef, params, model_config, tokenizer, **engine_kwargs)
        if weights_source is not None and ray.get_runtime_context().was_current_actor_reconstructed:
            self.update_weights(ray.get(weights_source.weights.remote()))
        heap.settle()  # the model is built: out of the garbage collector's scans

    async def generate(self, request):
        return await self.engine.generate(request)

    def abort(self, request_id: str) -> bool:
        """Stops one request in flight (its caller gave up); False if none."""
        return self.engine.abort(request_id)

    def end_session(self, session_id: str) -> None:
        """Frees the KV a finished episode's session kept."""
        self.engine.end_session(session_id)

    def update_weights(self, weights_and_version) -> int:
        """Takes ``(numpy params, version)`` as returned by ``LearnerActor.weights``."""
        params, version = weights_and_version
        with profiling.span("weight_receive", "weights", {"version": version}):
            self.engine.update_weights(jax.device_put(params), version)
        return version

    def engine_stats(self) -> dict:
        return self.engine.stats()

    def warmup(self) -> int:
        """Compiles every program the engine can call; returns how many shapes."""
        shapes = self.engine.warmup()
        heap.settle()  # and so are the compiled programs
        return shapes
