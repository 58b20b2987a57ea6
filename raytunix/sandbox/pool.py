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

The pool resizes during a run (``SandboxPool.resize``): clients look the actors up again
every few seconds, so new ones get work dirs; an actor removed from the pool refuses new
work dirs at once (a client then opens the work dir on another actor), serves the ones it
holds until they are closed, and is killed by ``SandboxPool.reap`` once it holds none.
"""

from __future__ import annotations

import logging
import os
import random
import re
import threading
import time
from typing import Any, Mapping, Sequence

import ray

from raytunix import profiling
from raytunix.cluster import heap
from raytunix.sandbox.sandbox import Sandbox
from raytunix.sandbox.types import (
    DEFAULT_POOL_NAME,
    SandboxLimits,
    SandboxResult,
    SandboxUnavailable,
    WorkspaceLost,
)

__all__ = [
    "DEFAULT_POOL_NAME",
    "RemoteSandbox",
    "SandboxActor",
    "SandboxPool",
    "SandboxRetiring",
    "find_pool",
]

logger = logging.getLogger(__name__)

_CPU_ONLY = {"env_vars": {"JAX_PLATFORMS": "cpu"}}  # never take the accelerator

# How often a client looks the pool's actors up again (seconds): a grown pool's new actors
# get work dirs within this time.
REFRESH_S = 5.0


class SandboxRetiring(SandboxUnavailable):
    """The sandbox actor is leaving the pool and opens no new work dir; the client opens
    it on another actor."""


class SandboxActor(profiling.ProfiledActor):
    """Hosts one ``Sandbox`` (run with ``ray.remote``; see ``SandboxPool``).

    Args: as ``Sandbox``. The sandbox's directory is named after the actor id, so a
    restarted actor first deletes what its previous life left.
    """

    def __init__(
        self,
        limits: SandboxLimits,
        backend: str = "auto",
        root_dir: str | None = None,
        ro_binds: Sequence[str] = (),
        allow_weak_isolation: bool = False,
    ) -> None:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        profiling.configure("sandbox", "sandbox")
        actor_id = ray.get_runtime_context().get_actor_id() or f"p{os.getpid()}"
        self._sandbox = Sandbox(
            limits,
            backend=backend,
            root_dir=root_dir,
            instance=f"actor-{actor_id}",
            ro_binds=ro_binds,
            allow_weak_isolation=allow_weak_isolation,
        )
        self._runs = 0
        self._count_lock = threading.Lock()
        self._retiring = False
        heap.settle()  # start-up state out of the garbage collector's scans

    def open_workspace(self, name: str = "") -> str:
        """A new work dir's id.

        Raises:
          SandboxRetiring: ``retire`` was called; open it on another actor.
        """
        with self._count_lock:  # after retire() returns, no work dir is opened here
            if self._retiring:
                raise SandboxRetiring(
                    "this sandbox actor is leaving the pool; open the work dir on another one."
                )
            return self._sandbox.open_workspace(name)

    def retire(self) -> int:
        """Refuses new work dirs from now on; returns how many this actor still holds (it
        serves them until they are closed)."""
        with self._count_lock:
            self._retiring = True
            return self._sandbox.num_workspaces()

    def run(
        self,
        workspace: str,
        argv: Sequence[str],
        stdin: bytes | str = b"",
        env: Mapping[str, str] | None = None,
        limits: SandboxLimits | None = None,
    ) -> SandboxResult:
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
        """``pid``, ``backend``, ``isolation``, ``missing`` (the guarantees that do not
        hold here, ``Sandbox.missing_guarantees``), ``workspaces`` open, ``runs`` started."""
        return {
            "pid": os.getpid(),
            "backend": self._sandbox.backend.value,
            "isolation": self._sandbox.isolation.value,
            "missing": list(self._sandbox.missing_guarantees),
            "workspaces": self._sandbox.num_workspaces(),
            "runs": self._runs,
            "retiring": self._retiring,
        }


class RemoteSandbox:
    """``SandboxClient`` over sandbox actors: each work dir is opened on a random actor
    (of those not known dead or retiring) and its calls go there. Blocking; call from a
    thread.

    Args:
      actors: the pool's actors, a list (indexed from 0) or ``{index: handle}``.
      seed: seeds the choice of actor.
      pool_name: the pool's name; when given, the actors named ``<pool_name>-<index>`` are
        looked up again every ``refresh_s`` seconds and whenever none is left to open a
        work dir on, so a resized pool's new actors are used and its removed ones are not.
      refresh_s: seconds between two look-ups.

    Raises (every method):
      SandboxUnavailable: the actor is dead or restarting, or lost the work dir
        (``WorkspaceLost``) when it restarted.
    """

    def __init__(
        self,
        actors: Sequence[Any] | Mapping[int, Any],
        seed: int | None = None,
        pool_name: str | None = None,
        refresh_s: float = REFRESH_S,
    ) -> None:
        self.actors: dict[int, Any] = dict(
            actors if isinstance(actors, Mapping) else enumerate(actors)
        )
        if not self.actors and pool_name is None:
            raise ValueError("RemoteSandbox needs at least one sandbox actor.")
        self._rng = random.Random(seed)
        self._dead: set[int] = set()
        self._retiring: set[int] = set()  # refused a work dir: leaving the pool
        self._pool_name = pool_name
        self._refresh_s = refresh_s
        self._refreshed = time.monotonic()
        self._lock = threading.Lock()

    def _candidates(self) -> list[int]:
        return [i for i in self.actors if i not in self._dead and i not in self._retiring]

    def refresh(self) -> None:
        """Looks the pool's actors up by name again (a no-op without ``pool_name``):
        actors new to this client are added; handles of those gone are kept, so calls on
        their work dirs fail as a dead actor's do."""
        if self._pool_name is None:
            return
        found = _named_actors(self._pool_name, self.actors)
        with self._lock:
            self._refreshed = time.monotonic()
            for index, handle in found.items():
                if index not in self.actors:
                    self.actors[index] = handle
            self._dead.update(set(self.actors) - set(found))

    def open_workspace(self, name: str = "") -> str:
        """Opens a work dir on a random actor; one that is leaving the pool, dead or
        unavailable is skipped for another.

        Raises:
          SandboxUnavailable: no actor could open it (the last actor's error).
        """
        if time.monotonic() - self._refreshed > self._refresh_s:
            self.refresh()
        tried: set[int] = set()
        error: SandboxUnavailable | None = None
        while True:
            alive = [i for i in self._candidates() if i not in tried]
            if not alive and not tried:
                self.refresh()
                alive = self._candidates()
            if not alive and not tried:  # every one known dead: try one (it may be back)
                alive = [i for i in self.actors if i not in self._retiring]
            if not alive:
                raise error or SandboxUnavailable(
                    f"no sandbox actor of pool {self._pool_name!r} takes a new work dir "
                    "(every one is leaving the pool)."
                )
            index = self._rng.choice(alive)
            tried.add(index)
            try:
                return f"{index}:{self._call(index, 'open_workspace', name)}"
            except SandboxRetiring as e:
                with self._lock:
                    self._retiring.add(index)
                error = e
            except SandboxUnavailable as e:  # dead (marked by _call) or restarting
                error = e

    def run(
        self,
        workspace: str,
        argv: Sequence[str],
        *,
        stdin: bytes | str = b"",
        env: Mapping[str, str] | None = None,
        limits: SandboxLimits | None = None,
    ) -> SandboxResult:
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
        if not (index.isdigit() and int(index) in self.actors and name):
            raise WorkspaceLost(f"work dir {workspace!r} was not opened by this client.")
        return int(index), name

    def _call(self, index: int, method: str, *args):
        actor = self.actors[index]
        try:
            return ray.get(getattr(actor, method).remote(*args))
        except ray.exceptions.ActorDiedError as e:
            with self._lock:
                self._dead.add(index)
            raise SandboxUnavailable(f"sandbox actor {index} died during {method}: {e}") from e
        except ray.exceptions.RayActorError as e:  # restarting, or unreachable
            raise SandboxUnavailable(
                f"sandbox actor {index} is unavailable for {method}: {e}"
            ) from e
        except ray.exceptions.RayTaskError as e:
            cause = getattr(e, "cause", None)  # the exception raised in the actor
            if isinstance(cause, Exception):
                raise cause from None
            raise


