"""An interactive bash terminal: the model runs commands in its episode's sandbox work dir
and sees their output; when it answers (``<answer>done</answer>``) the work dir's final
state is checked (files with the right content, directories, files that must be gone).

    <|user|>Create the directories docs/api and docs/guide. ...
    <|assistant|><tool_call>{"name": "bash", "arguments": {"command": "mkdir -p docs/api docs/guide"}}</tool_call>
    <|tool|>(no output)
    <|assistant|><answer>done</answer>           -> check: both directories exist -> reward 1
"""

from __future__ import annotations

import json
import random
from typing import Any, Callable

from raytunix.envs.tool_task import ToolTaskEnv, draw_tasks, read_state, write_files
from raytunix.registry import register
from raytunix.sandbox import SandboxClient, SandboxSession
from raytunix.tools import BashTool, PythonTool
from raytunix.types import Task

WORDS = (
    "apple",
    "birch",
    "cedar",
    "delta",
    "ember",
    "fjord",
    "grove",
    "harbor",
    "iris",
    "juniper",
    "kelp",
    "lotus",
    "maple",
    "nectar",
    "onyx",
    "pebble",
    "quartz",
    "river",
)

# A task: (question, setup files {path: text}, expected state {"files": {path: text},
# "dirs": [path], "absent": [path]}). File contents compare without trailing newlines.
_Spec = tuple[str, dict[str, str], dict[str, Any]]


def _write_line(rng: random.Random) -> _Spec:
    name, word, n = f"{rng.choice(WORDS)}.txt", rng.choice(WORDS), rng.randint(1, 999)
    return (
        f"Create a file {name} that contains exactly the line: {word} {n}",
        {},
        {"files": {name: f"{word} {n}"}},
    )


def _make_dirs(rng: random.Random) -> _Spec:
    top, a, b = rng.sample(WORDS, 3)
    return (
        f"Create the directories {top}/{a} and {top}/{b}.",
        {},
        {"dirs": [f"{top}/{a}", f"{top}/{b}"]},
    )


def _count_lines(rng: random.Random) -> _Spec:
    lines = [rng.choice(WORDS) for _ in range(rng.randint(3, 12))]
    return (
        "Write the number of lines of data.txt into count.txt.",
        {"data.txt": "\n".join(lines) + "\n"},
        {"files": {"count.txt": str(len(lines))}},
    )


def _rename(rng: random.Random) -> _Spec:
    old, new = rng.sample(WORDS, 2)
    text = f"{rng.choice(WORDS)} {rng.randint(1, 99)}"
    return (
        f"Rename {old}.txt to {new}.txt.",
        {f"{old}.txt": text + "\n"},
        {"files": {f"{new}.txt": text}, "absent": [f"{old}.txt"]},
    )


def _grep_errors(rng: random.Random) -> _Spec:
    lines = [
        f"{rng.choice(('INFO', 'INFO', 'ERROR'))} {rng.choice(WORDS)} {i}"
        for i in range(rng.randint(4, 10))
    ]
    errors = [line for line in lines if line.startswith("ERROR")]
    return (
        "Copy the lines of log.txt that contain ERROR, in order, into errors.txt.",
        {"log.txt": "\n".join(lines) + "\n"},
        {"files": {"errors.txt": "\n".join(errors)}},
    )


def _sort_lines(rng: random.Random) -> _Spec:
    names = rng.sample(WORDS, rng.randint(3, 7))
    return (
        "Write the lines of names.txt, sorted alphabetically, into sorted.txt.",
        {"names.txt": "\n".join(names) + "\n"},
        {"files": {"sorted.txt": "\n".join(sorted(names))}},
    )


