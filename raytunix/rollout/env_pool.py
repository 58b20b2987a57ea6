"""Environments hosted in a pool of Ray actors, apart from the orchestrator and learner.

Each ``EnvActor`` holds many environment instances (one per in-flight episode) and runs
their steps in threads, so a slow tool on one episode does not stall the others. The pool
size is configured on its own (``env.num_env_actors``); actors restart on failure, and an
episode whose actor died ends as ``env_error`` (and is re-run by the orchestrator) instead
of taking the run with it. An actor that is dead for good (its restarts spent) gets no more
episodes, and a new actor replaces it (an agent program that ends its process kills its
actor on each such episode, which ends as ``env_error``: the run goes on; an environment
that fails every episode trips the orchestrator's breaker instead). An actor that cannot
build its environment is not replaced; when none is left, ``lease`` raises
``EnvPoolExhausted`` and the run stops with that one error instead of producing failed
episodes.

The pool resizes during a run (``EnvPool.resize``, reached from the driver through
``OrchestratorActor.resize_env_pool``): new actors take episodes once they are ready, and
an actor removed from the pool first finishes the episodes it runs (it gets no new one),
then is killed.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import sys
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Awaitable, Callable, Sequence

import ray

from raytunix import profiling
from raytunix.cluster import heap
from raytunix.envs import make_env
from raytunix.envs.agent_program import AgentProgramEnv, ProgramOutcome, play_with_deadline
from raytunix.envs.contract import EnvErrorReport, check_observation, guarded_call
from raytunix.plugins import PluginError, add_import_paths
from raytunix.types import (
    Action,
    EnvFailure,
    EpisodeStatus,
    RolloutHalted,
    StepResult,
    Task,
)

logger = logging.getLogger(__name__)


# For actors that must never take the accelerator (libtpu allows one process per host).
CPU_ONLY_RUNTIME_ENV = {"env_vars": {"JAX_PLATFORMS": "cpu"}}

_LOOPBACK = {"127.0.0.1", "localhost", "::1"}


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

    def __init__(
        self,
        env_name: str,
        env_kwargs: dict[str, Any],
        max_threads: int = 256,
        import_paths: Sequence[str] = (),
    ):
        os.environ.setdefault("JAX_PLATFORMS", "cpu")  # never grab an accelerator
        add_import_paths(import_paths)
        profiling.configure("env actor", "env")
        self._env_name = env_name
        self._env_kwargs = env_kwargs
        self._envs: dict[str, Any] = {}
        self._program: AgentProgramEnv | None = None
        self._executor = ThreadPoolExecutor(max_workers=max_threads, thread_name_prefix="env")
        jax_before = "jax" in sys.modules
        try:  # fail at start, not mid-run, on a bad config
            make_env(env_name, **env_kwargs).close()
        except Exception as e:  # noqa: BLE001 - reported whole, with the fix
            if isinstance(e, PluginError):
                fix = (
                    f"This actor's sys.path starts with {sys.path[:3]}; on a multi-node "
                    "cluster install the module on every node or ship it with the job "
                    "(runtime_env working_dir or py_modules)."
                )
            else:
                fix = "Fix env.kwargs or the environment's constructor."
            raise EnvBuildError(
                f"environment {env_name!r} with env.kwargs={env_kwargs!r} cannot be built in "
                f"the env actor (pid {os.getpid()}): {type(e).__name__}: "
                f"{str(e).rstrip('.')}. {fix}"
            ) from e
        if "jax" in sys.modules and not jax_before:
            logger.warning(
                "building environment %r imported JAX into the env actor (pid %d). Tools and "
                "sandboxes fork from this process, and a fork of a process running JAX can "
                "deadlock; import JAX lazily in the environment's module, or not at all.",
                env_name,
                os.getpid(),
            )
        heap.settle()  # start-up state out of the garbage collector's scans

    def first_observation(self, task: Task) -> str:
        """Builds a fresh environment, resets it on ``task`` and closes it; returns the
        first observation (the driver measures prompts with it before training).

        Raises:
          Exception: whatever the environment's reset raised.
          EnvContractError: reset returned something that is not a str (a dict, list,
            None, ...), named as the env contract names it (not a TypeError deep in the
            agent's template).
        """
        env = make_env(self._env_name, **self._env_kwargs)
        try:
            return check_observation(env.reset(task), env, "reset")
        finally:
            try:
                env.close()
            except Exception as e:  # noqa: BLE001 - the environment's code
                # Only the observation is measured here; an episode's close that raises
                # ends that episode as env_error (with its traceback) when it runs.
                logger.warning(
                    "closing %s after measuring task %r's prompt raised %s: %s",
                    type(env).__qualname__,
                    task.task_id,
                    type(e).__name__,
                    e,
                )

    def tasks(self, split: str, size: int, seed: int) -> list[Task] | None:
        """The environment's own tasks (``BaseEnv.tasks``, checked by
        ``raytunix.data.tasks.env_tasks``), or None when it brings none."""
        from raytunix.data.tasks import env_tasks

        env = make_env(self._env_name, **self._env_kwargs)
        try:
            return env_tasks(env, split, size, seed)
        finally:
            env.close()

    async def demonstrations(self, tasks: list[Task]) -> list[list[dict[str, str]] | None]:
        """The environment's expert episode for each of ``tasks`` (``BaseEnv.demonstrate``,
        None where it has none), played one after another on one instance of its own in a
        thread, so episodes running on this actor are not held up.

        Raises:
          Exception: whatever the expert raised (a bug in it, named by the driver).
        """
        return await self._in_thread(self._demonstrate, tasks)

    def _demonstrate(self, tasks: list[Task]) -> list[list[dict[str, str]] | None]:
        env = make_env(self._env_name, **self._env_kwargs)
        try:
            expert = getattr(env, "demonstrate", None)
            return [expert(task) if expert is not None else None for task in tasks]
        finally:
            env.close()

    def jax_loaded(self) -> bool:
        """Whether JAX is imported in this actor's process (it should never be)."""
        return "jax" in sys.modules

    # reset, step and close return the environment's checked value, or the
    # ``EnvErrorReport`` of what its code raised or returned wrong (``guarded_call``): a
    # bad value is caught here, before Ray serialises it for the orchestrator.

    async def reset(self, episode_id: str, task: Task) -> str | EnvErrorReport:
        env = make_env(self._env_name, **self._env_kwargs)
        self._envs[episode_id] = (env, task.task_id)
        return await self._in_thread(
            _recorded, "env_reset", episode_id, guarded_call, env, "reset", task.task_id, task
        )

    async def step(self, episode_id: str, action: Action) -> StepResult | EnvErrorReport:
        env, task_id = self._envs.get(episode_id, (None, ""))
        if env is None:
            raise KeyError(f"episode {episode_id!r} has no environment on this actor (restarted?)")
        return await self._in_thread(
            _recorded, "env_step", episode_id, guarded_call, env, "step", task_id, action
        )

    async def close(self, episode_id: str) -> EnvErrorReport | None:
        env, task_id = self._envs.pop(episode_id, (None, ""))
        if env is not None:
            return guarded_call(env, "close", task_id)
        return None

    async def play(
        self,
        episode_id: str,
        task: Task,
        base_url: str,
        api_key: str,
        timeout_s: float,
        gateway_node_id: str | None = None,
    ) -> ProgramOutcome:
        """Runs one agent-program episode here (``env.name=agent_program`` and its
        subclasses): ``play_with_deadline`` of this actor's program, built once and shared
        by its episodes. ``gateway_node_id`` is the node serving ``base_url``: a gateway on
        loopback cannot be reached from another node, which is named instead of a
        connection error in every episode.

        Raises:
          TypeError: this actor's environment is not an ``AgentProgramEnv``.
        """
        if self._program is None:
            program = make_env(self._env_name, **self._env_kwargs)
            if not isinstance(program, AgentProgramEnv):
                raise TypeError(
                    f"environment {self._env_name!r} is a {type(program).__name__}, not an "
                    "agent program (raytunix.envs.agent_program.AgentProgramEnv): it has "
                    "reset/step, not play."
                )
            self._program = program
        host = urllib.parse.urlsplit(base_url).hostname or ""
        if gateway_node_id and host in _LOOPBACK and gateway_node_id != self.node_id():
            return ProgramOutcome(
                0.0,
                EpisodeStatus.ENV_ERROR,
                f"the gateway listens on loopback ({base_url}) of node {gateway_node_id}, "
                f"but this env actor runs on node {self.node_id()} and cannot reach it. Set "
                "gateway.host=0.0.0.0 (the cluster network), or keep the env actors on the "
                "orchestrator's node.",
            )
        with profiling.span("program", "env", flow=episode_id.rpartition("#")[0] or episode_id):
            return await play_with_deadline(self._program, task, base_url, api_key, timeout_s)

    async def _in_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def num_envs(self) -> int:
        return len(self._envs)

    def pid(self) -> int:
        return os.getpid()

    def node_id(self) -> str:
        """The Ray node this actor runs on (hex id)."""
        return ray.get_runtime_context().get_node_id()


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

    def __init__(
        self, actor, episode_id: str, on_actor_died: Callable[[], Awaitable[None]] | None = None
    ):
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
            raise EnvFailure(
                f"{method} failed: the env actor is unavailable ({e})", retryable=True
            ) from e
        except ray.exceptions.RayTaskError as e:
            gone = isinstance(e, KeyError)  # the episode's env was lost in a restart
            # The environment's own exception, not Ray's text of its whole traceback (which
            # stays chained on the EnvFailure).
            cause = getattr(e, "cause", None)
            what = f"{type(cause).__name__}: {cause}" if isinstance(cause, BaseException) else e
            raise EnvFailure(f"{method} failed on the env actor: {what}", retryable=gone) from e

    async def reset(self, task: Task) -> str:
        return _value_or_failure(await self._call("reset", task))

    async def step(self, action: Action) -> StepResult:
        return _value_or_failure(await self._call("step", action))

    async def close(self) -> None:
        _value_or_failure(await self._call("close"))

    async def play(
        self,
        task: Task,
        base_url: str,
        api_key: str,
        timeout_s: float,
        gateway_node_id: str | None = None,
    ) -> ProgramOutcome:
        """``EnvActor.play`` on this episode's actor (an agent program's episode)."""
        return await self._call("play", task, base_url, api_key, timeout_s, gateway_node_id)


