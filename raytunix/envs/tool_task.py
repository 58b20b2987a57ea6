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
import base64
import hashlib
import json
import random
import re
import secrets
import zlib
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

    def __init__(
        self,
        tools: Sequence[Tool],
        *,
        max_tool_errors: int = 2,
        tool_timeout_s: float | None = 10.0,
    ) -> None:
        super().__init__(
            max_tool_errors=max_tool_errors, tools=list(tools), tool_timeout_s=tool_timeout_s
        )

    def _step_impl(self, action: Action) -> StepResult:
        if action.parse_error is None and action.answer is not None and not action.tool_calls:
            with profiling.span("reward", "env", {"rule": type(self).__name__}):
                reward, info = self._score(action.answer)
            return StepResult(
                observation="",
                reward=reward,
                done=True,
                status=EpisodeStatus.COMPLETED,
                info={**info, TOOL_ERRORS_KEY: {}},
            )
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
        raise RuntimeError(
            f"writing {sorted(files)} into the work dir failed (exit "
            f"{result.exit_code}): {result.stderr[-2000:]}"
        )


def run_report(session: SandboxSession, program: str) -> dict[str, Any]:
    """Runs ``program`` (Python; it defines ``report()`` returning a JSON-able dict) in the
    session's work dir and returns that dict.

    For programs that only read the work dir (``read_state``, ``collect_sources``): the
    report is read from the one stdout line that starts with a fresh random marker, so
    what the program prints besides cannot pass for it. It is no verdict channel for code
    the model wrote: a program that imports such code shares its process, and the code can
    read the marker (see ``raytunix.envs.hidden_tests`` for tests whose verdict it cannot
    write). Decide the reward on the host from what the report says was there.

    Raises:
      RuntimeError: the program failed or printed no report (the message holds its output).
      SandboxUnavailable: the sandbox cannot serve the call.
    """
    marker = f"@@report-{secrets.token_hex(8)}@@"
    source = (
        f"{program}\n\nimport json as _json\n"
        f"print({marker!r} + _json.dumps(report()), flush=True)\n"
    )
    result = session.run(["python3", "-I", "-S", "-"], stdin=source)
    for line in result.stdout.splitlines():
        if line.startswith(marker):
            return json.loads(line[len(marker) :])
    raise RuntimeError(
        f"the check program printed no report (exit {result.exit_code}, "
        f"limit {result.killed_by_limit}); stdout: {result.stdout[-1000:]!r}; "
        f"stderr: {result.stderr[-2000:]!r}"
    )


# Reads what is at each path without following a link, opening a FIFO or reading more than
# asked, so no file the model planted can stall, flood or crash the check.
_READ_STATE = """
import json, os, stat
PATHS = json.loads({paths!r})
MAX_CHARS = {max_chars}

def state(path):
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return {{"kind": "missing"}}
    except OSError as e:
        return {{"kind": "unreadable", "why": e.strerror}}
    if stat.S_ISLNK(st.st_mode):
        return {{"kind": "link"}}
    if stat.S_ISDIR(st.st_mode):
        return {{"kind": "dir"}}
    if not stat.S_ISREG(st.st_mode):
        return {{"kind": "other"}}
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            data = f.read(4 * MAX_CHARS + 4)
    except OSError as e:
        return {{"kind": "unreadable", "why": e.strerror}}
    text = data.decode("utf-8", "replace")
    return {{"kind": "file", "text": text[:MAX_CHARS], "size": st.st_size,
            "truncated": len(text) > MAX_CHARS or len(data) < st.st_size}}

def report():
    return {{path: state(path) for path in PATHS}}
"""


def read_state(
    session: SandboxSession, paths: Sequence[str], max_chars: int = 4096
) -> dict[str, dict[str, Any]]:
    """What is at each of ``paths`` (relative to the session's work dir), read in the
    sandbox by a program that takes nothing from the work dir (``python3 -I -S``).

    Returns:
      ``{path: {"kind": kind, ...}}``; kind is ``"file"`` (a regular file; ``text``: its
      first ``max_chars`` characters, UTF-8 with bad bytes replaced; ``truncated``: there
      is more; ``size`` in bytes),
      ``"dir"``, ``"link"`` (a symbolic link, never followed), ``"other"`` (a FIFO, socket
      or device; never opened), ``"missing"`` or ``"unreadable"`` (``why``).

    Raises:
      ValueError: a path is absolute or has a ``..`` part.
      RuntimeError: the reading program failed (see ``run_report``).
      SandboxUnavailable: the sandbox cannot serve the call.
    """
    for path in paths:
        if not isinstance(path, str) or not path or path.startswith("/") or ".." in path.split("/"):
            raise ValueError(f"path {path!r} must be relative to the work dir, without '..'")
    return run_report(
        session, _READ_STATE.format(paths=json.dumps(list(paths)), max_chars=int(max_chars))
    )


MAX_SOURCE_BYTES = 4 << 20  # source read out of a work dir, in all
MAX_SOURCE_BLOB = 48 << 10  # the same compressed and base64-encoded (one run's stdout)
_MAX_LISTED = 20  # paths named in collect_sources' not-copied list

