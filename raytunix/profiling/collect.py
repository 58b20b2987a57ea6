"""The driver's side of profiling: drain every actor's spans once per window into the run
directory, and turn them into that window's metrics.

``RUN_DIR/profile/spans.jsonl`` gets one line per process per drain: the
``Recorder.drain()`` result plus ``phase`` (``warmup``, ``eval``, ``rl``) and ``step``.
The file only grows by appends, so a run killed mid-write loses at most its last line
(readers skip a torn line). Lines are written and read with ``orjson``: a step's chunks
(a few thousand spans) encode in about a sixth of the time ``json`` takes, and that work
is on the driver every step.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import pickle
import time
from typing import Any, Callable, Iterable, Iterator

import orjson

from raytunix.profiling import spans
from raytunix.profiling.metrics import WindowMetrics

logger = logging.getLogger(__name__)

DRAIN_TIMEOUT_S = 30.0  # an actor that does not answer in this time is skipped this window

ActorList = Callable[[], Iterable[tuple[str, Any]]]  # -> (name, actor handle) pairs


def spans_path(run_dir: str) -> str:
    return os.path.join(run_dir, "profile", "spans.jsonl")


_ORJSON_OPTIONS = orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_APPEND_NEWLINE


def dumps_line(obj: Any) -> bytes:
    """``obj`` as one line of JSON (UTF-8, ending in a newline), compact. Non-string dict
    keys are written as strings and anything else JSON has no type for as its ``str``, as
    ``json.dumps(..., default=str)`` would; NaN and infinities become ``null`` (JSON has
    no token for them). What orjson cannot write (an integer over 64 bits) falls back to
    ``json``."""
    try:
        return orjson.dumps(obj, default=_jsonable, option=_ORJSON_OPTIONS)
    except TypeError:
        return (json.dumps(obj, separators=(",", ":"), default=_jsonable) + "\n").encode()


def loads_line(line: str | bytes) -> Any:
    """The JSON value of one line. ``NaN``/``Infinity`` tokens (which ``json.dumps``
    writes and orjson refuses) are read with ``json``.

    Raises:
      json.JSONDecodeError: the line is not JSON (e.g. torn by a crash mid-write).
    """
    try:
        return orjson.loads(line)
    except orjson.JSONDecodeError:
        return json.loads(line)


def read_jsonl(path: str, skipped: list[int] | None = None) -> Iterator[dict[str, Any]]:
    """The JSON objects of a JSONL file (``metrics.jsonl``, ``spans.jsonl``); a line that
    is not one (torn by a crash mid-write) is skipped, and its number appended to
    ``skipped`` when given; a missing file yields nothing."""
    if not os.path.exists(path):
        return
    with open(path, errors="replace") as f:
        for number, line in enumerate(f, start=1):
            try:
                obj = loads_line(line)
            except json.JSONDecodeError:
                obj = None
            if isinstance(obj, dict):
                yield obj
            elif skipped is not None and line.strip():
                skipped.append(number)


def append_jsonl(path: str, lines: Iterable[str | bytes]) -> None:
    """Appends JSON lines (text or UTF-8 bytes, each ending in a newline) to ``path``; if
    a crash left its last line torn (no newline), the new lines start on a line of their
    own, so only the torn one is lost.

    Raises:
      OSError: the file cannot be written.
    """
    with open(path, "a+b") as f:
        torn = False
        if f.seek(0, os.SEEK_END) > 0:
            f.seek(-1, os.SEEK_END)
            torn = f.read(1) != b"\n"
        f.write(
            (b"\n" if torn else b"")
            + b"".join(line if isinstance(line, bytes) else line.encode() for line in lines)
        )


def is_rl_step(step: Any) -> bool:
    """Whether ``step`` is an RL step number: a whole number >= 1 (a JSON integer)."""
    return isinstance(step, int) and not isinstance(step, bool) and step >= 1


def rl_steps(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The RL step records of ``metrics.jsonl`` sorted by step, the last record of a step
    winning (a resumed run logs the steps after its checkpoint again); one whose step is
    not a step number (``is_rl_step``: a hand-edited or damaged line) is left out."""
    by_step: dict[int, dict[str, Any]] = {}
    for r in records:
        if r.get("phase") == "rl" and is_rl_step(r.get("step")):
            by_step[r["step"]] = r
    return [by_step[s] for s in sorted(by_step)]


