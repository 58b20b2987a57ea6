"""Runs commands in per-episode work dirs under resource limits, in namespaces of their
own (bubblewrap, or the launcher's own where bubblewrap does not work), and refuses to
run untrusted code where no namespaces can be made, unless told to accept that.

    sandbox = Sandbox(SandboxLimits(wall_time_s=5))
    ws = sandbox.open_workspace("episode-17")
    result = sandbox.run(ws, ["python3", "-I", "-"], stdin="print(6 * 7)")
    result.stdout, result.backend, result.isolation      # '42\\n', BWRAP, NAMESPACES
    sandbox.close_workspace(ws)

How a run is built:

* Every run starts as a fresh interpreter running ``_launch.py``, which sets the rlimits
  (CPU seconds, address space, file size, no core dumps, processes), switches user where
  that applies and ``exec``s the command, so nothing happens between ``fork`` and ``exec``
  in this (threaded) process.
* The host user root gives each work dir a user id of its own (from
  ``SANDBOX_UID_BASE`` up, one per open work dir on the host, claimed with a lock file).
  The process limit is only enforced for users other than root, and counts per user, so
  this is what makes it hold, under bubblewrap too; it also lets the end of every run kill
  all processes of that user, whatever session they moved to. As root each work dir is
  also a tmpfs of ``max_workdir_bytes``: its disk budget.
* bubblewrap (``bwrap``) unshares every namespace (no network, own PID namespace), mounts
  ``/usr``, ``/etc``, the ``/bin``-style links and the Python installation read-only, a
  fresh ``/dev``, ``/proc`` and a size-limited ``/tmp``, and the work dir read-write at
  its own path; nothing else of the host is visible. It dies with its parent, and its
  PID namespace dies with it, so killing its process group kills the whole tree.
* Where bubblewrap does not work, the subprocess backend's launcher builds the same
  namespaces itself (``_launch.py``: a user namespace first where the host user is not
  root, then mount, PID, network, IPC and UTS, and a ``pivot_root`` into a root of its
  own). Whether each works is found out once per process by running ``true`` in it.
* Where neither works (no user namespaces, no CAP_SYS_ADMIN), a command could read the
  host user's files and its processes' environments and reach loopback services: the
  sandbox refuses to start, naming what is missing (``MISSING_GUARANTEES``), unless
  ``allow_weak_isolation`` accepts it; every result says its isolation.
* The wall-clock deadline is watched with a pidfd and the output pipes in one ``select``
  loop; past it, the process group is killed (and, as root, every process of the work
  dir's user). Output beyond ``max_output_bytes`` is read and dropped, so a command that
  prints 100 MB neither blocks nor fills this process's memory.
* A closed work dir is deleted without following any link its commands left
  (``_remove_tree``).

Not covered: a disk budget where the host user is not root, seccomp filtering, and a
memory limit on resident memory (``RLIMIT_AS`` bounds address space). Runs of one work dir
are serialized.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import fcntl
import json
import logging
import math
import os
import re
import secrets
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import Mapping, Sequence, get_args

from raytunix.config import SandboxBackendChoice
from raytunix.sandbox.types import (
    IsolationLevel,
    SandboxBackend,
    SandboxError,
    SandboxLimit,
    SandboxLimits,
    SandboxResult,
    WorkspaceLost,
)

logger = logging.getLogger(__name__)

BACKENDS: tuple[str, ...] = get_args(SandboxBackendChoice)  # sandbox.backend
# Work dirs get user ids from here up when the host user is root; far above the ids
# distributions hand out (and below 2**31, which some tools treat as negative).
SANDBOX_UID_BASE = 1_900_000_000
SANDBOX_UID_SLOTS = 100_000
_LAUNCHER = (Path(__file__).with_name("_launch.py")).read_text()
_KILL_GRACE_S = 2.0  # after the command ended or was killed: pipes must close by then
_MAX_ARG_BYTES = 32 * 4096  # Linux's MAX_ARG_STRLEN: one argument, its NUL included
# How long a run waits for the zombies of its user's killed processes to be reaped; once
# a wait runs out, this host's init is taken not to reap, and no run waits again.
_REAP_WAIT_S = 5.0
_REAPING_STALLS = False
# Sandbox user ids whose processes were killed and may still be zombies (see
# ``_await_reaped``); a uid goes on to the next work dir that claims it.
_KILLED_UIDS: set[int] = set()
_KILLED_LOCK = threading.Lock()
_SYSTEM_RO = ("/usr", "/etc")
# The first process of a run's PID namespace (see ``_inside_bwrap``).
_INIT = ("/bin/sh", "-c", 'exec 3>&2 2>/dev/null; ("$@" 2>&3 3>&-); exit $?', "sh")
_SYSTEM_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_MEMORY_ERRORS = (
    "MemoryError",
    "Cannot allocate memory",
    "std::bad_alloc",
    "out of memory",
    "memory exhausted",
)
_DISK_ERRORS = ("No space left on device", "Disk quota exceeded")
_PROCESS_ERRORS = ("Resource temporarily unavailable", "Cannot fork", "can't fork")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# What a run can reach at each isolation level weaker than namespaces (none is missing
# under NAMESPACES); the README's table of guarantees says the same.
MISSING_GUARANTEES: dict[IsolationLevel, tuple[str, ...]] = {
    IsolationLevel.USER: (
        "network: commands can connect to the host's loopback services (Ray's dashboard, "
        "GCS) and beyond",
        "host files: whatever other users may read is readable, and /tmp and /dev/shm "
        "are shared and unbounded",
        "host processes: their command lines are visible",
    ),
    IsolationLevel.PROCESS: (
        "secrets: commands run as the host user, so they read its files (~/.ray/auth_token "
        "for one) and its processes' environments (/proc/<pid>/environ)",
        "network: commands can connect to the host's loopback services and beyond",
        "work dirs: other episodes' work dirs are readable and writable",
        "processes: a process that leaves its session (setsid) outlives the run",
    ),
}


@dataclasses.dataclass(frozen=True)
class _Mode:
    backend: SandboxBackend
    own_uid: bool  # each work dir runs as a user id of its own (needs root)
    # subprocess backend: the launcher builds the namespaces itself (see _launch.py)
    isolate: bool = False

    @property
    def isolation(self) -> IsolationLevel:
        if self.backend is SandboxBackend.BWRAP or self.isolate:
            return IsolationLevel.NAMESPACES
        return IsolationLevel.USER if self.own_uid else IsolationLevel.PROCESS

    def describe(self) -> str:
        if self.backend is SandboxBackend.BWRAP:
            return "bwrap" + (" as its own user" if self.own_uid else "")
        if self.isolate:
            return "subprocess in namespaces of its own" + (
                " as its own user" if self.own_uid else " (a user namespace)"
            )
        return "subprocess" + (" as its own user" if self.own_uid else "")


@dataclasses.dataclass
class _Workspace:
    path: str
    uid: int | None  # the work dir's own user id, or None (runs as the host user)
    lock_fd: int | None  # holds the uid's claim
    budget: int | None = None  # bytes of the tmpfs mounted on it, or None (no budget)
    run_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    running: subprocess.Popen | None = None
    closed: bool = False  # set by close_workspace; a run starting after it is killed at once
    state_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


# Found out once per process: mode -> None if it works, else why not.
_PROBES: dict["_Mode", str | None] = {}
_PROBE_LOCK = threading.Lock()
_WARNED: set[tuple[str, IsolationLevel]] = set()


class Sandbox:
    """Per-episode work dirs and limited, isolated command runs; thread-safe.

    Args:
      limits: default limits of a run (``SandboxLimits()`` if None).
      backend: ``"auto"`` (bubblewrap if it works here, else the subprocess backend with a
        warning), ``"bwrap"`` (bubblewrap or ``SandboxError``) or ``"subprocess"``.
      root_dir: where work dirs are created (default ``<temp dir>/raytunix-sandbox-<uid>``).
      instance: names this sandbox's subdirectory of ``root_dir``; whatever a previous
        sandbox of the same name left there is deleted first (a restarted actor passes its
        actor id). Default: unique to this object.
      ro_binds: more host paths visible read-only in the run's namespaces (e.g. a
        dataset).
      allow_weak_isolation: run even where no namespaces can be made (isolation
        ``USER`` or ``PROCESS``: see ``MISSING_GUARANTEES``), with a warning that names
        what is missing. False (the default): refuse to start there.

    Attributes:
      fallback_reason: why stronger backends were passed over (None if none was).
      disk_budget_missing: why ``max_workdir_bytes`` is not enforced here (None: it is).

    Raises:
      ValueError: ``backend`` is not one of ``BACKENDS``, or a ``ro_binds`` path is not
        an existing absolute path.
      SandboxError: ``backend="bwrap"`` and bubblewrap does not work here (the message
        says why), no backend works at all, no namespaces can be made here and
        ``allow_weak_isolation`` is false (the message names the missing guarantees and
        the key that accepts them), ``root_dir`` is a link, someone else's or writable
        by others, or (as root) it is closed to the sandbox's users.
    """

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        *,
        backend: str = "auto",
        root_dir: str | None = None,
        instance: str | None = None,
        ro_binds: Sequence[str] = (),
        allow_weak_isolation: bool = False,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r} is not one of {', '.join(BACKENDS)}.")
        for path in ro_binds:
            if not (os.path.isabs(path) and os.path.exists(path)):
                raise ValueError(f"ro_binds path {path!r} is not an existing absolute path.")
        self.limits = limits or SandboxLimits()
        self._ro_binds = tuple(ro_binds)
        self._allow_weak = bool(allow_weak_isolation)
        self._root = os.geteuid() == 0
        base = root_dir or os.path.join(tempfile.gettempdir(), f"raytunix-sandbox-{os.getuid()}")
        instance = instance or f"p{os.getpid()}-{secrets.token_hex(4)}"
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", instance) or instance in (".", ".."):
            raise ValueError(f"instance={instance!r} must be a plain directory name.")
        self._dir = os.path.join(os.path.abspath(base), instance)
        self._make_dirs(os.path.abspath(base))
        self._workspaces: dict[str, _Workspace] = {}
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _remove_tree, self._dir)
        # Why a work dir's disk budget does not hold here (None: it holds).
        self.disk_budget_missing: str | None = None
        if not self._root:
            self._no_disk_budget(
                "only a sandbox running as root mounts a size-limited tmpfs on each work dir"
            )
        self._mode, self.fallback_reason = self._choose_mode(backend)

    # -- public API ------------------------------------------------------------------

    @property
    def backend(self) -> SandboxBackend:
        return self._mode.backend

    @property
    def isolation(self) -> IsolationLevel:
        return self._mode.isolation

    @property
    def missing_guarantees(self) -> tuple[str, ...]:
        """What this sandbox does not keep from its commands here (empty: everything
        the README's table lists for namespaces holds)."""
        missing = MISSING_GUARANTEES.get(self.isolation, ())
        if self.disk_budget_missing:
            missing += (f"disk budget: {self.disk_budget_missing}",)
        return missing

    def open_workspace(self, name: str = "") -> str:
        """Creates an empty work dir only this sandbox's runs can use; returns its id.

        ``name`` (letters, digits, ``-_.``; others are replaced) prefixes the id to make
        logs readable. Files written there persist across runs until ``close_workspace``.
        """
        return self._open(name, self._mode)

    def run(
        self,
        workspace: str,
        argv: Sequence[str],
        *,
        stdin: bytes | str = b"",
        env: Mapping[str, str] | None = None,
        limits: SandboxLimits | None = None,
    ) -> SandboxResult:
        """Runs ``argv`` (``argv[0]`` looked up on the sandbox's ``PATH``) in the work dir.

        Args:
          workspace: an id from ``open_workspace``.
          argv: the command and its arguments (strings without NUL bytes).
          stdin: the command's standard input (a str is encoded as UTF-8).
          env: variables added to the sandbox's minimal environment (``PATH``, ``HOME``
            = the work dir, ``TMPDIR``, ``LANG=C.UTF-8``, one BLAS/OpenMP thread); the
            caller's own environment is never passed on.
          limits: this run's limits (default: the sandbox's).

        Returns:
          a ``SandboxResult``; a command that fails, hits a limit or cannot be found is a
          result (exit code 127 for the last), not an exception.

        Raises:
          WorkspaceLost: ``workspace`` is not open here.
          ValueError: ``argv``, ``stdin``, ``env`` or ``limits`` is malformed (the message
            names it), or ``argv`` and ``env`` together are over the kernel's size limit.
        """
        argv, data, env = _check_call(argv, stdin, env)
        if limits is not None and not isinstance(limits, SandboxLimits):
            raise ValueError(
                f"limits must be a SandboxLimits, got {limits!r}; e.g. "
                "SandboxLimits(wall_time_s=5)."
            )
        ws = self._workspace(workspace)
        with ws.run_lock:
            return self._execute(ws, argv, data, env, limits or self.limits, self._mode)

    def close_workspace(self, workspace: str) -> None:
        """Kills whatever still runs in the work dir and deletes it; unknown ids are
        ignored (closing twice is fine)."""
        with self._lock:
            ws = self._workspaces.pop(workspace, None)
        if ws is not None:
            self._discard(ws)

    def run_once(self, argv: Sequence[str], **kwargs) -> SandboxResult:
        """``run`` in a fresh work dir that is deleted afterwards (same keyword arguments)."""
        workspace = self.open_workspace("once")
        try:
            return self.run(workspace, argv, **kwargs)
        finally:
            self.close_workspace(workspace)

    def num_workspaces(self) -> int:
        return len(self._workspaces)

    def workspace_path(self, workspace: str) -> str:
        """The work dir's path on this host (the same path inside the sandbox)."""
        return self._workspace(workspace).path

    def close(self) -> None:
        """Closes every work dir and deletes this sandbox's directory."""
        with self._lock:
            workspaces, self._workspaces = list(self._workspaces.values()), {}
        for ws in workspaces:
            self._discard(ws)
        self._finalizer()

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- choosing a backend ------------------------------------------------------------

    def _choose_mode(self, backend: str) -> tuple[_Mode, str | None]:
        # Root never runs a command as root: the process limit does not hold for root.
        bwrap = _Mode(SandboxBackend.BWRAP, self._root)
        isolated = _Mode(SandboxBackend.SUBPROCESS, self._root, isolate=True)
        plain = _Mode(SandboxBackend.SUBPROCESS, self._root)
        candidates = {
            "auto": [bwrap, isolated, plain],
            "bwrap": [bwrap],
            "subprocess": [isolated, plain],
        }[backend]
        reasons = []
        for mode in candidates:
            reason = self._probe(mode)
            if reason is None:
                break
            reasons.append(f"{mode.describe()}: {reason}")
        else:
            raise SandboxError(
                f"sandbox backend={backend!r} cannot run here: " + "; ".join(reasons)
            )
        why = "; ".join(reasons) or None
        missing = MISSING_GUARANTEES.get(mode.isolation, ())
        if missing and not self._allow_weak:
            fix = (
                "backend='auto' (sandbox.backend=auto) tries bubblewrap, which is installed"
                if backend == SandboxBackend.SUBPROCESS.value and shutil.which("bwrap")
                else "Install bubblewrap (apt-get install bubblewrap) and allow user namespaces "
                "(sysctl kernel.unprivileged_userns_clone=1, user.max_user_namespaces > 0), "
                "or run the sandbox as root"
            )
            raise SandboxError(
                f"sandbox backend={backend!r} cannot isolate untrusted code here: with "
                f"{mode.describe()} (isolation {mode.isolation.value!r}) "
                + "; ".join(missing)
                + (f". Stronger backends failed: {why}" if why else "")
                + f". {fix}; or accept the weaker isolation with "
                "sandbox.allow_weak_isolation=true (Sandbox(allow_weak_isolation=True))."
            )
        if missing and (backend, mode.isolation) not in _WARNED:
            _WARNED.add((backend, mode.isolation))
            logger.warning(
                "sandbox: running tools with the %s backend, isolation %r, as "
                "sandbox.allow_weak_isolation allows: %s%s.",
                mode.describe(),
                mode.isolation.value,
                "; ".join(missing),
                f"; because {why}" if why else "",
            )
        elif why and (backend, mode.isolation) not in _WARNED:
            _WARNED.add((backend, mode.isolation))
            logger.info(
                "sandbox: %s runs the tools (isolation %r); %s",
                mode.describe(),
                mode.isolation.value,
                why,
            )
        return mode, why

    def _probe(self, mode: _Mode) -> str | None:
        with _PROBE_LOCK:
            if mode not in _PROBES:
                _PROBES[mode] = self._try(mode)
            return _PROBES[mode]

    def _try(self, mode: _Mode) -> str | None:
        if mode.backend is SandboxBackend.BWRAP and shutil.which("bwrap") is None:
            return "bwrap is not installed (no 'bwrap' on PATH)"
        workspace = self._open("probe", mode)
        try:
            ws = self._workspace(workspace)
            limits = dataclasses.replace(
                self.limits,
                wall_time_s=30.0,
                max_processes=8,
                memory_bytes=max(self.limits.memory_bytes, 256 << 20),
            )
            result = self._execute(ws, ["true"], b"", {}, limits, mode)
        except OSError as e:
            return f"cannot start it: {e}"
        finally:
            self.close_workspace(workspace)
        if result.exit_code != 0:
            return (
                f"'true' exited with {result.exit_code}: "
                f"{result.stderr.strip()[-300:] or 'no message'}"
            )
        return None

    # -- work dirs ---------------------------------------------------------------------

    def _make_dirs(self, base: str) -> None:
        # Traversable, not listable, by the work dirs' users; a previous life's leftovers go.
        mode = 0o711 if self._root else 0o700
        _owned_dir(base, mode, "sandbox root_dir")
        _remove_tree(self._dir)
        os.mkdir(self._dir, mode)
        os.chmod(self._dir, mode)
        if self._root and not _open_to_others(self._dir):
            raise SandboxError(
                f"root_dir {base!r} is closed to other users (no x permission on it or a "
                "parent), and the sandbox runs commands as users of their own; choose a "
                "directory they can traverse (the default is in the system temp dir)"
            )

    def _open(self, name: str, mode: _Mode) -> str:
        workspace = f"{re.sub(r'[^A-Za-z0-9_.-]', '_', name)[:48]}-{secrets.token_hex(6)}"
        path = os.path.join(self._dir, workspace)
        uid, lock_fd = _claim_uid() if mode.own_uid else (None, None)
        budget = None
        try:
            os.mkdir(path, 0o700)
            if uid is not None:
                os.chown(path, uid, uid)
                if _sweep(uid):  # processes a dead sandbox left under this id
                    _note_killed(uid)
            if self.disk_budget_missing is None:
                try:
                    _mount_budget(path, self.limits.max_workdir_bytes, uid)
                    budget = self.limits.max_workdir_bytes
                except OSError as e:
                    self._no_disk_budget(f"a tmpfs cannot be mounted on a work dir ({e})")
        except BaseException:
            _release_uid(lock_fd)
            _remove_tree(path)
            raise
        with self._lock:
            self._workspaces[workspace] = _Workspace(path, uid, lock_fd, budget)
        return workspace

    def _no_disk_budget(self, why: str) -> None:
        if self.disk_budget_missing is None:
            self.disk_budget_missing = why
            logger.warning(
                "sandbox: the disk budget of a work dir (max_workdir_bytes) is not "
                "enforced here: %s; a command can fill the file system of %s.",
                why,
                self._dir,
            )

    def _workspace(self, workspace: str) -> _Workspace:
        try:
            return self._workspaces[workspace]
        except KeyError:
            raise WorkspaceLost(
                f"work dir {workspace!r} is not open in this sandbox (closed, or lost when "
                "its sandbox actor restarted); open a new one"
            ) from None

    def _discard(self, ws: _Workspace) -> None:
        # Under the lock, so a run whose process is being started right now either is
        # seen here or sees ``closed`` itself and kills its process (see ``_execute``).
        with ws.state_lock:
            ws.closed = True
            proc = ws.running
        self._kill_tree(proc, ws)
        _remove_tree(ws.path)
        _release_uid(ws.lock_fd)

    # -- one run -----------------------------------------------------------------------

    def _execute(
        self,
        ws: _Workspace,
        argv: list[str],
        stdin: bytes,
        env: dict[str, str],
        limits: SandboxLimits,
        mode: _Mode,
    ) -> SandboxResult:
        if ws.uid is not None and _take_killed(ws.uid):
            _await_reaped(ws.uid, _REAP_WAIT_S)
        command = _command(ws, argv, limits, mode, self._ro_binds)
        environ = _environment(ws, env, mode)
        stdin_fd = os.memfd_create("sandbox-stdin", os.MFD_CLOEXEC)
        try:
            os.write(stdin_fd, stdin)  # a memfd takes it all at once; no writer thread
            os.lseek(stdin_fd, 0, os.SEEK_SET)
            start = time.monotonic()
            proc = subprocess.Popen(
                command,
                stdin=stdin_fd,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=ws.path,
                env=environ,
                start_new_session=True,
                close_fds=True,
            )
        except FileNotFoundError:
            if ws.closed:  # closed while this run waited to start: its dir is gone
                raise WorkspaceLost(
                    f"work dir {os.path.basename(ws.path)!r} was closed "
                    "before this run started; open a new one"
                ) from None
            raise
        except OSError as e:
            if e.errno == errno.E2BIG:
                size = sum(len(a.encode("utf-8", "surrogateescape")) + 1 for a in argv)
                raise ValueError(
                    f"argv ({len(argv)} items, {size} bytes) and env are over the kernel's "
                    "limit for a command line; pass large input on stdin or in a file of "
                    "the work dir."
                ) from None
            raise
        finally:
            os.close(stdin_fd)
        with ws.state_lock:
            ws.running = proc
            closed_meanwhile = ws.closed
        if closed_meanwhile:  # the work dir was closed while this process started
            self._kill_tree(proc, ws)
        out, err = _Capture(limits.max_output_bytes), _Capture(limits.max_output_bytes)
        try:
            timed_out = self._supervise(proc, ws, mode, out, err, start + limits.wall_time_s)
        finally:
            if proc.poll() is None:  # only on an unexpected error in supervise
                self._kill_tree(proc, ws)
                proc.wait()
            ws.running = None
            proc.stdout.close()
            proc.stderr.close()
        return _result(
            proc.returncode,
            out,
            err,
            timed_out,
            time.monotonic() - start,
            mode,
            limits,
            disk_full=_full(ws),
        )

    def _supervise(
        self,
        proc: subprocess.Popen,
        ws: _Workspace,
        mode: _Mode,
        out: "_Capture",
        err: "_Capture",
        deadline: float,
    ) -> bool:
        """Reads both pipes until they close, killing the tree at the deadline and any
        leftovers once the command exits. Returns whether the deadline passed."""
        timed_out = exited = False
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ, out)
        sel.register(proc.stderr, selectors.EVENT_READ, err)
        open_streams = 2
        pidfd = _pidfd(proc.pid)
        if pidfd is not None:
            sel.register(pidfd, selectors.EVENT_READ, None)
        try:
            while open_streams or not exited:
                wait = deadline - time.monotonic()
                if wait <= 0:
                    if exited or timed_out:
                        break  # something still holds the pipes after the grace period
                    timed_out = True
                    self._kill_tree(proc, ws)
                    deadline = time.monotonic() + _KILL_GRACE_S
                    continue
                for key, _ in sel.select(wait if pidfd is not None else min(wait, 0.05)):
                    if key.data is None:
                        sel.unregister(pidfd)  # the command exited; poll() reaps it
                        continue
                    chunk = os.read(key.fd, 1 << 16)
                    if chunk:
                        key.data.feed(chunk)
                    else:
                        sel.unregister(key.fileobj)
                        open_streams -= 1
                if not exited and proc.poll() is not None:
                    exited = True
                    # Background processes end with the command: bubblewrap's PID
                    # namespace ends with it; the subprocess backend kills them.
                    if mode.backend is SandboxBackend.SUBPROCESS:
                        self._kill_tree(proc, ws)
                    if not timed_out:
                        deadline = time.monotonic() + _KILL_GRACE_S
        finally:
            sel.close()
            if pidfd is not None:
                os.close(pidfd)
        return timed_out

    def _kill_tree(self, proc: subprocess.Popen | None, ws: _Workspace) -> None:
        killed = proc is not None and _kill_group(proc.pid)
        if ws.uid is not None and (_sweep(ws.uid) or killed):
            _note_killed(ws.uid)


