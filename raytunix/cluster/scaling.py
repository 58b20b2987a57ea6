"""Scaling a running run's env and sandbox actor pools from outside it.

    raytunix scale RUN_DIR --env-actors 8 --sandbox-actors 2   # write_scale_request
    # the driver, once per RL step:
    record = watcher.poll(job.orchestrator, step)               # ScaleWatcher

A request is a small JSON file, ``RUN_DIR/scale.json``, replaced atomically (written to a
temporary file in the same directory, then renamed), so the driver never reads half of
one. It holds the wanted sizes and a request id; the driver applies each request id once,
logs a line and a ``{"phase": "scale", ...}`` record in ``metrics.jsonl``. The file
stays: it is the size the user last asked for, and a resumed run applies it at its first
RL step.

The env pool is resized by the orchestrator, which holds the copy of the pool that leases
environments (``OrchestratorActor.resize_env_pool``); the driver adopts the membership it
returns, so its profiling drains and its shutdown reach every actor. The sandbox pool
lives in the driver and is resized there (``SandboxPool.resize``); its retiring actors are
killed by ``SandboxPool.reap`` once their work dirs are closed, checked at every poll.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Any

SCALE_FILE = "scale.json"


class ScaleRequestError(ValueError):
    """A scale request, or the run directory it is for, is not valid; the message names
    the bad value and what to pass instead."""


@dataclasses.dataclass(frozen=True)
class ScaleRequest:
    """Wanted pool sizes for a running run (None: leave that pool as it is).

    Attributes:
      env_actors: env actors wanted (>= 1).
      sandbox_actors: sandbox actors wanted (>= 1).
      request_id: unique per request; the driver applies each id once.
      requested_at: when the request was written (Unix time, seconds).
    """

    env_actors: int | None
    sandbox_actors: int | None
    request_id: str
    requested_at: float

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _check_count(flag: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ScaleRequestError(f"{flag} {value!r} is not a whole number; pass an int >= 1.")
    if value < 1:
        raise ScaleRequestError(
            f"{flag} {value} is below 1; a pool needs at least one actor (pass an int >= 1)."
        )
    return value


def scale_path(run_dir: str) -> str:
    return os.path.join(run_dir, SCALE_FILE)


def write_scale_request(
    run_dir: str, env_actors: int | None = None, sandbox_actors: int | None = None
) -> ScaleRequest:
    """Writes ``RUN_DIR/scale.json`` atomically; returns the request written.

    Raises:
      ScaleRequestError: ``run_dir`` is not a run directory (no ``config.yaml``) or has
        finished (``summary.json``), a count is not an int >= 1, or neither count is given.
      OSError: the file cannot be written.
    """
    env_actors = _check_count("--env-actors", env_actors)
    sandbox_actors = _check_count("--sandbox-actors", sandbox_actors)
    if env_actors is None and sandbox_actors is None:
        raise ScaleRequestError("nothing to scale; pass --env-actors N and/or --sandbox-actors M.")
    if not os.path.isdir(run_dir):
        raise ScaleRequestError(
            f"run directory {run_dir!r} does not exist; pass the "
            "directory `raytunix train` printed at start (under runs/)."
        )
    if not os.path.exists(os.path.join(run_dir, "config.yaml")):
        raise ScaleRequestError(
            f"{run_dir!r} has no config.yaml, so it is not a raytunix run "
            "directory; pass the directory `raytunix train` printed at "
            "start (under runs/)."
        )
    if os.path.exists(os.path.join(run_dir, "summary.json")):
        raise ScaleRequestError(
            f"{run_dir!r} has finished (it has its summary.json), so nothing would apply the "
            "request; to train it further at another size, resume it with "
            "`raytunix train --resume RUN_DIR learner.rl_steps=N env.num_env_actors=K`."
        )
    request = ScaleRequest(env_actors, sandbox_actors, uuid.uuid4().hex, time.time())
    fd, tmp = tempfile.mkstemp(prefix=".scale-", suffix=".tmp", dir=run_dir)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(request.to_json(), f)
        os.replace(tmp, scale_path(run_dir))
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return request


def read_scale_request(run_dir: str) -> ScaleRequest | None:
    """The request in ``RUN_DIR/scale.json``, or None when there is none.

    Raises:
      ScaleRequestError: the file is not a valid request (the message says what is wrong).
    """
    path = scale_path(run_dir)
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        return None
    try:
        tree = json.loads(text)
    except json.JSONDecodeError as e:
        raise ScaleRequestError(
            f"{path} is not JSON ({e}); write it with `raytunix scale`."
        ) from None
    if not isinstance(tree, dict) or not isinstance(tree.get("request_id"), str):
        raise ScaleRequestError(f"{path} holds no request_id; write it with `raytunix scale`.")
    env = _check_count("env_actors", tree.get("env_actors"))
    sandbox = _check_count("sandbox_actors", tree.get("sandbox_actors"))
    requested_at = tree.get("requested_at", 0.0)
    if isinstance(requested_at, bool) or not isinstance(requested_at, (int, float)):
        raise ScaleRequestError(f"{path}: requested_at={requested_at!r} is not a number.")
    return ScaleRequest(env, sandbox, tree["request_id"], float(requested_at))


class ScaleWatcher:
    """The driver's side: applies each new request in ``RUN_DIR/scale.json`` once.

    Args:
      run_dir: the run directory.
      env_pool: the driver's copy of the run's ``EnvPool``; it adopts the membership the
        orchestrator returns after a resize.
      sandbox_pool: the run's ``SandboxPool``, or None when the run has none.
      say: prints a line for the user (the driver's log).
    """

    def __init__(
        self, run_dir: str, env_pool, sandbox_pool=None, say: Callable[[str], None] = print
    ) -> None:
        self.run_dir = run_dir
        self.env_pool = env_pool
        self.sandbox_pool = sandbox_pool
        self._say = say
        self._applied: str | None = None  # request id applied last
        self._bad: str | None = None  # the error of an invalid file, reported once

    def poll(self, orchestrator, step: int) -> dict[str, Any] | None:
        """Applies a request not applied yet; returns the metrics record to log
        (``{"phase": "scale", "step", "request_id", ...}``), or None when nothing
        changed. An invalid file or a failed resize is reported in the record (and said
        once), never raised: the run goes on at its current size.

        Args:
          orchestrator: the ``OrchestratorActor`` handle whose pool leases environments.
          step: the RL step about to run (for the record).
        """
        if self.sandbox_pool is not None:
            self.sandbox_pool.reap()
        if self.env_pool.retiring:  # killed by the orchestrator once drained: stop draining
            self._follow_env_pool(orchestrator)  # their spans from the next window on
        try:
            request = read_scale_request(self.run_dir)
        except ScaleRequestError as e:
            if str(e) == self._bad:
                return None
            self._bad = str(e)
            self._say(f"scale request ignored: {e}")
            return {"phase": "scale", "step": step, "error": str(e)}
        self._bad = None
        if request is None or request.request_id == self._applied:
            return None
        self._applied = request.request_id
        record: dict[str, Any] = {
            "phase": "scale",
            "step": step,
            "request_id": request.request_id,
            "requested_at": request.requested_at,
        }
        notes = []
        if request.env_actors is not None:
            record.update(self._resize_env(orchestrator, request.env_actors))
            notes.append(self._note("env actors", record, "env"))
        if request.sandbox_actors is not None:
            record.update(self._resize_sandbox(request.sandbox_actors))
            notes.append(self._note("sandbox actors", record, "sandbox"))
        self._say(f"scale request at RL step {step}: " + "; ".join(notes))
        return record

    def _follow_env_pool(self, orchestrator) -> None:
        import ray

        try:
            self.env_pool.adopt(ray.get(orchestrator.env_pool_membership.remote()))
        except ray.exceptions.RayError:
            pass  # the orchestrator is gone: the next batch says so

    def _resize_env(self, orchestrator, n: int) -> dict[str, Any]:
        import ray

        before = self.env_pool.size
        try:
            membership = ray.get(orchestrator.resize_env_pool.remote(n))
        except ray.exceptions.RayError as e:
            return {"env_actors_before": before, "env_error": f"{type(e).__name__}: {e}"}
        self.env_pool.adopt(membership)
        return {
            "env_actors_before": before,
            "env_actors": n,
            **{f"env_{k}": membership[k] for k in ("active", "starting", "retiring", "retired")},
        }

    def _resize_sandbox(self, n: int) -> dict[str, Any]:
        if self.sandbox_pool is None:
            return {
                "sandbox_error": "this run has no sandbox pool (its environment runs no "
                "sandboxed tools); --sandbox-actors has no effect"
            }
        import ray

        before = self.sandbox_pool.size
        try:
            membership = self.sandbox_pool.resize(n)
        except ray.exceptions.RayError as e:
            return {"sandbox_actors_before": before, "sandbox_error": f"{type(e).__name__}: {e}"}
        return {
            "sandbox_actors_before": before,
            "sandbox_actors": n,
            **{f"sandbox_{k}": v for k, v in membership.items()},
        }

    @staticmethod
    def _note(what: str, record: dict[str, Any], prefix: str) -> str:
        error = record.get(f"{prefix}_error")
        if error:
            return f"{what} not resized: {error}"
        line = f"{what} {record[f'{prefix}_actors_before']} -> {record[f'{prefix}_actors']}"
        retiring = record.get(f"{prefix}_retiring")
        if retiring:
            line += f" (retiring {retiring} once their work is done)"
        return line
