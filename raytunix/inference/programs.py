"""The compiled programs of an engine's step function, and the background compiler that
builds the ones a run can reach before a request needs them.

A program is one XLA executable of the engine's jitted step for one *shape*,
``(truncate, batch rows, tokens fed per row, span blocks)``. JAX compiles a jitted
function lazily, on the call that first meets a shape, on the calling thread: the
engine's event loop, so every live request waits for it (about a second per shape on a
CPU, and a run meets dozens of shapes as its rows and contexts grow). Here programs are
compiled with ``jit(...).lower(specs).compile()`` — on a background thread, ahead of need
— and called directly; a step whose own program is not built yet runs on the cheapest
built program that *holds* it (as many rows or more, as many tokens per row or more, as
long a span or longer: padding is masked, so the samples are the same) while its own is
compiled first.

Programs are shared by every engine of one step function and buffer layout in the
process, so a second engine of the same model compiles nothing; across processes JAX's
persistent compilation cache (``run.compilation_cache_dir``) does the same, as
``Lowered.compile`` reads and writes it.
"""

from __future__ import annotations

import concurrent.futures
import heapq
import itertools
import logging
import os
import threading
import time
from typing import Any, Callable, Iterable, NamedTuple

logger = logging.getLogger(__name__)


class Shape(NamedTuple):
    """One step program's shape: ``truncate`` (top-k/top-p compiled in), ``batch`` rows,
    ``length`` tokens fed per row (1 = decode), ``span`` KV blocks attended per row."""

    truncate: bool
    batch: int
    length: int
    span: int

    def holds(self, other: "Shape") -> bool:
        """True when a step of ``other`` can run on this program: the same kind (decode or
        prefill, truncation or not) and no dimension smaller."""
        return (
            self.truncate == other.truncate
            and (self.length == 1) == (other.length == 1)
            and self.batch >= other.batch
            and self.length >= other.length
            and self.span >= other.span
        )

    @property
    def cost(self) -> tuple[int, int]:
        """Order of device cost: tokens through the model, then attention span."""
        return self.batch * self.length, self.span


# Priorities of the background queue: a shape a step is waiting for (or running on a
# larger program for), then the largest shapes (so that every step has a program that
# holds it), then the rest of the reachable shapes, cheapest first.
NEEDED, COVER, AHEAD = 0, 1, 2