def _command(
    ws: _Workspace,
    argv: list[str],
    limits: SandboxLimits,
    mode: _Mode,
    ro_binds: tuple[str, ...],
) -> list[str]:
    """The host argv of one run: our launcher (``_launch.py``) with its spec of limits
    (``RLIMIT_*``, the process limit, the run's uid) and, by ``mode``, bubblewrap's
    namespaces or the launcher's own (``isolate``), then ``argv``; ``ro_binds`` are the
    sandbox's extra read-only host paths."""
    cpu = math.ceil(limits.cpu_time_s)
    spec = {
        "rlimits": [
            ["RLIMIT_CPU", cpu, cpu + 1],
            ["RLIMIT_AS", limits.memory_bytes, limits.memory_bytes],
            ["RLIMIT_FSIZE", limits.max_file_bytes, limits.max_file_bytes],
            ["RLIMIT_CORE", 0, 0],
        ]
    }
    if ws.uid is not None:
        spec.update(nproc=limits.max_processes, nproc_on_top=True, uid=ws.uid, gid=ws.uid)
    elif mode.isolate:  # counted in its own user namespace: this run's processes only
        spec.update(nproc=limits.max_processes)
    elif mode.backend is SandboxBackend.SUBPROCESS:
        spec.update(nproc=limits.max_processes, nproc_on_top=True)
    if mode.backend is SandboxBackend.BWRAP:
        argv = _bwrap_argv(ws, limits, ro_binds) + _inside_bwrap(ws, limits, argv)
    elif mode.isolate:
        spec.update(
            no_new_privs=True,
            isolate={
                "user_ns": ws.uid is None,
                "workdir": ws.path,
                "tmp_bytes": limits.tmp_bytes,
                "links": [[os.readlink(p), p] for p in _SYSTEM_LINKS if os.path.islink(p)],
                "ro": [
                    p
                    for p in (
                        *(p for p in _SYSTEM_LINKS if not os.path.islink(p)),
                        *_SYSTEM_RO,
                        *_python_dirs(ws),
                        *ro_binds,
                    )
                    if os.path.exists(p)
                ],
            },
        )
        argv = [*_INIT, *argv]
    else:
        spec.update(no_new_privs=True)
    return _launcher(spec) + argv