class SandboxPool:
    """Starts ``num_actors`` named ``SandboxActor``s; ``resize`` grows or shrinks the pool
    while tools use it.

    Args:
      num_actors: actors in the pool (>= 1).
      limits, backend, root_dir, ro_binds, allow_weak_isolation: each actor's ``Sandbox``.
      num_cpus: Ray CPUs each actor reserves (>= 0; fractions allowed).
      resource: a custom Ray resource each actor needs one unit of (e.g.
        ``"sandbox_host"``, declared on the nodes meant for sandboxes), or None.
      max_concurrent_runs: commands one actor runs at once (>= 1).
      max_restarts: Ray restarts of a crashed actor.
      name: the actors are named ``<name>-0``, ``<name>-1``, ... in the job's namespace
        (an actor added by ``resize`` takes the next number never used); actors left with
        those names (a previous pool not shut down) are killed first.

    Raises:
      ValueError: a count is out of range.
    """

    def __init__(
        self,
        num_actors: int = 1,
        limits: SandboxLimits | None = None,
        *,
        backend: str = "auto",
        root_dir: str | None = None,
        ro_binds: Sequence[str] = (),
        num_cpus: float = 0.5,
        resource: str | None = None,
        max_concurrent_runs: int = 32,
        max_restarts: int = 3,
        name: str = DEFAULT_POOL_NAME,
        allow_weak_isolation: bool = False,
    ) -> None:
        _check_size(num_actors)
        if num_cpus < 0:
            raise ValueError(f"num_cpus={num_cpus} must be >= 0.")
        if max_concurrent_runs < 1:
            raise ValueError(f"max_concurrent_runs={max_concurrent_runs} must be >= 1.")
        self.name = name
        self._options = {
            "num_cpus": num_cpus,
            "max_concurrency": max_concurrent_runs,
            "max_restarts": max_restarts,
            "max_task_retries": 0,
            "resources": {resource: 1} if resource else {},
            "runtime_env": _CPU_ONLY,
        }
        self._args = (
            limits or SandboxLimits(),
            backend,
            root_dir,
            tuple(ro_binds),
            allow_weak_isolation,
        )
        self._slots: dict[int, Any] = {}  # index -> handle, of every actor not yet killed
        self._retiring: set[int] = set()
        self.retired: list[int] = []  # indices of the actors killed by reap, in order
        self._next = 0
        for _ in range(num_actors):
            self._start_actor()
        _CLIENTS.pop(name, None)

    def _start_actor(self) -> int:
        index, self._next = self._next, self._next + 1
        actor_name = f"{self.name}-{index}"
        _kill_named(actor_name)
        self._slots[index] = (
            ray.remote(SandboxActor).options(name=actor_name, **self._options).remote(*self._args)
        )
        return index

    @property
    def actors(self) -> list[Any]:
        """Handles of the actors not yet killed (serving and retiring), by index."""
        return [self._slots[i] for i in sorted(self._slots)]

    def members(self) -> list[tuple[int, Any]]:
        """``(index, handle)`` of the actors not yet killed (serving and retiring), by
        index: the ones whose spans the driver drains, named by their stable index."""
        return sorted(self._slots.items())

    @property
    def size(self) -> int:
        """Actors that take new work dirs (what ``resize`` sets)."""
        return len(self._slots) - len(self._retiring)

    @classmethod
    def from_config(cls, sandbox, name: str = DEFAULT_POOL_NAME) -> "SandboxPool":
        """The pool a run's ``sandbox`` config section (``raytunix.config.SandboxConfig``)
        describes."""
        return cls(
            sandbox.num_actors,
            SandboxLimits.from_config(sandbox),
            backend=sandbox.backend,
            root_dir=sandbox.root_dir or None,
            num_cpus=sandbox.num_cpus_per_actor,
            resource=sandbox.resource or None,
            max_concurrent_runs=sandbox.max_concurrent_runs,
            max_restarts=sandbox.actor_max_restarts,
            name=name,
            allow_weak_isolation=sandbox.allow_weak_isolation,
        )

    def client(self, seed: int | None = None) -> RemoteSandbox:
        active = {i: a for i, a in self._slots.items() if i not in self._retiring}
        return RemoteSandbox(active, seed, pool_name=self.name)

    def resize(self, num_actors: int, timeout_s: float = 30.0) -> dict[str, list[int]]:
        """Sets the number of actors taking new work dirs to ``num_actors``.

        Growing starts actors with the same options as the others (clients find them
        within ``REFRESH_S`` seconds). Shrinking retires the actors holding the fewest
        work dirs (the newest on a tie): each refuses new work dirs at once, serves the
        ones it holds until they are closed, and is killed by ``reap`` (called here and
        by the driver once per RL step) when it holds none, so no tool call fails
        because of a resize.

        Returns:
          ``membership()`` after the change.

        Raises:
          ValueError: ``num_actors`` is not an int >= 1.
        """
        _check_size(num_actors)
        serving = [i for i in sorted(self._slots) if i not in self._retiring]
        if len(serving) < num_actors:
            started = [self._start_actor() for _ in range(num_actors - len(serving))]
            logger.info(
                "sandbox pool %r: %d -> %d actors (started %s)",
                self.name,
                len(serving),
                num_actors,
                started,
            )
        elif len(serving) > num_actors:
            held = self._workspaces(serving, timeout_s)
            order = sorted(serving, key=lambda i: (held.get(i, 0), -i))
            retire = order[: len(serving) - num_actors]
            refs = [self._slots[i].retire.remote() for i in retire]
            try:  # once retire() returned, the actor opens no new work dir
                ray.get(refs, timeout=timeout_s)
            except (ray.exceptions.RayError, TimeoutError) as e:
                logger.warning(
                    "sandbox pool %r: not every retiring actor answered: %s", self.name, e
                )
            self._retiring.update(retire)
            logger.info(
                "sandbox pool %r: %d -> %d actors (retiring %s once their work dirs are closed)",
                self.name,
                len(serving),
                num_actors,
                retire,
            )
        _CLIENTS.pop(self.name, None)
        self.reap(timeout_s)
        return self.membership()

    def reap(self, timeout_s: float = 10.0) -> list[int]:
        """Kills the retiring actors that hold no work dir (or are dead); returns their
        indices."""
        if not self._retiring:
            return []
        retiring = sorted(self._retiring)
        held = self._workspaces(retiring, timeout_s)
        done = [i for i in retiring if held.get(i, 1) == 0]
        for i in done:
            actor = self._slots.pop(i)
            self._retiring.discard(i)
            try:
                ray.get(actor.close.remote(), timeout=timeout_s)
            except (ray.exceptions.RayError, TimeoutError):
                pass  # dead already, or stuck: its work dirs stay in the temp dir
            ray.kill(actor, no_restart=True)
            self.retired.append(i)
            logger.info("sandbox pool %r: actor %d retired", self.name, i)
        return done

    def _workspaces(self, indices: Sequence[int], timeout_s: float) -> dict[int, int]:
        """Work dirs each actor holds; a dead actor holds 0, one that does not answer in
        ``timeout_s`` is left out."""
        refs = {i: self._slots[i].stats.remote() for i in indices}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
        held = {}
        for i, ref in refs.items():
            if ref not in ready:
                continue
            try:
                held[i] = ray.get(ref)["workspaces"]
            except ray.exceptions.ActorDiedError:
                held[i] = 0
            except ray.exceptions.RayError:
                pass  # restarting: not known
        return held

    def membership(self) -> dict[str, list[int]]:
        """``active`` and ``retiring`` actor indices now, and those ``retired`` so far."""
        return {
            "active": sorted(set(self._slots) - self._retiring),
            "retiring": sorted(self._retiring),
            "retired": list(self.retired),
        }

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


