"""The common part of tools that run code in a sandbox (``PythonTool``, ``BashTool``):
one episode's work dir, and how a run's outcome reads to the model.

A run that a limit stopped is a tool error (``TIMEOUT`` for the wall-clock deadline,
``TOOL_EXCEPTION`` for CPU time, memory, file size or processes), its message naming the
limit and holding the output so far. A sandbox that cannot serve the call (its actor
died) raises ``SandboxUnavailable``, which is no tool error: the episode ends as
``env_error``.
"""

from __future__ import annotations

from typing import Sequence

from raytunix.sandbox import SandboxLimit, SandboxLimits, SandboxResult, SandboxSession
from raytunix.tools.base import Tool, ToolError
from raytunix.types import ToolErrorKind

DEFAULT_MAX_INPUT_CHARS = 20_000


class SandboxedTool(Tool):
    """A tool whose calls run commands in one sandbox work dir (files persist between
    calls until ``close``).

    Args:
      session: the work dir to use; tools given the same session share files (a
        Python tool's output file is visible to a bash tool). Default: a session of its
        own on ``raytunix.sandbox.connect()``, closed by ``close``.
      limits: limits of each run (default: the sandbox's own).
      max_input_chars: longest code or command accepted (> 0).

    Raises:
      ValueError: ``max_input_chars`` is not positive.
    """

    def __init__(
        self,
        session: SandboxSession | None = None,
        *,
        limits: SandboxLimits | None = None,
        max_input_chars: int = DEFAULT_MAX_INPUT_CHARS,
    ) -> None:
        if max_input_chars < 1:
            raise ValueError(f"max_input_chars={max_input_chars} must be > 0.")
        self._owns_session = session is None
        self.session = session if session is not None else SandboxSession(name=self.name)
        self.limits = limits
        self.max_input_chars = max_input_chars

    def close(self) -> None:
        """Deletes the work dir if this tool opened it (a shared session is its owner's)."""
        if self._owns_session:
            self.session.close()

    def _execute(self, argv: Sequence[str], source: str, stdin: str = "") -> SandboxResult:
        if len(source) > self.max_input_chars:
            raise ToolError(
                f"{self.name}: input of {len(source)} characters is longer than "
                f"the limit of {self.max_input_chars}; send less at once"
            )
        result = self.session.run(argv, stdin=stdin, limits=self.limits)
        if result.killed_by_limit is not None:
            raise ToolError(
                _limit_message(self.name, result),
                ToolErrorKind.TIMEOUT if result.timed_out else ToolErrorKind.TOOL_EXCEPTION,
            )
        return result


def render_output(result: SandboxResult) -> str:
    """stdout, then stderr under a ``[stderr]`` line, each with a note when it was cut."""
    parts = []
    if result.stdout:
        parts.append(result.stdout.rstrip("\n"))
    if result.stdout_truncated:
        parts.append(
            f"[stdout cut: first {result.limits.max_output_bytes} of "
            f"{result.stdout_bytes} bytes shown]"
        )
    if result.stderr:
        parts.append("[stderr]\n" + result.stderr.rstrip("\n"))
    if result.stderr_truncated:
        parts.append(
            f"[stderr cut: first {result.limits.max_output_bytes} of "
            f"{result.stderr_bytes} bytes shown]"
        )
    return "\n".join(parts)


def _limit_message(tool: str, result: SandboxResult) -> str:
    limits = result.limits
    what = {
        SandboxLimit.WALL_TIME: f"did not finish within {limits.wall_time_s:g} s and was stopped",
        SandboxLimit.CPU_TIME: f"used up its {limits.cpu_time_s:g} s of CPU time and was stopped",
        SandboxLimit.MEMORY: f"ran out of memory (limit {limits.memory_bytes / 2**20:g} MiB "
        "of address space)",
        SandboxLimit.FILE_SIZE: f"tried to write a file larger than the limit of "
        f"{limits.max_file_bytes / 2**20:g} MiB",
        SandboxLimit.PROCESSES: f"tried to start more than {limits.max_processes} processes",
    }[result.killed_by_limit]
    output = render_output(result)
    return f"{tool}: the command {what}." + (f" Output so far:\n{output}" if output else "")
