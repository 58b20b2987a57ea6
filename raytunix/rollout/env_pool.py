"""Environments hosted in a pool of Ray actors, apart from the orchestrator and learner.

Each ``EnvActor`` holds many environment instances (one per in-flight episode) and runs
their steps in threads, so a slow tool on one episode does not stall the others. The pool
size is configured on its own (``env.num_env_actors``); actors restart on failure, and an
episode whose actor died ends as ``env_error`` instead of taking the run with it.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ray

from raytunix.envs import make_env
from raytunix.rollout.episode import EnvFailure
from raytunix.types import Action, StepResult, Task


# For actors that must never take the accelerator (libtpu allows one process per host).
CPU_ONLY_RUNTIME_ENV = {"env_vars": {"JAX_PLATFORMS": "cpu"}}


class EnvActor:
    """Hosts environment instances keyed by episode id (run with ``ray.remote``).

    Args:
      env_name, env_kwargs: what ``raytunix.envs.make_env`` builds per episode.
      max_threads: environment calls that may block at once (threads are started on
        demand). asyncio's default executor has only ``cpu_count + 4`` threads, so on a
        small host a few slow tools would queue every other episode's step behind them.
    """

    def __init__(self, env_name: str, env_kwargs: dict[str, Any], max_threads: int = 256):
        os.environ.setdefault("JAX_PLATFORMS", "cpu")  # never grab an accelerator
        self._env_name = env_name
        self._env_kwargs = env_kwargs
        self._envs: dict[str, Any] = {}
        self._executor = ThreadPoolExecutor(max_workers=max_threads, thread_name_prefix="env")
        make_env(env_name, **env_kwargs).close()  # fail at start, not mid-run, on a bad config

    async def reset(self, episode_id: str, task: Task) -> str:
        env = make_env(self._env_name, **self._env_kwargs)
        self._envs[episode_id] = env
        return await self._in_thread(env.reset, task)

    async def step(self, episode_id: str, action: Action) -> StepResult:
        env = self._envs.get(episode_id)
        if env is None:
            raise KeyError(f"episode {episode_id!r} has no environment on this actor (restarted?)")
        return await self._in_thread(env.step, action)

    async def close(self, episode_id: str) -> None:
        env = self._envs.pop(episode_id, None)
        if env is not None:
            env.close()

    async def _in_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def num_envs(self) -> int:
        return len(self._envs)

    def pid(self) -> int:
        return os.getpid()


class RemoteEnv:
    """``EnvClient`` for one episode on one ``EnvActor``; actor failures become EnvFailure."""

    def __init__(self, actor, episode_id: str):
        self._actor = actor
        self._episode_id = episode_id

    async def _call(self, method: str, *args):
        try:
            return await getattr(self._actor, method).remote(self._episode_id, *args)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError,
                ray.exceptions.RayTaskError, KeyError) as e:
            raise EnvFailure(f"{method} failed on env actor: {e}") from e

    async def reset(self, task: Task) -> str:
        return await self._call("reset", task)

    async def step(self, action: Action) -> StepResult:
        return await self._call("step", action)

    async def close(self) -> None:
        await self._call("close")


class LocalEnv:
    """``EnvClient`` running an environment in-process (tests, evaluation without Ray).

    Like ``RemoteEnv``, an exception from the environment becomes ``EnvFailure`` (the
    episode ends as ENV_ERROR); anything else would read as an engine failure and the
    task would be retried forever."""

    def __init__(self, env_name: str, env_kwargs: dict[str, Any]):
        self._env = make_env(env_name, **env_kwargs)

    async def reset(self, task: Task) -> str:
        try:
            return self._env.reset(task)
        except Exception as e:  # noqa: BLE001 - any failure ends this episode only
            raise EnvFailure(f"reset failed: {e!r}") from e

    async def step(self, action: Action) -> StepResult:
        try:
            return self._env.step(action)
        except Exception as e:  # noqa: BLE001
            raise EnvFailure(f"step failed: {e!r}") from e

    async def close(self) -> None:
        self._env.close()


class EnvPool:
    """Spreads episodes over ``num_actors`` env actors, least-loaded first.

    Args:
      env_name, env_kwargs: what ``raytunix.envs.make_env`` builds in each actor.
      num_actors: actors in the pool (>= 1).
      max_restarts: Ray restarts of a crashed actor.
      resources: extra Ray resources each actor needs (e.g. ``{"env_host": 1}``) so that
        env actors land on their own node pool.
      threads_per_actor: environment calls each actor runs at once (see ``EnvActor``).
    """

    def __init__(self, env_name: str, env_kwargs: dict[str, Any], num_actors: int,
                 max_restarts: int = 3, resources: dict[str, float] | None = None,
                 threads_per_actor: int = 256):
        if num_actors < 1:
            raise ValueError(f"num_actors={num_actors}: an env pool needs at least one actor.")
        cls = ray.remote(EnvActor).options(
            num_cpus=0, max_restarts=max_restarts, max_task_retries=0,
            max_concurrency=10_000, resources=resources or {},
            runtime_env=CPU_ONLY_RUNTIME_ENV,
        )
        self.actors = [cls.remote(env_name, env_kwargs, threads_per_actor)
                       for _ in range(num_actors)]
        self._load = [0] * num_actors
        self._ids = itertools.count()

    def lease(self, group_id: str) -> tuple[RemoteEnv, int]:
        i = min(range(len(self.actors)), key=self._load.__getitem__)
        self._load[i] += 1
        return RemoteEnv(self.actors[i], f"{group_id}#{next(self._ids)}"), i

    def release(self, index: int) -> None:
        self._load[index] -= 1

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        ray.get([a.num_envs.remote() for a in self.actors], timeout=timeout_s)
