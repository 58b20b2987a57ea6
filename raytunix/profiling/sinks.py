"""Where a run's metric records go besides ``metrics.jsonl``: TensorBoard, Ray's metrics
(Prometheus and Grafana on a cluster) and the console.

The driver logs one record per warm-start check, RL step and held-out evaluation to
``metrics.jsonl`` (``RunDir.log``) and hands the same record to ``MetricSinks.write``::

    sinks = MetricSinks(run.path, total_rl_steps=cfg.learner.rl_steps,
                        log_every=cfg.run.log_every)
    for step in ...:
        record = {"phase": "rl", "step": step + 1, **metrics}
        run.log(record)
        sinks.write(record)
    sinks.close()

A record's numbers are flattened to ``{"key": float}`` (``flatten_metrics``: nested dicts
joined with "/", so ``{"statuses": {"completed": 3}}`` becomes ``statuses/completed``),
written to TensorBoard as ``<phase>/<key>`` and set on Ray gauges named
``raytunix_<phase>_<key>``. No sink can fail a run: a sink that cannot write logs why
once and turns itself off; ``metrics.jsonl`` keeps every record either way.
"""

from __future__ import annotations

import contextlib
import logging
import math
import numbers
import os
import re
import sys
import time
from collections.abc import Iterator, Mapping
from typing import Any, TextIO

import ray
from ray.util.metrics import Gauge
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)


@contextlib.contextmanager
def _torch_hidden() -> Iterator[None]:
    """Makes ``import torch`` fail inside the block when torch is not imported yet.

    tensorboardX's package imports torch whenever it is installed, only so that its own
    SummaryWriter accepts torch tensors; this module writes floats. That import costs the
    driver 1.5 s (4-6 s on a busy 2-core machine), measured with ``python -X importtime``.
    A ``None`` entry in ``sys.modules`` is Python's way to mark a module as unimportable;
    it is removed on leaving, so a later ``import torch`` works as usual.
    """
    if "torch" in sys.modules:
        yield
        return
    sys.modules["torch"] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        if sys.modules.get("torch", ...) is None:
            del sys.modules["torch"]


with _torch_hidden():
    from tensorboardX.event_file_writer import EventsWriter
    from tensorboardX.proto.event_pb2 import Event, SessionLog
    from tensorboardX.proto.summary_pb2 import Summary

logger = logging.getLogger(__name__)

# The x axes of a record, not metrics: TensorBoard keeps them as an event's step and wall
# time, so they are not written as scalars of their own.
AXIS_KEYS = ("step", "time")
MAX_GAUGES = 512  # Ray gauges one RayMetricsSink makes at most; a key explosion stops here
TENSORBOARD_SUBDIR = "tensorboard"


def flatten_metrics(record: Mapping[str, Any]) -> dict[str, float]:
    """The numbers of one metrics record, flat.

    Args:
      record: a ``metrics.jsonl`` record; values may be numbers, strings, lists and
        nested dicts.

    Returns:
      ``{key: value}`` in the record's order. Nested dict keys are joined with "/"
      (``statuses/completed``). Ints, floats and numpy scalars become floats; bools
      become 0.0 / 1.0 (a flag is worth a curve); NaN and infinities are left out (no
      sink can plot them); strings, lists and None are left out.
    """
    flat: dict[str, float] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, Mapping):
            for k, v in value.items():
                walk(f"{prefix}/{k}" if prefix else str(k), v)
        elif isinstance(value, bool):
            flat[prefix] = float(value)
        elif isinstance(value, numbers.Real):
            v = float(value)
            if math.isfinite(v):
                flat[prefix] = v

    walk("", record)
    return flat


def _wall_time(record: Mapping[str, Any]) -> float:
    """The record's own ``time`` (unix s) when it has one (a record read back from
    ``metrics.jsonl``), else now."""
    t = record.get("time")
    if isinstance(t, numbers.Real) and not isinstance(t, bool) and math.isfinite(t):
        return float(t)
    return time.time()