def _inside_bwrap(ws: _Workspace, limits: SandboxLimits, argv: list[str]) -> list[str]:
    """What bubblewrap runs: a shell as the PID namespace's first process
    (``--as-pid-1``), which runs the command, reaps the namespace's orphans while it
    waits, and exits as the command did (128 + N for signal N; 127 for a command
    that cannot be found), ending the namespace. In the host user's own namespace
    our launcher first sets the process limit, which there counts this run's
    processes only (set outside, it would also cap the user's processes outside
    the sandbox).

    Not bubblewrap's own init: bubblewrap's outer process exits before it, leaving
    it to the host's init to reap, a zombie of the run's user for a second or two
    after every run. ``RLIMIT_NPROC`` counts zombies, and the next run's limit adds
    the processes the user already has (``nproc_on_top``), so that limit grew as
    they were reaped: 17 of them let a run fork 29 processes under a limit of 16."""
    # The shell's own stderr goes to /dev/null and the command's to the run's (the
    # subshell execs it), so that the shell's reports of a command killed by a signal
    # ("Killed", "Segmentation fault") are not added to the run's stderr.
    init = list(_INIT)
    if ws.uid is None:
        init = _launcher({"nproc": limits.max_processes}) + init
    return ["--as-pid-1", "--", *init, *argv]


