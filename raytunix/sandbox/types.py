"""What a sandbox run is asked (``SandboxLimits``) and what it reports (``SandboxResult``),
the failures it raises, and the client protocol that tools talk to.

Nothing here imports Ray.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Mapping, Protocol, Sequence, runtime_checkable

from raytunix.config import SANDBOX_MAX_BYTES, SANDBOX_MAX_PROCESSES, SANDBOX_MAX_SECONDS
from raytunix.types import EnvFailure

# The Ray actor name of a job's sandbox pool, where clients look for it.
DEFAULT_POOL_NAME = "raytunix-sandbox"


class SandboxBackend(str, enum.Enum):
    """What ran the command."""

    BWRAP = "bwrap"  # bubblewrap: Linux namespaces (user, pid, net, mount, ipc, uts)
    SUBPROCESS = "subprocess"  # a plain child process with rlimits and its own session


class IsolationLevel(str, enum.Enum):
    """How well a run is kept apart from the host and from other episodes.

    Every level has the same resource limits (CPU time, address space, processes, file
    size, output size, a wall-clock deadline); they differ in what else holds:

    * ``NAMESPACES`` (bubblewrap, or the subprocess backend where its launcher can make
      namespaces: as root, or with user namespaces): no network at all (an empty
      network namespace), a root of its own with the system mounted read-only, only the
      episode's own work dir writable (plus a private ``/tmp`` and ``/dev/shm``), the
      host's other files, other work dirs and the host's processes not even visible,
      its own PID namespace (every process it started ends with the run, whatever
      session it moved to).
    * ``USER`` (subprocess, host user root, no namespaces: a container without
      CAP_SYS_ADMIN; only with ``allow_weak_isolation``): the command runs as a user id of its own per
      work dir, so file permissions keep episodes apart and the system read-only, and every
      process of that user is killed at the end of each run. The network is open, and
      world-writable places (``/tmp``, ``/dev/shm``) are writable.
    * ``PROCESS`` (subprocess, any other host user, no user namespaces; only with
      ``allow_weak_isolation``): the command runs as the host user in
      its own session, killed by process group; it can read and write whatever that user
      can (other episodes' work dirs included), reach the network, and a process that
      leaves the session escapes the deadline. The process limit counts on top of the
      user's processes already running.
    """

    NAMESPACES = "namespaces"
    USER = "user"
    PROCESS = "process"


class SandboxLimit(str, enum.Enum):
    """A limit a run reached (``SandboxResult.killed_by_limit`` / ``limits_hit``)."""

    WALL_TIME = "wall_time"  # the wall-clock deadline passed; the process tree was killed
    CPU_TIME = "cpu_time"  # a process used up its CPU seconds (SIGXCPU)
    MEMORY = "memory"  # an allocation failed against the address-space limit
    PROCESSES = "processes"  # a fork failed against the process limit
    FILE_SIZE = "file_size"  # a write would have grown a file past the limit
    OUTPUT = "output"  # stdout or stderr was longer than kept (the rest was discarded)
    DISK = "disk"  # the work dir's disk budget was full (a write failed with ENOSPC)


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one run.

    Attributes:
      wall_time_s: wall-clock deadline, seconds (> 0); past it the whole process tree is
        killed with SIGKILL.
      cpu_time_s: CPU seconds per process (> 0; ``RLIMIT_CPU``, rounded up to whole
        seconds): SIGXCPU at the limit, SIGKILL one second later.
      memory_bytes: address space per process, bytes (``RLIMIT_AS``; >= 16 MiB, since an
        interpreter needs some to start). Virtual, not resident, memory: a program that
        maps much more than it touches needs a higher value.
      max_processes: processes (and threads) the run may have at once (>= 1;
        ``RLIMIT_NPROC``), counting bubblewrap's own two when it is the backend.
      max_file_bytes: largest file a process may write, bytes (>= 0; ``RLIMIT_FSIZE``).
      max_output_bytes: bytes of stdout, and separately of stderr, kept (>= 1); the rest
        is read and discarded, and the run is reported truncated.
      tmp_bytes: size of the private ``/tmp`` and ``/dev/shm`` (tmpfs mounts of the run's
        namespaces), bytes each (>= 1 MiB).
      max_workdir_bytes: disk budget of a work dir, bytes (>= 1 MiB): all its files
        together, across runs. Where the host user is root, the work dir is a tmpfs of
        this size (its files live in memory, swappable), mounted when it is opened, with
        the sandbox's own limits (a run's limits do not resize it); a write past it
        fails with ENOSPC, which fails that command (``SandboxLimit.DISK``), never the
        host's file system. Elsewhere it is not enforced, and the sandbox says so when it
        starts (``Sandbox.disk_budget_missing``).

    Raises:
      ValueError: a value is not a number of the field's kind (seconds: int or float;
        the rest: int) or is out of range (the message names the field and the range).
    """

    wall_time_s: float = 10.0
    cpu_time_s: float = 10.0
    memory_bytes: int = 1 << 30
    max_processes: int = 64
    max_file_bytes: int = 64 << 20
    max_output_bytes: int = 64 << 10
    tmp_bytes: int = 64 << 20
    max_workdir_bytes: int = 256 << 20

    @classmethod
    def from_config(cls, sandbox) -> "SandboxLimits":
        """The limits a run's ``sandbox`` config section (``raytunix.config.SandboxConfig``,
        sizes in MiB and KiB) sets."""
        return cls(
            wall_time_s=sandbox.wall_time_s,
            cpu_time_s=sandbox.cpu_time_s,
            memory_bytes=sandbox.memory_mb << 20,
            max_processes=sandbox.max_processes,
            max_file_bytes=sandbox.max_file_mb << 20,
            max_output_bytes=sandbox.max_output_kb << 10,
            tmp_bytes=sandbox.tmp_mb << 20,
            max_workdir_bytes=sandbox.max_workdir_mb << 20,
        )

    def __post_init__(self) -> None:
        for name in ("wall_time_s", "cpu_time_s"):
            value = getattr(self, name)
            if not (_is_number(value) and math.isfinite(value) and 0 < value <= MAX_SECONDS):
                raise ValueError(
                    f"SandboxLimits.{name}={value!r} must be a number of seconds "
                    f"> 0 and <= {MAX_SECONDS:g}."
                )
        for name, low in (
            ("memory_bytes", 16 << 20),
            ("max_processes", 1),
            ("max_file_bytes", 0),
            ("max_output_bytes", 1),
            ("tmp_bytes", 1 << 20),
            ("max_workdir_bytes", 1 << 20),
        ):
            value = getattr(self, name)
            high = MAX_PROCESSES if name == "max_processes" else MAX_BYTES
            if not (
                isinstance(value, int) and not isinstance(value, bool) and low <= value <= high
            ):
                raise ValueError(
                    f"SandboxLimits.{name}={value!r} must be a whole number >= {low} and <= {high}."
                )


# Upper bounds of SandboxLimits, defined with the sandbox settings they bound.
MAX_SECONDS = SANDBOX_MAX_SECONDS
MAX_BYTES = SANDBOX_MAX_BYTES
MAX_PROCESSES = SANDBOX_MAX_PROCESSES


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """What one sandboxed command did.

    Attributes:
      exit_code: the command's exit status; a death by signal N reads 128 + N, as in a
        shell (bubblewrap reports it so, and the subprocess backend follows suit).
      signal: N when the command died of signal N, else None.
      stdout, stderr: the first ``max_output_bytes`` of each stream, decoded as UTF-8
        (undecodable bytes replaced).
      stdout_bytes, stderr_bytes: bytes the command wrote to each stream in all.
      stdout_truncated, stderr_truncated: the stream was longer than what is kept.
      timed_out: the wall-clock deadline passed and the process tree was killed.
      killed_by_limit: the limit that ended the command, or None if it ended on its own
        terms (``WALL_TIME``, ``CPU_TIME`` and ``FILE_SIZE`` from how it died; ``MEMORY``,
        ``PROCESSES`` and ``DISK`` when it failed with the matching error in its stderr,
        or for ``DISK`` with its work dir's budget full).
      limits_hit: every limit the run evidently reached, in ``SandboxLimit`` order (a fork
        bomb stopped by the deadline shows ``PROCESSES`` and ``WALL_TIME``). Memory and
        process limits are recognised from the error messages they cause in stderr
        ("MemoryError", "Cannot allocate memory", "Resource temporarily unavailable"...),
        so a program that hides its errors hides them here too.
      wall_time_s: seconds from start until the last process was gone.
      backend: what ran it (``SandboxBackend``).
      isolation: how it was kept apart (``IsolationLevel``; weaker than ``NAMESPACES``
        only where bubblewrap cannot run).
      limits: the limits it ran under.
    """

    exit_code: int
    signal: int | None
    stdout: str
    stderr: str
    stdout_bytes: int
    stderr_bytes: int
    stdout_truncated: bool
    stderr_truncated: bool
    timed_out: bool
    killed_by_limit: SandboxLimit | None
    limits_hit: tuple[SandboxLimit, ...]
    wall_time_s: float
    backend: SandboxBackend
    isolation: IsolationLevel
    limits: SandboxLimits

    @property
    def ok(self) -> bool:
        """Exit status 0 and no limit ended it."""
        return self.exit_code == 0 and self.killed_by_limit is None


class SandboxError(RuntimeError):
    """The sandbox cannot run as configured (e.g. ``backend="bwrap"`` where bubblewrap
    does not work); raised when the sandbox is built, with the reason."""


class SandboxUnavailable(EnvFailure):
    """A sandbox could not serve a call: its actor died or restarted, or the work dir it
    held is gone with it. Not the policy's fault; the episode ends as ``env_error``
    (``retryable``: a new episode on a fresh work dir may succeed)."""

    def __init__(self, message: str, *, retryable: bool = True):
        super().__init__(message, retryable=retryable)


class WorkspaceLost(SandboxUnavailable):
    """The work dir named in a call is unknown to the sandbox (closed, or lost when its
    actor restarted)."""


@runtime_checkable
class SandboxClient(Protocol):
    """Runs commands in per-episode work dirs: a local ``Sandbox`` or a ``RemoteSandbox``
    reaching a pool of sandbox actors. Methods block; call them from a thread, not from
    an event loop."""

    def open_workspace(self, name: str = "") -> str:
        """Creates a private, empty, writable work dir and returns its id."""

    def run(
        self,
        workspace: str,
        argv: Sequence[str],
        *,
        stdin: bytes | str = b"",
        env: Mapping[str, str] | None = None,
        limits: SandboxLimits | None = None,
    ) -> SandboxResult:
        """Runs ``argv`` in the work dir ``workspace``."""

    def close_workspace(self, workspace: str) -> None:
        """Kills what still runs there and deletes the work dir (idempotent)."""