class _SharedPrograms:
    """Programs of one step function and buffer layout, shared by the engines of a
    process; ``compile`` builds each shape once, whichever thread asks first."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ready: dict[Shape, Any] = {}
        self.building: dict[Shape, concurrent.futures.Future] = {}

    def compile(self, shape: Shape, lower: Callable[[Shape], Any]) -> tuple[Any, float]:
        """The program of ``shape`` and the seconds this call spent building it (0 when it
        was built already or another thread built it)."""
        with self.lock:
            program = self.ready.get(shape)
            if program is not None:
                return program, 0.0
            future = self.building.get(shape)
            owner = future is None
            if owner:
                future = self.building[shape] = concurrent.futures.Future()
        assert future is not None
        if not owner:
            return future.result(), 0.0
        start = time.perf_counter()
        try:
            program = lower(shape).compile()
        except BaseException as error:
            with self.lock:
                del self.building[shape]
            future.set_exception(error)
            raise
        seconds = time.perf_counter() - start
        with self.lock:
            self.ready[shape] = program
            del self.building[shape]
        future.set_result(program)
        return program, seconds


_SHARED: dict[Any, _SharedPrograms] = {}
_SHARED_LOCK = threading.Lock()


def shared_programs(key: Any) -> _SharedPrograms:
    """The process-wide program table of ``key`` (step function + buffer layout)."""
    with _SHARED_LOCK:
        table = _SHARED.get(key)
        if table is None:
            table = _SHARED[key] = _SharedPrograms()
        return table


def programs_in_process() -> int:
    """Step programs compiled in this process so far, all engines."""
    with _SHARED_LOCK:
        tables = list(_SHARED.values())
    return sum(len(table.ready) for table in tables)


class StepPrograms:
    """One engine's view of its step programs, and its background compiler.

    Args:
      table: the shared program table (``shared_programs``).
      lower: ``shape -> jax.stages.Lowered`` of the step for that shape (no device work).
      reachable: ``truncate -> shapes`` the engine's scheduler can ask for.
      ahead: start a background thread that compiles reachable shapes before they are
        needed (False: each shape is compiled on the step that first needs it, the
        plain lazy behaviour, and every such compile is a stall).

    Counters (``stats``): ``compiles`` (programs this engine built), ``compile_s``
    (seconds spent building them, foreground and background), ``compiles_ahead`` (built by
    the background thread), ``compile_stalls`` / ``compile_stall_s`` (steps that waited
    for a program, and the seconds they waited: live requests waited that long),
    ``steps_on_larger_program`` (steps run on a program larger than their own while
    theirs was compiled), ``compile_queue`` (shapes still to build ahead).
    """

    def __init__(
        self,
        table: _SharedPrograms,
        lower: Callable[[Shape], Any],
        reachable: Callable[[bool], Iterable[Shape]],
        *,
        ahead: bool,
    ):
        self._table = table
        self._lower = lower
        self._reachable = reachable
        self._ahead = ahead
        self._lock = threading.Lock()
        self._queue: list[tuple[int, int, Shape]] = []
        self._queued: dict[Shape, int] = {}  # shape -> best priority queued
        self._order = itertools.count()
        self._swept: set[bool] = set()  # truncate values whose shapes were queued
        self._wake = threading.Condition(self._lock)
        self._closed = False
        self._idle = threading.Event()
        self._idle.set()
        self.counters = {
            "compiles": 0,
            "compile_s": 0.0,
            "compiles_ahead": 0,
            "compile_stalls": 0,
            "compile_stall_s": 0.0,
            "steps_on_larger_program": 0,
        }
        self._thread: threading.Thread | None = None
        if ahead:
            self._thread = threading.Thread(target=self._work, name="raytunix-compile", daemon=True)
            self._thread.start()
            self.sweep(False)

    # ------------------------------------------------------------------ the step's side

    def program_for(self, shape: Shape) -> tuple[Any, Shape]:
        """The program a step of ``shape`` runs on, and that program's shape: its own if
        built; else (compiling ahead) the cheapest built one that holds it, while its own
        is queued first; else it waits for its own (a stall, counted)."""
        program = self._table.ready.get(shape)
        if program is not None:
            return program, shape
        if self._ahead:
            self.sweep(shape.truncate)
            self._push(shape, NEEDED)
            holders = [s for s in list(self._table.ready) if s.holds(shape)]
            if holders:
                best = min(holders, key=lambda s: s.cost)
                with self._lock:
                    self.counters["steps_on_larger_program"] += 1
                return self._table.ready[best], best
        start = time.perf_counter()
        program, built_s = self._table.compile(shape, self._lower)
        waited = time.perf_counter() - start
        self._count_build(built_s, ahead=False)
        with self._lock:
            self.counters["compile_stalls"] += 1
            self.counters["compile_stall_s"] += waited
        return program, shape

    def compile_now(self, shapes: Iterable[Shape]) -> int:
        """Builds ``shapes`` on this thread (``InferenceEngine.warmup``); returns how many
        programs the table holds of them afterwards."""
        shapes = list(shapes)
        for shape in shapes:
            _, built_s = self._table.compile(shape, self._lower)
            self._count_build(built_s, ahead=False)
        return sum(shape in self._table.ready for shape in shapes)

    def sweep(self, truncate: bool) -> None:
        """Queues every reachable shape of ``truncate`` (once): the largest first, then
        the rest cheapest first."""
        if not self._ahead or truncate in self._swept:
            return
        self._swept.add(truncate)
        shapes = sorted(set(self._reachable(truncate)), key=lambda s: s.cost)
        decode = [s for s in shapes if s.length == 1]
        prefill = [s for s in shapes if s.length > 1]
        covers = [group[-1] for group in (decode, prefill) if group]
        for shape in covers:
            self._push(shape, COVER)
        for shape in shapes:
            self._push(shape, AHEAD)

    def wait_until_compiled(self, timeout_s: float | None = None) -> bool:
        """Blocks until the background queue is empty; True if it is."""
        return self._idle.wait(timeout_s)

    def stats(self) -> dict:
        with self._lock:
            return {**self.counters, "compile_queue": len(self._queued)}

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._queue.clear()
            self._queued.clear()
            self._wake.notify_all()
        self._idle.set()

    # ------------------------------------------------------------------ background

    def _push(self, shape: Shape, priority: int) -> None:
        if shape in self._table.ready:
            return
        with self._lock:
            if self._closed or self._queued.get(shape, AHEAD + 1) <= priority:
                return
            self._queued[shape] = priority
            heapq.heappush(self._queue, (priority, next(self._order), shape))
            self._idle.clear()
            self._wake.notify()

    def _pop(self) -> Shape | None:
        with self._lock:
            while True:
                while self._queue:
                    priority, _, shape = heapq.heappop(self._queue)
                    if self._queued.get(shape) == priority:
                        del self._queued[shape]
                        return shape
                if not self._queued:
                    self._idle.set()
                if self._closed:
                    return None
                self._wake.wait()

    def _count_build(self, seconds: float, *, ahead: bool) -> None:
        if seconds <= 0:
            return
        with self._lock:  # both threads count
            self.counters["compiles"] += 1
            self.counters["compile_s"] += seconds
            if ahead:
                self.counters["compiles_ahead"] += 1

    def _work(self) -> None:
        try:  # below the step loop's threads: compiling ahead must not slow live work
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + 5))
        except (AttributeError, OSError):
            pass
        while True:
            shape = self._pop()
            if shape is None:
                return
            try:
                _, built_s = self._table.compile(shape, self._lower)
            except Exception:  # noqa: BLE001 - the step that needs it compiles it and raises
                logger.exception(
                    "Compiling step program %s ahead failed; it is compiled when a step needs it.",
                    shape,
                )
                continue
            self._count_build(built_s, ahead=True)
