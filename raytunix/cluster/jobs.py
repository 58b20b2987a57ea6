"""Runs as Ray jobs: ``raytunix submit`` and ``raytunix status``.

A submission resolves and validates the config here, on the user's machine, so a bad key
fails before anything reaches the cluster. It then copies the working directory as Ray
would ship it (without ``WORKING_DIR_EXCLUDES``, nor what its ``.gitignore`` and
``.rayignore`` files name; ``stage_working_dir``) into a snapshot, says what it leaves out,
validates the config again in that snapshot, in a fresh process, as the job will read it,
and ships exactly that snapshot (Ray's ``runtime_env`` ``working_dir``). The job's
entrypoint is ``python -m raytunix.cli train`` with the same arguments: ``-m`` puts the
job's copy first on ``sys.path``, so a shipped ``raytunix/`` is the one that runs whatever
``raytunix`` the cluster has on its ``PATH``, and the job checks it
(``SHIPPED_PACKAGE_ENV``):

    raytunix submit --address http://HEAD:8265 --config default learner.rl_steps=50
    raytunix status --address http://HEAD:8265            # raytunix jobs on that cluster
    raytunix status --address http://HEAD:8265 JOB_ID     # one job, with its run directory

The job server is the Ray dashboard's (``ray start --head --include-dashboard=true``, port
8265 by default). The address comes from ``--address``, else ``RAY_API_SERVER_ADDRESS``,
else an ``http://`` ``RAY_ADDRESS``, else the local head.

Token authentication: Ray 2.60 clusters check a bearer token. Ray's job client only sends it
when ``RAY_AUTH_MODE=token`` is set in the client's environment; for a head on this machine
we set it when ``~/.ray/auth_token`` exists (the token ``ray start`` uses), and for a remote
head when ``RAY_AUTH_TOKEN`` or ``RAY_AUTH_TOKEN_PATH`` names its token.
"""

from __future__ import annotations

import asyncio
import datetime
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import uuid
from collections.abc import Sequence
from typing import Any, TextIO

from raytunix.config import ConfigError, load_config

DEFAULT_ADDRESS = "http://127.0.0.1:8265"

# Never shipped with the working directory: run outputs, version control, caches and build
# products (gitignore syntax, as Ray's runtime_env "excludes" reads it).
WORKING_DIR_EXCLUDES = (
    "runs/",
    ".git/",
    "__pycache__/",
    "*.pyc",
    ".pytest_cache/",
    ".ruff_cache/",
    ".mypy_cache/",
    ".benchmarks/",
    "*.egg-info/",
    ".venv/",
    "build/",
    "dist/",
)

# Set in a job whose shipped working dir holds a raytunix/ package: the job then refuses to
# run any other raytunix (``check_shipped_package``).
SHIPPED_PACKAGE_ENV = "RAYTUNIX_SHIPPED_PACKAGE"

# Seconds the snapshot's config check (a fresh ``python -m raytunix.cli config``) may take.
STAGED_CHECK_TIMEOUT_S = 300.0

# Marks our jobs among the cluster's others; `raytunix status` lists only these.
METADATA_KEY = "raytunix"

_RUN_DIR_LINE = re.compile(r"run directory: (\S+)")
_LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "0.0.0.0"})


class JobError(RuntimeError):
    """The cluster cannot be reached, or a job cannot be submitted or found; the message
    names the address or job and says what to do."""


def resolve_address(address: str | None) -> str:
    """The job server's HTTP address: ``address``, else ``RAY_API_SERVER_ADDRESS``, else an
    ``http(s)://`` ``RAY_ADDRESS``, else ``DEFAULT_ADDRESS``; ``http://`` is added when the
    address has no scheme (``HEAD:8265``)."""
    env_address = os.environ.get("RAY_ADDRESS", "")
    address = (
        address
        or os.environ.get("RAY_API_SERVER_ADDRESS")
        or (env_address if env_address.startswith(("http://", "https://")) else "")
        or DEFAULT_ADDRESS
    )
    return address if "://" in address else f"http://{address}"


def _is_local(address: str) -> bool:
    host = urllib.parse.urlsplit(address).hostname or ""
    if host in _LOCAL_HOSTS:
        return True
    try:
        return host in {socket.gethostname(), socket.gethostbyname(socket.gethostname())}
    except OSError:
        return False