def _value_or_failure(value: Any) -> Any:
    """``value``, or ``EnvFailure`` (not retryable: the same code would fail again) with
    the report when the environment's code failed."""
    if isinstance(value, EnvErrorReport):
        raise EnvFailure(value.summary(), report=value)
    return value


class LocalEnv:
    """``EnvClient`` running an environment in-process (tests, evaluation without Ray).

    Like ``RemoteEnv``, an exception from the environment, or a value of the wrong kind,
    becomes ``EnvFailure`` with its ``EnvErrorReport`` (the episode ends as ENV_ERROR, not
    retryable: the same code would fail again)."""

    def __init__(self, env_name: str, env_kwargs: dict[str, Any]):
        self._env = make_env(env_name, **env_kwargs)
        self._task_id = ""

    @classmethod
    def of(cls, env: Any) -> LocalEnv:
        """A client for an environment built already (an ``AgentProgramEnv`` shared by
        episodes, a test's env)."""
        client = cls.__new__(cls)
        client._env, client._task_id = env, ""
        return client

    async def reset(self, task: Task) -> str:
        self._task_id = task.task_id
        return _value_or_failure(guarded_call(self._env, "reset", task.task_id, task))

    async def step(self, action: Action) -> StepResult:
        return _value_or_failure(guarded_call(self._env, "step", self._task_id, action))

    async def close(self) -> None:
        _value_or_failure(guarded_call(self._env, "close", self._task_id))

    async def play(
        self,
        task: Task,
        base_url: str,
        api_key: str,
        timeout_s: float,
        gateway_node_id: str | None = None,
    ) -> ProgramOutcome:
        """An agent program's episode in this process (``play_with_deadline``).

        Raises:
          TypeError: the environment is not an ``AgentProgramEnv``.
        """
        if not isinstance(self._env, AgentProgramEnv):
            raise TypeError(f"{type(self._env).__name__} is not an agent program: no play.")
        return await play_with_deadline(self._env, task, base_url, api_key, timeout_s)


