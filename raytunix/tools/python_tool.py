"""A Python interpreter tool: runs the model's program with ``python3 -I`` in a sandbox."""

from __future__ import annotations

from raytunix.registry import register
from raytunix.sandbox import SandboxLimits, SandboxSession
from raytunix.tools.base import ToolError
from raytunix.tools.sandboxed import DEFAULT_MAX_INPUT_CHARS, SandboxedTool, render_output


@register("tool", "python")
class PythonTool(SandboxedTool):
    """Runs a complete Python 3 program and returns what it printed.

    Argument ``code`` (str, at most ``max_input_chars`` characters), fed to
    ``<python> -I -`` on stdin (isolated mode: no user site-packages, no ``PYTHON*``
    variables) in the episode's work dir, so files it writes stay for later calls.
    Output: stdout, then stderr under ``[stderr]``, or ``(no output ...)``. A program
    that exits non-zero (an uncaught exception) is a ``TOOL_EXCEPTION`` whose message
    holds its output and traceback; limits: see ``SandboxedTool``.

    Args:
      session, limits, max_input_chars: see ``SandboxedTool``.
      python: the interpreter, looked up on the sandbox's ``PATH`` (this process's Python
        installation first where the sandbox can reach it, then the system's).
    """

    name = "python"
    description = (
        "Run a Python 3 program in a sandbox without network access and return what it "
        "prints; files it writes stay in the working directory for later calls."
    )
    parameters = {
        "type": "object",
        "properties": {
            "code": {
                "type": "string",
                "description": "a complete program; print() the results, e.g. 'print(sum(range(10)))'",
            }
        },
        "required": ["code"],
    }

    def __init__(
        self,
        session: SandboxSession | None = None,
        *,
        limits: SandboxLimits | None = None,
        max_input_chars: int = DEFAULT_MAX_INPUT_CHARS,
        python: str = "python3",
    ) -> None:
        super().__init__(session, limits=limits, max_input_chars=max_input_chars)
        self.python = python

    def run(self, code: str) -> str:
        result = self._execute([self.python, "-I", "-"], code, stdin=code)
        output = render_output(result)
        if result.exit_code != 0:
            raise ToolError(
                f"python: the program failed with exit code {result.exit_code}:\n"
                f"{output or '(no output)'}"
            )
        return output or "(no output; print() what you want to see)"
