"""Spans: what one process did, when, on which track — recorded cheaply, always on.

Every process of a run (driver, orchestrator, engine, learner, env and sandbox actors) has
one ``Recorder``. Code that does a unit of work records it::

    with profiling.span("env_step", track="env", flow=episode_id):
        ...
    # or, when start and end are already known (perf_counter seconds):
    profiling.add("decode", start, end, track="steps", args={"rows": 12})

A span is a plain tuple appended to a bounded ring buffer (``collections.deque`` with
``maxlen``): no lock on the hot path (one append is atomic under the GIL, also from the
worker threads that run tools and device steps), no formatting, no I/O. When the buffer is
full the oldest spans are dropped and counted. The driver drains every actor's buffer at the
end of an RL step, at most every ``run.profile_window_s`` seconds
(``ProfiledActor.profile_drain``), and appends the chunk to the run's
``profile/spans.jsonl``; the trace, the metrics and the bottleneck report are made from
those files.

Times are ``time.perf_counter()`` seconds of the recording process (CLOCK_MONOTONIC on
Linux). Each drained chunk carries ``clock_offset_s`` (``time.time() - perf_counter()``,
sampled when the chunk is drained), so spans of processes on different hosts line up on
one wall clock to the accuracy of the hosts' clock sync.

The tuple layout, ``SPAN_FIELDS``: ``(name, track, start_s, end_s, args, flow)``:

* ``name``: what was done (``episode``, ``turn``, ``env_step``, ``tool_call``,
  ``prefill``, ``decode``, ``request``, ``update``, ``weight_publish``, ``checkpoint``,
  ``batch_pack``, ``object_store_put``, ``object_store_get``, ...).
* ``track``: the timeline it belongs on inside its process (``steps``, ``slot 3``,
  ``episodes``, ``tool calculator``, ``learner``...). Spans on one track may overlap; the
  trace export spreads overlapping ones on lanes.
* ``args``: a small JSON-able dict or None.
* ``flow``: an id (str) shared by the spans of one episode across processes (its session
  id ``<group_id>/<seed>``), or None; the trace links them with flow arrows.
"""

from __future__ import annotations

import collections
import contextvars
import gc
import os
import pickle
import socket
import time
from typing import Any

SPAN_FIELDS = ("name", "track", "start_s", "end_s", "args", "flow")
DEFAULT_CAPACITY = 200_000  # spans held between two drains (~65-120 MB when full)
ENABLE_ENV = "RAYTUNIX_PROFILING"  # "0" turns recording off in a process (and its actors)

Span = tuple  # (name, track, start_s, end_s, args, flow), see SPAN_FIELDS


class Recorder:
    """The span buffer of one process.

    Args:
      process: the process's name in the trace (``orchestrator``, ``engine 0``, ...).
      kind: what it is (``driver``, ``orchestrator``, ``engine``, ``learner``, ``policy``,
        ``env``, ``sandbox``); the metrics and the report group processes by it.
      capacity: spans kept between two drains; older ones are dropped (counted).
      enabled: record at all; off, ``add`` and ``span`` cost one attribute test.
    """

    def __init__(
        self, process: str, kind: str, capacity: int = DEFAULT_CAPACITY, enabled: bool = True
    ):
        if capacity < 1:
            raise ValueError(f"a span recorder needs capacity >= 1, got {capacity}")
        self.process = process
        self.kind = kind
        self.enabled = enabled
        self._spans: collections.deque = collections.deque(maxlen=capacity)
        self._recorded = 0  # spans appended since the last drain
        self._created_s = time.perf_counter()

    def add(
        self,
        name: str,
        start_s: float,
        end_s: float,
        track: str = "main",
        args: dict[str, Any] | None = None,
        flow: str | None = None,
    ) -> None:
        """Records one finished span (``perf_counter`` seconds of this process)."""
        if self.enabled:
            self._spans.append((name, track, start_s, end_s, args, flow))
            self._recorded += 1

    def span(
        self,
        name: str,
        track: str = "main",
        args: dict[str, Any] | None = None,
        flow: str | None = None,
    ) -> "_Span":
        """Records the ``with`` block as one span; ``as`` gives ``args`` so the block can
        add what it learns (a status, a token count). An exception still records the span,
        with ``args["error"]`` set to the exception's type name, and propagates. (A class,
        not a generator context manager: it is on the env actors' per-step path, and costs
        a third as much.)"""
        return _Span(self, name, track, args, flow)

    def drain(self) -> dict[str, Any]:
        """Takes every span recorded since the last drain.

        Returns:
          ``{"process", "kind", "pid", "host", "clock_offset_s", "cpu_s", "now_s",
          "enabled", "dropped", "spans"}`` (``enabled``: whether it records now):
          ``spans`` is a list of ``SPAN_FIELDS`` tuples in recording order, ``dropped``
          how many were lost to the ring buffer since the last drain (approximate under
          threads), ``cpu_s`` the process's CPU seconds so far (``time.process_time``:
          its busy fraction between two drains is the difference over ``now_s``'s, the
          drain's ``perf_counter``).
        """
        spans, recorded = [], self._recorded
        pop = self._spans.popleft
        try:
            while True:
                spans.append(pop())
        except IndexError:
            pass
        # Spans appended while draining are counted now and drained next time.
        self._recorded -= recorded
        dropped = max(0, recorded - len(spans))
        return {
            "process": self.process,
            "kind": self.kind,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "clock_offset_s": time.time() - time.perf_counter(),
            "cpu_s": time.process_time(),
            "now_s": time.perf_counter(),
            "enabled": self.enabled,
            "dropped": dropped,
            "spans": spans,
        }