def _use_token_auth(address: str) -> None:
    """Turns on Ray's token mode in this process when a token for ``address`` is at hand
    (see the module docstring); an explicit ``RAY_AUTH_MODE`` is left as the user set it."""
    if "RAY_AUTH_MODE" in os.environ:
        return
    explicit = os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")
    local_token = os.path.exists(os.path.expanduser("~/.ray/auth_token"))
    if not (explicit or (local_token and _is_local(address))):
        return
    os.environ["RAY_AUTH_MODE"] = "token"
    if "ray" in sys.modules:  # Ray caches its config at import; make it read the mode again
        from ray._raylet import Config

        Config.initialize("")


def connect(address: str | None = None):
    """A ``ray.job_submission.JobSubmissionClient`` for the job server at ``address`` (see
    ``resolve_address``).

    Raises:
      JobError: nothing answers at the address, or the cluster refused our token.
    """
    address = resolve_address(address)
    _use_token_auth(address)
    from ray.exceptions import AuthenticationError
    from ray.job_submission import JobSubmissionClient

    try:
        return JobSubmissionClient(address)
    except ConnectionError:
        raise JobError(
            f"cannot reach a Ray job server at {address}. Start one on the head with "
            "`ray start --head --include-dashboard=true` (dashboard port 8265 by default), or "
            "pass --address http://HEAD:PORT (on GKE: `kubectl port-forward "
            "svc/CLUSTER-head-svc 8265` first)."
        ) from None
    except AuthenticationError as e:
        raise JobError(
            f"the Ray cluster at {address} refused our authentication token ({e}). Set "
            "RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH) to the cluster's token, with "
            "RAY_AUTH_MODE=token."
        ) from None


def train_entrypoint(config: str, overrides: Sequence[str], working_dir: str) -> str:
    """The job's shell command: ``python -m raytunix.cli train`` with ``config`` and
    ``overrides`` (``-m``: the job's working dir first on ``sys.path``, not whichever
    ``raytunix`` is first on the cluster's ``PATH``).

    A config file must lie inside ``working_dir`` (it is shipped with it); it is named by
    its path relative to that directory, where the job starts.

    Raises:
      ConfigError: the config file is outside ``working_dir``.
    """
    if os.path.isfile(config):
        relative = os.path.relpath(os.path.abspath(config), os.path.abspath(working_dir))
        if relative.startswith(os.pardir + os.sep):
            raise ConfigError(
                f"config file {config!r} is outside the working dir {working_dir!r} that is "
                "shipped to the cluster; move it into that directory or pass --working-dir "
                "a directory that holds it."
            )
        config = relative
    return shlex.join(["python", "-m", "raytunix.cli", "train", "--config", config, *overrides])


def check_shipped_package(environ=os.environ, cwd: str | None = None) -> str | None:
    """In a job (``SHIPPED_PACKAGE_ENV`` set by ``submit``): None when the imported
    ``raytunix`` is the one shipped in the job's working dir (``cwd``), else what is
    wrong, naming both paths. Outside a job: None."""
    if environ.get(SHIPPED_PACKAGE_ENV) != "1":
        return None
    import raytunix

    shipped = os.path.realpath(os.path.join(cwd or os.getcwd(), "raytunix"))
    imported = os.path.realpath(os.path.dirname(raytunix.__file__))
    if imported == shipped:
        return None
    return (
        f"this job shipped raytunix in {shipped}, but Python imported {imported} (another "
        "install first on sys.path, e.g. a PYTHONPATH or a .pth of the cluster's image); "
        "run the entrypoint as `python -m raytunix.cli` from the working dir, or remove "
        "the other install."
    )


