"""The rollout orchestrator as a Ray actor: wires the plain ``RolloutOrchestrator`` to an
engine actor, an env actor pool and the object store. Runs without JAX."""

from __future__ import annotations

import asyncio
import os
from typing import Any, Sequence

import ray

from raytunix import profiling
from raytunix.cluster import heap
from raytunix.agents import make_agent
from raytunix.inference.router import EngineRouter
from raytunix.plugins import add_import_paths
from raytunix.rollout.env_pool import EnvPool
from raytunix.rollout.orchestrator import RolloutOrchestrator
from raytunix.types import EngineFailure, GenerationRequest, GenerationResult, Task


class RayEngineClient:
    """``EngineClient`` over one or more engine actor handles (``generate``, ``abort``,
    ``end_session``): with several replicas, each request goes to the least loaded one,
    and a session's turns to the replica that holds its KV (``EngineRouter``).

    The engine actor dying or restarting raises ``EngineFailure`` (retried with backoff by
    the episode); an exception raised by the engine's own code (a bad request) propagates
    as the bug it is."""

    def __init__(self, handles):
        self._handles = list(handles) if isinstance(handles, (list, tuple)) else [handles]
        self._router = EngineRouter(len(self._handles))
        # An engine actor of the user's own may lack these; it then keeps no state to free.
        self._can_abort = all(hasattr(h, "abort") for h in self._handles)
        self._can_end_sessions = all(hasattr(h, "end_session") for h in self._handles)

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        handle = self._handles[self._router.acquire(request)]
        try:
            return await handle.generate.remote(request)
        except ray.exceptions.RayActorError as e:  # died, restarting or unreachable
            raise EngineFailure(f"engine actor failed on {request.request_id}: {e}") from e
        except asyncio.CancelledError:
            # The episode gave up (timeout, stop, dropped group): free the engine's row
            # now instead of letting the request decode to max_new_tokens.
            if self._can_abort:
                handle.abort.remote(request.request_id)
            raise
        finally:
            self._router.release(request)

    def end_session(self, session_id: str) -> None:
        """Frees the KV the engine keeps for a finished episode (fire and forget)."""
        replica = self._router.end_session(session_id)
        if replica is not None and self._can_end_sessions:
            self._handles[replica].end_session.remote(session_id)

    @property
    def in_flight(self) -> tuple[int, ...]:
        """Requests in flight per engine replica."""
        return self._router.in_flight

    async def engine_stats(self) -> list[dict]:
        """``InferenceEngine.stats()`` of every replica, in replica order (what the
        adaptive concurrency controller reads).

        Raises:
          EngineFailure: a replica died, is restarting or cannot be reached.
          TypeError: an engine actor of the user's own has no ``engine_stats`` method.
        """
        missing = [i for i, h in enumerate(self._handles) if not hasattr(h, "engine_stats")]
        if missing:
            raise TypeError(
                f"engine replicas {missing} have no engine_stats() method, which "
                "adaptive concurrency reads; add one returning "
                "InferenceEngine.stats(), or set rollout.adaptive_concurrency=false."
            )
        try:
            return list(await asyncio.gather(*(h.engine_stats.remote() for h in self._handles)))
        except ray.exceptions.RayActorError as e:
            raise EngineFailure(f"engine stats unavailable: {e}") from e


class OrchestratorActor(profiling.ProfiledActor):
    """Owns the trajectory batches it puts into the object store (run with ``ray.remote``).

    Args:
      tasks: training tasks.
      tokenizer: the run's ``Tokenizer``.
      agent_name: what ``raytunix.agents.make_agent`` builds per episode: a registered
        name or ``package.module:Class``, resolved here, in the actor.
      agent_kwargs: the agent's constructor arguments besides the tokenizer.
      import_paths: directories put first on this process's ``sys.path`` before the agent
        is resolved (see ``raytunix.plugins``).
      env_pool: an ``EnvPool`` whose actors host the environments.
      engine: an actor handle with ``generate`` (``PolicyActor`` or ``EngineActor``), or
        a list of them (engine replicas).
      program: ``raytunix.driver.prepare.program_settings``: episodes are agent programs
        run through a gateway served from this actor (``ProgramOrchestrator``); None =
        native episodes.
      orchestrator_kwargs: the rest of ``RolloutOrchestrator``'s arguments.
    """

    def __init__(
        self,
        *,
        tasks: Sequence[Task],
        tokenizer,
        agent_name: str,
        env_pool: EnvPool,
        engine,
        agent_kwargs: dict[str, Any] | None = None,
        import_paths: Sequence[str] = (),
        program: dict[str, Any] | None = None,
        **orchestrator_kwargs: Any,
    ):
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        add_import_paths(import_paths)
        profiling.configure("orchestrator", "orchestrator")
        agent_kwargs = dict(agent_kwargs or {})
        make_agent(agent_name, tokenizer, **agent_kwargs)  # a bad agent fails here, at start
        self._pool = env_pool
        env_pool.finish_retiring()  # retired by an orchestrator before this one

        def env_provider(group_id: str):
            env, index = env_pool.lease(group_id)
            return env, lambda: env_pool.release(index)

        orchestrator_cls: type[RolloutOrchestrator] = RolloutOrchestrator
        if program is not None:
            from raytunix.rollout.program import ProgramOrchestrator, program_parts

            orchestrator_cls = ProgramOrchestrator
            orchestrator_kwargs.update(program_parts(program, tokenizer))
        self.orchestrator = orchestrator_cls(
            tasks=tasks,
            agent_factory=lambda: make_agent(agent_name, tokenizer, **agent_kwargs),
            engine=RayEngineClient(engine),
            env_provider=env_provider,
            put=ray.put,
            **orchestrator_kwargs,
        )
        heap.settle()  # start-up state out of the garbage collector's scans

    async def next_batch(self):
        return await self.orchestrator.next_batch()

    def mark_trained(self, batch_id: int, policy_version: int) -> None:
        self.orchestrator.mark_trained(batch_id, policy_version)

    def set_policy_version(self, policy_version: int) -> None:
        self.orchestrator.set_policy_version(policy_version)

    async def evaluate(
        self, tasks: Sequence[Task], max_new_tokens: int, temperature: float = 0.0, keep=False
    ) -> dict:
        return await self.orchestrator.evaluate(tasks, max_new_tokens, temperature, keep)

    def state(self) -> dict:
        return self.orchestrator.state()

    def resize_env_pool(self, num_actors: int) -> dict:
        """Grows or shrinks the env actor pool to ``num_actors`` serving actors while
        episodes run (``EnvPool.resize``: new actors take episodes once ready; removed ones
        finish theirs, then are killed); returns ``EnvPool.membership()``, which the driver
        ``adopt``-s into its copy of the pool.

        Raises:
          ValueError: ``num_actors`` is not an int >= 1.
        """
        membership = self._pool.resize(num_actors)
        self.orchestrator.counters["env_pool_resizes"] += 1
        return membership

    def env_pool_membership(self) -> dict:
        """``EnvPool.membership()`` of the pool this orchestrator leases from."""
        return self._pool.membership()

    def stats(self) -> dict:
        return self.orchestrator.stats()

    def take_env_errors(self) -> tuple[list[dict], dict[str, int]]:
        """``RolloutOrchestrator.take_env_errors``."""
        return self.orchestrator.take_env_errors()

    async def stop(self) -> None:
        await self.orchestrator.stop()
