"""RL metrics of one window (an RL step) computed from the spans drained in it.

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
``generated_tokens_per_s``      ``tokens`` of ``generate`` spans / window
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
    if values.size == 0:
        return {}
    return {f"p{q}": float(np.percentile(values, q)) for q in qs}


class WindowMetrics:
    """Computes each window's metrics from the chunks drained at its end.

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
        """The metrics of one window.

        Args:
          chunks: ``Recorder.drain()`` results of every process, drained at the window's
            end (spans as lists or tuples of ``SPAN_FIELDS``).
          window_s: the window's wall-clock length, seconds (> 0).

        Returns:
          flat ``{name: float}`` (see the module docstring); a metric with nothing to
          measure in this window is absent.
        """
        if not window_s > 0:
            raise ValueError(f"a metrics window must last > 0 seconds, got {window_s!r}")
        if chunks and not any(chunk.get("enabled", True) for chunk in chunks):
            # Recording is off everywhere (RAYTUNIX_PROFILING=0): no span is evidence of
            # nothing, so no metric rather than zeros.
            return {"profiling_enabled": 0.0}
        by_name: dict[str, list[tuple[float, Any]]] = collections.defaultdict(list)
        tool_latency: dict[str, list[float]] = collections.defaultdict(list)
        tool_errors: collections.Counter = collections.Counter()
        engine_processes, dropped = set(), 0
        cpu: dict[str, list[float]] = collections.defaultdict(list)
        for chunk in chunks:
            key = process_key(chunk)
            dropped += int(chunk.get("dropped", 0))
            kind = chunk.get("kind", "")
            if kind in ENGINE_KINDS:
                engine_processes.add(key)
            self._cpu_fraction(key, chunk, kind, cpu)
            for name, track, start, end, args, _flow in chunk.get("spans", ()):
                seconds = max(0.0, end - start)
                if name == "tool_call":
                    tool = (args or {}).get("tool") or track.removeprefix("tool ")
                    tool_latency[tool].append(seconds)
                    if args and args.get("error"):
                        tool_errors[args["error"]] += 1
                    continue
                if name in ENGINE_STEP_SPANS:
                    engine_processes.add(key)
                if track == EPISODE_TRACK and name in EPISODE_ENV_SPANS:
                    continue  # the episode's wait, summed in its ``episode`` span's args
                by_name[name].append((seconds, args))

        def total(name: str) -> float:
            return sum(seconds for seconds, _ in by_name.get(name, ()))

        out: dict[str, float] = {"window_s": window_s, "spans_dropped": float(dropped)}
        engines = max(1, len(engine_processes))
        busy = total("prefill") + total("decode")
        if engine_processes:
            out["engine_busy_fraction"] = min(1.0, busy / (window_s * engines))
            out["engine_prefill_fraction"] = min(1.0, total("prefill") / (window_s * engines))
        rows = [a["rows"] for _, a in by_name.get("decode", ()) if a and "rows" in a]
        if rows:
            out["engine_decode_rows_mean"] = float(np.mean(rows))
            if self.max_batch_size:
                out["engine_batch_occupancy"] = float(np.mean(rows)) / self.max_batch_size
        queued = [a["queued_s"] for _, a in by_name.get("request", ()) if a and "queued_s" in a]
        if queued:
            out["engine_queue_wait_s_mean"] = float(np.mean(queued))
        if "update" in by_name or "next_batch_wait" in by_name:
            learner_busy = min(1.0, total("update") / window_s)
            out["learner_busy_fraction"] = learner_busy
            out["learner_idle_fraction"] = 1.0 - learner_busy
        if "next_batch_wait" in by_name:
            out["learner_wait_fraction"] = min(1.0, total("next_batch_wait") / window_s)
        episodes = by_name.get("episode", ())
        out["trajectories_per_s"] = len(episodes) / window_s
        tokens = sum(int(a.get("tokens", 0)) for _, a in by_name.get("generate", ()) if a)
        out["generated_tokens_per_s"] = tokens / window_s
        episode_s = sum(seconds for seconds, _ in episodes)
        if episode_s > 0:
            # From the episodes that ended in the window (their span carries its totals),
            # so an episode's turns never count in one window and its length in another.
            generate_s = sum(float((a or {}).get("generate_s", 0.0)) for _, a in episodes)
            env_s = sum(float((a or {}).get("env_s", 0.0)) for _, a in episodes)
            out["episode_generate_fraction"] = min(1.0, generate_s / episode_s)
            out["episode_env_fraction"] = min(1.0, env_s / episode_s)
            out["episode_other_fraction"] = max(0.0, 1.0 - (generate_s + env_s) / episode_s)
            out["episode_wall_s_mean"] = episode_s / len(episodes)
        for tool, latencies in tool_latency.items():
            out[f"tool_calls/{tool}"] = float(len(latencies))
            for q, value in percentiles(latencies).items():
                out[f"tool_latency_s/{tool}/{q}"] = value
        for kind, count in tool_errors.items():
            out[f"tool_call_errors/{kind}"] = float(count)
        # Env steps as the env actors timed them (without the trip to the actor).
        env_steps = [seconds for seconds, _ in by_name.get("env_step", ())]
        for q, value in percentiles(env_steps).items():
            out[f"env_step_latency_s/{q}"] = value
        for kind, fractions in cpu.items():
            out[f"{kind}_cpu_fraction"] = float(np.mean(fractions))
        own = total("profile_drain") + sum(float((a or {}).get("cpu_s", 0.0))
                                            for _, a in by_name.get("profile_collect", ()))
        if own:
            out["profiling_cpu_s"] = own
        for name in ("weight_publish", "checkpoint", "object_store_get", "object_store_put",
                     "batch_pack"):
            if name in by_name:
                out[f"{name}_s"] = total(name)
        return {k: v for k, v in out.items() if math.isfinite(v)}

    def _cpu_fraction(self, key: tuple, chunk: dict[str, Any], kind: str,
                      cpu: dict[str, list[float]]) -> None:
        if "cpu_s" not in chunk or "now_s" not in chunk:
            return
        now = (float(chunk["cpu_s"]), float(chunk["now_s"]))
        before = self._cpu.get(key)
        self._cpu[key] = now
        if before is not None and now[1] > before[1]:
            cpu[kind or "process"].append(max(0.0, (now[0] - before[0]) / (now[1] - before[1])))