def _bwrap_argv(ws: _Workspace, limits: SandboxLimits, ro_binds: tuple[str, ...]) -> list[str]:
    """bubblewrap and its options for one run: every namespace unshared, the system's
    directories, this Python and ``ro_binds`` read-only, a fresh ``/proc``, ``/dev`` and
    size-limited ``/tmp``, and the work dir bound read-write as the working directory."""
    args = [
        shutil.which("bwrap") or "bwrap",
        "--unshare-all",
        "--die-with-parent",
        "--new-session",
        "--hostname",
        "sandbox",
    ]
    for path in _SYSTEM_LINKS:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    for path in (*_SYSTEM_RO, *_python_dirs(ws), *ro_binds):
        if os.path.exists(path):
            args += ["--ro-bind", path, path]
    args += ["--proc", "/proc", "--dev", "/dev"]
    if _bwrap_has_size():
        args += ["--size", str(limits.tmp_bytes)]
    args += ["--tmpfs", "/tmp", "--bind", ws.path, ws.path, "--chdir", ws.path]
    return args


def _python_dirs(ws: _Workspace) -> list[str]:
    """This Python's installation when the run's user can reach it (root's own
    home, for one, is closed to other users); the system one is under /usr anyway."""
    dirs = []
    for prefix in dict.fromkeys((sys.prefix, sys.base_prefix)):
        if prefix.startswith(("/usr/", "/etc/")) or prefix == "/usr":
            continue
        if ws.uid is None or _open_to_others(prefix):
            dirs.append(prefix)
    return dirs