def _check_size(num_actors: Any) -> None:
    if isinstance(num_actors, bool) or not isinstance(num_actors, int) or num_actors < 1:
        raise ValueError(
            f"num_actors={num_actors!r}: a sandbox pool needs a whole number of actors, at least 1."
        )


def _kill_named(actor_name: str) -> None:
    try:
        stale = ray.get_actor(actor_name)
    except ValueError:
        return
    logger.warning("sandbox: killing the actor %r left by an earlier pool", actor_name)
    ray.kill(stale)


def _named_actors(name: str, known: Mapping[int, Any] | None = None) -> dict[int, Any]:
    """``{index: handle}`` of the live actors named ``<name>-<index>`` in this job's
    namespace; handles in ``known`` are reused instead of looked up again."""
    known = known or {}
    pattern = re.compile(re.escape(name) + r"-(\d+)")
    found = {}
    for actor_name in ray.util.list_named_actors():
        match = pattern.fullmatch(actor_name)
        if match is None:
            continue
        index = int(match.group(1))
        if index in known:
            found[index] = known[index]
            continue
        try:
            found[index] = ray.get_actor(actor_name)
        except ValueError:
            pass  # killed since it was listed
    return found


_CLIENTS: dict[str, RemoteSandbox] = {}
_CLIENTS_LOCK = threading.Lock()


def find_pool(name: str = DEFAULT_POOL_NAME) -> RemoteSandbox | None:
    """A client for the pool started as ``name`` in this Ray job, or None when Ray is not
    running or no such pool exists. Cached per process; the client follows the pool's
    resizes (``RemoteSandbox.refresh``)."""
    if not ray.is_initialized():
        return None
    with _CLIENTS_LOCK:
        client = _CLIENTS.get(name)
        if client is not None and len(client._dead) < len(client.actors):
            return client
        actors = _named_actors(name)
        if not actors:
            return None
        _CLIENTS[name] = client = RemoteSandbox(actors, pool_name=name)
        return client
