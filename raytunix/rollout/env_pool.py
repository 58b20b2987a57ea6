"""Environments hosted in a pool of Ray actors, apart from the orchestrator and learner.

Each ``EnvActor`` holds many environment instances (one per in-flight episode) and runs
their steps in threads, so a slow tool on one episode does not stall the others. The pool
size is configured on its own (``env.num_env_actors``); actors restart on failure, and an
episode whose actor died ends as ``env_error`` (and is re-run by the orchestrator) instead
of taking the run with it. An actor that is dead for good (its restarts spent) gets no more
episodes; when none is left, ``lease`` raises ``EnvPoolExhausted`` and the run stops with
that one error instead of producing failed episodes.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Awaitable, Callable, Sequence

import ray

from raytunix import profiling
from raytunix.envs import make_env
from raytunix.plugins import PluginError, add_import_paths
from raytunix.types import Action, EnvFailure, RolloutHalted, StepResult, Task

logger = logging.getLogger(__name__)


# For actors that must never take the accelerator (libtpu allows one process per host).
CPU_ONLY_RUNTIME_ENV = {"env_vars": {"JAX_PLATFORMS": "cpu"}}


class EnvBuildError(RuntimeError):
    """The environment cannot be built (or its module imported) in an env actor; the
    message names the environment, the cause and what to do."""


class EnvActor(profiling.ProfiledActor):
    """Hosts environment instances keyed by episode id (run with ``ray.remote``).

    Args:
      env_name, env_kwargs: what ``raytunix.envs.make_env`` builds per episode (a
        registered name or an import path, resolved here, in the actor).
      max_threads: environment calls that may block at once (threads are started on
        demand). asyncio's default executor has only ``cpu_count + 4`` threads, so on a
        small host a few slow tools would queue every other episode's step behind them.
      import_paths: directories put first on this process's ``sys.path`` before the
        environment is resolved (``raytunix.plugins.import_root`` of an import path the
        driver resolved).

    Raises:
      EnvBuildError: the environment cannot be resolved or built here; the actor does not
        start (Ray does not restart an actor whose constructor raised).

    JAX stays out of this process: tools and sandboxes started from env actors fork, and a
    fork of a process running JAX's threads can deadlock. If building the environment
    imports JAX, a warning says which environment did.
    """

    def __init__(self, env_name: str, env_kwargs: dict[str, Any], max_threads: int = 256,
                 import_paths: Sequence[str] = ()):
        os.environ.setdefault("JAX_PLATFORMS", "cpu")  # never grab an accelerator
        add_import_paths(import_paths)
        profiling.configure("env actor", "env")
        self._env_name = env_name
        self._env_kwargs = env_kwargs
        self._envs: dict[str, Any] = {}
        self._executor = ThreadPoolExecutor(max_workers=max_threads, thread_name_prefix="env")
        jax_before = "jax" in sys.modules
        try:  # fail at start, not mid-run, on a bad config
            make_env(env_name, **env_kwargs).close()
        except Exception as e:  # noqa: BLE001 - reported whole, with the fix
            if isinstance(e, PluginError):
                fix = (f"This actor's sys.path starts with {sys.path[:3]}; on a multi-node "
                       "cluster install the module on every node or ship it with the job "
                       "(runtime_env working_dir or py_modules).")
            else:
                fix = "Fix env.kwargs or the environment's constructor."
            raise EnvBuildError(
                f"environment {env_name!r} with env.kwargs={env_kwargs!r} cannot be built in "
                f"the env actor (pid {os.getpid()}): {type(e).__name__}: "
                f"{str(e).rstrip('.')}. {fix}") from e
        if "jax" in sys.modules and not jax_before:
            logger.warning(
                "building environment %r imported JAX into the env actor (pid %d). Tools and "
                "sandboxes fork from this process, and a fork of a process running JAX can "
                "deadlock; import JAX lazily in the environment's module, or not at all.",
                env_name, os.getpid())

    def first_observation(self, task: Task) -> str:
        """Builds a fresh environment, resets it on ``task`` and closes it; returns the
        first observation (the driver measures prompts with it before training).

        Raises:
          Exception: whatever the environment's reset raised.
        """
        env = make_env(self._env_name, **self._env_kwargs)
        try:
            return env.reset(task)
        finally:
            env.close()

    def tasks(self, split: str, size: int, seed: int) -> list[Task] | None:
        """The environment's own tasks (``BaseEnv.tasks``, checked by
        ``raytunix.data.tasks.env_tasks``), or None when it brings none."""
        from raytunix.data.tasks import env_tasks

        env = make_env(self._env_name, **self._env_kwargs)
        try:
            return env_tasks(env, split, size, seed)
        finally:
            env.close()

    def jax_loaded(self) -> bool:
        """Whether JAX is imported in this actor's process (it should never be)."""
        return "jax" in sys.modules

    async def reset(self, episode_id: str, task: Task) -> str:
        env = make_env(self._env_name, **self._env_kwargs)
        self._envs[episode_id] = env
        return await self._in_thread(_recorded, "env_reset", episode_id, env.reset, task)

    async def step(self, episode_id: str, action: Action) -> StepResult:
        env = self._envs.get(episode_id)
        if env is None:
            raise KeyError(f"episode {episode_id!r} has no environment on this actor (restarted?)")
        return await self._in_thread(_recorded, "env_step", episode_id, env.step, action)

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