def _environment(ws: _Workspace, extra: dict[str, str], mode: _Mode) -> dict[str, str]:
    """The run's whole environment: a ``PATH`` of this Python and the system, the work dir
    as ``HOME`` (and ``TMPDIR`` without a private ``/tmp``), one BLAS/OpenMP thread, then
    ``extra`` over it; nothing of the host's environment (its secrets) is passed on."""
    bins = [os.path.join(p, "bin") for p in _python_dirs(ws)]
    env = {
        "PATH": ":".join([*bins, "/usr/local/bin", "/usr/bin", "/bin"]),
        "HOME": ws.path,
        "TMPDIR": "/tmp" if mode.isolation is IsolationLevel.NAMESPACES else ws.path,
        "LANG": "C.UTF-8",
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }
    env.update(extra)
    return env


class _Capture:
    """Keeps the first ``keep`` bytes of a stream and counts the rest."""

    def __init__(self, keep: int):
        self.keep = keep
        self.data = bytearray()
        self.total = 0

    def feed(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self.keep - len(self.data)
        if room > 0:
            self.data += chunk[:room]

    @property
    def truncated(self) -> bool:
        return self.total > len(self.data)

    def text(self) -> str:
        return self.data.decode("utf-8", errors="replace")


def _full(ws: _Workspace) -> bool:
    """Whether the work dir's budget (its tmpfs) has no block or inode left."""
    if ws.budget is None:
        return False
    try:
        st = os.statvfs(ws.path)
    except OSError:
        return False
    return st.f_bavail == 0 or st.f_favail == 0


def _result(
    returncode: int,
    out: _Capture,
    err: _Capture,
    timed_out: bool,
    wall_s: float,
    mode: _Mode,
    limits: SandboxLimits,
    disk_full: bool = False,
) -> SandboxResult:
    exit_code = 128 - returncode if returncode < 0 else returncode
    sig = exit_code - 128 if 128 < exit_code <= 128 + 64 else None
    stderr = err.text()
    hits = set()
    if timed_out:
        hits.add(SandboxLimit.WALL_TIME)
    if sig == signal.SIGXCPU:
        hits.add(SandboxLimit.CPU_TIME)
    if any(marker in stderr for marker in _MEMORY_ERRORS):
        hits.add(SandboxLimit.MEMORY)
    if any(marker in stderr for marker in _PROCESS_ERRORS):
        hits.add(SandboxLimit.PROCESSES)
    # A shell reports a child's SIGXFSZ as "File size limit exceeded".
    if sig == signal.SIGXFSZ or any(
        m in stderr for m in ("File too large", "File size limit exceeded")
    ):
        hits.add(SandboxLimit.FILE_SIZE)
    if disk_full or any(m in stderr for m in _DISK_ERRORS):
        hits.add(SandboxLimit.DISK)
    if out.truncated or err.truncated:
        hits.add(SandboxLimit.OUTPUT)
    killed_by = None
    if timed_out:
        killed_by = SandboxLimit.WALL_TIME
    elif sig == signal.SIGXCPU:
        killed_by = SandboxLimit.CPU_TIME
    elif sig == signal.SIGXFSZ:
        killed_by = SandboxLimit.FILE_SIZE
    elif exit_code != 0:
        killed_by = next(
            (
                limit
                for limit in (
                    SandboxLimit.MEMORY,
                    SandboxLimit.FILE_SIZE,
                    SandboxLimit.DISK,
                    SandboxLimit.PROCESSES,
                )
                if limit in hits
            ),
            None,
        )
    return SandboxResult(
        exit_code=exit_code,
        signal=sig,
        stdout=out.text(),
        stderr=stderr,
        stdout_bytes=out.total,
        stderr_bytes=err.total,
        stdout_truncated=out.truncated,
        stderr_truncated=err.truncated,
        timed_out=timed_out,
        killed_by_limit=killed_by,
        limits_hit=tuple(limit for limit in SandboxLimit if limit in hits),
        wall_time_s=wall_s,
        backend=mode.backend,
        isolation=mode.isolation,
        limits=limits,
    )


def _check_call(
    argv: Sequence[str], stdin: bytes | str, env: Mapping[str, str] | None
) -> tuple[list[str], bytes, dict[str, str]]:
    if isinstance(argv, (str, bytes)) or not isinstance(argv, Sequence) or not argv:
        raise ValueError(f"argv must be a non-empty list of strings, got {argv!r}.")
    for arg in argv:
        if not isinstance(arg, str) or "\0" in arg:
            raise ValueError(f"argv item {arg!r} must be a string without NUL bytes.")
        if len(arg.encode("utf-8", "surrogateescape")) >= _MAX_ARG_BYTES:
            raise ValueError(
                f"argv item {arg[:40]!r}... is {len(arg)} characters, over the "
                f"kernel's {_MAX_ARG_BYTES}-byte limit for one argument; pass "
                "large input on stdin or in a file of the work dir."
            )
    if not argv[0]:
        raise ValueError(f"argv[0] is empty in {list(argv)!r}; it names the command to run.")
    if isinstance(stdin, str):
        stdin = stdin.encode("utf-8")
    if not isinstance(stdin, (bytes, bytearray)):
        raise ValueError(f"stdin must be bytes or str, got {type(stdin).__name__}.")
    env = dict(env or {})
    for key, value in env.items():
        if not (isinstance(key, str) and _ENV_NAME.fullmatch(key)):
            raise ValueError(f"env name {key!r} is not a valid variable name.")
        if not isinstance(value, str) or "\0" in value:
            raise ValueError(f"env[{key!r}]={value!r} must be a string without NUL bytes.")
    return list(argv), bytes(stdin), env


def _launcher(spec: dict) -> list[str]:
    return [sys.executable, "-I", "-S", "-c", _LAUNCHER, json.dumps(spec)]


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):  # kernels before 5.3: poll instead
        return None


