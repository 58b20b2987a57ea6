"""Sandboxes in a pool of Ray actors of their own, scaled apart from the env actors.

    pool = SandboxPool(num_actors=4, limits=SandboxLimits(wall_time_s=5),
                       num_cpus=0.5, resource="sandbox_host")
    client = pool.client()                      # or connect() in any actor of the job
    ws = client.open_workspace("episode-17")    # lands on one actor, stays there
    client.run(ws, ["bash", "-c", "ls"])

Each ``SandboxActor`` is a thin shell around a ``Sandbox``: a threaded actor (one thread
per run in flight, up to ``max_concurrent_runs``), placed by its own Ray resources
(``num_cpus`` per actor and optionally a custom resource, so sandboxes can live on their
own node pool), restarted on failure. The actors are named ``<pool name>-<i>`` in the
job's namespace; ``connect`` finds them from any actor of the job (an env actor's tools,
for one). A work dir lives on the actor that opened it; a call that finds the actor
dead or restarted raises ``SandboxUnavailable`` (the episode ends as ``env_error``, not
as a tool error of the policy).
"""

from __future__ import annotations

import logging
import os
import random
import threading
from typing import Any, Mapping, Sequence

import ray

from raytunix import profiling
from raytunix.sandbox.client import DEFAULT_POOL_NAME
from raytunix.sandbox.sandbox import Sandbox
from raytunix.sandbox.types import (
    SandboxLimits,
    SandboxResult,
    SandboxUnavailable,
    WorkspaceLost,
)

__all__ = ["DEFAULT_POOL_NAME", "RemoteSandbox", "SandboxActor", "SandboxPool", "find_pool"]

logger = logging.getLogger(__name__)

_CPU_ONLY = {"env_vars": {"JAX_PLATFORMS": "cpu"}}  # never take the accelerator


class SandboxActor(profiling.ProfiledActor):
    """Hosts one ``Sandbox`` (run with ``ray.remote``; see ``SandboxPool``).

    Args: as ``Sandbox``. The sandbox's directory is named after the actor id, so a
    restarted actor first deletes what its previous life left.
    """

    def __init__(self, limits: SandboxLimits, backend: str = "auto",
                 root_dir: str | None = None, ro_binds: Sequence[str] = ()) -> None:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        profiling.configure("sandbox", "sandbox")
        actor_id = ray.get_runtime_context().get_actor_id() or f"p{os.getpid()}"
        self._sandbox = Sandbox(limits, backend=backend, root_dir=root_dir,
                                instance=f"actor-{actor_id}", ro_binds=ro_binds)
        self._runs = 0
        self._count_lock = threading.Lock()

    def open_workspace(self, name: str = "") -> str:
        return self._sandbox.open_workspace(name)

    def run(self, workspace: str, argv: Sequence[str], stdin: bytes | str = b"",
            env: Mapping[str, str] | None = None,
            limits: SandboxLimits | None = None) -> SandboxResult:
        with self._count_lock:
            self._runs += 1
        with profiling.span("sandbox_run", "sandbox", {"argv0": str(argv[0]) if argv else ""}):
            return self._sandbox.run(workspace, argv, stdin=stdin, env=env, limits=limits)

    def close_workspace(self, workspace: str) -> None:
        self._sandbox.close_workspace(workspace)

    def close(self) -> None:
        """Closes every work dir and deletes the sandbox's directory."""
        self._sandbox.close()

    def stats(self) -> dict[str, Any]:
        """``pid``, ``backend``, ``isolation``, ``workspaces`` open, ``runs`` started."""
        return {"pid": os.getpid(), "backend": self._sandbox.backend.value,
                "isolation": self._sandbox.isolation.value,
                "workspaces": self._sandbox.num_workspaces(), "runs": self._runs}


class RemoteSandbox:
    """``SandboxClient`` over sandbox actors: each work dir is opened on a random actor
    (of those not known dead) and its calls go there. Blocking; call from a thread.

    Raises (every method):
      SandboxUnavailable: the actor is dead or restarting, or lost the work dir
        (``WorkspaceLost``) when it restarted.
    """

    def __init__(self, actors: Sequence[Any], seed: int | None = None) -> None:
        if not actors:
            raise ValueError("RemoteSandbox needs at least one sandbox actor.")
        self.actors = list(actors)
        self._rng = random.Random(seed)
        self._dead: set[int] = set()

    def open_workspace(self, name: str = "") -> str:
        alive = [i for i in range(len(self.actors)) if i not in self._dead] or \
            list(range(len(self.actors)))
        index = self._rng.choice(alive)
        workspace = self._call(index, "open_workspace", name)
        return f"{index}:{workspace}"

    def run(self, workspace: str, argv: Sequence[str], *, stdin: bytes | str = b"",
            env: Mapping[str, str] | None = None,
            limits: SandboxLimits | None = None) -> SandboxResult:
        index, name = self._split(workspace)
        return self._call(index, "run", name, list(argv), stdin, dict(env or {}), limits)

    def close_workspace(self, workspace: str) -> None:
        index, name = self._split(workspace)
        try:
            self._call(index, "close_workspace", name)
        except SandboxUnavailable:
            pass  # gone with its actor

    def _split(self, workspace: str) -> tuple[int, str]:
        index, _, name = workspace.partition(":")
        if not (index.isdigit() and int(index) < len(self.actors) and name):
            raise WorkspaceLost(f"work dir {workspace!r} was not opened by this client.")
        return int(index), name

    def _call(self, index: int, method: str, *args):
        actor = self.actors[index]
        try:
            return ray.get(getattr(actor, method).remote(*args))
        except ray.exceptions.ActorDiedError as e:
            self._dead.add(index)
            raise SandboxUnavailable(f"sandbox actor {index} died during {method}: {e}") from e
        except ray.exceptions.RayActorError as e:  # restarting, or unreachable
            raise SandboxUnavailable(
                f"sandbox actor {index} is unavailable for {method}: {e}") from e
        except ray.exceptions.RayTaskError as e:
            cause = getattr(e, "cause", None)  # the exception raised in the actor
            if isinstance(cause, Exception):
                raise cause from None
            raise


