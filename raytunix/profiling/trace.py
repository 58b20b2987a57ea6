"""A run's spans as a Chrome JSON trace that ui.perfetto.dev (and chrome://tracing) opens.

``write_trace(RUN_DIR)`` reads ``RUN_DIR/profile/spans.jsonl`` (the chunks the driver drains
from every actor, see ``spans``) and writes ``RUN_DIR/trace.json`` in the trace-event format
(https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAseU):

* one trace process per recording process, i.e. per (host, pid, process name), named
  ``"engine 0 (host h, pid 123)"`` and ordered driver, orchestrator, engines, learner, env
  actors, sandboxes, others;
* one thread per track of that process. Spans of one track may overlap (episodes run
  concurrently, tools are called in parallel) but a trace thread holds only properly
  nested slices, so such a track is spread over lanes ``episodes``, ``episodes #2``, ...;
  a span stays on the lane of an open span that holds it whole and has the same ``flow``
  (a ``generate`` under its own ``episode``), otherwise it takes the lowest free lane;
* complete events (``"ph": "X"``) with the span's args plus ``"flow"``; an orchestrator's
  ``turn`` span gets its ``generate`` and ``env_step`` as children, from the durations
  it carries (``generate_s``, ``env_s``);
* flow arrows (flow v1 events ``s``/``t``/``f``, category and name ``episode``) through all
  spans of one episode (its flow id, within its ``episode`` span), across processes, in
  order of start;
* counters: ``decode rows`` (rows of the ``decode`` spans in progress) and ``episodes in
  flight`` (``episode`` spans in progress) in the processes that record them;
* an instant event where a process's ring buffer dropped spans.

Time: ``ts`` and ``dur`` are whole microseconds of wall clock since the earliest span of the
run (``metadata.start_unix_s``), so the processes of all hosts line up. Whole microseconds
keep nesting exact through the importer's float parsing, and a wall-clock double holds no
finer time anyway. A process's ``perf_counter`` seconds go on the wall clock with one
offset, the median ``clock_offset_s`` of its chunks: the offsets of one process differ by
sampling jitter only, and one offset keeps a span nested in its parent when the two were
drained in different chunks.
"""

from __future__ import annotations

import bisect
import collections
import heapq
import json
import math
import os
import re
import statistics
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from raytunix.profiling.collect import loads_line

SPANS_FILE = os.path.join("profile", "spans.jsonl")
TRACE_FILE = "trace.json"
FLOW_NAME = "episode"  # name and category of the flow events
_KIND_ORDER = {
    "driver": 0,
    "orchestrator": 1,
    "engine": 2,
    "policy": 2,
    "learner": 3,
    "env": 4,
    "sandbox": 5,
}

# A stored span: (start_us, end_us, name, args, flow); start/end are absolute wall-clock
# microseconds once the process's clock offset is applied.
_Span = tuple


class _Process:
    """The spans of one recording process, gathered over all its chunks."""

    def __init__(self, host: str, pid: int, name: str, kind: str):
        self.host, self.pid, self.name, self.kind = host, pid, name, kind
        self.offsets: list[float] = []
        self.offset = 0.0  # seconds, perf_counter -> wall clock; set by _TraceBuilder.finish
        self.tracks: dict[str, list[_Span]] = collections.defaultdict(list)
        # (start_s of the chunk's earliest span or None, spans dropped, phase, step)
        self.drops: list[tuple[float | None, int, Any, Any]] = []

    def label(self) -> str:
        return f"{self.name} (host {self.host}, pid {self.pid})"

    def sort_key(self) -> tuple:
        return (
            _KIND_ORDER.get(self.kind, len(_KIND_ORDER)),
            _natural(self.name),
            self.host,
            self.pid,
        )