def _recorded(name: str, episode_id: str, fn, *args):
    """``fn(*args)`` in an env thread, recorded as a span of the episode: the time the
    environment computed, without the wait for a free thread."""
    with profiling.span(name, "env", flow=episode_id.rpartition("#")[0] or episode_id):
        return fn(*args)


class EnvPoolExhausted(RolloutHalted):
    """Every env actor of the pool is dead for good; no episode can run."""


class RemoteEnv:
    """``EnvClient`` for one episode on one ``EnvActor``; failures become ``EnvFailure``.

    The actor dying or restarting, or the episode's environment being gone (the actor was
    restarted under it), is ``retryable``: the episode may run again elsewhere. An exception
    raised by the environment's own code is not.

    Args:
      on_actor_died: awaited when a call finds the actor dead (``ActorDiedError``), before
        the failure is raised; the pool uses it to check whether the actor is gone for good.
    """

    def __init__(self, actor, episode_id: str,
                 on_actor_died: Callable[[], Awaitable[None]] | None = None):
        self._actor = actor
        self._episode_id = episode_id
        self._on_actor_died = on_actor_died

    async def _call(self, method: str, *args):
        try:
            return await getattr(self._actor, method).remote(self._episode_id, *args)
        except ray.exceptions.ActorDiedError as e:
            if self._on_actor_died is not None:
                await self._on_actor_died()
            raise EnvFailure(f"{method} failed: the env actor died ({e})", retryable=True) from e
        except ray.exceptions.RayActorError as e:  # ActorUnavailableError: restarting
            raise EnvFailure(f"{method} failed: the env actor is unavailable ({e})",
                             retryable=True) from e
        except ray.exceptions.RayTaskError as e:
            gone = isinstance(e, KeyError)  # the episode's env was lost in a restart
            # The environment's own exception, not Ray's text of its whole traceback (which
            # stays chained on the EnvFailure).
            cause = getattr(e, "cause", None)
            what = f"{type(cause).__name__}: {cause}" if isinstance(cause, BaseException) else e
            raise EnvFailure(f"{method} failed on the env actor: {what}", retryable=gone) from e

    async def reset(self, task: Task) -> str:
        return await self._call("reset", task)

    async def step(self, action: Action) -> StepResult:
        return await self._call("step", action)

    async def close(self) -> None:
        await self._call("close")


class LocalEnv:
    """``EnvClient`` running an environment in-process (tests, evaluation without Ray).

    Like ``RemoteEnv``, an exception from the environment becomes ``EnvFailure`` (the
    episode ends as ENV_ERROR, not retryable: the same code would fail again)."""

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
        try:
            self._env.close()
        except Exception as e:  # noqa: BLE001
            raise EnvFailure(f"close failed: {e!r}") from e