def _kill_group(pgid: int) -> bool:
    """SIGKILLs process group ``pgid``; returns whether it had any process."""
    try:
        os.killpg(pgid, signal.SIGKILL)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _sweep(uid: int) -> int:
    """Kills every process of the sandbox user ``uid`` (as that user: ``kill(-1)``).
    Returns how many live processes it found: each is a zombie until the host's init
    reaps it (see ``_await_reaped``)."""
    done = subprocess.run(
        _launcher({"sweep_uid": uid}),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={},
        timeout=30,
        check=False,
    )
    if done.returncode != 0:
        logger.error(
            "sandbox: could not kill the processes of user %d: %s",
            uid,
            done.stderr.decode(errors="replace")[-300:],
        )
    try:
        return int(done.stdout.split()[0])
    except (IndexError, ValueError):
        return 1  # unknown: assume it killed some


def _note_killed(uid: int) -> None:
    with _KILLED_LOCK:
        _KILLED_UIDS.add(uid)


def _take_killed(uid: int) -> bool:
    """Whether processes of ``uid`` were killed since the last call for it."""
    with _KILLED_LOCK:
        if uid in _KILLED_UIDS:
            _KILLED_UIDS.discard(uid)
            return True
        return False


def _zombies(uid: int) -> int:
    """Processes whose real user id is ``uid`` that have ended and wait to be reaped."""
    count = 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except (OSError, ValueError):
            continue
        if fields.get("State", "").split()[:1] == ["Z"] and fields.get("Uid", "").split()[:1] == [
            str(uid)
        ]:
            count += 1
    return count