class TensorBoardSink:
    """Scalars in TensorBoard event files under ``logdir`` (``tensorboard --logdir``), one
    TensorBoard run per phase: ``logdir/rl``, ``logdir/warmup``, ``logdir/eval``.

    Each phase's event file is made at its first write (``events.out.tfevents.<unix
    s>.<host>.<pid>``, so a resumed run adds a file beside the first). Each ``write`` is one
    event holding every number of the record, flushed to disk, so a live TensorBoard sees
    each step and a killed run keeps what it wrote. ``restart`` marks where a resumed run
    goes on, so TensorBoard drops what the earlier process logged from there on (the
    steps redone from the checkpoint); its phases have step axes of their own, hence a run
    each: the mark purges every tag of its run. Events are written in the calling thread:
    an ``OSError`` (disk full, directory gone) is logged once and turns the sink off
    instead of failing the run.
    """

    def __init__(self, logdir: str):
        self.logdir = logdir
        self.enabled = True
        self._writers: dict[str, EventsWriter] = {}

    def write(self, record: Mapping[str, Any], step: int, prefix: str) -> None:
        """Writes every number of ``record`` as scalar ``<prefix>/<key>`` at ``step`` in
        the run ``prefix`` (``step`` and ``time`` are the event's step and wall time, not
        scalars)."""
        values = [
            Summary.Value(tag=_tensorboard_tag(f"{prefix}/{k}"), simple_value=v)
            for k, v in flatten_metrics(record).items()
            if k not in AXIS_KEYS
        ]
        if values:
            self._write(
                prefix,
                Event(wall_time=_wall_time(record), step=int(step), summary=Summary(value=values)),
            )

    def restart(self, prefix: str, step: int) -> None:
        """Marks that run ``prefix`` goes on at ``step`` (a resume): TensorBoard then drops
        the events of that run it read before the mark with a step >= ``step``
        (``SessionLog.START``; files are read in the order they were made)."""
        self._write(
            prefix,
            Event(
                wall_time=time.time(),
                step=int(step),
                session_log=SessionLog(status=SessionLog.START),
            ),
        )

    def _write(self, prefix: str, event: Event) -> None:
        if not self.enabled:
            return
        try:
            writer = self._writers.get(prefix)
            if writer is None:
                directory = os.path.join(self.logdir, _tensorboard_tag(prefix))
                os.makedirs(directory, exist_ok=True)
                writer = self._writers[prefix] = EventsWriter(
                    os.path.join(directory, "events"), filename_suffix=f".{os.getpid()}"
                )
            writer.write_event(event)
            writer.flush()
        except OSError as e:
            self._turn_off(e)

    def flush(self) -> None:
        for writer in list(self._writers.values()):
            if not self.enabled:
                return
            try:
                writer.flush()
            except OSError as e:
                self._turn_off(e)

    def close(self) -> None:
        """Flushes and closes the event files; later writes are ignored."""
        writers, self._writers = list(self._writers.values()), {}
        failed = None
        for writer in writers:  # each closed, whatever the one before did
            try:
                writer.close()
            except OSError as e:
                failed = failed or e
        if failed is not None and self.enabled:
            self._turn_off(failed)
        self.enabled = False

    def _turn_off(self, error: OSError) -> None:
        logger.warning(
            "TensorBoard metrics stop for this run: writing under %s failed (%s). "
            "metrics.jsonl still holds every record.",
            self.logdir,
            error,
        )
        self.enabled = False
        writers, self._writers = list(self._writers.values()), {}
        for writer in writers:
            try:
                writer.close()
            except OSError:
                pass  # already reported; the files are given up either way


_TAG_CHARS = re.compile(r"[^-/\w.]")  # what TensorBoard shows as-is in a tag


def _tensorboard_tag(tag: str) -> str:
    return _TAG_CHARS.sub("_", tag)


_NOT_METRIC_NAME_CHARS = re.compile(r"[^a-zA-Z0-9_]")


def ray_metric_name(key: str) -> str:
    """``raytunix_`` + ``key`` with every character outside ``[a-zA-Z0-9_]`` made ``_``.

    Prometheus allows ``[a-zA-Z_:][a-zA-Z0-9_:]*``; colons are left out too, as Prometheus
    reserves them for recording rules and Ray 2.60 warns on them. The prefix keeps the
    first character a letter. ``rl/tool_latency_s/calculator/p50`` becomes
    ``raytunix_rl_tool_latency_s_calculator_p50``.
    """
    return "raytunix_" + _NOT_METRIC_NAME_CHARS.sub("_", key)