class Collector:
    """Drains the run's actors (``ProfiledActor.profile_drain``) and this process.

    Args:
      run_dir: the run directory (``profile/`` is made in it).
      actors: called at each drain: the actors to drain now, as ``(name, handle)``
        pairs; the name becomes the process's name in the trace (``engine 0``,
        ``env actor 1``...). The set may change between drains (an orchestrator
        re-created, an env actor restarted).
      max_batch_size: the engine's decode rows, for ``engine_batch_occupancy``.
      timeout_s: how long one drain waits for the actors; a dead or slow actor is
        skipped (warned once), never fatal.
      min_window_s: ``due`` says a window may close only once it is this many seconds
        long (``run.profile_window_s``). A drain is one call to every actor, and Ray's
        per-call work (~1-2 ms of CPU in the caller and in a busy actor) does not shrink
        with the spans: steps faster than this share one window instead of paying it
        every step. 0: every step.

    Raises:
      ValueError: ``min_window_s`` is negative.
    """

    def __init__(
        self,
        run_dir: str,
        actors: ActorList,
        max_batch_size: int | None = None,
        timeout_s: float = DRAIN_TIMEOUT_S,
        min_window_s: float = 0.0,
    ):
        if not min_window_s >= 0:
            raise ValueError(f"min_window_s must be >= 0 seconds, got {min_window_s!r}")
        self.path = spans_path(run_dir)
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self._actors = actors
        self._timeout_s = timeout_s
        self.min_window_s = min_window_s
        self._metrics = WindowMetrics(max_batch_size)
        self._window_start = time.perf_counter()
        self._warned: set[str] = set()
        self.last_span_counts: dict[str, int] = {}  # spans per process of the last window
        spans.configure("driver", "driver")

    def start_window(self) -> None:
        """Starts a new window now (what was recorded before still goes into the next
        drain; only the window's length, the metrics' denominator, restarts)."""
        self._window_start = time.perf_counter()

    def due(self) -> bool:
        """Whether the window is at least ``min_window_s`` long: the caller closes it
        (``window``) at the end of the first step for which this holds, and at its last."""
        return time.perf_counter() - self._window_start >= self.min_window_s

    def drain(self, phase: str, step: int, timeout_s: float | None = None) -> list[dict[str, Any]]:
        """Drains every process, appends the chunks to ``spans.jsonl``, returns them; an
        actor that does not answer within ``timeout_s`` (default: the collector's) is
        skipped."""
        timeout_s = self._timeout_s if timeout_s is None else timeout_s
        import ray

        named = list(self._actors())
        refs = []
        for name, handle in named:
            try:
                refs.append((name, handle.profile_drain.remote()))
            except Exception as e:  # noqa: BLE001 - a handle of a dead actor: skip it
                self._warn(name, e)
        chunks = []
        if refs:
            ready, _ = ray.wait([ref for _, ref in refs], num_returns=len(refs), timeout=timeout_s)
            ready = set(ready)
            for name, ref in refs:
                if ref not in ready:
                    self._warn(name, TimeoutError(f"no answer in {timeout_s:.0f} s"))
                    continue
                try:
                    chunk = spans.decode_chunk(ray.get(ref))
                except (
                    ray.exceptions.RayActorError,
                    ray.exceptions.RayTaskError,
                    TypeError,
                    pickle.UnpicklingError,
                    EOFError,
                ) as e:
                    self._warn(name, e)
                    continue
                chunk["process"] = name
                chunks.append(chunk)
        chunks.append(spans.recorder().drain())
        try:
            append_jsonl(
                self.path, (dumps_line(dict(chunk, phase=phase, step=step)) for chunk in chunks)
            )
        except OSError as e:  # a full disk must not stop training
            self._warn("spans.jsonl", e)
        return chunks

    def window(self, phase: str, step: int, timeout_s: float | None = None) -> dict[str, float]:
        """Drains (``drain``, with ``timeout_s``) and returns the metrics of the window
        ending now; the next window starts.

        Python's cyclic garbage collector is paused for the call (and resumed if it was
        on): the few thousand span objects it decodes live only until the metrics are
        computed and are freed by reference counting, but while they live their
        allocations would trigger collections that scan the driver's heap, a quarter of
        the call's CPU on the rollout benchmark (``benchmarks/profiling_drain_cost.py``).
        """
        start, cpu = time.perf_counter(), time.process_time()
        collecting = gc.isenabled()
        gc.disable()
        try:
            chunks = self.drain(phase, step, timeout_s)
            self.last_span_counts = {chunk["process"]: len(chunk["spans"]) for chunk in chunks}
            now = time.perf_counter()
            metrics = self._metrics.compute(chunks, max(now - self._window_start, 1e-9))
            del chunks
        finally:
            if collecting:
                gc.enable()
        self._window_start = now
        # Profiling's own cost in the driver, counted in the next window: its wall time
        # is mostly waiting for the actors; ``cpu_s`` is the work done here.
        spans.add(
            "profile_collect",
            start,
            time.perf_counter(),
            "profiling",
            {"chunks": len(self.last_span_counts), "cpu_s": time.process_time() - cpu},
        )
        return metrics

    def _warn(self, name: str, error: BaseException) -> None:
        if name not in self._warned:
            self._warned.add(name)
            logger.warning(
                "profiling: skipped %s (%r); its spans of this window are lost", name, error
            )


def _jsonable(value: Any) -> Any:
    """Span args are meant to be plain; anything else is written as its text."""
    return str(value)
