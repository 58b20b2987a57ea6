"""Math environments: a multi-turn one with a calculator tool, a single-turn verifier.

Both score a final answer with ``raytunix.data.answers.score_answer``, the one rule for
math answers (exact numbers in the usual formats, ``\\boxed{}``, math-verify for LaTeX
expressions): reward 1.0 if correct.
"""

from __future__ import annotations

import collections
import concurrent.futures
import time
from typing import Sequence

from raytunix.config import SANDBOX_MAX_SECONDS as SECONDS_MAX
from raytunix.data.answers import score_answer
from raytunix.envs.base import BaseEnv
from raytunix.registry import register
from raytunix.tools import Calculator, Tool, ToolResult, resolve_tool
from raytunix.types import (
    TOOL_ERRORS_KEY,
    Action,
    EpisodeStatus,
    StepResult,
    Task,
    ToolErrorKind,
)

# Tool calls with a deadline run here. A call past its deadline cannot be killed (it is a
# thread); it finishes in the background, so the pool is sized for a few stuck calls.
_TOOL_THREADS = concurrent.futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="tool")


@register("env", "calculator_math")
class CalculatorMathEnv(BaseEnv):
    """Multi-turn math with tools: tool calls get their results back, an answer ends the
    episode.

    Per step:
      * tool calls: each runs; the observation is one line per call, the output or
        ``error: <message>``; not done.
      * a parse error, an unknown tool, bad arguments, a failing call or one past
        ``tool_timeout_s`` counts one tool error (per call) and shows ``error: <message>``;
        once more than ``max_tool_errors`` are counted the episode ends with status
        ``TOOL_ERROR_LIMIT`` and reward 0 (the policy's outcome, trained on).
      * an answer: reward 1.0 if correct else 0.0, done, ``COMPLETED``.

    ``info[TOOL_ERRORS_KEY]`` is ``{ToolErrorKind value: count}`` for this step; ``info``
    also holds ``tool_latency_s`` (seconds spent in tools this step) or ``correct``.

    Args:
      max_tool_errors: tool errors tolerated per episode (>= 0).
      tools: the tools offered, each a ``Tool`` or the name of one (a registered tool
        name such as ``"calculator"``, or ``package.module:ToolClass``; built with no
        arguments). Default: a ``Calculator``.
      tool_timeout_s: deadline of one tool call, seconds (> 0), or None to call tools
        inline with no deadline.

    Raises:
      ValueError: ``max_tool_errors`` is negative, ``tool_timeout_s`` is not positive, a
        tool name does not resolve, or two tools share a name.
    """

    default_agent = "tool"

    def __init__(
        self,
        max_tool_errors: int = 2,
        tools: Sequence[Tool | str] | None = None,
        tool_timeout_s: float | None = 10.0,
    ) -> None:
        super().__init__()
        if max_tool_errors < 0:
            raise ValueError(f"max_tool_errors must be >= 0, got {max_tool_errors}")
        # Finite: a wait of inf overflows the platform's time_t (OverflowError, not the
        # TimeoutError a late tool raises); None is how "no deadline" is said.
        if tool_timeout_s is not None and not (
            isinstance(tool_timeout_s, (int, float))
            and not isinstance(tool_timeout_s, bool)
            and 0 < tool_timeout_s <= SECONDS_MAX
        ):
            raise ValueError(
                f"tool_timeout_s must be a number of seconds in (0, "
                f"{SECONDS_MAX:g}] or None (no deadline), got {tool_timeout_s!r}"
            )
        self.tool_timeout_s = tool_timeout_s
        if isinstance(tools, (str, Tool)):
            tools = [tools]
        tools = [_tool(tool) for tool in tools] if tools is not None else [Calculator()]
        self.tools = {tool.name: tool for tool in tools}
        if len(self.tools) != len(tools):
            raise ValueError(f"tool names must be unique, got {[tool.name for tool in tools]}")
        self.max_tool_errors = max_tool_errors
        self.tool_errors = 0

    def _initial_observation(self, task: Task) -> str:
        self.tool_errors = 0
        return task.question

    def close(self) -> None:
        """Closes the tools (a sandboxed tool deletes its work dir)."""
        for tool in self.tools.values():
            tool.close()

    def _step_impl(self, action: Action) -> StepResult:
        if action.parse_error is None and action.answer is not None and not action.tool_calls:
            correct = score_answer(self.task, action.answer) == 1.0
            return StepResult(
                observation="",
                reward=1.0 if correct else 0.0,
                done=True,
                status=EpisodeStatus.COMPLETED,
                info={"correct": correct, TOOL_ERRORS_KEY: {}},
            )
        lines, latency_s = [], 0.0
        errors: collections.Counter = collections.Counter()
        if action.parse_error is not None or not action.tool_calls:
            lines.append(f"error: {action.parse_error or 'no tool call or answer found'}")
            errors[(action.parse_error_kind or ToolErrorKind.FORMAT).value] += 1
        else:
            for call in action.tool_calls:
                start = time.perf_counter()
                result = self._run_tool(call.name, call.arguments)
                latency_s += time.perf_counter() - start
                if result.error is not None:
                    errors[result.error_kind.value] += 1
                    lines.append(f"error: {result.error}")
                else:
                    lines.append(result.output)
        self.tool_errors += sum(errors.values())
        info = {TOOL_ERRORS_KEY: dict(errors), "tool_latency_s": latency_s}
        if self.tool_errors > self.max_tool_errors:
            return StepResult(
                observation="",
                reward=0.0,
                done=True,
                status=EpisodeStatus.TOOL_ERROR_LIMIT,
                info=info,
            )
        return StepResult(observation="\n".join(lines), info=info)

    def _run_tool(self, name: str, arguments: dict) -> ToolResult:
        tool = self.tools.get(name)
        if tool is None:
            return ToolResult(
                output="",
                error=f"unknown tool {name!r}; available tools: {sorted(self.tools)}",
                error_kind=ToolErrorKind.UNKNOWN_TOOL,
            )
        if self.tool_timeout_s is None:
            return tool(**arguments)
        future = _TOOL_THREADS.submit(lambda: tool(**arguments))
        try:
            return future.result(timeout=self.tool_timeout_s)
        except concurrent.futures.TimeoutError:
            return ToolResult(
                output="",
                error=f"{name} did not answer within {self.tool_timeout_s} s; try a simpler call",
                latency_s=self.tool_timeout_s,
                error_kind=ToolErrorKind.TIMEOUT,
            )


def _tool(tool: Tool | str) -> Tool:
    if isinstance(tool, Tool):
        return tool
    if isinstance(tool, str):
        return resolve_tool(tool)()
    raise TypeError(
        f"a tool must be a Tool or a tool's name, got {type(tool).__qualname__} ({tool!r:.60})"
    )


@register("env", "math_verifier")
class MathVerifierEnv(BaseEnv):
    """Single-turn math: the one action's answer is scored and the episode ends.

    Reward 1.0 if correct else 0.0, status ``COMPLETED``; no answer scores 0 with the
    reason in ``info["parse_error"]``. ``info["correct"]`` says whether it was right.
    """

    default_agent = "answer"

    def _initial_observation(self, task: Task) -> str:
        return task.question

    def _step_impl(self, action: Action) -> StepResult:
        info: dict = {}
        if action.answer is None:
            info["parse_error"] = action.parse_error or "no answer found"
        correct = score_answer(self.task, action.answer) == 1.0
        info["correct"] = correct
        return StepResult(
            observation="",
            reward=1.0 if correct else 0.0,
            done=True,
            status=EpisodeStatus.COMPLETED,
            info=info,
        )