class RayMetricsSink:
    """The record's numbers as Ray gauges, which Ray's metrics agent exports to
    Prometheus (and so Grafana) on a cluster.

    One ``ray.util.metrics.Gauge`` per key, made at the key's first write, named
    ``ray_metric_name("<prefix>/<key>")`` and tagged ``run=<run_name>`` so runs sharing a
    cluster stay apart. Only while ``ray.is_initialized()``; otherwise ``write`` does
    nothing. At most ``max_gauges`` gauges are made: keys past that, or keys whose name
    collides with another key's, are dropped (logged once).
    """

    def __init__(self, run_name: str, max_gauges: int = MAX_GAUGES):
        if max_gauges < 1:
            raise ValueError(f"RayMetricsSink needs max_gauges >= 1, got {max_gauges}")
        self.run_name = str(run_name)
        self.max_gauges = max_gauges
        self._gauges: dict[str, Gauge] = {}  # metric name -> gauge
        self._name_of: dict[str, str | None] = {}  # key -> metric name, None when dropped
        self._warned = False

    @property
    def gauges(self) -> dict[str, Gauge]:
        """The gauges made so far, by metric name (a copy)."""
        return dict(self._gauges)

    def write(self, record: Mapping[str, Any], step: int, prefix: str) -> None:
        """Sets gauge ``<prefix>/<key>`` to each number of ``record``, and
        ``<prefix>/step`` to ``step`` (``time`` is left out: Prometheus stamps samples)."""
        if not ray.is_initialized():
            return
        values = {k: v for k, v in flatten_metrics(record).items() if k not in AXIS_KEYS}
        values["step"] = float(step)
        for key, value in values.items():
            gauge = self._gauge(f"{prefix}/{key}")
            if gauge is not None:
                gauge.set(value)

    def _gauge(self, key: str) -> Gauge | None:
        if key in self._name_of:
            name = self._name_of[key]
            return None if name is None else self._gauges[name]
        name = ray_metric_name(key)
        if name in self._gauges or len(self._gauges) >= self.max_gauges:
            why = (
                f"its name {name} is taken by another key"
                if name in self._gauges
                else f"the sink has made its max_gauges={self.max_gauges} gauges"
            )
            if not self._warned:
                logger.warning(
                    "Ray metric %r (and any later such key) is not exported: %s. "
                    "metrics.jsonl and TensorBoard still have it.",
                    key,
                    why,
                )
                self._warned = True
            self._name_of[key] = None
            return None
        gauge = Gauge(name, description=f"raytunix metric {key}", tag_keys=("run",))
        gauge.set_default_tags({"run": self.run_name})
        self._gauges[name] = gauge
        self._name_of[key] = name
        return gauge


def format_headline(record: Mapping[str, Any]) -> str:
    """The headline numbers of an RL step record, e.g. ``reward 0.512  tool use 98.0%  loss
    +0.0123  tok/s 5321  engine busy 41%  learner busy 63%  staleness<= 1  in flight 96``;
    a number the record lacks (or holds as a non-number) is left out."""
    fields = (
        ("reward_mean", "reward {:.3f}"),
        ("tool_use_rate", "tool use {:.1%}"),
        ("loss", "loss {:+.4f}"),
        ("generated_tokens_per_s", "tok/s {:.0f}"),
        ("engine_busy_fraction", "engine busy {:.0%}"),
        ("learner_busy_fraction", "learner busy {:.0%}"),
        ("staleness_max", "staleness<= {:g}"),
        ("mismatch_logprob_abs_mean", "|dlogp| {:.4f}"),
        ("episodes_in_flight", "in flight {:g}"),
    )
    flat = flatten_metrics(record)
    return "  ".join(fmt.format(flat[k]) for k, fmt in fields if k in flat)


class ConsoleProgress:
    """The console view of the RL loop.

    On a terminal: a live progress bar (``rich``) with the step, the headline numbers of
    the latest ``update`` and the elapsed time. Elsewhere (Ray job logs, a pipe, pytest's
    capture): no live display, one plain line per ``update``::

        RL step 3/30: reward 0.512  tool use 98.0%  loss +0.0123  tok/s 5321  engine busy 41%
        learner busy 63%  staleness<= 1  in flight 96  (12 s)

    (one line, broken here to fit).

    Elapsed seconds count from when this object is made to the step's end: its record's
    ``time`` (wall clock, Unix seconds), so the steps of one profiling window, printed
    together when it closes, each show their own; now when a record has no ``time``.

    Args:
      total_steps: RL steps of the run.
      enabled: False prints nothing at all.
      stream: where to write; None means ``sys.stdout`` as it is when this is made.
      start_step: where the bar starts (a resumed run's step).
    """

    def __init__(
        self,
        total_steps: int,
        enabled: bool = True,
        stream: TextIO | None = None,
        start_step: int = 0,
    ):
        self.total_steps = int(total_steps)
        self.enabled = enabled
        self.stream = sys.stdout if stream is None else stream
        self._t0 = time.time()
        console = Console(file=self.stream)
        self.live = enabled and console.is_terminal and not console.is_dumb_terminal
        self._progress = None
        if self.live:
            self._progress = Progress(
                TextColumn("RL step"),
                MofNCompleteColumn(),
                BarColumn(),
                TextColumn("{task.fields[headline]}"),
                TimeElapsedColumn(),
                console=console,
                refresh_per_second=2,
            )
            self._task = self._progress.add_task(
                "rl", total=self.total_steps, completed=start_step, headline=""
            )
            self._started = False

    def update(self, step: int, record: Mapping[str, Any]) -> None:
        """Shows RL step ``step`` (1-based) with the headline numbers of its record."""
        if not self.enabled:
            return
        headline = format_headline(record)
        if self._progress is not None:
            if not self._started:  # the bar appears with the first step, not before
                self._progress.start()
                self._started = True
            self._progress.update(self._task, completed=step, headline=headline)
            return
        ended = record.get("time")
        if not isinstance(ended, (int, float)) or isinstance(ended, bool):
            ended = time.time()
        elapsed = max(0.0, ended - self._t0)
        print(
            f"RL step {step}/{self.total_steps}: {headline}  ({elapsed:.0f} s)",
            file=self.stream,
            flush=True,
        )

    def close(self) -> None:
        """Ends the live display (its last state stays on screen)."""
        if self._progress is not None and self._started:
            self._progress.stop()
            self._started = False


