"""Math environments: a multi-turn one with a calculator tool, a single-turn verifier.

Both score a final answer with ``raytunix.data.score_answer`` (reasoning-gym's scorer
when the task carries its entry, else numeric comparison): reward 1.0 if correct.
"""

from __future__ import annotations

import time
from typing import Sequence

from raytunix.data.arithmetic import score_answer
from raytunix.envs.base import BaseEnv
from raytunix.tools import Calculator, Tool
from raytunix.types import Action, EpisodeStatus, StepResult, Task


class CalculatorMathEnv(BaseEnv):
    """Multi-turn math with tools: tool calls get their results back, an answer ends the
    episode.

    Per step:
      * tool calls: each runs; the observation is one line per call, the output or
        ``error: <message>``; not done.
      * a parse error, an unknown tool or a failing call counts one tool error (per call)
        and shows ``error: <message>``; once more than ``max_tool_errors`` are counted the
        episode ends with status ``TOOL_ERROR_LIMIT`` and reward 0.
      * an answer: reward 1.0 if correct else 0.0, done, ``COMPLETED``.

    ``info`` holds ``tool_errors`` (count so far), and ``tool_latency_s`` (seconds spent
    in tools this step) or ``correct``.

    Args:
      max_tool_errors: tool errors tolerated per episode (>= 0).
      tools: the tools offered (default: a ``Calculator``).

    Raises:
      ValueError: ``max_tool_errors`` is negative or two tools share a name.
    """

    default_agent = "tool"

    def __init__(self, max_tool_errors: int = 3, tools: Sequence[Tool] | None = None) -> None:
        super().__init__()
        if max_tool_errors < 0:
            raise ValueError(f"max_tool_errors must be >= 0, got {max_tool_errors}")
        tools = list(tools) if tools is not None else [Calculator()]
        self.tools = {tool.name: tool for tool in tools}
        if len(self.tools) != len(tools):
            raise ValueError(f"tool names must be unique, got {[tool.name for tool in tools]}")
        self.max_tool_errors = max_tool_errors
        self.tool_errors = 0

    def _initial_observation(self, task: Task) -> str:
        self.tool_errors = 0
        return task.question

    def _step_impl(self, action: Action) -> StepResult:
        if action.parse_error is None and action.answer is not None and not action.tool_calls:
            correct = score_answer(self.task, action.answer) == 1.0
            return StepResult(
                observation="",
                reward=1.0 if correct else 0.0,
                done=True,
                status=EpisodeStatus.COMPLETED,
                info={"correct": correct, "tool_errors": self.tool_errors},
            )
        lines, latency_s = [], 0.0
        if action.parse_error is not None or not action.tool_calls:
            lines.append(f"error: {action.parse_error or 'no tool call or answer found'}")
        else:
            for call in action.tool_calls:
                start = time.perf_counter()
                lines.append(self._run_tool(call.name, call.arguments))
                latency_s += time.perf_counter() - start
        self.tool_errors += sum(line.startswith("error: ") for line in lines)
        info = {"tool_errors": self.tool_errors, "tool_latency_s": latency_s}
        if self.tool_errors > self.max_tool_errors:
            return StepResult(
                observation="",
                reward=0.0,
                done=True,
                status=EpisodeStatus.TOOL_ERROR_LIMIT,
                info=info,
            )
        return StepResult(observation="\n".join(lines), info=info)

    def _run_tool(self, name: str, arguments: dict) -> str:
        tool = self.tools.get(name)
        if tool is None:
            return f"error: unknown tool {name!r}; available tools: {sorted(self.tools)}"
        result = tool(**arguments)
        return f"error: {result.error}" if result.error is not None else result.output


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