class EnvPool:
    """Spreads episodes over ``num_actors`` env actors, least-loaded first.

    Args:
      env_name, env_kwargs: what ``raytunix.envs.make_env`` builds in each actor.
      num_actors: actors in the pool (>= 1).
      max_restarts: Ray restarts of a crashed actor.
      resources: extra Ray resources each actor needs (e.g. ``{"env_host": 1}``) so that
        env actors land on their own node pool.
      threads_per_actor: environment calls each actor runs at once (see ``EnvActor``).
      probe_timeout_s: how long a liveness check of an actor that raised
        ``ActorDiedError`` may take, seconds; an actor restarting takes that long at most
        to answer, one dead for good fails at once.
      import_paths: directories each actor puts first on its ``sys.path`` (see
        ``EnvActor``).

    Raises (``lease``):
      EnvPoolExhausted: every actor is dead for good.
    """

    def __init__(self, env_name: str, env_kwargs: dict[str, Any], num_actors: int,
                 max_restarts: int = 3, resources: dict[str, float] | None = None,
                 threads_per_actor: int = 256, probe_timeout_s: float = 60.0,
                 import_paths: Sequence[str] = ()):
        if num_actors < 1:
            raise ValueError(f"num_actors={num_actors}: an env pool needs at least one actor.")
        cls = ray.remote(EnvActor).options(
            num_cpus=0, max_restarts=max_restarts, max_task_retries=0,
            max_concurrency=10_000, resources=resources or {},
            runtime_env=CPU_ONLY_RUNTIME_ENV,
        )
        self.env_name = env_name
        self.actors = [cls.remote(env_name, env_kwargs, threads_per_actor, tuple(import_paths))
                       for _ in range(num_actors)]
        self._load = [0] * num_actors
        self._ids = itertools.count()
        self._dead: set[int] = set()
        self.max_restarts = max_restarts
        self.probe_timeout_s = probe_timeout_s

    def lease(self, group_id: str) -> tuple[RemoteEnv, int]:
        """An environment client for one episode on the least-loaded live actor, and that
        actor's index (give it back with ``release``).

        Raises:
          EnvPoolExhausted: no actor is alive.
        """
        alive = [i for i in range(len(self.actors)) if i not in self._dead]
        if not alive:
            raise EnvPoolExhausted(
                f"all {len(self.actors)} env actors are dead (each was restarted up to "
                f"env.env_actor_max_restarts={self.max_restarts} times); no episode can run. "
                "Check the env actors' logs (`ray logs`), fix the cause, and resume the run.")
        i = min(alive, key=self._load.__getitem__)
        self._load[i] += 1

        async def on_actor_died() -> None:
            await self._check_alive(i)

        # Named after the episode when the orchestrator says which (its trace flow id).
        key = profiling.current_flow.get() or group_id
        return RemoteEnv(self.actors[i], f"{key}#{next(self._ids)}", on_actor_died), i

    @property
    def num_alive(self) -> int:
        """Actors not known to be dead for good."""
        return len(self.actors) - len(self._dead)

    async def _check_alive(self, index: int) -> None:
        # A call to an actor that is restarting waits for it; one to an actor that will not
        # come back fails at once with ActorDiedError.
        if index in self._dead:
            return
        try:
            async with asyncio.timeout(self.probe_timeout_s):
                await self.actors[index].num_envs.remote()
        except ray.exceptions.ActorDiedError as e:
            self._dead.add(index)
            logger.error("env actor %d is dead for good (%d of %d left): %s", index,
                         self.num_alive, len(self.actors), e)
        except (ray.exceptions.RayActorError, TimeoutError):
            pass  # restarting or slow: not known dead

    def release(self, index: int) -> None:
        self._load[index] -= 1

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Returns once every actor has built its environment and answers.

        Raises:
          EnvBuildError: an actor could not build the environment (the cause, as the actor
            raised it, is in the message).
          TimeoutError: the actors did not start within ``timeout_s`` (e.g. no node has the
            resources they ask for).
        """
        try:
            ray.get([a.num_envs.remote() for a in self.actors], timeout=timeout_s)
        except ray.exceptions.ActorDiedError as e:
            if not getattr(e, "_actor_init_failed", False):
                raise
            lines = [line for line in str(getattr(e, "error_msg", e)).splitlines() if line.strip()]
            cause = lines[-1] if lines else str(e)
            prefix = f"{__name__}.EnvBuildError: "
            raise EnvBuildError(cause[len(prefix):] if cause.startswith(prefix) else
                                f"environment {self.env_name!r} cannot be built in the env "
                                f"actors: {cause}") from None
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(
                f"the {len(self.actors)} env actors of {self.env_name!r} were not ready within "
                f"{timeout_s} s; check that the cluster has the resources they ask for "
                "(`ray status`) and the env actors' logs (`ray logs`).") from None