class MetricSinks:
    """TensorBoard, Ray gauges and the console behind one ``write(record)`` per record.

    ``metrics.jsonl`` is not written here: the driver's ``RunDir.log`` writes it.

    Records are routed by ``record["phase"]``:

    * ``"rl"``: TensorBoard ``rl/*`` and Ray gauges at ``record["step"]``; the console
      every ``log_every`` steps and at the last step.
    * ``"warmup"``: ``warmup/*`` at ``record["step"]`` (warm-start steps count apart
      from RL steps).
    * ``"eval"``: ``eval/*`` at step 0 for ``when == "before_rl"`` and at
      ``total_rl_steps`` for ``"after_rl"``, so the held-out success sits at both ends of
      the RL step axis; ``"during_rl"`` (``eval.every``) at the RL step it started at.
    * ``"resume"``: the console bar restarts at ``record["rl_step"]``, and TensorBoard's
      ``rl`` run is marked to go on after it (``TensorBoardSink.restart``: the steps the
      crashed process logged past its checkpoint are dropped, as in ``metrics.jsonl``).
    * ``"warmup_resume"``: the same for the ``warmup`` run, after ``record["step"]``.
    * other phases, or a record without its step: ignored.

    The console is made when the RL loop starts (at the ``before_rl`` evaluation, a
    ``resume`` record, or the first RL record), so its elapsed time is RL time.

    Args:
      run_dir: the run directory; TensorBoard files go to ``run_dir/tensorboard``.
      total_rl_steps: ``learner.rl_steps``.
      log_every: ``run.log_every``: RL steps between console lines.
      run_name: the ``run`` tag of the Ray gauges; default the run directory's name.
      tensorboard, ray_metrics, console: turn one sink off.
      stream: the console's stream (None: ``sys.stdout``).
    """

    def __init__(
        self,
        run_dir: str,
        total_rl_steps: int,
        log_every: int = 1,
        run_name: str | None = None,
        tensorboard: bool = True,
        ray_metrics: bool = True,
        console: bool = True,
        stream: TextIO | None = None,
    ):
        if log_every < 1:
            raise ValueError(
                f"log_every must be >= 1 (RL steps between console lines), got {log_every}"
            )
        self.total_rl_steps = int(total_rl_steps)
        self.log_every = int(log_every)
        self.tensorboard = (
            TensorBoardSink(os.path.join(run_dir, TENSORBOARD_SUBDIR)) if tensorboard else None
        )
        name = run_name or os.path.basename(os.path.normpath(os.path.abspath(run_dir)))
        self.ray_metrics = RayMetricsSink(name) if ray_metrics else None
        self._console_on = console
        self._stream = stream
        self.console: ConsoleProgress | None = None

    def write(self, record: Mapping[str, Any]) -> None:
        """Hands one record to every sink (see the class docstring for the routing)."""
        phase = record.get("phase")
        if phase in ("resume", "warmup_resume"):
            run, key = ("rl", "rl_step") if phase == "resume" else ("warmup", "step")
            at = record.get(key, 0)
            at = int(at) if isinstance(at, numbers.Integral) else 0
            if self.tensorboard is not None:
                self.tensorboard.restart(run, at + 1)
            if phase == "resume":
                self._start_console(at)
            return
        if phase == "eval":
            when = str(record.get("when"))
            at = {"before_rl": 0, "during_rl": record.get("step")}.get(when, self.total_rl_steps)
            if not isinstance(at, numbers.Integral):
                return
            step = int(at)
            if when == "before_rl":
                self._start_console(0)
        elif phase in ("rl", "warmup") and isinstance(record.get("step"), numbers.Integral):
            step = int(record["step"])
        else:
            return
        for sink in (self.tensorboard, self.ray_metrics):
            if sink is not None:
                sink.write(record, step, phase)
        if phase == "rl":
            self._start_console(step - 1)
            if step % self.log_every == 0 or step == self.total_rl_steps:
                self.console.update(step, record)

    def _start_console(self, start_step: int) -> None:
        if self.console is None:
            self.console = ConsoleProgress(
                self.total_rl_steps,
                enabled=self._console_on,
                stream=self._stream,
                start_step=start_step,
            )

    def close(self) -> None:
        """Ends the console display and closes the TensorBoard file."""
        if self.console is not None:
            self.console.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