def stage_working_dir(working_dir: str, into: str) -> tuple[list[str], list[str]]:
    """Copies what Ray would ship of ``working_dir`` into the empty directory ``into``: every
    file but those ``WORKING_DIR_EXCLUDES`` and the tree's ``.gitignore`` files (unless
    ``RAY_RUNTIME_ENV_IGNORE_GITIGNORE=1``) and ``.rayignore`` files name, matched by Ray's
    own rules (``ray._private.runtime_env.packaging``). The ignore files themselves stay
    out, so Ray ships the copy unchanged.

    Returns:
      ``(shipped, left_out)``: relative paths of the files copied and of those left out,
      sorted.
    """
    from pathlib import Path

    from ray._private.runtime_env import packaging

    root = Path(working_dir).absolute()
    include_gitignore = os.environ.get("RAY_RUNTIME_ENV_IGNORE_GITIGNORE", "0") != "1"
    shipped: list[str] = []

    def copy(path: Path) -> None:
        relative = path.relative_to(root)
        if path.name in (".gitignore", ".rayignore") or str(relative) == ".":
            return
        target = os.path.join(into, relative)
        if path.is_dir():
            if next(path.iterdir(), None) is None:  # Ray ships an empty dir as one
                os.makedirs(target, exist_ok=True)
        elif path.is_file():
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copy2(path, target)
            shipped.append(str(relative))

    packaging._dir_travel(
        root,
        [packaging._get_excludes(root, list(WORKING_DIR_EXCLUDES))],
        copy,
        include_gitignore=include_gitignore,
    )
    every = [
        os.path.relpath(os.path.join(d, f), root) for d, _, files in os.walk(root) for f in files
    ]
    kept = set(shipped)
    return sorted(shipped), sorted(
        p
        for p in every
        if p not in kept and os.path.basename(p) not in (".gitignore", ".rayignore")
    )


def describe_left_out(left_out: Sequence[str], limit: int = 8) -> str:
    """``left_out`` in a line: by top-level entry, with file counts (``runs/ (12 files)``)."""
    groups: dict[str, int] = {}
    for path in left_out:
        head, sep, _ = path.partition(os.sep)
        key = head + "/" if sep else head
        groups[key] = groups.get(key, 0) + 1
    parts = [
        f"{name} ({n} file{'s' if n != 1 else ''})" if name.endswith("/") else name
        for name, n in sorted(groups.items())
    ]
    more = f", and {len(parts) - limit} more" if len(parts) > limit else ""
    return ", ".join(parts[:limit]) + more