def _natural(text: str) -> tuple:
    """Sort key that puts ``slot 2`` before ``slot 10``."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text))


def _turn_parts(start: float, end: float, args: dict[str, Any], flow: str | None) -> list[tuple]:
    """The children of an orchestrator's ``turn`` span (``rollout.episode``), which records
    them in its args to keep the spans per turn to one: ``generate`` from the turn's start
    for ``generate_s``, and ``env_step`` ending at its end, ``env_s`` long (none when the
    turn ended without an env step). Both are clipped to the turn."""
    parts = []
    generate_s, env_s = args.get("generate_s"), args.get("env_s")
    if _number(generate_s) and generate_s >= 0:
        parts.append(
            (
                start,
                min(end, start + generate_s),
                "generate",
                {"turn": args.get("turn"), "tokens": args.get("tokens")},
                flow,
            )
        )
    if _number(env_s) and env_s >= 0:
        parts.append((max(start, end - env_s), end, "env_step", None, flow))
    return parts


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class _TraceBuilder:
    """Gathers chunks (one pass), then yields the trace events."""

    def __init__(self):
        self.processes: dict[tuple, _Process] = {}
        self.spans = 0
        self.bad_chunks = 0
        self.bad_spans = 0
        self.dropped = 0
        self.t0_us: int | None = None
        self._names: dict[str, str] = {}  # one str object per distinct name or track

    def _intern(self, text: Any) -> str:
        text = str(text)
        return self._names.setdefault(text, text)

    def add(self, chunk: Any) -> None:
        """Adds one ``Recorder.drain()`` result; a malformed chunk or span is counted and
        skipped."""
        if (
            not isinstance(chunk, dict)
            or not isinstance(chunk.get("spans"), list)
            or not _number(chunk.get("clock_offset_s"))
        ):
            self.bad_chunks += 1
            return
        host, pid = str(chunk.get("host", "?")), chunk.get("pid", 0)
        if not isinstance(pid, (int, str)):
            pid = str(pid)  # a key part must be hashable
        name = str(chunk.get("process", f"process {pid}"))
        key = (host, pid, name)
        process = self.processes.get(key)
        if process is None:
            process = self.processes[key] = _Process(
                host, pid, name, str(chunk.get("kind", "process"))
            )
        process.offsets.append(float(chunk["clock_offset_s"]))
        earliest = None
        for span in chunk["spans"]:
            if (
                not isinstance(span, (list, tuple))
                or len(span) != 6
                or not _number(span[2])
                or not _number(span[3])
                or span[3] < span[2]
            ):
                self.bad_spans += 1
                continue
            span_name, track, start, end, args, flow = span
            if args is not None and not isinstance(args, dict):
                args = {"value": args}
            spans = process.tracks[self._intern(track)]
            flow = None if flow is None else str(flow)
            spans.append((start, end, self._intern(span_name), args, flow))
            if span_name == "turn" and args:
                spans.extend(_turn_parts(start, end, args, flow))
            earliest = start if earliest is None else min(earliest, start)
            self.spans += 1
        dropped = chunk.get("dropped", 0)
        if _number(dropped) and dropped > 0:
            process.drops.append((earliest, int(dropped), chunk.get("phase"), chunk.get("step")))
            self.dropped += int(dropped)

    def finish(self) -> None:
        """Puts every span on the wall clock (whole µs), sorts each track by start (an
        enclosing span before the spans it holds) and finds the run's earliest span."""
        for process in self.processes.values():
            offset = statistics.median(process.offsets)
            for track, spans in process.tracks.items():
                spans = [
                    (round((s + offset) * 1e6), round((e + offset) * 1e6), name, args, flow)
                    for s, e, name, args, flow in spans
                ]
                spans.sort(key=lambda span: (span[0], -span[1]))
                process.tracks[track] = spans
                if self.t0_us is None or spans[0][0] < self.t0_us:
                    self.t0_us = spans[0][0]
            process.offset = offset

    def metadata(self) -> dict[str, Any]:
        return {
            "producer": "raytunix.profiling.trace",
            "start_unix_s": None if self.t0_us is None else self.t0_us / 1e6,
            "time": "ts and dur are whole microseconds of wall clock since start_unix_s",
            "processes": len(self.processes),
            "spans": self.spans,
            "dropped_spans": self.dropped,
            "bad_chunks": self.bad_chunks,
            "bad_spans": self.bad_spans,
        }

    def events(self) -> Iterator[dict[str, Any]]:
        """Yields metadata, slice, counter, instant and flow events; call ``finish`` first."""
        t0 = self.t0_us or 0
        flows: dict[str, list[tuple]] = collections.defaultdict(list)
        ordered = sorted(self.processes.values(), key=_Process.sort_key)
        for pid, process in enumerate(ordered, start=1):
            yield {
                "ph": "M",
                "name": "process_name",
                "pid": pid,
                "tid": 0,
                "args": {"name": process.label()},
            }
            yield {
                "ph": "M",
                "name": "process_sort_index",
                "pid": pid,
                "tid": 0,
                "args": {"sort_index": pid},
            }
            decode_rows, episodes = [], []  # (ts, change) of the two counters
            tid = 0
            for track in sorted(process.tracks, key=_natural):
                for lane, spans in enumerate(_lanes(process.tracks[track])):
                    tid += 1
                    thread = track if lane == 0 else f"{track} #{lane + 1}"
                    yield {
                        "ph": "M",
                        "name": "thread_name",
                        "pid": pid,
                        "tid": tid,
                        "args": {"name": thread},
                    }
                    yield {
                        "ph": "M",
                        "name": "thread_sort_index",
                        "pid": pid,
                        "tid": tid,
                        "args": {"sort_index": tid},
                    }
                    for start, end, name, args, flow in spans:
                        ts, dur = start - t0, end - start
                        event = {
                            "ph": "X",
                            "name": name,
                            "cat": process.kind,
                            "pid": pid,
                            "tid": tid,
                            "ts": ts,
                            "dur": dur,
                        }
                        if flow is not None:
                            args = dict(args or (), flow=flow)
                            flows[flow].append((ts, -dur, pid, tid, name == "episode"))
                        if args:
                            event["args"] = args
                        yield event
                        if name == "decode" and args and _number(args.get("rows")):
                            decode_rows += [(ts, args["rows"]), (ts + dur, -args["rows"])]
                        elif name == "episode":
                            episodes += [(ts, 1), (ts + dur, -1)]
            yield from _counter(decode_rows, "decode", "rows", pid)
            yield from _counter(episodes, "episodes", "in flight", pid)
            yield from self._drop_events(process, pid, t0)
        yield from _flow_events(flows)

    def _drop_events(self, process: _Process, pid: int, t0: int) -> Iterator[dict[str, Any]]:
        if self.t0_us is None:
            return  # no span anywhere: nothing to place the instant against
        first = min((spans[0][0] for spans in process.tracks.values()), default=t0)
        for start_s, dropped, phase, step in process.drops:
            ts = first if start_s is None else round((start_s + process.offset) * 1e6)
            yield {
                "ph": "i",
                "s": "p",
                "name": f"{dropped} spans dropped",
                "pid": pid,
                "tid": 0,
                "ts": ts - t0,
                "args": {"dropped": dropped, "phase": phase, "step": step},
            }


