"""How a tool reaches a sandbox: ``connect`` picks one, ``SandboxSession`` holds one
episode's work dir in it.

    session = SandboxSession(connect())       # the job's sandbox pool, or a local sandbox
    session.run(["bash", "-c", "echo hi > notes.txt"])
    session.run(["cat", "notes.txt"]).stdout  # 'hi\\n': the work dir persists
    session.close()                           # kills leftovers, deletes the work dir

Ray is imported only when this process already runs in a Ray job.
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import Mapping, Sequence

from raytunix.sandbox.sandbox import Sandbox
from raytunix.sandbox.types import DEFAULT_POOL_NAME, SandboxClient, SandboxLimits, SandboxResult

logger = logging.getLogger(__name__)

_LOCAL: dict[tuple[SandboxLimits, str, bool], Sandbox] = {}
_LOCAL_LOCK = threading.Lock()


def connect(
    pool: str = DEFAULT_POOL_NAME,
    *,
    limits: SandboxLimits | None = None,
    backend: str = "auto",
    allow_weak_isolation: bool = False,
) -> SandboxClient:
    """The sandbox pool named ``pool`` if this process runs in a Ray job that started one
    (``SandboxPool``; its actors' own limits and isolation apply), else a ``Sandbox`` in
    this process, one per (``limits``, ``backend``, ``allow_weak_isolation``), shared by
    every caller here.

    Raises:
      SandboxError: no pool, and ``backend`` cannot run here, or cannot isolate
        untrusted code here and ``allow_weak_isolation`` is false (the message names
        what is missing).
    """
    if "ray" in sys.modules:
        # Deferred: the pool module imports Ray, which a process outside a Ray job skips.
        from raytunix.sandbox.pool import find_pool

        client = find_pool(pool)
        if client is not None:
            return client
    key = (limits or SandboxLimits(), backend, bool(allow_weak_isolation))
    with _LOCAL_LOCK:
        if key not in _LOCAL:
            if "ray" in sys.modules:
                logger.info("sandbox: no pool %r in this job; running tools in this process", pool)
            _LOCAL[key] = Sandbox(key[0], backend=backend, allow_weak_isolation=key[2])
        return _LOCAL[key]


class SandboxSession:
    """One episode's work dir in a sandbox: opened on the first run, kept (with every file
    written there) until ``close``. Thread-safe; one run at a time per work dir.

    Args:
      client: the sandbox to use (default: ``connect()`` on the first run).
      name: prefixes the work dir's id (logs only).
    """

    def __init__(self, client: SandboxClient | None = None, name: str = "episode") -> None:
        self._client = client
        self._name = name
        self._workspace: str | None = None
        self._lock = threading.Lock()

    @property
    def client(self) -> SandboxClient:
        if self._client is None:
            self._client = connect()
        return self._client

    @property
    def workspace(self) -> str | None:
        """The work dir's id, or None before the first run."""
        return self._workspace

    def run(
        self,
        argv: Sequence[str],
        *,
        stdin: bytes | str = b"",
        env: Mapping[str, str] | None = None,
        limits: SandboxLimits | None = None,
    ) -> SandboxResult:
        """``SandboxClient.run`` in this session's work dir (opened on first use).

        Raises:
          SandboxUnavailable: the sandbox (or its actor) cannot serve the call.
          ValueError: malformed ``argv``, ``stdin`` or ``env``.
        """
        with self._lock:
            if self._workspace is None:
                self._workspace = self.client.open_workspace(self._name)
            workspace = self._workspace
        return self.client.run(workspace, argv, stdin=stdin, env=env, limits=limits)

    def close(self) -> None:
        """Deletes the work dir and kills what still runs there; the next ``run`` opens a
        fresh one."""
        with self._lock:
            workspace, self._workspace = self._workspace, None
        if workspace is not None:
            self.client.close_workspace(workspace)

    def __enter__(self) -> "SandboxSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