def check_staged_config(staged: str, config: str, overrides: Sequence[str]) -> None:
    """Validates the config in the snapshot ``staged`` as the job will: a fresh
    ``python -m raytunix.cli config`` run there (env classes and a shipped raytunix import
    from the snapshot, nothing from this process).

    Raises:
      ConfigError: the snapshot's check failed (its message), or it took longer than
        ``STAGED_CHECK_TIMEOUT_S``.
    """
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # the job's copy, not this machine's trees, decides
    if os.path.isfile(os.path.join(staged, "raytunix", "__init__.py")):
        env[SHIPPED_PACKAGE_ENV] = "1"
    try:
        done = subprocess.run(
            [sys.executable, "-m", "raytunix.cli", "config", "--config", config, *overrides],
            cwd=staged,
            env=env,
            capture_output=True,
            text=True,
            timeout=STAGED_CHECK_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise ConfigError(
            f"checking the config in the copy of the working dir to ship took "
            f"over {STAGED_CHECK_TIMEOUT_S:.0f} s; nothing was submitted."
        ) from None
    if done.returncode != 0:
        lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
        raise ConfigError(
            "the config does not validate in the working dir as it would be shipped (files "
            "excluded, .gitignore, .rayignore left out): "
            + (lines[-1] if lines else f"exit status {done.returncode}")
        )


def check_config(config: str, overrides: Sequence[str], working_dir: str = "."):
    """The resolved, validated ``Config`` the job will run, read here as the job will read
    it from its copy of ``working_dir`` (env classes named by path import from there).

    Raises:
      ConfigError: an unknown key, a bad value, or ``working_dir`` is not a directory.
    """
    if not os.path.isdir(working_dir):
        raise ConfigError(
            f"--working-dir {working_dir!r} is not a directory; pass the "
            "directory to ship to the cluster (default: the current one)."
        )
    working_dir = os.path.abspath(working_dir)
    added = working_dir not in sys.path
    if added:
        sys.path.insert(0, working_dir)
    try:
        cfg = load_config(config, overrides)
    finally:
        if added:
            sys.path.remove(working_dir)
    train_entrypoint(config, overrides, working_dir)  # a config file outside it is an error
    return cfg


def submit(
    client,
    config: str,
    overrides: Sequence[str],
    working_dir: str = ".",
    agent_wait_s: float = 60.0,
    out: TextIO = sys.stderr,
) -> str:
    """Validates the config locally, snapshots the working dir as it will ship
    (``stage_working_dir``; what is left out is printed to ``out``), validates the config
    again in the snapshot (``check_staged_config``), then submits ``python -m raytunix.cli
    train`` as a Ray job with exactly that snapshot as its working dir.

    Args:
      client: from ``connect``.
      config: a preset name or a YAML file inside ``working_dir``.
      overrides: ``section.key=value`` strings, as ``raytunix train`` takes them.
      working_dir: shipped to the cluster (less ``WORKING_DIR_EXCLUDES``); the job runs in
        its copy, so a relative ``run.output_dir`` lands under that copy on the head.
      agent_wait_s: how long to retry while the head's job agent is not up yet (seconds).

    Returns:
      The job's submission id (``raytunix-<run.name>-<time>-<4 hex>``).

    Raises:
      ConfigError: an unknown key or bad value, the config file left out of the shipped
        tree, or a config that fails in the snapshot; before anything is submitted.
      JobError: the cluster refused the job.
    """
    cfg = check_config(config, overrides, working_dir)
    working_dir = os.path.abspath(working_dir)
    entrypoint = train_entrypoint(config, overrides, working_dir)
    staged = tempfile.mkdtemp(prefix="raytunix-submit-")
    try:
        return _submit_staged(
            client, cfg, config, overrides, working_dir, staged, entrypoint, agent_wait_s, out
        )
    finally:
        shutil.rmtree(staged, ignore_errors=True)  # Ray has uploaded its own zip of it


def _submit_staged(
    client, cfg, config, overrides, working_dir, staged, entrypoint, agent_wait_s, out
) -> str:
    shipped, left_out = stage_working_dir(working_dir, staged)
    job_config = config  # as the job names it, in its copy of the working dir
    if os.path.isfile(config):
        job_config = relative = os.path.relpath(os.path.abspath(config), working_dir)
        if relative not in shipped:
            raise ConfigError(
                f"config file {config!r} would not be shipped: WORKING_DIR_EXCLUDES, a "
                ".gitignore or a .rayignore in the working dir leaves it out; move it or "
                "change that ignore file."
            )
    if left_out:
        print(
            f"raytunix: not shipped with the working dir ({len(left_out)} files: excludes, "
            f".gitignore, .rayignore): {describe_left_out(left_out)}",
            file=out,
            flush=True,
        )
    check_staged_config(staged, job_config, overrides)
    env_vars = (
        {SHIPPED_PACKAGE_ENV: "1"}
        if os.path.isfile(os.path.join(staged, "raytunix", "__init__.py"))
        else {}
    )
    stamp = time.strftime("%Y%m%d-%H%M%S")
    name = re.sub(r"[^A-Za-z0-9_.-]", "-", cfg.run.name)
    submission_id = f"raytunix-{name}-{stamp}-{uuid.uuid4().hex[:4]}"
    deadline = time.monotonic() + agent_wait_s
    while True:
        try:
            return client.submit_job(
                entrypoint=entrypoint,
                submission_id=submission_id,
                runtime_env={"working_dir": staged, "env_vars": env_vars},
                metadata={METADATA_KEY: "train", "config": config, "run_name": cfg.run.name},
            )
        except RuntimeError as e:  # the SDK raises RuntimeError for a refused request
            # A head that has just started answers before its job agent is up.
            if "No available agent" in str(e) and time.monotonic() < deadline:
                time.sleep(2.0)
                continue
            raise JobError(
                f"the cluster at {client.get_address()} refused the job: {e}. If "
                "it has no job agent, see the head's logs/dashboard_agent.log (a "
                "port taken by another Ray cluster on that machine?)."
            ) from None


def follow(client, job_id: str, out: TextIO = sys.stdout) -> str:
    """Prints the job's logs as they come until it ends; returns its final status
    (``SUCCEEDED``, ``FAILED`` or ``STOPPED``). Ctrl-C propagates as KeyboardInterrupt."""

    async def tail() -> None:
        async for lines in client.tail_job_logs(job_id):
            out.write(lines)
            out.flush()

    asyncio.run(tail())
    return wait(client, job_id)


def wait(client, job_id: str, poll_s: float = 0.5) -> str:
    """Blocks until the job reaches a terminal status and returns it."""
    while True:
        status = client.get_job_status(job_id)
        if status.is_terminal():
            return str(status)
        time.sleep(poll_s)


def stop(client, job_id: str, out: TextIO = sys.stderr) -> str:
    """Stops the job (Ray sends SIGINT, then SIGKILL after a grace period: the run writes
    its checkpoint in flight) and returns its final status."""
    print(f"raytunix: stopping job {job_id} ...", file=out, flush=True)
    client.stop_job(job_id)
    return wait(client, job_id)


def exit_code(status: str) -> int:
    """The process exit status for a job status: 0 succeeded, 130 stopped, 1 otherwise."""
    return {"SUCCEEDED": 0, "STOPPED": 130}.get(status, 1)


def run_dir_from_logs(logs: str) -> str | None:
    """The run directory ``raytunix train`` printed at start, or None if it has not yet."""
    match = _RUN_DIR_LINE.search(logs)
    return match.group(1) if match else None


def raytunix_jobs(client) -> list:
    """The cluster's raytunix jobs (``JobDetails``), oldest first."""
    jobs = [job for job in client.list_jobs() if METADATA_KEY in (job.metadata or {})]
    return sorted(jobs, key=lambda job: job.start_time or 0)


def describe(client, job_id: str) -> dict[str, Any]:
    """One job's status, times (UTC, ISO), entrypoint, message and run directory.

    Raises:
      JobError: no job with that id on the cluster.
    """
    try:
        info = client.get_job_info(job_id)
    except RuntimeError:
        raise JobError(
            f"no job {job_id!r} on the cluster at {client.get_address()}; "
            "`raytunix status` lists them."
        ) from None
    return {
        "job_id": info.submission_id or job_id,
        "status": str(info.status),
        "start": _when(info.start_time),
        "end": _when(info.end_time),
        "entrypoint": info.entrypoint,
        "message": info.message or "",
        "run_dir": run_dir_from_logs(client.get_job_logs(job_id)),
    }


def _when(ms: int | None) -> str:
    if not ms:
        return "-"
    return datetime.datetime.fromtimestamp(ms / 1000, datetime.UTC).strftime(
        "%Y-%m-%d %H:%M:%S UTC"
    )


def submit_command(
    address: str | None,
    config: str,
    overrides: Sequence[str],
    working_dir: str = ".",
    follow_logs: bool = True,
) -> int:
    """``raytunix submit``: validate, submit, print how to follow, follow unless told not
    to; Ctrl-C stops the job. Returns the exit status (2: config or cluster error)."""
    try:
        cfg = check_config(config, overrides, working_dir)
        client = connect(address)
        job_id = submit(client, config, overrides, working_dir)
    except ConfigError as e:
        print(f"raytunix: config error: {e}", file=sys.stderr)
        return 2
    except JobError as e:
        print(f"raytunix: {e}", file=sys.stderr)
        return 2
    where = client.get_address()
    if not os.path.isabs(cfg.run.output_dir):
        print(
            f"raytunix: note: run.output_dir={cfg.run.output_dir!r} is relative, so the run "
            "directory lands in the job's copy of the working dir on the head, which Ray "
            "deletes in time; pass an absolute path on lasting storage to keep it.",
            file=sys.stderr,
        )
    print(
        f"raytunix: submitted job {job_id} to {where}\n"
        f"  follow: ray job logs --follow {job_id} --address {where}\n"
        f"  status: raytunix status --address {where} {job_id}\n"
        f"  stop:   ray job stop {job_id} --address {where}",
        flush=True,
    )
    if not follow_logs:
        return 0
    try:
        status = follow(client, job_id)
    except KeyboardInterrupt:
        status = stop(client, job_id)
    message = client.get_job_info(job_id).message if status == "FAILED" else ""
    print(f"raytunix: job {job_id} {status}" + (f": {message}" if message else ""), file=sys.stderr)
    return exit_code(status)


def status_command(address: str | None, job_id: str | None = None, out: TextIO = sys.stdout) -> int:
    """``raytunix status``: one job's details, or a table of the cluster's raytunix jobs.
    Returns the exit status (2: cluster unreachable or no such job)."""
    try:
        client = connect(address)
        if job_id:
            for key, value in describe(client, job_id).items():
                print(f"{key + ':':<12}{value if value else '-'}", file=out)
            return 0
        jobs = raytunix_jobs(client)
    except JobError as e:
        print(f"raytunix: {e}", file=sys.stderr)
        return 2
    if not jobs:
        print(f"no raytunix jobs on {client.get_address()}", file=out)
        return 0
    print(f"{'JOB ID':<44}{'STATUS':<11}{'START':<25}{'END':<25}ENTRYPOINT", file=out)
    for job in jobs:
        print(
            f"{job.submission_id or job.job_id:<44}{job.status!s:<11}"
            f"{_when(job.start_time):<25}{_when(job.end_time):<25}{job.entrypoint}",
            file=out,
        )
    return 0