def _await_reaped(uid: int, timeout_s: float) -> None:
    """Waits until no zombie of sandbox user ``uid`` is left, or ``timeout_s`` (seconds).

    The processes a sweep killed stay zombies until the host's init reaps them, a second
    or two later on some hosts, and ``RLIMIT_NPROC`` counts them until then. The launcher
    adds the user's processes to the next run's limit (``nproc_on_top``), so each zombie
    reaped while that run forks would be one process more for it: CI saw 19 forks under
    a limit of 16, and a run right after one that left 8 children forked 40. Only the
    run after a kill that found processes of ``uid`` waits, in whichever work dir holds
    the uid then (a bubblewrap run that ends by itself leaves none: see
    ``_inside_bwrap``). Past
    ``timeout_s`` the run goes ahead with the zombies counted, and later runs no longer
    wait (a container whose PID 1 never reaps would make each of them wait in vain)."""
    global _REAPING_STALLS
    if _REAPING_STALLS:
        return
    deadline = time.monotonic() + timeout_s
    while _zombies(uid):
        if time.monotonic() >= deadline:
            _REAPING_STALLS = True
            logger.warning(
                "sandbox: processes killed in the sandbox were not reaped within %.0f s by "
                "this host's init (PID 1 %r); runs no longer wait for them, and a run may "
                "have one process more than max_processes for each one reaped while it "
                "runs. Give the host or container an init that reaps orphans (docker run "
                "--init, tini, dumb-init).",
                timeout_s,
                _init_name(),
            )
            return
        time.sleep(0.02)


def _init_name() -> str:
    try:
        with open("/proc/1/comm") as f:
            return f.read().strip()
    except OSError:
        return "unknown"


def _uid_lock_dir() -> str:
    path = os.path.join(tempfile.gettempdir(), "raytunix-sandbox-uids")
    _owned_dir(path, 0o700, "the sandbox's user id lock dir")
    return path


def _claim_uid() -> tuple[int, int]:
    """The lowest sandbox user id no work dir on this host holds, and the fd of its lock
    (held until ``_release_uid``, or until this process dies)."""
    lock_dir = _uid_lock_dir()
    for uid in range(SANDBOX_UID_BASE, SANDBOX_UID_BASE + SANDBOX_UID_SLOTS):
        fd = os.open(
            os.path.join(lock_dir, str(uid)),
            os.O_CREAT | os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW,
            0o600,
        )
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return uid, fd
        except BlockingIOError:
            os.close(fd)
    raise SandboxError(
        f"all {SANDBOX_UID_SLOTS} sandbox user ids are in use on this host; "
        "close work dirs that are no longer needed"
    )


def _release_uid(lock_fd: int | None) -> None:
    if lock_fd is not None:
        os.close(lock_fd)  # drops the flock


def _open_to_others(path: str) -> bool:
    """Whether a user other than the owner may reach ``path`` (x on every ancestor)."""
    current = os.path.abspath(path)
    while True:
        try:
            if not os.stat(current).st_mode & stat.S_IXOTH:
                return False
        except OSError:
            return False
        parent = os.path.dirname(current)
        if parent == current:
            return True
        current = parent


def _remove_tree(path: str) -> None:
    """Deletes ``path`` and all under it without following a link a command planted:
    every step is relative to a directory fd opened with ``O_NOFOLLOW``, a link (symbolic
    or hard) is only unlinked, and a mode is only ever changed on a directory fd this
    function opened (``fchmod``), so no file outside the tree is touched, whatever
    links, modes or swaps the tree holds. Mounts under ``path`` (work-dir tmpfs mounts)
    are detached first; another file system found inside is left, with an error logged.

    Raises:
      OSError: ``path``'s parent cannot be opened, or an entry cannot be removed.
    """
    path = os.path.abspath(path)
    _unmount_under(path)
    parent, name = os.path.split(path)
    try:
        parent_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        _remove_at(parent_fd, name, None)
    finally:
        os.close(parent_fd)


