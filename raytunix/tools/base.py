"""The tool contract: a named callable with a JSON schema that never raises for bad input.

A tool call reads::

    result = tool(**call.arguments)          # ToolResult, never an exception for bad input
    text = result.error and f"error: {result.error}" or result.output

Subclasses implement ``run``; the base class checks the arguments against ``parameters``,
times the call and turns a failure into a ``ToolResult`` with ``error`` and its
``error_kind`` set. Argument names come from the model, so any name (``self``, ``run``...)
is just a key: a name the schema does not list is a ``BAD_ARGUMENTS`` error, never a crash.
"""

from __future__ import annotations

import abc
import dataclasses
import time
import logging
from typing import Any, ClassVar

from raytunix import profiling
from raytunix.types import EnvFailure, ToolErrorKind

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ToolResult:
    """What one tool call produced.

    Attributes:
      output: the tool's text output; empty when ``error`` is set.
      error: why the call failed (names the bad value), or None on success.
      latency_s: wall-clock time of the call, seconds.
      error_kind: what kind of failure ``error`` is (``BAD_ARGUMENTS``,
        ``TOOL_EXCEPTION``, ``TIMEOUT``...), None on success.
    """

    output: str
    error: str | None = None
    latency_s: float = 0.0
    error_kind: ToolErrorKind | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


class ToolError(Exception):
    """Raised inside ``Tool.run`` for input the tool cannot handle; the message is shown
    to the model, so it names the bad value and what to do instead.

    Args:
      message: what went wrong, for the model.
      kind: how it is counted (default ``TOOL_EXCEPTION``; ``TIMEOUT`` for a call that
        ran out of time).
    """

    def __init__(self, message: str, kind: ToolErrorKind = ToolErrorKind.TOOL_EXCEPTION):
        super().__init__(message)
        self.kind = kind


# JSON-schema type name -> Python types accepted for it (bool is not a number here).
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
}


class Tool(abc.ABC):
    """A named function the model may call.

    Attributes:
      name: the name the model writes in a tool call.
      description: one sentence for the model (system prompt) and for people.
      parameters: JSON schema of the arguments, an ``object`` schema with ``properties``
        and ``required``; only top-level keys and their ``type`` are checked.
    """

    name: ClassVar[str]
    description: ClassVar[str]
    parameters: ClassVar[dict[str, Any]]

    def __call__(self, /, **arguments: Any) -> ToolResult:
        """Runs the tool on ``arguments``; never raises for anything the model wrote.

        Arguments that do not fit ``parameters`` give ``error_kind=BAD_ARGUMENTS``; a
        ``ToolError`` from ``run`` gives ``TOOL_EXCEPTION`` with its message; any other
        exception from ``run`` (a bug in the tool) is logged and also gives
        ``TOOL_EXCEPTION``, naming the exception, so one broken tool call costs the
        episode a tool error, not the environment. A ``ToolError`` may name another kind
        (``TIMEOUT``). An ``EnvFailure`` (the tool's host, such as a sandbox actor, is
        gone) is not the policy's doing and propagates: the episode ends as
        ``env_error``.
        """
        start = time.perf_counter()
        error = self._check_arguments(arguments)
        kind = ToolErrorKind.BAD_ARGUMENTS
        if error is None:
            kind = ToolErrorKind.TOOL_EXCEPTION
            try:
                output = self.run(**arguments)
                return self._recorded(
                    ToolResult(output=output, latency_s=time.perf_counter() - start), start
                )
            except ToolError as e:
                error, kind = str(e), e.kind
            except EnvFailure:
                profiling.add(
                    "tool_call",
                    start,
                    time.perf_counter(),
                    f"tool {self.name}",
                    {"tool": self.name, "error": "env_failure"},
                )
                raise
            except Exception as e:  # noqa: BLE001 - a tool bug is reported to the model and logged
                logger.warning("tool %r raised %r on %r", self.name, e, arguments, exc_info=True)
                error = f"{self.name} failed with {type(e).__name__}: {_short(str(e))}"
        return self._recorded(
            ToolResult(
                output="", error=error, latency_s=time.perf_counter() - start, error_kind=kind
            ),
            start,
        )

    def _recorded(self, result: ToolResult, start: float) -> ToolResult:
        """Records the call as a ``tool_call`` span on this tool's track (latency per
        tool, errors by kind), then returns ``result``."""
        args = {"tool": self.name}
        if result.error_kind is not None:
            args["error"] = result.error_kind.value
        profiling.add("tool_call", start, start + result.latency_s, f"tool {self.name}", args)
        return result

    def close(self) -> None:
        """Releases what the tool holds (a sandbox work dir...); nothing by default. The
        environment that owns the tool calls it when its episode ends."""

    def function_schema(self) -> dict[str, Any]:
        """The tool as the model is shown it: ``{"type": "function", "function": {"name",
        "description", "parameters"}}``, the JSON-schema layout chat templates take as
        ``tools`` (Hugging Face ``apply_chat_template``, OpenAI function tools)."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }

    @abc.abstractmethod
    def run(self, /, **arguments: Any) -> str:
        """Does the work on checked arguments and returns the output text (declare
        ``self`` positional-only, as here, if the schema lists a parameter named ``self``).

        Raises:
          ToolError: the input cannot be handled (the message is shown to the model).
        """

    def _check_arguments(self, arguments: dict[str, Any], /) -> str | None:
        properties = self.parameters.get("properties", {})
        expected = f"expected arguments {sorted(properties)}"
        unknown = [key for key in arguments if key not in properties]
        if unknown:
            return f"{self.name}: unknown argument(s) {unknown}; {expected}"
        missing = [key for key in self.parameters.get("required", ()) if key not in arguments]
        if missing:
            return f"{self.name}: missing argument(s) {missing}; {expected}"
        for key, value in arguments.items():
            type_name = properties[key].get("type")
            accepted = _JSON_TYPES.get(type_name)
            if accepted is None:
                continue
            is_bool_as_number = isinstance(value, bool) and type_name != "boolean"
            if is_bool_as_number or not isinstance(value, accepted):
                got = _short(repr(value))
                return f"{self.name}: argument {key!r} must be a {type_name}, got {got}"
        return None


def _short(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
