"""The rollout orchestrator as a Ray actor: wires the plain ``RolloutOrchestrator`` to an
engine actor, an env actor pool and the object store. Runs without JAX."""

from __future__ import annotations

import os
from typing import Any, Sequence

import ray

from raytunix.agents import make_agent
from raytunix.rollout.env_pool import EnvPool
from raytunix.rollout.orchestrator import RolloutOrchestrator
from raytunix.types import EngineFailure, GenerationRequest, GenerationResult, Task


class RayEngineClient:
    """``EngineClient`` over an actor handle that has an async ``generate`` method.

    The engine actor dying or restarting raises ``EngineFailure`` (retried with backoff by
    the episode); an exception raised by the engine's own code (a bad request) propagates
    as the bug it is."""

    def __init__(self, handle):
        self._handle = handle

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        try:
            return await self._handle.generate.remote(request)
        except ray.exceptions.RayActorError as e:  # died, restarting or unreachable
            raise EngineFailure(f"engine actor failed on {request.request_id}: {e}") from e


class OrchestratorActor:
    """Owns the trajectory batches it puts into the object store (run with ``ray.remote``).

    Args:
      tasks: training tasks.
      tokenizer: the run's ``Tokenizer``.
      agent_name: ``raytunix.agents.make_agent`` name.
      env_pool: an ``EnvPool`` whose actors host the environments.
      engine: an actor handle with ``generate`` (``PolicyActor`` or ``EngineActor``).
      orchestrator_kwargs: the rest of ``RolloutOrchestrator``'s arguments.
    """

    def __init__(self, *, tasks: Sequence[Task], tokenizer, agent_name: str, env_pool: EnvPool,
                 engine, **orchestrator_kwargs: Any):
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        self._pool = env_pool

        def env_provider(group_id: str):
            env, index = env_pool.lease(group_id)
            return env, lambda: env_pool.release(index)

        self.orchestrator = RolloutOrchestrator(
            tasks=tasks,
            agent_factory=lambda: make_agent(agent_name, tokenizer),
            engine=RayEngineClient(engine),
            env_provider=env_provider,
            put=ray.put,
            **orchestrator_kwargs,
        )

    async def next_batch(self):
        return await self.orchestrator.next_batch()

    def mark_trained(self, batch_id: int, policy_version: int) -> None:
        self.orchestrator.mark_trained(batch_id, policy_version)

    def set_policy_version(self, policy_version: int) -> None:
        self.orchestrator.set_policy_version(policy_version)

    async def evaluate(self, tasks: Sequence[Task], max_new_tokens: int) -> dict:
        return await self.orchestrator.evaluate(tasks, max_new_tokens)

    def state(self) -> dict:
        return self.orchestrator.state()

    def stats(self) -> dict:
        return self.orchestrator.stats()

    async def stop(self) -> None:
        await self.orchestrator.stop()