def _lanes(spans: list[_Span]) -> list[list[_Span]]:
    """Spreads one track's spans (sorted by start, then longest first) over lanes so that
    the spans of a lane are properly nested: two spans of a lane either do not overlap or
    one holds the other whole.

    A span nests in the innermost open span of the lane its flow last used when that span
    holds it whole and has the same flow (``None`` included); otherwise it takes the lowest
    lane free at its start, or a new one. As many lanes as the most spans open at once, at
    most (the greedy interval partition).
    """
    lanes: list[list[_Span]] = []
    open_spans: list[list[tuple]] = []  # per lane: stack of (end_us, flow) still open
    free: list[int] = []  # heap of lane indices with nothing open
    busy: list[tuple[int, int]] = []  # heap of (end of the lane's outermost span, lane)
    last_lane: dict[Any, int] = {}
    for span in spans:
        start, end, flow = span[0], span[1], span[4]
        lane = last_lane.get(flow)
        if lane is not None:
            stack = open_spans[lane]
            while stack and stack[-1][0] <= start:
                stack.pop()
            if not (stack and end <= stack[-1][0] and stack[-1][1] == flow):
                lane = None
        if lane is None:
            while busy and busy[0][0] <= start:
                heapq.heappush(free, heapq.heappop(busy)[1])
            if free:
                lane = heapq.heappop(free)
                open_spans[lane].clear()
            else:
                lane = len(lanes)
                lanes.append([])
                open_spans.append([])
            heapq.heappush(busy, (end, lane))
        open_spans[lane].append((end, flow))
        lanes[lane].append(span)
        last_lane[flow] = lane
    return lanes


def _counter(
    changes: list[tuple[int, float]], name: str, key: str, pid: int
) -> Iterator[dict[str, Any]]:
    """Counter events of a running sum of ``(ts, change)``: one value per distinct ts, only
    when it changes. Perfetto names the track ``"<name> <key>"``."""
    changes.sort(key=lambda change: change[0])
    value, shown = 0, None
    for i, (ts, change) in enumerate(changes):
        value += change
        if i + 1 < len(changes) and changes[i + 1][0] == ts:
            continue
        if value != shown:
            shown = value
            yield {"ph": "C", "name": name, "pid": pid, "tid": 0, "ts": ts, "args": {key: value}}


def _by_episode(points: list[tuple]) -> list[list[tuple]]:
    """The points of one flow id, split into one list per ``episode`` span: an id names an
    episode's session, and a later evaluation or a resumed run can use the same one again.
    A point belongs to the latest episode span that started at or before it and had not
    ended; points inside none (an attempt restarted before its episode span) go together.
    Each list is sorted by start."""
    points.sort()
    episodes = [p for p in points if p[4]]
    if len(episodes) <= 1:
        return [points]
    starts = [p[0] for p in episodes]
    groups: list[list[tuple]] = [[] for _ in episodes]
    loose: list[tuple] = []
    for point in points:
        i = bisect.bisect_right(starts, point[0]) - 1
        if i >= 0 and point[0] <= episodes[i][0] - episodes[i][1]:
            groups[i].append(point)
        else:
            loose.append(point)
    return groups + ([loose] if loose else [])


