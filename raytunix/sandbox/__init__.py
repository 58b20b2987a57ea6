"""Sandboxed command runs for code-running tools: per-episode work dirs, resource limits,
bubblewrap isolation where it works (``raytunix.sandbox.sandbox``), a pool of sandbox
actors (``raytunix.sandbox.pool``, imported on its own: it needs Ray), and the session a
tool holds (``raytunix.sandbox.client``)."""

from raytunix.sandbox.client import DEFAULT_POOL_NAME, SandboxSession, connect
from raytunix.sandbox.sandbox import BACKENDS, Sandbox
from raytunix.sandbox.types import (
    IsolationLevel,
    SandboxBackend,
    SandboxClient,
    SandboxError,
    SandboxLimit,
    SandboxLimits,
    SandboxResult,
    SandboxUnavailable,
    WorkspaceLost,
)

__all__ = [
    "BACKENDS",
    "DEFAULT_POOL_NAME",
    "IsolationLevel",
    "Sandbox",
    "SandboxBackend",
    "SandboxClient",
    "SandboxError",
    "SandboxLimit",
    "SandboxLimits",
    "SandboxResult",
    "SandboxSession",
    "SandboxUnavailable",
    "WorkspaceLost",
    "connect",
]
