"""RL metrics of one window (an RL step, or the steps of ``run.profile_window_s``) computed
from the spans drained in it.

Each process's chunk is reduced in one pass over its spans (``summarize``) and the
processes' summaries are added up (``WindowMetrics.combine``): the driver does this once
per window over thousands of spans, so the pass is kept to one.

The metrics are derived from span names, not from which process recorded them, so the
same code measures a run on a cluster (one process per actor) and an in-process test (one
process for everything). What each metric reads:

==============================  ==========================================================
``engine_busy_fraction``        ``prefill`` + ``decode`` span seconds (device time; the
                                engine records them back to back, never overlapping) /
                                (window seconds x engine processes)
``engine_prefill_fraction``     the ``prefill`` part of it
``engine_batch_occupancy``      mean ``rows`` of ``decode`` spans / ``max_batch_size``
``engine_queue_wait_s_mean``    mean ``queued_s`` of ``request`` spans (waiting for a slot)
``learner_busy_fraction``       ``update`` span seconds / window; ``learner_idle_fraction``
                                is the rest
``learner_wait_fraction``       the driver's ``next_batch_wait`` seconds / window: the
                                learner waiting for rollouts
``trajectories_per_s``          ``episode`` spans ended / window
``generated_tokens_per_s``      ``tokens`` of the orchestrator's ``turn`` spans / window
``episode_generate_fraction``   of the seconds of the episodes that ended in the window,
``episode_env_fraction``        the share spent waiting on the engine, on the environment
``episode_other_fraction``      and its tools, and on neither (the orchestrator's own
                                work, queueing for its event loop): ``generate_s`` and
                                ``env_s`` in the args of each ``episode`` span
``tool_latency_s/<tool>/pXX``   percentiles 50/90/99 of ``tool_call`` seconds per tool;
                                ``tool_calls/<tool>``, ``tool_call_errors/<kind>``
``env_step_latency_s/pXX``      percentiles of ``env_step`` seconds in env actors
``<kind>_cpu_fraction``         CPU seconds / wall seconds of each process kind between two
                                drains (``orchestrator``, ``env``, ``driver``, ...; the
                                mean over processes of that kind; in cores, so a process
                                running several threads can pass 1)
``spans_dropped``               spans lost to full ring buffers
``profiling_cpu_s``             seconds the processes spent draining their spans
                                (``profile_drain`` spans) and the driver's CPU seconds
                                collecting them (``cpu_s`` of ``profile_collect``):
                                profiling's own cost
``window_s``                    the window's length, seconds
``profiling_enabled``           0.0, alone, when no process recorded spans (the rest is
                                then absent, not zero)
==============================  ==========================================================
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any, Iterable

import numpy as np

ENGINE_STEP_SPANS = ("prefill", "decode")
ENGINE_KINDS = ("engine", "policy")
EPISODE_ENV_SPANS = ("env_step", "env_reset")
EPISODE_TRACK = "episodes"  # the orchestrator's spans of an episode (run_episode)
PERCENTILES = (50, 90, 99)


def process_key(chunk: dict[str, Any]) -> tuple[str, int, str]:
    """(host, pid, process name): one process of the run."""
    return (chunk.get("host", ""), int(chunk.get("pid", 0)), chunk.get("process", ""))


def percentiles(values: Iterable[float], qs: Iterable[int] = PERCENTILES) -> dict[str, float]:
    """``{"p50": ..., "p90": ..., "p99": ...}`` of ``values`` (linear interpolation);
    empty when there are none."""
    values = np.asarray(list(values), np.float64)
    qs = list(qs)
    if values.size == 0:
        return {}
    return {f"p{q}": float(v) for q, v in zip(qs, np.percentile(values, qs))}


SUMMARY_HEADER = ("process", "kind", "host", "pid", "enabled", "dropped", "cpu_s", "now_s")


def summarize(chunk: dict[str, Any]) -> dict[str, Any]:
    """What one process's drained chunk contributes to a window's metrics, in one pass
    over its spans; ``WindowMetrics.combine`` adds the processes' summaries up. Its size
    does not grow with the spans but for the latencies the percentiles need.

    Args:
      chunk: a ``Recorder.drain()`` result (spans as lists or tuples of ``SPAN_FIELDS``).

    Returns:
      a plain dict (picklable, JSON-able): the chunk's header (``SUMMARY_HEADER``), its
      span count (``spans``), whether it ran engine steps (``engine_steps``), seconds and
      counts of its spans by name (``seconds``, ``counts``; tool calls and the
      orchestrator's waits on the environment left out, see the module docstring), decode
      rows and queue waits as ``[sum, count]``, generated tokens, the ended episodes' wait
      seconds (``episode_generate_s``, ``episode_env_s``), tool latencies in seconds by tool
      and tool errors by kind, env step seconds, and the driver's collection CPU seconds
      (``collect_cpu_s``).
    """
    seconds: dict[str, float] = {}
    counts: dict[str, int] = {}
    tool_latency: dict[str, list[float]] = {}
    tool_errors: dict[str, int] = {}
    env_steps: list[float] = []
    rows = [0.0, 0]
    queued = [0.0, 0]
    tokens, generate_s, env_s, collect_cpu_s = 0, 0.0, 0.0, 0.0
    spans = chunk.get("spans", ())
    for name, track, start, end, args, _flow in spans:
        duration = end - start if end > start else 0.0
        if name == "tool_call":
            tool = (args or {}).get("tool") or track.removeprefix("tool ")
            tool_latency.setdefault(tool, []).append(duration)
            if args and args.get("error"):
                tool_errors[args["error"]] = tool_errors.get(args["error"], 0) + 1
            continue
        if track == EPISODE_TRACK and name in EPISODE_ENV_SPANS:
            continue  # the episode's wait, summed in its ``episode`` span's args
        seconds[name] = seconds.get(name, 0.0) + duration
        counts[name] = counts.get(name, 0) + 1
        if not args:
            if name == "env_step":
                env_steps.append(duration)
            continue
        if name == "decode":
            if "rows" in args:
                rows[0] += args["rows"]
                rows[1] += 1
        elif name == "request":
            if "queued_s" in args:
                queued[0] += args["queued_s"]
                queued[1] += 1
        elif name == "turn" or name == "generate":  # a turn's generation (its own span
            tokens += int(args.get("tokens", 0))  # in runs recorded before this release)
        elif name == "episode":
            generate_s += float(args.get("generate_s", 0.0))
            env_s += float(args.get("env_s", 0.0))
        elif name == "env_step":
            env_steps.append(duration)
        elif name == "profile_collect":
            collect_cpu_s += float(args.get("cpu_s", 0.0))
    out = {key: chunk[key] for key in SUMMARY_HEADER if key in chunk}
    out.update(
        spans=len(spans),
        seconds=seconds,
        counts=counts,
        engine_steps=any(name in counts for name in ENGINE_STEP_SPANS),
        decode_rows=rows,
        queued_s=queued,
        generated_tokens=tokens,
        episode_generate_s=generate_s,
        episode_env_s=env_s,
        tool_latency_s=tool_latency,
        tool_errors=tool_errors,
        env_step_s=env_steps,
        collect_cpu_s=collect_cpu_s,
    )
    return out


@dataclasses.dataclass
class WindowTotals:
    """Every process's ``summarize`` of one window, added up (``add_up``).

    Attributes:
      seconds, counts: span seconds and spans ended, by span name.
      tool_latency: ``{tool: [seconds of each call]}``.
      tool_errors: failed tool calls by error kind.
      env_steps: seconds of each ``env_step`` as the env actors timed it.
      decode_rows, queued_s: ``[sum, count]`` of decode spans' rows and of requests'
        seconds waiting for a slot.
      generated_tokens: tokens of the orchestrator's turns.
      episode_generate_s, episode_env_s: seconds the episodes that ended waited on the
        engine and on the environment.
      collect_cpu_s: the driver's CPU seconds collecting spans.
      engine_processes: processes that ran an engine (by kind, or having decode steps).
      dropped: spans lost to full ring buffers.
    """

    seconds: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    counts: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    tool_latency: dict[str, list[float]] = dataclasses.field(
        default_factory=lambda: collections.defaultdict(list)
    )
    tool_errors: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    env_steps: list[float] = dataclasses.field(default_factory=list)
    decode_rows: list[float] = dataclasses.field(default_factory=lambda: [0.0, 0])
    queued_s: list[float] = dataclasses.field(default_factory=lambda: [0.0, 0])
    generated_tokens: int = 0
    episode_generate_s: float = 0.0
    episode_env_s: float = 0.0
    collect_cpu_s: float = 0.0
    engine_processes: int = 0
    dropped: int = 0


def add_up(summaries: list[dict[str, Any]]) -> WindowTotals:
    """The processes' summaries of one window (``summarize``) added into one total."""
    totals = WindowTotals()
    engines = set()
    for s in summaries:
        totals.dropped += int(s.get("dropped", 0))
        if s.get("kind", "") in ENGINE_KINDS or s.get("engine_steps"):
            engines.add(process_key(s))
        totals.seconds.update(s.get("seconds", {}))
        totals.counts.update(s.get("counts", {}))
        for tool, latencies in s.get("tool_latency_s", {}).items():
            totals.tool_latency[tool].extend(latencies)
        totals.tool_errors.update(s.get("tool_errors", {}))
        totals.env_steps.extend(s.get("env_step_s", ()))
        for total, part in (
            (totals.decode_rows, s.get("decode_rows")),
            (totals.queued_s, s.get("queued_s")),
        ):
            if part:
                total[0] += part[0]
                total[1] += part[1]
        totals.generated_tokens += s.get("generated_tokens", 0)
        totals.episode_generate_s += s.get("episode_generate_s", 0.0)
        totals.episode_env_s += s.get("episode_env_s", 0.0)
        totals.collect_cpu_s += s.get("collect_cpu_s", 0.0)
    totals.engine_processes = len(engines)
    return totals


def engine_metrics(
    totals: WindowTotals, window_s: float, max_batch_size: int | None
) -> dict[str, float]:
    """``engine_busy_fraction`` and its prefill part (per engine process),
    ``engine_decode_rows_mean``, ``engine_batch_occupancy`` (with ``max_batch_size``) and
    ``engine_queue_wait_s_mean``, each only when the window has what it reads."""
    out: dict[str, float] = {}
    seconds, engines = totals.seconds, totals.engine_processes
    if engines:
        busy = seconds["prefill"] + seconds["decode"]
        out["engine_busy_fraction"] = min(1.0, busy / (window_s * engines))
        out["engine_prefill_fraction"] = min(1.0, seconds["prefill"] / (window_s * engines))
    rows, queued = totals.decode_rows, totals.queued_s
    if rows[1]:
        out["engine_decode_rows_mean"] = rows[0] / rows[1]
        if max_batch_size:
            out["engine_batch_occupancy"] = rows[0] / rows[1] / max_batch_size
    if queued[1]:
        out["engine_queue_wait_s_mean"] = queued[0] / queued[1]
    return out


def learner_metrics(totals: WindowTotals, window_s: float) -> dict[str, float]:
    """``learner_busy_fraction`` / ``learner_idle_fraction`` when the learner updated or
    waited in the window, and ``learner_wait_fraction`` when it waited."""
    seconds, counts = totals.seconds, totals.counts
    out: dict[str, float] = {}
    if counts["update"] or counts["next_batch_wait"]:
        learner_busy = min(1.0, seconds["update"] / window_s)
        out["learner_busy_fraction"] = learner_busy
        out["learner_idle_fraction"] = 1.0 - learner_busy
    if counts["next_batch_wait"]:
        out["learner_wait_fraction"] = min(1.0, seconds["next_batch_wait"] / window_s)
    return out


def episode_metrics(totals: WindowTotals, window_s: float) -> dict[str, float]:
    """``trajectories_per_s``, ``generated_tokens_per_s``, and where the episodes that
    ended in the window spent their time (``episode_*_fraction``, ``episode_wall_s_mean``)."""
    episode_s, episodes = totals.seconds["episode"], totals.counts["episode"]
    out = {
        "trajectories_per_s": episodes / window_s,
        "generated_tokens_per_s": totals.generated_tokens / window_s,
    }
    if episode_s > 0:
        # From the episodes that ended in the window (their span carries its totals),
        # so an episode's turns never count in one window and its length in another.
        generate_s, env_s = totals.episode_generate_s, totals.episode_env_s
        out["episode_generate_fraction"] = min(1.0, generate_s / episode_s)
        out["episode_env_fraction"] = min(1.0, env_s / episode_s)
        out["episode_other_fraction"] = max(0.0, 1.0 - (generate_s + env_s) / episode_s)
        out["episode_wall_s_mean"] = episode_s / episodes
    return out


def tool_and_env_step_metrics(totals: WindowTotals) -> dict[str, float]:
    """Per tool: calls and latency percentiles (seconds); failed calls by kind; and the
    percentiles of env steps as the env actors timed them (without the trip to the actor)."""
    out: dict[str, float] = {}
    for tool, latencies in totals.tool_latency.items():
        out[f"tool_calls/{tool}"] = float(len(latencies))
        for q, value in percentiles(latencies).items():
            out[f"tool_latency_s/{tool}/{q}"] = value
    for kind, count in totals.tool_errors.items():
        out[f"tool_call_errors/{kind}"] = float(count)
    for q, value in percentiles(totals.env_steps).items():
        out[f"env_step_latency_s/{q}"] = value
    return out


# Spans whose seconds in a window are a metric of their own, ``<name>_s``.
TIMED_SPANS = ("weight_publish", "checkpoint", "object_store_get", "object_store_put", "batch_pack")


def cost_metrics(totals: WindowTotals) -> dict[str, float]:
    """``profiling_cpu_s`` (profiling's own cost: draining plus collecting) and the
    seconds of each ``TIMED_SPANS`` span that ran in the window."""
    out: dict[str, float] = {}
    own = totals.seconds["profile_drain"] + totals.collect_cpu_s
    if own:
        out["profiling_cpu_s"] = own
    for name in TIMED_SPANS:
        if totals.counts[name]:
            out[f"{name}_s"] = totals.seconds[name]
    return out


class WindowMetrics:
    """Computes each window's metrics from what every process drained at its end.

    Args:
      max_batch_size: the engine's decode rows (``engine.max_batch_size``), for
        ``engine_batch_occupancy``; None leaves that metric out.

    Keeps each process's last CPU reading, so CPU fractions cover the time between two
    of its drains.
    """

    def __init__(self, max_batch_size: int | None = None):
        self.max_batch_size = max_batch_size
        self._cpu: dict[tuple, tuple[float, float]] = {}

    def compute(self, chunks: list[dict[str, Any]], window_s: float) -> dict[str, float]:
        """The metrics of one window from the processes' chunks (``Recorder.drain()``
        results, spans as lists or tuples of ``SPAN_FIELDS``): ``combine`` of their
        ``summarize``."""
        return self.combine([summarize(chunk) for chunk in chunks], window_s)

    def combine(self, summaries: list[dict[str, Any]], window_s: float) -> dict[str, float]:
        """The metrics of one window.

        Args:
          summaries: ``summarize`` of every process's chunk, drained at the window's end.
          window_s: the window's wall-clock length, seconds (> 0).

        Returns:
          flat ``{name: float}`` (see the module docstring); a metric with nothing to
          measure in this window is absent.

        Raises:
          ValueError: ``window_s`` is not > 0.
        """
        if not window_s > 0:
            raise ValueError(f"a metrics window must last > 0 seconds, got {window_s!r}")
        if summaries and not any(s.get("enabled", True) for s in summaries):
            # Recording is off everywhere (RAYTUNIX_PROFILING=0): no span is evidence of
            # nothing, so no metric rather than zeros.
            return {"profiling_enabled": 0.0}
        cpu: dict[str, list[float]] = collections.defaultdict(list)
        for s in summaries:
            self._cpu_fraction(process_key(s), s, s.get("kind", ""), cpu)
        totals = add_up(summaries)
        out: dict[str, float] = {"window_s": window_s, "spans_dropped": float(totals.dropped)}
        out.update(engine_metrics(totals, window_s, self.max_batch_size))
        out.update(learner_metrics(totals, window_s))
        out.update(episode_metrics(totals, window_s))
        out.update(tool_and_env_step_metrics(totals))
        for kind, fractions in cpu.items():
            out[f"{kind}_cpu_fraction"] = float(np.mean(fractions))
        out.update(cost_metrics(totals))
        return {k: v for k, v in out.items() if math.isfinite(v)}

    def _cpu_fraction(
        self, key: tuple, summary: dict[str, Any], kind: str, cpu: dict[str, list[float]]
    ) -> None:
        if "cpu_s" not in summary or "now_s" not in summary:
            return
        now = (float(summary["cpu_s"]), float(summary["now_s"]))
        before = self._cpu.get(key)
        self._cpu[key] = now
        if before is not None and now[1] > before[1]:
            cpu[kind or "process"].append(max(0.0, (now[0] - before[0]) / (now[1] - before[1])))