def _flow_events(flows: dict[str, list[tuple]]) -> Iterator[dict[str, Any]]:
    """Flow v1 events linking the spans of each episode in order of start: ``s`` at the
    first, ``t`` at the middle ones, ``f`` (bound to the enclosing slice) at the last."""
    groups = (group for points in flows.values() for group in _by_episode(points))
    for number, points in enumerate(groups, start=1):
        if len(points) < 2:
            continue
        last = len(points) - 1
        for i, (ts, _, pid, tid, _) in enumerate(points):
            event = {
                "ph": "s" if i == 0 else "f" if i == last else "t",
                "id": number,
                "cat": FLOW_NAME,
                "name": FLOW_NAME,
                "pid": pid,
                "tid": tid,
                "ts": ts,
            }
            if i == last:
                event["bp"] = "e"
            yield event


def _build(chunks: Iterable[Any]) -> _TraceBuilder:
    builder = _TraceBuilder()
    for chunk in chunks:
        builder.add(chunk)
    builder.finish()
    return builder


def trace_events(chunks: Iterable[dict]) -> dict[str, Any]:
    """The trace-event JSON object of some span chunks.

    Args:
      chunks: ``Recorder.drain()`` results (optionally with the driver's ``phase`` and
        ``step`` keys), in any order. Malformed chunks and spans are skipped and counted in
        ``metadata`` (``bad_chunks``, ``bad_spans``).

    Returns:
      ``{"displayTimeUnit": "ms", "metadata": {...}, "traceEvents": [...]}``; ``ts`` and
      ``dur`` in whole microseconds since ``metadata["start_unix_s"]`` (None without spans).
    """
    builder = _build(chunks)
    return {
        "displayTimeUnit": "ms",
        "metadata": builder.metadata(),
        "traceEvents": list(builder.events()),
    }


def _spans_path(run_dir_or_spans_path: str | os.PathLike) -> tuple[Path, Path]:
    """(spans.jsonl, run directory) of a run directory or of a spans file."""
    path = Path(run_dir_or_spans_path)
    if path.is_dir():
        return path / SPANS_FILE, path
    run_dir = path.parent.parent if path.parent.name == "profile" else path.parent
    return path, run_dir


def _read_chunks(path: Path, bad_lines: list[int]) -> Iterator[Any]:
    """The JSON values of the file's lines; a line that is not JSON (the truncated last line
    of a crashed run) is skipped and counted in ``bad_lines[0]``."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                yield loads_line(line)
            except ValueError:
                bad_lines[0] += 1


def write_trace(
    run_dir_or_spans_path: str | os.PathLike, out_path: str | os.PathLike | None = None
) -> str:
    """Writes the Chrome JSON trace of a run's spans; returns its path.

    Args:
      run_dir_or_spans_path: a run directory (its ``profile/spans.jsonl`` is read) or the
        path of a spans file.
      out_path: where to write; default ``RUN_DIR/trace.json``. Written to a temporary file
        and renamed, so a reader never sees half a trace.

    Lines that are not JSON are skipped and counted in ``metadata["bad_lines"]``.

    Raises:
      FileNotFoundError: there is no spans file.
    """
    spans_path, run_dir = _spans_path(run_dir_or_spans_path)
    if not spans_path.is_file():
        raise FileNotFoundError(
            f"no span file at {spans_path}: a run writes it from its first drain (the "
            "warm start's first check, or RL step 1); point at a run directory that got "
            "that far"
        )
    out = Path(out_path) if out_path is not None else run_dir / TRACE_FILE
    bad_lines = [0]
    builder = _build(_read_chunks(spans_path, bad_lines))
    metadata = dict(builder.metadata(), bad_lines=bad_lines[0], source=str(spans_path))
    tmp = out.with_name(out.name + ".tmp")
    # Event by event, so the whole event list never sits in memory; Perfetto's importer
    # reads displayTimeUnit only at the start of the file.
    with open(tmp, "w", encoding="utf-8") as f:
        f.write('{"displayTimeUnit": "ms", "metadata": ')
        json.dump(metadata, f)
        f.write(', "traceEvents": [\n')
        for i, event in enumerate(builder.events()):
            if i:
                f.write(",\n")
            f.write(json.dumps(event, separators=(",", ":")))
        f.write("\n]}\n")
    os.replace(tmp, out)
    return str(out)
