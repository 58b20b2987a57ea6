"""The common shape of the shipped tool-using environments: tool calls run as in
``CalculatorMathEnv`` (results back, errors counted, a limit on them), and the final
``<answer>`` is scored by the subclass (``_score``), which may inspect what the tools left
behind (a sandbox work dir, a database) before the episode ends.

Sandboxed environments share one ``SandboxSession`` between their tools, so a file the
bash tool writes is there for the python tool and for the final check; the session (the
episode's work dir) is deleted by ``close``.
"""

from __future__ import annotations

import abc
import hashlib
import json
import random
import secrets
from typing import Any, Callable, Sequence

from raytunix import profiling
from raytunix.envs.math_envs import CalculatorMathEnv
from raytunix.sandbox import SandboxSession
from raytunix.tools import Tool
from raytunix.types import TOOL_ERRORS_KEY, Action, EpisodeStatus, StepResult, Task

HELDOUT_SHARE = 10  # about one generated task in this many belongs to the held-out split


class ToolTaskEnv(CalculatorMathEnv):
    """A multi-turn tool environment whose final answer the subclass scores.

    Per step: tool calls (and malformed turns) as in ``CalculatorMathEnv``; an answer
    ends the episode as ``COMPLETED`` with the reward and info ``_score`` gives
    (``info[TOOL_ERRORS_KEY]`` is ``{}`` on that step).

    Args:
      tools: the tools offered (instances).
      max_tool_errors, tool_timeout_s: see ``CalculatorMathEnv``.
    """

    def __init__(self, tools: Sequence[Tool], *, max_tool_errors: int = 2,
                 tool_timeout_s: float | None = 10.0) -> None:
        super().__init__(max_tool_errors=max_tool_errors, tools=list(tools),
                         tool_timeout_s=tool_timeout_s)

    def _step_impl(self, action: Action) -> StepResult:
        if action.parse_error is None and action.answer is not None and not action.tool_calls:
            with profiling.span("reward", "env", {"rule": type(self).__name__}):
                reward, info = self._score(action.answer)
            return StepResult(observation="", reward=reward, done=True,
                              status=EpisodeStatus.COMPLETED,
                              info={**info, TOOL_ERRORS_KEY: {}})
        return super()._step_impl(action)

    @abc.abstractmethod
    def _score(self, answer: str) -> tuple[float, dict[str, Any]]:
        """``(reward, info)`` for the final answer ``answer`` (stripped of nothing);
        may raise (the episode then ends as ``ENV_ERROR``)."""


def write_files_program(files: dict[str, str]) -> str:
    """A Python program that writes ``files`` (relative path -> text) under its working
    directory, making parent directories; refuses absolute paths and ``..``."""
    return (
        "import json, os\n"
        f"files = json.loads({json.dumps(files)!r})\n"
        "for path, text in files.items():\n"
        "    if os.path.isabs(path) or '..' in path.split('/'):\n"
        "        raise SystemExit(f'refusing to write {path!r} outside the work dir')\n"
        "    if os.path.dirname(path):\n"
        "        os.makedirs(os.path.dirname(path), exist_ok=True)\n"
        "    with open(path, 'w') as f:\n"
        "        f.write(text)\n"
    )


def write_files(session: SandboxSession, files: dict[str, str]) -> None:
    """Writes ``files`` (relative path -> text) into the session's work dir.

    Raises:
      RuntimeError: the program that writes them failed (the message holds its stderr).
      SandboxUnavailable: the sandbox cannot serve the call.
    """
    result = session.run(["python3", "-I", "-"], stdin=write_files_program(files))
    if not result.ok:
        raise RuntimeError(f"writing {sorted(files)} into the work dir failed (exit "
                           f"{result.exit_code}): {result.stderr[-2000:]}")


def run_report(session: SandboxSession, program: str) -> dict[str, Any]:
    """Runs ``program`` (Python; it defines ``report()`` returning a JSON-able dict) in the
    session's work dir and returns that dict.

    The report is read from the one stdout line that starts with a fresh random marker,
    so whatever else the run prints (code the model wrote, imported by the check)
    cannot pass for it.

    Raises:
      RuntimeError: the program failed or printed no report (the message holds its output).
      SandboxUnavailable: the sandbox cannot serve the call.
    """
    marker = f"@@report-{secrets.token_hex(8)}@@"
    source = (f"{program}\n\nimport json as _json\n"
              f"print({marker!r} + _json.dumps(report()), flush=True)\n")
    result = session.run(["python3", "-I", "-"], stdin=source)
    for line in result.stdout.splitlines():
        if line.startswith(marker):
            return json.loads(line[len(marker):])
    raise RuntimeError(f"the check program printed no report (exit {result.exit_code}, "
                       f"limit {result.killed_by_limit}); stdout: {result.stdout[-1000:]!r}; "
                       f"stderr: {result.stderr[-2000:]!r}")


def split_of(question: str, answer: str) -> str:
    """The split a generated task belongs to, by a stable hash of its question and answer:
    "heldout" for about one in ``HELDOUT_SHARE``, else "train". So a generator's train and
    held-out tasks never share a task, whatever the seeds and sizes."""
    digest = hashlib.sha256(f"{question}\n{answer}".encode()).digest()
    return "heldout" if digest[0] % HELDOUT_SHARE == 0 else "train"


def draw_tasks(split: str, size: int, rng: random.Random,
               draw: Callable[[random.Random], tuple[str, str, dict[str, Any]]]) -> list[Task]:
    """``size`` tasks of ``split`` ("train" or "heldout"), ids ``<split>-<i>``: ``draw(rng)``
    gives ``(question, answer, metadata)`` and only those of the split (``split_of``) are
    kept.

    Raises:
      ValueError: ``split`` is neither, or the generator makes too few tasks of the split
        (a task space too small to split).
    """
    if split not in ("train", "heldout"):
        raise ValueError(f"split={split!r} must be 'train' or 'heldout'")
    tasks: list[Task] = []
    for _ in range(100 * HELDOUT_SHARE * (size + 10)):
        if len(tasks) == size:
            return tasks
        question, answer, metadata = draw(rng)
        if split_of(question, answer) == split:
            tasks.append(Task(f"{split}-{len(tasks)}", question, answer, metadata))
    if len(tasks) == size:
        return tasks
    raise ValueError(f"drew only {len(tasks)} of {size} {split} tasks; the generator's task "
                     "space is too small to hold a held-out split apart")