_COLLECT = """
import base64, json, os, re, stat, zlib
DIRS = json.loads({dirs!r})
NAME = re.compile({pattern!r})
EXCLUDE = set(json.loads({exclude!r}))
MAX_BYTES, MAX_BLOB, MAX_ENTRIES, MAX_DEPTH = {max_bytes}, {max_blob}, 20000, 16

def report():
    files, skipped, total, entries = {{}}, [], 0, 0
    stack = [(d, 0) for d in reversed(DIRS)]
    while stack:
        path, depth = stack.pop()
        entries += 1
        if entries > MAX_ENTRIES:
            skipped.append(f"{{path}} and the rest: more than {{MAX_ENTRIES}} entries")
            break
        name = os.path.basename(path)
        try:
            st = os.lstat(path)
        except OSError as e:
            skipped.append(f"{{path}}: {{e.strerror}}")
            continue
        if stat.S_ISLNK(st.st_mode):
            skipped.append(f"{{path}}: a symbolic link")
        elif stat.S_ISDIR(st.st_mode):
            if depth >= MAX_DEPTH:
                skipped.append(f"{{path}}: deeper than {{MAX_DEPTH}} levels")
                continue
            try:
                names = sorted(os.listdir(path))
            except OSError as e:
                skipped.append(f"{{path}}: {{e.strerror}}")
                continue
            stack.extend((path + "/" + n, depth + 1) for n in reversed(names)
                         if n != "__pycache__")
        elif depth == 0:
            skipped.append(f"{{path}}: not a directory")
        elif not NAME.fullmatch(name):
            continue  # not source (data, notes, bytecode...): not copied, not listed
        elif name in EXCLUDE or not stat.S_ISREG(st.st_mode):
            skipped.append(f"{{path}}: not project source")
        elif total + st.st_size > MAX_BYTES:
            skipped.append(f"{{path}}: over the {{MAX_BYTES}} bytes of source copied")
        else:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
                with os.fdopen(fd, "rb") as f:
                    data = f.read(MAX_BYTES - total + 1)
            except OSError as e:
                skipped.append(f"{{path}}: {{e.strerror}}")
                continue
            total += len(data)
            files[path] = data.decode("utf-8", "replace")
    blob = base64.b64encode(zlib.compress(json.dumps(files).encode(), 9)).decode()
    if len(blob) > MAX_BLOB:
        return {{"blob": "", "skipped": [f"every file: the sources compress to {{len(blob)}} "
                                        f"bytes, over {{MAX_BLOB}}"] + skipped[:{listed}],
                "more": max(0, len(skipped) - {listed})}}
    return {{"blob": blob, "skipped": skipped[:{listed}], "more": max(0, len(skipped) - {listed})}}
"""


def collect_sources(
    session: SandboxSession, dirs: Sequence[str], *, name_pattern: str, exclude: Sequence[str] = ()
) -> tuple[dict[str, str], list[str]]:
    """The source files under ``dirs`` of the session's work dir, read by a program that
    takes nothing from the work dir (``python3 -I -S``), to be copied into a pristine one.

    Only regular files whose name matches ``name_pattern`` (a full match) and is not in
    ``exclude`` are taken; symbolic links are never followed, ``__pycache__`` is skipped,
    and at most ``MAX_SOURCE_BYTES`` are read (``MAX_SOURCE_BLOB`` once compressed).

    Returns:
      ``(files, not_copied)``: ``{path: text}`` (UTF-8, bad bytes replaced; paths
      checked here to lie under ``dirs`` with plain names), and the paths left out that
      look like they mattered (links, excluded names, over the size bound), with why.

    Raises:
      ValueError: a directory name is not a plain relative path.
      RuntimeError: the reading program failed (see ``run_report``).
      SandboxUnavailable: the sandbox cannot serve the call.
    """
    part = r"[A-Za-z0-9_][A-Za-z0-9_.-]*"
    for d in dirs:
        if (
            not isinstance(d, str)
            or not re.fullmatch(rf"{part}(/{part})*", d)
            or ".." in d.split("/")
        ):
            raise ValueError(f"source dir {d!r} must be a relative path of plain names")
    program = _COLLECT.format(
        dirs=json.dumps(list(dirs)),
        pattern=name_pattern,
        exclude=json.dumps(list(exclude)),
        max_bytes=MAX_SOURCE_BYTES,
        max_blob=MAX_SOURCE_BLOB,
        listed=_MAX_LISTED,
    )
    report = run_report(session, program)
    not_copied = [str(s) for s in report.get("skipped", [])][:_MAX_LISTED]
    if report.get("more"):
        not_copied.append(f"... and {int(report['more'])} more")
    files: dict[str, str] = {}
    if report.get("blob"):
        raw = zlib.decompressobj().decompress(
            base64.b64decode(report["blob"]), 2 * MAX_SOURCE_BYTES
        )
        allowed = re.compile(
            "(?:" + "|".join(re.escape(d) for d in dirs) + rf")(?:/{part})*/(?:{name_pattern})"
        )
        for path, text in json.loads(raw).items():
            if (
                isinstance(path, str)
                and isinstance(text, str)
                and allowed.fullmatch(path)
                and ".." not in path.split("/")
                and path.rsplit("/", 1)[-1] not in exclude
            ):
                files[path] = text
            else:
                not_copied.append(f"{str(path)[:200]}: not a source path")
    return files, not_copied


def split_of(question: str, answer: str) -> str:
    """The split a generated task belongs to, by a stable hash of its question and answer:
    "heldout" for about one in ``HELDOUT_SHARE``, else "train". So a generator's train and
    held-out tasks never share a task, whatever the seeds and sizes."""
    digest = hashlib.sha256(f"{question}\n{answer}".encode()).digest()
    return "heldout" if digest[0] % HELDOUT_SHARE == 0 else "train"


def draw_tasks(
    split: str,
    size: int,
    rng: random.Random,
    draw: Callable[[random.Random], tuple[str, str, dict[str, Any]]],
) -> list[Task]:
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
    raise ValueError(
        f"drew only {len(tasks)} of {size} {split} tasks; the generator's task "
        "space is too small to hold a held-out split apart"
    )
