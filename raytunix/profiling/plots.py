"""``profile.png``: a run on one page, drawn from the files of its run directory.

Four panels:

a. learning: ``reward_mean`` and ``tool_use_rate`` per RL step, with the held-out success
   before RL (at step 0) and after RL (at the last step) as markers;
b. throughput: generated tokens/s (left axis) and trajectories/s (right axis) per step;
c. busy fractions: engine busy, learner busy and orchestrator CPU per step;
d. tool latency: a histogram per tool of the ``tool_call`` spans in
   ``profile/spans.jsonl`` (log seconds when they span more than two decades).

Drawing uses ``matplotlib.figure.Figure`` with the Agg canvas directly, so pyplot's global
backend and figure list are left alone (callers may use pyplot themselves).
"""

from __future__ import annotations

import math
import numbers
import os
from typing import Any, Sequence

import numpy as np

from raytunix.profiling.collect import read_jsonl, rl_steps

PLOT_FILE = "profile.png"
METRICS_FILE = "metrics.jsonl"
SPANS_FILE = os.path.join("profile", "spans.jsonl")
_LOG_X_RATIO = 100.0  # latencies wider than this max/min ratio get a log axis


def write_plots(run_dir: str, out_path: str | None = None) -> str:
    """Draws ``run_dir/profile.png`` (or ``out_path``) from ``metrics.jsonl`` and
    ``profile/spans.jsonl``.

    Whatever exists is drawn; a missing file, key or panel's data gives a note in that
    panel instead (a run with no RL step still gets a PNG that says so). Lines that are
    not JSON objects (a last line cut off by a crash) are skipped. When a step was logged
    twice (a resumed run trains again the steps after its checkpoint), the later record
    is drawn.

    Returns:
      the PNG's path (written to a temporary file, then renamed into place).

    Raises:
      FileNotFoundError: ``run_dir`` is not a directory.
      OSError: the PNG cannot be written.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    if not os.path.isdir(run_dir):
        raise FileNotFoundError(
            f"no run directory at {run_dir!r}: pass the directory "
            f"`raytunix train` made (it holds {METRICS_FILE})"
        )
    records = list(read_jsonl(os.path.join(run_dir, METRICS_FILE)))
    steps = rl_steps(records)
    evals = {r.get("when"): r for r in records if r.get("phase") == "eval"}
    latencies = tool_latencies(os.path.join(run_dir, SPANS_FILE))

    fig = Figure(figsize=(13, 9), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    (learning, throughput), (busy, tools) = fig.subplots(2, 2)
    for ax in (learning, throughput, busy):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    _plot_learning(learning, steps, evals)
    _plot_throughput(throughput, steps)
    _plot_busy(busy, steps)
    recording_off = any(r.get("profiling_enabled") == 0 for r in steps)
    _plot_tool_latency(tools, latencies, recording_off)
    name = os.path.basename(os.path.normpath(os.path.abspath(run_dir)))
    fig.suptitle(f"{name}: {len(steps)} RL step{'s' if len(steps) != 1 else ''}")

    path = out_path or os.path.join(run_dir, PLOT_FILE)
    tmp = path + ".tmp"
    fig.savefig(tmp, format="png")
    os.replace(tmp, path)
    return path


def _number(value: Any) -> float | None:
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        value = float(value)
        if math.isfinite(value):
            return value
    return None


def _series(steps: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in steps:
        y = _number(r.get(key))
        if y is not None:
            xs.append(r["step"])
            ys.append(y)
    return xs, ys


def _note(ax, text: str) -> None:
    ax.text(
        0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", fontsize=12, color="0.4"
    )


def _plot_lines(ax, steps, keys_labels) -> bool:
    """One line per key that has numbers; True if any was drawn."""
    drawn = False
    for key, label in keys_labels:
        xs, ys = _series(steps, key)
        if xs:
            ax.plot(xs, ys, marker="." if len(xs) < 50 else None, label=label)
            drawn = True
    return drawn


def _plot_learning(ax, steps, evals) -> None:
    ax.set_title("reward and tool use per RL step")
    ax.set_xlabel("RL step")
    drawn = _plot_lines(
        ax, steps, [("reward_mean", "reward mean"), ("tool_use_rate", "tool use rate")]
    )
    last_step = steps[-1]["step"] if steps else 0
    for when, x, marker, label in (
        ("before_rl", 0, "o", "held-out success before RL"),
        ("after_rl", last_step, "*", "held-out success after RL"),
    ):
        y = _number(evals.get(when, {}).get("success_rate"))
        if y is not None:
            ax.plot([x], [y], marker=marker, markersize=12, linestyle="none", label=label)
            drawn = True
    if drawn:
        ax.legend(loc="best", fontsize=8)
    if not steps:
        _note(ax, "no RL steps recorded")


def _plot_throughput(ax, steps) -> None:
    ax.set_title("throughput")
    ax.set_xlabel("RL step")
    tok_x, tok_y = _series(steps, "generated_tokens_per_s")
    traj_x, traj_y = _series(steps, "trajectories_per_s")
    handles = []
    if tok_x:
        handles += ax.plot(tok_x, tok_y, color="C0", label="generated tokens/s")
        ax.set_ylabel("tokens/s")
    if traj_x:
        right = ax.twinx() if tok_x else ax
        handles += right.plot(traj_x, traj_y, color="C1", label="trajectories/s")
        right.set_ylabel("trajectories/s")
    if handles:
        ax.legend(handles=handles, loc="best", fontsize=8)
    else:
        _note(ax, "no throughput recorded" if steps else "no RL steps recorded")


def _plot_busy(ax, steps) -> None:
    ax.set_title("busy fractions")
    ax.set_xlabel("RL step")
    keys = [
        ("engine_busy_fraction", "engine busy"),
        ("learner_busy_fraction", "learner busy"),
        ("orchestrator_cpu_fraction", "orchestrator CPU"),
    ]
    if _plot_lines(ax, steps, keys):
        top = max([1.0] + [y for k, _ in keys for y in _series(steps, k)[1]])
        ax.set_ylim(0.0, 1.05 * top)
        ax.legend(loc="best", fontsize=8)
    else:
        _note(ax, "no busy fractions recorded" if steps else "no RL steps recorded")


EPISODE_PHASES = ("rl", "eval")  # drains holding the episodes' tool calls


def tool_latencies(
    path: str, phases: Sequence[str] | None = EPISODE_PHASES, skipped: list[int] | None = None
) -> dict[str, list[float]]:
    """Tool latencies from a ``profile/spans.jsonl`` file.

    Args:
      phases: only chunks drained in these phases (default: RL steps and evaluations,
        leaving out the warm start's demonstrations, which call tools in the driver);
        None for all.
      skipped: when given, gets the line number of each line that is not a JSON object
        (torn by a crash, damaged) and a 0 for each JSON object that is not a drained
        chunk (no ``spans`` list).

    Returns:
      ``{tool: [seconds, ...]}``: ``end_s - start_s`` of every ``tool_call`` span, by the
      tool its track names (``tool <name>``; another track is used as the name as is), in
      file order. Empty when the file is missing; lines and spans that do not parse are
      skipped.
    """
    by_tool: dict[str, list[float]] = {}
    for chunk in read_jsonl(path, skipped):
        spans = chunk.get("spans")
        if not isinstance(spans, list):
            if skipped is not None:
                skipped.append(0)  # a JSON object that is no drained chunk
            continue
        if phases is not None and chunk.get("phase") not in phases:
            continue
        for span in spans:
            if not (isinstance(span, list) and len(span) >= 4 and span[0] == "tool_call"):
                continue
            start, end = _number(span[2]), _number(span[3])
            if start is None or end is None or end < start:
                continue
            track = span[1] if isinstance(span[1], str) else ""
            tool = track[len("tool ") :] if track.startswith("tool ") else (track or "?")
            by_tool.setdefault(tool, []).append(end - start)
    return by_tool


def _plot_tool_latency(ax, by_tool: dict[str, list[float]], recording_off: bool = False) -> None:
    ax.set_title("tool call latency")
    if not by_tool:
        _note(
            ax,
            "span recording was off (RAYTUNIX_PROFILING=0)" if recording_off else "no tool calls",
        )
        return
    every = np.concatenate([np.asarray(v) for v in by_tool.values()])
    positive = every[every > 0]
    lo = float(positive.min()) if positive.size else 1e-6
    hi = float(every.max())
    log_x = hi > lo * _LOG_X_RATIO
    if log_x:
        bins = np.geomspace(lo, hi, 40)
        ax.set_xscale("log")
    else:
        bins = np.linspace(0.0, max(hi, lo) * 1.05, 40)
    for tool in sorted(by_tool):
        seconds = np.asarray(by_tool[tool])
        label = f"{tool} (n={seconds.size}, p50 {1000 * float(np.median(seconds)):.1f} ms)"
        if log_x:
            seconds = np.maximum(seconds, lo)  # a 0 s call (clock resolution) in the first bin
        ax.hist(seconds, bins=bins, histtype="step", linewidth=1.5, label=label)
    ax.set_xlabel("seconds" + (" (log)" if log_x else ""))
    ax.set_ylabel("calls")
    ax.legend(loc="best", fontsize=8)