class SandboxPool:
    """Starts ``num_actors`` named ``SandboxActor``s.

    Args:
      num_actors: actors in the pool (>= 1).
      limits, backend, root_dir, ro_binds: each actor's ``Sandbox``.
      num_cpus: Ray CPUs each actor reserves (>= 0; fractions allowed).
      resource: a custom Ray resource each actor needs one unit of (e.g.
        ``"sandbox_host"``, declared on the nodes meant for sandboxes), or None.
      max_concurrent_runs: commands one actor runs at once (>= 1).
      max_restarts: Ray restarts of a crashed actor.
      name: the actors are named ``<name>-0``, ``<name>-1``, ... in the job's namespace;
        actors left with those names (a previous pool not shut down) are killed first.

    Raises:
      ValueError: a count is out of range.
    """

    def __init__(self, num_actors: int = 1, limits: SandboxLimits | None = None, *,
                 backend: str = "auto", root_dir: str | None = None,
                 ro_binds: Sequence[str] = (), num_cpus: float = 0.5,
                 resource: str | None = None, max_concurrent_runs: int = 32,
                 max_restarts: int = 3, name: str = DEFAULT_POOL_NAME) -> None:
        if num_actors < 1:
            raise ValueError(f"num_actors={num_actors}: a sandbox pool needs at least one actor.")
        if num_cpus < 0:
            raise ValueError(f"num_cpus={num_cpus} must be >= 0.")
        if max_concurrent_runs < 1:
            raise ValueError(f"max_concurrent_runs={max_concurrent_runs} must be >= 1.")
        self.name = name
        options = dict(num_cpus=num_cpus, max_concurrency=max_concurrent_runs,
                       max_restarts=max_restarts, max_task_retries=0,
                       resources={resource: 1} if resource else {}, runtime_env=_CPU_ONLY)
        cls = ray.remote(SandboxActor)
        self.actors = []
        for i in range(num_actors):
            actor_name = f"{name}-{i}"
            _kill_named(actor_name)
            self.actors.append(cls.options(name=actor_name, **options).remote(
                limits or SandboxLimits(), backend, root_dir, tuple(ro_binds)))
        _CLIENTS.pop(name, None)

    @classmethod
    def from_config(cls, sandbox, name: str = DEFAULT_POOL_NAME) -> "SandboxPool":
        """The pool a run's ``sandbox`` config section (``raytunix.config.SandboxConfig``)
        describes."""
        return cls(sandbox.num_actors, SandboxLimits.from_config(sandbox),
                   backend=sandbox.backend, root_dir=sandbox.root_dir or None,
                   num_cpus=sandbox.num_cpus_per_actor, resource=sandbox.resource or None,
                   max_concurrent_runs=sandbox.max_concurrent_runs,
                   max_restarts=sandbox.actor_max_restarts, name=name)

    def client(self, seed: int | None = None) -> RemoteSandbox:
        return RemoteSandbox(self.actors, seed)

    def wait_ready(self, timeout_s: float = 60.0) -> list[dict[str, Any]]:
        """Blocks until every actor has built its sandbox; returns their ``stats``.

        Raises:
          ray.exceptions.RayActorError: an actor failed to start (e.g. ``backend="bwrap"``
            where bubblewrap does not work; the error says why).
          ray.exceptions.GetTimeoutError: not ready within ``timeout_s`` seconds.
        """
        return ray.get([actor.stats.remote() for actor in self.actors], timeout=timeout_s)

    def stats(self) -> list[dict[str, Any]]:
        return ray.get([actor.stats.remote() for actor in self.actors])

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Deletes the actors' work dirs (waiting up to ``timeout_s`` seconds; a dead or
        stuck actor's stay in the temp dir) and kills the actors."""
        try:
            ray.get([actor.close.remote() for actor in self.actors], timeout=timeout_s)
        except (ray.exceptions.RayError, TimeoutError) as e:
            logger.warning("sandbox: not every actor cleaned up before shutdown: %s", e)
        for actor in self.actors:
            ray.kill(actor)
        _CLIENTS.pop(self.name, None)


def _kill_named(actor_name: str) -> None:
    try:
        stale = ray.get_actor(actor_name)
    except ValueError:
        return
    logger.warning("sandbox: killing the actor %r left by an earlier pool", actor_name)
    ray.kill(stale)


_CLIENTS: dict[str, RemoteSandbox] = {}
_CLIENTS_LOCK = threading.Lock()


def find_pool(name: str = DEFAULT_POOL_NAME) -> RemoteSandbox | None:
    """A client for the pool started as ``name`` in this Ray job, or None when Ray is not
    running or no such pool exists. Cached per process."""
    if not ray.is_initialized():
        return None
    with _CLIENTS_LOCK:
        client = _CLIENTS.get(name)
        if client is not None and len(client._dead) < len(client.actors):
            return client
        actors = []
        while True:
            try:
                actors.append(ray.get_actor(f"{name}-{len(actors)}"))
            except ValueError:
                break
        if not actors:
            return None
        _CLIENTS[name] = client = RemoteSandbox(actors)
        return client
