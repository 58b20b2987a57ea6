"""A bash tool: runs the model's command in the episode's sandbox work dir."""

from __future__ import annotations

from raytunix.registry import register
from raytunix.sandbox import SandboxLimits, SandboxSession
from raytunix.tools.sandboxed import DEFAULT_MAX_INPUT_CHARS, SandboxedTool, render_output


@register("tool", "bash")
class BashTool(SandboxedTool):
    """Runs one shell command and returns its output, as a terminal would show it.

    Argument ``command`` (str, at most ``max_input_chars`` characters), run with
    ``bash --noprofile --norc -c`` in the episode's work dir (its ``HOME`` too) with
    stdin empty. State persists across calls through the work dir's files only; shell
    variables and ``cd`` do not carry over. Output: stdout, then stderr under
    ``[stderr]``, then ``[exit code N]`` when N is not 0 (a failing command is an
    observation, not a tool error); ``(no output)`` if there is none. Limits: see
    ``SandboxedTool``.

    Args:
      session, limits, max_input_chars: see ``SandboxedTool``.
      shell: the shell, looked up on the sandbox's ``PATH``; it must take
        ``--noprofile --norc -c`` (bash does).
    """

    name = "bash"
    description = (
        "Run a bash command in a sandbox without network access, in a working directory "
        "whose files persist for later calls (variables and cd do not); returns its "
        "output and a non-zero exit code."
    )
    parameters = {
        "type": "object",
        "properties": {
            "command": {
                "type": "string",
                "description": "e.g. 'ls -la && cat notes.txt'",
            }
        },
        "required": ["command"],
    }

    def __init__(
        self,
        session: SandboxSession | None = None,
        *,
        limits: SandboxLimits | None = None,
        max_input_chars: int = DEFAULT_MAX_INPUT_CHARS,
        shell: str = "bash",
    ) -> None:
        super().__init__(session, limits=limits, max_input_chars=max_input_chars)
        self.shell = shell

    def run(self, command: str) -> str:
        result = self._execute([self.shell, "--noprofile", "--norc", "-c", command], command)
        output = render_output(result)
        if result.exit_code != 0:
            output = (
                f"{output}\n[exit code {result.exit_code}]"
                if output
                else f"[exit code {result.exit_code}]"
            )
        return output or "(no output)"