def _delete_tmp(rng: random.Random) -> _Spec:
    words = rng.sample(WORDS, rng.randint(3, 6))
    tmp = words[: max(1, len(words) // 2)]
    files = {f"{w}.tmp" if w in tmp else f"{w}.txt": f"{w}\n" for w in words}
    keep = {path: text.rstrip("\n") for path, text in files.items() if path.endswith(".txt")}
    return (
        "Delete every .tmp file in the working directory and keep the others.",
        files,
        {"files": keep, "absent": [f"{w}.tmp" for w in tmp]},
    )


TEMPLATES: dict[str, Callable[[random.Random], _Spec]] = {
    "write_line": _write_line,
    "make_dirs": _make_dirs,
    "count_lines": _count_lines,
    "rename": _rename,
    "grep_errors": _grep_errors,
    "sort_lines": _sort_lines,
    "delete_tmp": _delete_tmp,
}


def check_state(expect: dict[str, Any], state: dict[str, dict[str, Any]]) -> list[str]:
    """What is wrong with the work dir's ``state`` (``tool_task.read_state``) against the
    task's ``expect``, one line per check that failed (empty: all hold). Decided here, on
    the host: the expected contents never enter the sandbox.

    A file must be a regular file (not a link to one) whose text equals the expected one
    without trailing newlines; a directory a real directory; an absent path nothing at all
    (a dangling link still exists)."""

    def at(path: str) -> tuple[str, str]:
        got = state.get(path)
        if not isinstance(got, dict) or got.get("kind") not in _WHAT:
            return "unreadable", ""
        if got["kind"] == "file" and got.get("truncated"):
            return "long", ""
        return got["kind"], str(got.get("text", ""))

    failures = []
    for path, text in expect.get("files", {}).items():
        kind, got = at(path)
        if kind == "missing":
            failures.append(f"{path}: no such file")
        elif kind == "long":
            failures.append(f"{path}: content longer than the expected {text[:80]!r}")
        elif kind != "file":
            failures.append(f"{path}: {_WHAT[kind]}, not a file")
        elif got.rstrip("\n") != text:
            failures.append(f"{path}: content {got[:80]!r}, expected {text[:80]!r}")
    for path in expect.get("dirs", []):
        kind, _ = at(path)
        if kind == "missing":
            failures.append(f"{path}: no such directory")
        elif kind != "dir":
            failures.append(f"{path}: {_WHAT[kind]}, not a directory")
    for path in expect.get("absent", []):
        kind, _ = at(path)
        if kind != "missing":
            failures.append(f"{path}: still exists ({_WHAT[kind]})")
    return failures


_WHAT = {
    "missing": "no such file",
    "file": "a file",
    "dir": "a directory",
    "link": "a symbolic link",
    "other": "a FIFO, socket or device",
    "unreadable": "unreadable",
    "long": "a file longer than expected",
}


@register("env", "bash_terminal")
class BashTerminalEnv(ToolTaskEnv):
    """Shell tasks in a sandbox, rewarded by a check of the work dir's final state.

    Each episode gets a fresh sandbox work dir holding the task's starting files. A
    ``bash`` call (``{"command": "..."}``) runs there and returns its output with a
    non-zero exit code noted; files persist between calls (shell variables and ``cd`` do
    not). With ``python_tool`` a ``python`` tool shares the same work dir. An
    ``<answer>`` (any text, e.g. ``done``) ends the episode: what is at each path the task
    names is read out of the work dir (links not followed, FIFOs not opened, no more read
    than the expected text and 64 characters) and compared here with the expected state, which
    never enters the sandbox (``check_state``); the reward is 1.0 if every check passes,
    else 0.0, with ``info["check_failures"]`` listing what was wrong. An episode that runs out of turns
    before answering ends ``truncated`` with reward 0, unchecked.

    Tasks come from ``TEMPLATES`` (write a file, make directories, count lines, rename,
    filter a log, sort, delete by pattern), seeded by split and seed, train and held-out
    kept apart (``tool_task.split_of``); the task's metadata holds ``template``, ``setup`` (files written at reset) and ``expect`` (the
    checked state).

    Args:
      max_tool_errors: tool errors tolerated per episode (>= 0). A command that exits
        non-zero is output, not a tool error; a limit (timeout, memory...) is one.
      tool_timeout_s: deadline of one call as the env waits for it, seconds (the
        sandbox's ``sandbox.wall_time_s`` bounds the command itself).
      python_tool: also offer the ``python`` tool in the same work dir.
      sandbox: the sandbox to run in (default: ``raytunix.sandbox.connect()``).

    Raises:
      ValueError: see ``CalculatorMathEnv``.
    """

    default_agent = "tool"
    uses_sandbox = True

    def __init__(
        self,
        max_tool_errors: int = 3,
        tool_timeout_s: float | None = 30.0,
        python_tool: bool = False,
        sandbox: SandboxClient | None = None,
    ) -> None:
        self.session = SandboxSession(sandbox, name="bash_terminal")
        tools = [BashTool(self.session)] + ([PythonTool(self.session)] if python_tool else [])
        super().__init__(tools, max_tool_errors=max_tool_errors, tool_timeout_s=tool_timeout_s)

    def tasks(self, split: str, size: int, seed: int) -> list[Task]:
        names = sorted(TEMPLATES)

        def draw(rng: random.Random) -> tuple[str, str, dict]:
            name = rng.choice(names)
            question, setup, expect = TEMPLATES[name](rng)
            # The answer (the checked state) and the starting files tell tasks apart.
            answer = json.dumps({"expect": expect, "setup": setup}, sort_keys=True)
            return (
                f"{question} Reply <answer>done</answer> when finished.",
                answer,
                {"template": name, "setup": setup, "expect": expect},
            )

        return draw_tasks(split, size, random.Random(f"bash_terminal/{split}/{seed}"), draw)

    def _initial_observation(self, task: Task) -> str:
        question = super()._initial_observation(task)
        self.session.close()  # a fresh work dir per episode
        write_files(self.session, task.metadata.get("setup") or {})
        return question

    def _score(self, answer: str) -> tuple[float, dict[str, Any]]:
        expect = self.task.metadata["expect"]
        paths = [*expect.get("files", {}), *expect.get("dirs", []), *expect.get("absent", [])]
        longest = max((len(text) for text in expect.get("files", {}).values()), default=0)
        failures = check_state(expect, read_state(self.session, paths, max_chars=longest + 64))
        return (0.0 if failures else 1.0), {"correct": not failures, "check_failures": failures}

    def close(self) -> None:
        """Deletes the episode's work dir."""
        super().close()
        self.session.close()