class _Span:
    """``Recorder.span``'s context manager."""

    __slots__ = ("recorder", "name", "track", "args", "flow", "start")

    def __init__(
        self,
        recorder: Recorder,
        name: str,
        track: str,
        args: dict[str, Any] | None,
        flow: str | None,
    ):
        self.recorder, self.name, self.track, self.args, self.flow = (
            recorder,
            name,
            track,
            args,
            flow,
        )

    def __enter__(self) -> dict[str, Any] | None:
        self.start = time.perf_counter()
        return self.args

    def __exit__(self, error_type, error, traceback) -> bool:
        if self.recorder.enabled:
            args = self.args
            if error_type is not None:
                args = dict(args or {}, error=error_type.__name__)
            self.recorder.add(
                self.name, self.start, time.perf_counter(), self.track, args, self.flow
            )
        return False


# The episode the running asyncio task works for (its flow id), set by the orchestrator
# around an episode, so that clients it creates (an env lease) can name their remote spans
# after it without threading the id through every signature.
current_flow: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "raytunix_current_flow", default=None
)


def _enabled_by_env() -> bool:
    return os.environ.get(ENABLE_ENV, "1").strip().lower() not in ("0", "false", "off", "no")


_recorder = Recorder(f"process {os.getpid()}", "process", enabled=_enabled_by_env())


def recorder() -> Recorder:
    """This process's recorder."""
    return _recorder


def configure(process: str, kind: str) -> Recorder:
    """Names this process's recorder (an actor calls it in its constructor); spans already
    recorded keep their place in the buffer."""
    _recorder.process, _recorder.kind = process, kind
    return _recorder


def add(
    name: str,
    start_s: float,
    end_s: float,
    track: str = "main",
    args: dict[str, Any] | None = None,
    flow: str | None = None,
) -> None:
    """``recorder().add(...)``."""
    _recorder.add(name, start_s, end_s, track, args, flow)


def span(
    name: str, track: str = "main", args: dict[str, Any] | None = None, flow: str | None = None
):
    """``recorder().span(...)``."""
    return _recorder.span(name, track, args, flow)


def enabled() -> bool:
    return _recorder.enabled


def decode_chunk(encoded: bytes) -> dict[str, Any]:
    """A chunk as ``ProfiledActor.profile_drain`` returns it, decoded: ``Recorder.drain``'s
    dict (spans as tuples).

    Raises:
      TypeError: ``encoded`` is not ``bytes``.
      pickle.UnpicklingError, EOFError: it is not a pickled chunk (truncated or foreign).
    """
    if not isinstance(encoded, (bytes, bytearray, memoryview)):
        raise TypeError(
            f"a drained chunk is bytes (profile_drain's result), got {type(encoded).__name__}"
        )
    chunk = pickle.loads(encoded)
    if not isinstance(chunk, dict) or "spans" not in chunk:
        raise pickle.UnpicklingError(f"not a drained chunk: a {type(chunk).__name__}")
    return chunk


_gc_totals: dict[str, float] | None = None


def gc_stats() -> dict[str, float]:
    """This process's time in the cyclic garbage collector (``gc.callbacks``): seconds and
    collections by generation (``gen0_s``, ``gen0``, ...) since the first call, which
    installs the timer."""
    global _gc_totals
    if _gc_totals is None:
        totals = _gc_totals = {}
        started = [0.0]

        def timer(phase: str, info: dict) -> None:
            if phase == "start":
                started[0] = time.perf_counter()
            else:
                count = f"gen{info.get('generation', 0)}"
                seconds = count + "_s"
                totals[seconds] = totals.get(seconds, 0.0) + time.perf_counter() - started[0]
                totals[count] = totals.get(count, 0) + 1

        gc.callbacks.append(timer)
    return dict(_gc_totals)


class ProfiledActor:
    """Mixin for actor classes: the driver drains the process's spans through it."""

    def profile_drain(self) -> bytes:
        """``Recorder.drain`` of this actor's process, pickled (``decode_chunk`` reads it).

        Pickled here, with the C pickler, because Ray pickles a return value with a
        Python-level pickler that costs microseconds per object: a chunk of ~1,500 span
        tuples cost the actor ~4 ms that way and costs ~0.4 ms so, and ``bytes`` cross
        to the driver as one object. The drain is itself recorded (a ``profile_drain``
        span, in the next chunk), so profiling's own cost shows."""
        start = time.perf_counter()
        chunk = _recorder.drain()
        encoded = pickle.dumps(chunk, protocol=pickle.HIGHEST_PROTOCOL)
        _recorder.add(
            "profile_drain",
            start,
            time.perf_counter(),
            "profiling",
            {"spans": len(chunk["spans"]), "bytes": len(encoded)},
        )
        return encoded

    def profile_cpu_s(self) -> float:
        """This actor's process's CPU seconds so far (``time.process_time``), read without
        draining: the overhead benchmark brackets a measurement with it."""
        return time.process_time()

    def profile_gc(self) -> dict[str, float]:
        """Seconds this actor's process spent in Python's cyclic garbage collector, and
        collections, by generation, since the first call (which starts the count)."""
        return gc_stats()

    def profile_set_enabled(self, enabled: bool) -> None:
        """Turns span recording in this actor's process on or off (the overhead benchmark
        alternates the two in one run)."""
        _recorder.enabled = bool(enabled)
