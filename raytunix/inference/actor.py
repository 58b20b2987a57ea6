"""The inference engine as its own Ray actor (``engine.placement: disaggregated``)."""

from __future__ import annotations

import jax

from raytunix.inference.engine import InferenceEngine
from raytunix.models.llama import ModelConfig, init_model


class EngineActor:
    """Hosts one ``InferenceEngine`` replica (run with ``ray.remote``)."""

    def __init__(self, model_config: ModelConfig, seed: int, tokenizer, max_batch_size: int):
        graphdef, params = init_model(model_config, seed)
        self.engine = InferenceEngine(graphdef, params, model_config, tokenizer,
                                      max_batch_size=max_batch_size)

    async def generate(self, request):
        return await self.engine.generate(request)

    def update_weights(self, weights_and_version) -> int:
        """Takes ``(numpy params, version)`` as returned by ``LearnerActor.weights``."""
        params, version = weights_and_version
        self.engine.update_weights(jax.device_put(params), version)
        return version

    def engine_stats(self) -> dict:
        return self.engine.stats()