class EnvPool:
    """Spreads episodes over env actors, least-loaded first; resizable during a run.

    Each actor has a stable index (its place in ``actors``, which only grows) and a state:
    *active* (takes leases), *starting* (started by ``resize``; takes leases once it has
    built its environment and answered, so episodes do not queue behind a node the
    autoscaler is still adding), *retiring* (``resize`` shrank the pool: no new lease; it
    is killed when its last episode releases it), *retired* (killed) or *dead* (dead for
    good, its restarts spent).

    Args:
      env_name, env_kwargs: what ``raytunix.envs.make_env`` builds in each actor.
      num_actors: actors the pool starts with (>= 1).
      max_restarts: Ray restarts of a crashed actor.
      resources: extra Ray resources each actor needs (e.g. ``{"raytunix_env": 1}``) so
        that env actors land on their own node pool (and the autoscaler adds nodes offering
        it when the pool grows).
      threads_per_actor: environment calls each actor runs at once (see ``EnvActor``).
      probe_timeout_s: how long a liveness check of an actor that raised
        ``ActorDiedError`` may take, seconds; an actor restarting takes that long at most
        to answer, one dead for good fails at once.
      import_paths: directories each actor puts first on its ``sys.path`` (see
        ``EnvActor``).

    Raises (``lease``):
      EnvPoolExhausted: every actor is dead for good.

    The pool is a plain object: the orchestrator holds the copy that leases and resizes
    (``OrchestratorActor.resize_env_pool``), and the driver keeps its copy in step with
    ``membership`` / ``adopt`` (for profiling drains and shutdown).
    """

    def __init__(
        self,
        env_name: str,
        env_kwargs: dict[str, Any],
        num_actors: int,
        max_restarts: int = 3,
        resources: dict[str, float] | None = None,
        threads_per_actor: int = 256,
        probe_timeout_s: float = 60.0,
        import_paths: Sequence[str] = (),
    ):
        _check_size("num_actors", num_actors)
        self.env_name = env_name
        self.max_restarts = max_restarts
        self.probe_timeout_s = probe_timeout_s
        self._options = {
            "num_cpus": 0,
            "max_restarts": max_restarts,
            "max_task_retries": 0,
            "max_concurrency": 10_000,
            "resources": dict(resources or {}),
            "runtime_env": CPU_ONLY_RUNTIME_ENV,
        }
        self._args = (env_name, env_kwargs, threads_per_actor, tuple(import_paths))
        self.actors: list[Any] = []  # every actor this pool started, by index
        self._load: list[int] = []  # episodes leased per actor now
        self._leases: list[int] = []  # episodes leased per actor since it started
        self._ids = itertools.count()
        self._dead: set[int] = set()
        self.replaced = 0  # actors started in place of ones dead for good
        self._retiring: set[int] = set()
        self._retired: set[int] = set()
        self._starting: dict[int, Any] = {}  # index -> ObjectRef of its readiness probe
        self._probes: dict[int, Any] = {}  # index -> its future (not pickled)
        for _ in range(num_actors):
            self._start_actor()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_probes"] = {}  # futures stay in the process that made them
        return state

    def _start_actor(self) -> int:
        index = len(self.actors)
        self.actors.append(_remote_env_actor().options(**self._options).remote(*self._args))
        self._load.append(0)
        self._leases.append(0)
        return index

    def _serving(self) -> list[int]:
        """Indices of the actors that count towards the pool's size: active or starting."""
        gone = self._dead | self._retiring | self._retired
        return [i for i in range(len(self.actors)) if i not in gone]

    @property
    def size(self) -> int:
        """Actors serving now or about to (active and starting); what ``resize`` sets."""
        return len(self._serving())

    @property
    def retiring(self) -> list[int]:
        """Indices of the actors finishing their episodes before they are killed."""
        return sorted(self._retiring)

    def lease(self, group_id: str) -> tuple[RemoteEnv, int]:
        """An environment client for one episode on the least-loaded active actor (a
        starting one if none is active yet), and that actor's index (give it back with
        ``release``).

        Raises:
          EnvPoolExhausted: no actor is alive.
        """
        self._promote_started()
        serving = self._serving()
        alive = [i for i in serving if i not in self._starting] or serving
        if not alive and self._retiring:  # the active ones died: take retiring ones back
            alive = sorted(self._retiring - self._dead)
            self._retiring.difference_update(alive)
            logger.warning(
                "env pool: no active env actor left; retiring actors %s serve again", alive
            )
        if not alive:
            total = len(self.actors) - len(self._retired)
            raise EnvPoolExhausted(
                f"all {total} env actors are dead (each was restarted up to "
                f"env.env_actor_max_restarts={self.max_restarts} times); no episode can run. "
                "Check the env actors' logs (`ray logs`), fix the cause, and resume the run."
            )
        i = min(alive, key=self._load.__getitem__)
        self._load[i] += 1
        self._leases[i] += 1

        async def on_actor_died() -> None:
            await self._check_alive(i)

        # Named after the episode when the orchestrator says which (its trace flow id).
        key = profiling.current_flow.get() or group_id
        return RemoteEnv(self.actors[i], f"{key}#{next(self._ids)}", on_actor_died), i

    @property
    def num_alive(self) -> int:
        """Actors not known to be dead for good nor retired."""
        return len(self.actors) - len(self._dead | self._retired)

    async def _check_alive(self, index: int) -> None:
        # A call to an actor that is restarting waits for it; one to an actor that will not
        # come back fails at once with ActorDiedError.
        if index in self._dead or index in self._retired:
            return
        try:
            async with asyncio.timeout(self.probe_timeout_s):
                await self.actors[index].num_envs.remote()
        except ray.exceptions.ActorDiedError as e:
            if index in self._dead:  # another episode of it found out first
                return
            self._dead.add(index)
            self._starting.pop(index, None)
            replacement = self._replace(index, e)
            logger.error(
                "env actor %d is dead for good (%d of %d left)%s: %s",
                index,
                self.size,
                len(self.actors) - len(self._retired),
                f"; env actor {replacement} replaces it" if replacement is not None else "",
                e,
            )
        except (ray.exceptions.RayActorError, TimeoutError):
            pass  # restarting or slow: not known dead

    def _replace(self, index: int, death: BaseException) -> int | None:
        """Starts a new actor in place of ``index``, dead for good of ``death``, unless it
        could not build its environment (a new one could not either) or was retiring;
        the new actor's index, or None."""
        if getattr(death, "_actor_init_failed", False) or index in self._retiring:
            return None
        new = self._start_actor()
        self._starting[new] = self.actors[new].num_envs.remote()
        self.replaced += 1
        return new

    def release(self, index: int) -> None:
        """Gives back a lease of ``lease``; a retiring actor whose last episode this was
        is killed."""
        self._load[index] -= 1
        if index in self._retiring and self._load[index] == 0:
            self._retire_now(index)

    def resize(self, num_actors: int) -> dict[str, Any]:
        """Sets the number of serving actors to ``num_actors``; returns ``membership()``.

        Growing takes retiring actors back first (they are warm), then starts new ones
        with the same resources and runtime env as the others; a new actor takes leases
        once it has built its environment (an actor that cannot build it is counted dead,
        with an error in the log). Shrinking retires starting actors first, then the
        least-loaded active ones (the newest on a tie): they get no new lease, the
        episodes on them run to the end, and each is killed when its last one releases it
        (at once when it has none). No episode fails because of a resize. Actors started
        here are owned by the calling process (the orchestrator actor in a run) and end
        with it, as the run does.

        Raises:
          ValueError: ``num_actors`` is not an int >= 1.
        """
        _check_size("num_actors", num_actors)
        self._promote_started()
        serving = self._serving()
        if len(serving) < num_actors:
            back = sorted(self._retiring - self._dead, key=lambda i: -self._load[i])
            back = back[: num_actors - len(serving)]
            self._retiring.difference_update(back)
            started = [self._start_actor() for _ in range(num_actors - len(serving) - len(back))]
            for i in started:
                self._starting[i] = self.actors[i].num_envs.remote()
            logger.info(
                "env pool: %d -> %d actors (%d taken back from retiring, %d started)",
                len(serving),
                num_actors,
                len(back),
                len(started),
            )
        elif len(serving) > num_actors:
            order = sorted(serving, key=lambda i: (i not in self._starting, self._load[i], -i))
            retire = order[: len(serving) - num_actors]
            for i in retire:
                self._starting.pop(i, None)
                self._probes.pop(i, None)
                self._retiring.add(i)
                if self._load[i] == 0:
                    self._retire_now(i)
            logger.info(
                "env pool: %d -> %d actors (retiring %s once their episodes end)",
                len(serving),
                num_actors,
                retire,
            )
        return self.membership()

    def _retire_now(self, index: int) -> None:
        self._retiring.discard(index)
        self._retired.add(index)
        ray.kill(self.actors[index], no_restart=True)
        logger.info("env pool: env actor %d retired after %d episodes", index, self._leases[index])

    def _promote_started(self) -> None:
        """Starting actors that answered their probe become active; one whose environment
        could not be built is counted dead."""
        for index, ref in list(self._starting.items()):
            probe = self._probes.get(index)
            if probe is None:
                probe = self._probes[index] = ref.future()
            if not probe.done():
                continue
            del self._starting[index], self._probes[index]
            error = probe.exception()
            if error is None:
                logger.info("env pool: env actor %d is ready and takes episodes", index)
            elif isinstance(error, ray.exceptions.ActorUnavailableError):
                # Restarting (an episode it took while starting ended its process): ask again.
                self._starting[index] = self.actors[index].num_envs.remote()
            else:
                self._dead.add(index)
                replacement = self._replace(index, error)
                logger.error(
                    "env pool: env actor %d could not start and is left out%s: %s",
                    index,
                    f"; env actor {replacement} replaces it" if replacement is not None else "",
                    error,
                )

    def membership(self) -> dict[str, Any]:
        """The pool's actors as the orchestrator's copy knows them (JSON-able but for the
        handles): ``actors`` (handles, by index), ``active``, ``starting``, ``retiring``,
        ``retired``, ``dead`` (sorted index lists), ``load`` (episodes on each actor now)
        and ``leases`` (episodes leased to each since it started)."""
        self._promote_started()
        serving = self._serving()
        return {
            "actors": list(self.actors),
            "active": [i for i in serving if i not in self._starting],
            "starting": sorted(self._starting),
            "retiring": sorted(self._retiring),
            "retired": sorted(self._retired),
            "dead": sorted(self._dead),
            "load": list(self._load),
            "leases": list(self._leases),
        }

    def adopt(self, membership: dict[str, Any]) -> None:
        """Takes the membership of another copy of this pool (the orchestrator's, after a
        resize), so this copy's ``actors`` and ``members`` match it; loads stay this
        copy's (a copy that leases nothing keeps zeros)."""
        actors = list(membership["actors"])
        added = len(actors) - len(self.actors)
        self.actors = actors
        self._load += [0] * added
        self._leases = list(membership.get("leases", self._leases + [0] * added))
        self._dead = set(membership["dead"])
        self._retired = set(membership["retired"])
        self._retiring = set(membership["retiring"])
        # A retiring actor of the other copy has its episodes there; this copy never
        # leases to it and leaves its killing to that copy (or to shutdown).
        self._starting = {i: self.actors[i].num_envs.remote() for i in membership["starting"]}
        self._probes = {}

    def finish_retiring(self) -> list[int]:
        """Kills the retiring actors with no episode leased from this copy (a copy that
        ``adopt``-ed them from another, now gone); returns their indices."""
        idle = sorted(i for i in self._retiring if self._load[i] == 0)
        for i in idle:
            self._retire_now(i)
        return idle

    def members(self) -> list[tuple[int, Any]]:
        """``(index, handle)`` of every actor not retired and not dead for good (active,
        starting, retiring): the ones whose spans the driver drains."""
        gone = self._dead | self._retired
        return [(i, a) for i, a in enumerate(self.actors) if i not in gone]

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Returns once every serving actor (active or starting) has built its environment
        and answers; the starting ones then take leases.

        Raises:
          EnvBuildError: an actor could not build the environment (the cause, as the actor
            raised it, is in the message).
          TimeoutError: the actors did not start within ``timeout_s`` (e.g. no node has the
            resources they ask for).
        """
        try:
            serving = [self.actors[i] for i in self._serving()]
            ray.get([a.num_envs.remote() for a in serving], timeout=timeout_s)
        except ray.exceptions.ActorDiedError as e:
            if not getattr(e, "_actor_init_failed", False):
                raise
            lines = [line for line in str(getattr(e, "error_msg", e)).splitlines() if line.strip()]
            cause = lines[-1] if lines else str(e)
            prefix = f"{__name__}.EnvBuildError: "
            raise EnvBuildError(
                cause[len(prefix) :]
                if cause.startswith(prefix)
                else f"environment {self.env_name!r} cannot be built in the env actors: {cause}"
            ) from None
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(
                f"the {len(serving)} env actors of {self.env_name!r} were not ready within "
                f"{timeout_s} s; check that the cluster has the resources they ask for "
                "(`ray status`) and the env actors' logs (`ray logs`)."
            ) from None
        self._promote_started()


def _check_size(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"{name}={value!r}: an env pool needs a whole number of actors, at least 1."
        )


_REMOTE_ENV_ACTOR = None


def _remote_env_actor():
    """``ray.remote(EnvActor)``, made once per process (each call would export the class
    again)."""
    global _REMOTE_ENV_ACTOR
    if _REMOTE_ENV_ACTOR is None:
        _REMOTE_ENV_ACTOR = ray.remote(EnvActor)
    return _REMOTE_ENV_ACTOR