def _remove_at(dir_fd: int, name: str, dev: int | None, tries: int = 3) -> None:
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    inside = dev is not None  # dir_fd is a directory of the tree, not the top's parent
    if not stat.S_ISDIR(st.st_mode):
        _retry_writable(dir_fd, lambda: os.unlink(name, dir_fd=dir_fd), inside)
        return
    try:
        fd = _open_dir_at(dir_fd, name)
    except OSError as e:
        # Swapped for a link or a file since the stat: look again.
        if e.errno in (errno.ELOOP, errno.ENOTDIR) and tries > 1:
            return _remove_at(dir_fd, name, dev, tries - 1)
        raise
    if fd is None:
        return
    try:
        own = os.fstat(fd)  # what was opened, whatever the name pointed to before
        if dev is not None and own.st_dev != dev:
            logger.error(
                "sandbox: %r is another file system inside a work dir; left in place", name
            )
            return
        if stat.S_IMODE(own.st_mode) & 0o700 != 0o700:
            os.fchmod(fd, 0o700)  # the directory itself, never what a link points to
        for entry in os.listdir(fd):
            _remove_at(fd, entry, own.st_dev)
    finally:
        os.close(fd)
    _retry_writable(dir_fd, lambda: os.rmdir(name, dir_fd=dir_fd), inside)


def _open_dir_at(dir_fd: int, name: str) -> int | None:
    """``name`` in ``dir_fd`` opened as a directory, never through a link (None if it is
    gone); one without read permission is opened by path fd and given it first."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(name, flags, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except PermissionError:
        pass
    handle = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        # Through the fd's /proc link: the inode just opened, a directory, not a name
        # that could have been swapped for a link since.
        os.chmod(f"/proc/self/fd/{handle}", 0o700)
        return os.open(f"/proc/self/fd/{handle}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    finally:
        os.close(handle)


def _retry_writable(dir_fd: int, remove, may_chmod: bool) -> None:
    """Runs ``remove``; when the containing directory (an fd this module opened, inside
    the tree if ``may_chmod``) forbids it, gives that directory owner rights and tries
    once more."""
    try:
        remove()
    except FileNotFoundError:
        pass
    except PermissionError:
        if not may_chmod:
            raise
        os.fchmod(dir_fd, 0o700)
        try:
            remove()
        except FileNotFoundError:
            pass


def _owned_dir(path: str, mode: int, what: str) -> None:
    """Creates directory ``path`` (``mode``) or checks the one there: a real directory,
    not a link, owned by this user and writable by no one else; else ``SandboxError``.
    A predictable name in a shared temp dir could otherwise be someone else's."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        os.mkdir(path, mode)
        os.chmod(path, mode)  # whatever the umask
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        kind = (
            "a symbolic link"
            if stat.S_ISLNK(st.st_mode)
            else ("a directory" if stat.S_ISDIR(st.st_mode) else "not a directory")
        )
        raise SandboxError(
            f"{what} {path!r} is {kind} owned by uid {st.st_uid} with mode "
            f"{stat.S_IMODE(st.st_mode):o}; it must be a directory of this user "
            f"(uid {os.geteuid()}) that no one else can write. Remove it, or choose "
            "another (sandbox.root_dir)."
        )


_MS_NOSUID, _MS_NODEV = 2, 4
_MNT_DETACH, _UMOUNT_NOFOLLOW = 2, 8
_LIBC = ctypes.CDLL(None, use_errno=True)


def _mount_budget(path: str, size: int, uid: int | None) -> None:
    """Mounts a tmpfs of ``size`` bytes (and one inode per 4 KiB of it, so that empty
    files cannot take the memory instead) on work dir ``path``, owned by ``uid``. Needs
    root.

    Raises:
      OSError: the kernel refused (e.g. no CAP_SYS_ADMIN in a container).
    """
    inodes = max(1024, size // 4096)
    owner = f",uid={uid},gid={uid}" if uid is not None else ""
    data = f"size={size},nr_inodes={inodes},mode=0700{owner}".encode()
    flags = _MS_NOSUID | _MS_NODEV
    source = b"raytunix-workdir"
    if _LIBC.mount(source, path.encode(), b"tmpfs", ctypes.c_ulong(flags), data) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount tmpfs size={size} on {path}: {os.strerror(err)}")


def _mounts_under(path: str) -> list[str]:
    """Mount points at or under ``path`` in this mount namespace, deepest first."""
    found = []
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                point = line.split()[4]
                point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), point)
                if point == path or point.startswith(path.rstrip("/") + "/"):
                    found.append(point)
    except OSError:
        return []
    return sorted(found, key=len, reverse=True)


def _unmount_under(path: str) -> None:
    if os.geteuid() != 0:
        return
    for point in _mounts_under(path):
        if _LIBC.umount2(point.encode(), _MNT_DETACH | _UMOUNT_NOFOLLOW) != 0:
            logger.error(
                "sandbox: could not unmount %s: %s", point, os.strerror(ctypes.get_errno())
            )


_BWRAP_SIZE: bool | None = None


def _bwrap_has_size() -> bool:
    """bubblewrap >= 0.5 sizes a tmpfs (``--size``); older ones mount it unbounded."""
    global _BWRAP_SIZE
    if _BWRAP_SIZE is None:
        try:
            help_text = subprocess.run(
                [shutil.which("bwrap") or "bwrap", "--help"],
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout
        except (OSError, subprocess.TimeoutExpired):
            help_text = ""
        _BWRAP_SIZE = "--size" in help_text
    return _BWRAP_SIZE
