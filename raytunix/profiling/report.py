"""The bottleneck report: which resource bounded a run's throughput, the evidence, and
what to change.

Read from the run directory: the RL steps' metrics in ``metrics.jsonl`` (each step's
window, see ``raytunix.profiling.metrics``), the settings in ``config.yaml``, and the tool
calls in ``profile/spans.jsonl``. The verdict follows where the waiting is, in this order:

1. **learner**: the learner waits for rollouts less than ``LEARNER_WAIT_LOW`` of the time
   while updating at least ``LEARNER_BUSY_HIGH`` of it — batches are ready before it asks.
2. **orchestrator**: the orchestrator's process is CPU-saturated
   (``ORCHESTRATOR_CPU_HIGH`` of a core), or episodes spend most of their time
   (``EPISODE_OTHER_HIGH``) neither generating nor in the environment: waiting for the
   orchestrator's own event loop.
3. **environment/tools**: episodes wait longer on environment steps (tools, sandboxes)
   than on generation.
4. **engine**: episodes wait mostly on generation. With the engine busy at least
   ``ENGINE_BUSY_HIGH`` it is at capacity (add replicas, or rows if its batches are full);
   below that its batches run part-empty (raise the number of episodes in flight).

Fractions are means over the RL steps weighted by step length, leaving out the first
step when there are three or more (it includes compiling).

Before any of this comes the learning signal (``raytunix.profiling.learning``): a run whose
groups (almost) all got equal rewards learns nothing, so its report leads with "no learning
signal" and what to change for it, and holds the throughput advice back — more throughput
would only make more batches with nothing to learn, and advice such as fewer trajectories
per batch works against the signal.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

from raytunix.config import settings as settings_of_config
from raytunix.profiling.collect import is_rl_step, read_jsonl, rl_steps
from raytunix.profiling.learning import LearningVerdict, judge_learning, learning_lines
from raytunix.profiling.metrics import percentiles

LEARNER_WAIT_LOW = 0.3
LEARNER_BUSY_HIGH = 0.4
ORCHESTRATOR_CPU_HIGH = 0.85
EPISODE_OTHER_HIGH = 0.5
ENGINE_BUSY_HIGH = 0.75

RESOURCES = ("engine", "environment/tools", "learner", "orchestrator")


@dataclasses.dataclass
class Verdict:
    """What bounded the run.

    Attributes:
      resource: one of ``RESOURCES``, or ``"unknown"`` when the run has no RL step to
        judge.
      summary: one sentence: the resource, the deciding numbers, what to change.
      evidence: ``{metric: value}`` the decision read (fractions in [0, 1], seconds).
      advice: what to change, most useful first.
      learning: the learning verdict (``judge_learning``); when it is ``"none"`` the
        summary says the throughput advice is held back and ``advice`` is empty.
    """

    resource: str
    summary: str
    evidence: dict[str, float]
    advice: list[str]
    learning: LearningVerdict | None = None


def with_learning(verdict: Verdict, learning: LearningVerdict) -> Verdict:
    """``verdict`` with ``learning`` attached; without learning signal, its advice is held
    back (faster steps would only make more batches with nothing to learn)."""
    if learning.signal != "none":
        return dataclasses.replace(verdict, learning=learning)
    return dataclasses.replace(
        verdict,
        learning=learning,
        advice=[],
        summary=(
            f"{verdict.resource} bounded throughput, but its advice is held back while there "
            "is no learning signal: faster steps would only make more batches with nothing "
            "to learn (see \"Learning signal\"; the evidence is below)."
        ),
    )


def compile_steps(records: list[dict[str, Any]]) -> set[int]:
    """The RL steps whose window includes compiling: the run's first, and the first after
    each resume (a resumed process compiles its programs again)."""
    steps = [r["step"] for r in rl_steps(records)]
    if not steps:
        return set()
    out = {steps[0]}
    for record in records:
        if record.get("phase") == "resume" and isinstance(record.get("rl_step"), int):
            later = [step for step in steps if step > record["rl_step"]]
            if later:
                out.add(later[0])
    return out


# Metrics summarised by their largest value over the steps, not their mean.
MAX_OVER_STEPS = ("staleness_max", "spans_dropped")


def weighted_means(
    steps: list[dict[str, Any]], leave_out: set[int] | None = None
) -> dict[str, float]:
    """Each numeric metric's mean over ``steps``, weighted by the step's share of its
    profiling window, ``window_s / window_steps`` (the steps of one window share its
    metrics; ``window_steps`` is 1 where absent, the weight 1 where ``window_s`` is);
    ``MAX_OVER_STEPS`` metrics take their largest value instead.

    Args:
      leave_out: steps not to count (``compile_steps``), unless that would leave fewer
        than two; default: the first step when there are three or more.
    """
    if leave_out is None:
        leave_out = {steps[0].get("step")} if len(steps) >= 3 else set()
    kept = [step for step in steps if step.get("step") not in leave_out]
    if len(kept) >= 2:
        steps = kept
    sums: dict[str, float] = {}
    weights: dict[str, float] = {}
    peaks: dict[str, float] = {}
    for step in steps:
        w, shared = _number(step.get("window_s")), _number(step.get("window_steps"))
        w = w if w is not None and w > 0 else 1.0
        if shared is not None and shared >= 1:
            w /= shared
        for key, value in step.items():
            value = _number(value)
            if value is None:
                continue
            if key in MAX_OVER_STEPS:
                peaks[key] = max(peaks.get(key, value), value)
                continue
            sums[key] = sums.get(key, 0.0) + w * value
            weights[key] = weights.get(key, 0.0) + w
    return {**{key: sums[key] / weights[key] for key in sums if weights[key] > 0}, **peaks}


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def learner_advice(learner_cfg: dict[str, Any], colocated: bool) -> list[str]:
    """What makes a learner-bound run's updates cheaper, from its ``learner`` settings
    (``config.yaml``); the first item leads the report's summary."""
    advice = []
    if learner_cfg.get("sequence_packing") is False:
        advice.append(
            "pack trajectories into rows (learner.sequence_packing=true): the "
            "update then computes no padding"
        )
    iterations = learner_cfg.get("num_iterations", 1)
    if isinstance(iterations, int) and iterations > 1:
        advice.append(
            f"fewer optimizer steps per batch (learner.num_iterations {iterations}"
            " -> less): each one is a full pass over the batch"
        )
    micro = learner_cfg.get("micro_batch_size", 0)
    if isinstance(micro, int) and micro > 0:
        advice.append(
            f"larger micro-batches (learner.micro_batch_size {micro} -> more, as "
            "far as device memory allows): fewer, fuller passes"
        )
    advice.append("fewer trajectories per batch (rollout.groups_per_batch) or a smaller model")
    if colocated:
        advice.append(
            "on an accelerator, give the learner devices of its own "
            "(engine.placement=disaggregated): colocated, its updates and the "
            "engine's decoding share one"
        )
    return advice


def _target_engine_busy(rollout: dict[str, Any]) -> float:
    """The engine busy fraction the run's controller aimed for (``rollout.
    target_engine_busy``; a config.yaml without a usable one: the setting's default)."""
    target = _number(rollout.get("target_engine_busy"))
    if target is None or not 0 < target <= 1:
        target = settings_of_config()["rollout.target_engine_busy"].default
    return target


# The metrics a throughput verdict shows as its evidence, when the run recorded them.
_DECIDING = (
    "engine_busy_fraction",
    "engine_batch_occupancy",
    "learner_busy_fraction",
    "learner_wait_fraction",
    "episode_generate_fraction",
    "episode_env_fraction",
    "episode_other_fraction",
    "orchestrator_cpu_fraction",
    "env_cpu_fraction",
    "trajectories_per_s",
    "generated_tokens_per_s",
    "max_concurrent_episodes",
    "engine_queue_wait_s_mean",
)


def diagnose(means: dict[str, float], settings: dict[str, Any] | None = None) -> Verdict:
    """The verdict from a run's mean metrics (``weighted_means``).

    The verdict families are tried in the module docstring's order (learner, orchestrator,
    environment/tools, engine); the first that the evidence fits decides.

    Args:
      means: fractions and latencies as ``WindowMetrics`` names them; missing ones count
        as unknown, never as zero evidence.
      settings: the run's config as a nested dict (``config.yaml``), for the advice
        (``rollout.max_concurrent_episodes``, ``target_engine_busy``, ``env.num_env_actors``...).
    """
    settings = settings or {}
    return (
        no_evidence_verdict(means)
        or learner_verdict(means, settings)
        or orchestrator_verdict(means, settings)
        or environment_verdict(means, settings)
        or engine_verdict(means, settings)
    )


def _metric(means: dict[str, float], name: str) -> float:
    """``means[name]``, NaN (unknown) when the run did not record it."""
    return means.get(name, float("nan"))


def _evidence(means: dict[str, float]) -> dict[str, float]:
    """The ``_DECIDING`` metrics present in ``means``: what a verdict shows it read."""
    return {key: means[key] for key in _DECIDING if key in means}


def _capitalized(text: str) -> str:
    return text[0].upper() + text[1:]


def no_evidence_verdict(means: dict[str, float]) -> Verdict | None:
    """An ``"unknown"`` verdict when no RL step was profiled (neither episode nor learner
    fractions in ``means``), saying whether span recording was off; else None."""
    if "episode_generate_fraction" in means or "learner_busy_fraction" in means:
        return None
    if means.get("profiling_enabled", 1.0) == 0.0:
        reason = (
            "span recording was off in this run (RAYTUNIX_PROFILING=0), so there is no "
            "evidence to judge; run without it to get a verdict."
        )
    else:
        reason = (
            "no RL step has been profiled (the run stopped or is still before RL), so "
            "nothing is known to bound it."
        )
    return Verdict("unknown", reason, {}, [])


def more_episodes_advice(means: dict[str, float], rollout: dict[str, Any]) -> str:
    """How many episodes in flight would bring the engine to the run's busy target.

    Scales ``max_concurrent_episodes`` (from ``means``, else ``rollout``) by target busy /
    measured busy (at least one more), and says when staleness admission, which lets at
    most ``(max_staleness + 1) * groups_per_batch * group_size`` in flight, caps it.
    """
    busy = _metric(means, "engine_busy_fraction")
    episodes = means.get(
        "max_concurrent_episodes", float(rollout.get("max_concurrent_episodes", 0) or 0)
    )
    if not (episodes > 0 and busy > 0):
        return "raise rollout.max_concurrent_episodes"
    wanted = max(
        int(math.ceil(episodes * _target_engine_busy(rollout) / max(busy, 0.05))),
        int(episodes) + 1,
    )
    advice = f"raise rollout.max_concurrent_episodes from {episodes:.0f} to ~{wanted}" + (
        " (rollout.adaptive_max_episodes too: adaptive concurrency is on)"
        if rollout.get("adaptive_concurrency")
        else ""
    )
    # Admission never lets more groups in than the learner will consume within
    # max_staleness versions; past that, more budget changes nothing.
    try:
        cap = (
            (int(rollout["max_staleness"]) + 1)
            * int(rollout["groups_per_batch"])
            * int(rollout["group_size"])
        )
    except (KeyError, TypeError, ValueError):
        return advice
    if wanted > cap:
        advice += (
            f"; admission lets at most {cap} in flight ((rollout.max_staleness + 1)"
            " x groups_per_batch x group_size), so raise rollout.max_staleness "
            "(with off-policy correction) or rollout.groups_per_batch as well"
        )
    return advice


def _colocated(settings: dict[str, Any]) -> bool:
    return settings.get("engine", {}).get("placement", "colocated") == "colocated"


def learner_verdict(means: dict[str, float], settings: dict[str, Any]) -> Verdict | None:
    """``"learner"`` when the learner waited for rollouts under ``LEARNER_WAIT_LOW`` of
    the time while updating at least ``LEARNER_BUSY_HIGH`` of it; else None."""
    busy, wait = _metric(means, "learner_busy_fraction"), _metric(means, "learner_wait_fraction")
    if math.isnan(wait) or wait >= LEARNER_WAIT_LOW or math.isnan(busy):
        return None
    if busy < LEARNER_BUSY_HIGH:
        return None
    # Throughput is the learner's: advice that makes rollouts faster changes nothing.
    advice = learner_advice(settings.get("learner", {}), _colocated(settings))
    summary = (
        f"learner: it updated {busy:.0%} of the time and waited for rollouts only "
        f"{wait:.0%}: a batch was nearly always ready when it asked (engine busy "
        f"{_pct(_metric(means, 'engine_busy_fraction'))}). {_capitalized(advice[0])}."
    )
    return Verdict("learner", summary, _evidence(means), advice)


def orchestrator_verdict(means: dict[str, float], settings: dict[str, Any]) -> Verdict | None:
    """``"orchestrator"`` when its process used ``ORCHESTRATOR_CPU_HIGH`` of a core or
    more, or episodes spent ``EPISODE_OTHER_HIGH`` of their time or more neither generating
    nor in the environment; else None. ``settings`` is unused (the advice is general)."""
    cpu = _metric(means, "orchestrator_cpu_fraction")
    other = means.get("episode_other_fraction", 0.0)
    if not ((not math.isnan(cpu) and cpu >= ORCHESTRATOR_CPU_HIGH) or other >= EPISODE_OTHER_HIGH):
        return None
    advice = [
        "cut per-turn work in the agent/parser or the orchestrator (profile the "
        "orchestrator actor with py-spy)",
        "fewer episodes in flight per orchestrator, or shard episodes across orchestrators",
    ]
    summary = (
        f"orchestrator: its process used {_pct(cpu)} of a core and episodes "
        f"spent {other:.0%} of their time waiting on it (generation "
        f"{means.get('episode_generate_fraction', 0.0):.0%}, environment "
        f"{means.get('episode_env_fraction', 0.0):.0%}). {_capitalized(advice[0])}."
    )
    return Verdict("orchestrator", summary, _evidence(means), advice)


def environment_verdict(means: dict[str, float], settings: dict[str, Any]) -> Verdict | None:
    """``"environment/tools"`` when episodes waited longer on environment steps than on
    generation; the advice adds env actors when they are CPU-bound (0.7 of a core or more)
    and names the slowest tool by p90 latency. Else None."""
    generate = means.get("episode_generate_fraction", 0.0)
    env_wait = means.get("episode_env_fraction", 0.0)
    if not env_wait > generate:
        return None
    advice = [more_episodes_advice(means, settings.get("rollout", {}))]
    env_cpu = _metric(means, "env_cpu_fraction")
    actors = settings.get("env", {}).get("num_env_actors")
    if not math.isnan(env_cpu) and env_cpu >= 0.7 and actors:
        advice.insert(
            0,
            f"add env actors (env.num_env_actors {actors} -> {2 * int(actors)}): "
            f"they are CPU-bound ({env_cpu:.0%} of a core each)",
        )
    elif actors:
        advice.append(f"or add env actors (env.num_env_actors {actors} -> {2 * int(actors)})")
    slow = _slowest_tool(means)
    if slow:
        advice.append(f"speed up or time-limit the slowest tool: {slow}")
    summary = (
        f"environment/tools: engine busy {_pct(_metric(means, 'engine_busy_fraction'))}; "
        f"episodes wait on the environment and its tools {env_wait:.0%} of the time "
        f"(generation {generate:.0%}); {advice[0]}."
    )
    return Verdict("environment/tools", summary, _evidence(means), advice)


def engine_verdict(means: dict[str, float], settings: dict[str, Any]) -> Verdict:
    """``"engine"``, the verdict when no other family fits, in one of three readings:
    busy at least ``ENGINE_BUSY_HIGH`` with batches under half full (few rows per step:
    more episodes, less prefill), busy with fuller batches (at capacity: replicas, larger
    batches), or less busy (too few episodes in flight keep it fed)."""
    busy, occupancy = (
        _metric(means, "engine_busy_fraction"),
        _metric(means, "engine_batch_occupancy"),
    )
    generate = means.get("episode_generate_fraction", 0.0)
    env_wait = means.get("episode_env_fraction", 0.0)
    rollout = settings.get("rollout", {})
    if math.isnan(busy) or busy < ENGINE_BUSY_HIGH:
        advice = [more_episodes_advice(means, rollout)]
        summary = (
            f"engine: episodes wait on generation {generate:.0%} of their time (environment "
            f"{env_wait:.0%}), but the engine is busy only {_pct(busy)} with batches "
            f"{_pct(occupancy)} full: too few episodes in flight keep it fed; "
            f"{advice[0]}."
        )
        return Verdict("engine", summary, _evidence(means), advice)
    engine_cfg = settings.get("engine", {})
    replicas = (
        "add engine replicas (engine.placement=disaggregated with engine.num_replicas "
        "2 or more, one device each)"
        if _colocated(settings)
        else f"add engine replicas (engine.num_replicas {engine_cfg.get('num_replicas', 1)}"
        " -> more, one device each)"
    )
    if not math.isnan(occupancy) and occupancy < 0.5:
        advice = [
            more_episodes_advice(means, rollout)
            + ": a decode step costs about the same with more rows",
            "cut prefill (engine.sessions on, shared prompts for the prefix cache)",
            replicas + " once batches are full",
        ]
        summary = (
            f"engine: busy {busy:.0%} of the time, but its batches are only "
            f"{occupancy:.0%} full (prefill {_pct(_metric(means, 'engine_prefill_fraction'))}"
            f" of the wall time): it spends its time on few rows at a time; {advice[0]}."
        )
        return Verdict("engine", summary, _evidence(means), advice)
    advice = [replicas + " or a faster device"]
    if not math.isnan(occupancy) and occupancy >= 0.9:
        advice.insert(
            0,
            f"batches are full ({occupancy:.0%} of engine.max_batch_size="
            f"{engine_cfg.get('max_batch_size', '?')}): raise "
            "engine.max_batch_size if KV memory allows",
        )
    advice.append("shorter generations (rollout.max_new_tokens) cost less engine time")
    summary = (
        f"engine: busy {busy:.0%} of the time and episodes wait on generation "
        f"{generate:.0%} of theirs (environment {env_wait:.0%}); {advice[0]}."
    )
    return Verdict("engine", summary, _evidence(means), advice)


def _pct(x: float) -> str:
    return "n/a" if x is None or math.isnan(x) else f"{x:.0%}"


def _slowest_tool(means: dict[str, float]) -> str:
    p90 = {
        key.split("/")[1]: value
        for key, value in means.items()
        if key.startswith("tool_latency_s/") and key.endswith("/p90")
    }
    if not p90:
        return ""
    tool = max(p90, key=p90.get)
    return f"{tool} (p90 {p90[tool] * 1000:.0f} ms)"


def tool_latency_table(
    spans_path: str, skipped: list[int] | None = None
) -> dict[str, dict[str, float]]:
    """``{tool: {"calls", "p50", "p90", "p99"}}`` (seconds) over the RL steps and
    evaluations of a run, from the ``tool_call`` spans in ``spans.jsonl``; ``skipped``
    as in ``plots.tool_latencies``."""
    from raytunix.profiling.plots import tool_latencies

    return {
        tool: {"calls": float(len(values)), **percentiles(values)}
        for tool, values in tool_latencies(spans_path, skipped=skipped).items()
    }


def _line_numbers(numbers: list[int]) -> str:
    """``line 2, 3, 6`` (the first five, then ``, ...``)."""
    return f"line {', '.join(map(str, numbers[:5]))}{', ...' if len(numbers) > 5 else ''}"


def _spans_file_note(path: str, skipped: list[int]) -> str | None:
    """A line for the report when ``spans.jsonl`` is missing, empty or partly unreadable
    (what the tool latencies and the trace are made from), else None."""
    if not os.path.exists(path):
        return (
            "profile/spans.jsonl is missing: no tool latencies and no trace (the run "
            "stopped before its first drain, or the file was moved)"
        )
    if os.path.getsize(path) == 0:
        return (
            "profile/spans.jsonl is empty: no span was drained (the run stopped before "
            "its first RL step, or recording was off)"
        )
    if not skipped:
        return None
    lines = [n for n in skipped if n > 0]
    others = len(skipped) - len(lines)  # JSON objects that are no drained chunk
    note = f"profile/spans.jsonl lines that could not be read, skipped: {len(skipped)}"
    parts = []
    if lines:
        parts.append(_line_numbers(lines))
    if others:
        parts.append(f"{others} JSON object(s) that are no drained chunk")
    if parts:
        note += f" ({'; '.join(parts)})"
    return note + "; the spans they held are missing from the tool latencies and the trace"


def render_report(run_dir: str) -> tuple[str, Verdict]:
    """The text of ``RUN_DIR/report.txt`` and the verdict, from the run's files.

    Raises:
      FileNotFoundError: ``run_dir`` has no ``metrics.jsonl`` (not a run directory, or
        one that stopped before it logged anything).
    """
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(metrics_path):
        raise FileNotFoundError(
            f"{run_dir!r} has no metrics.jsonl; pass a run directory that `raytunix train` "
            "wrote (under runs/)."
        )
    skipped: list[int] = []
    records = list(read_jsonl(metrics_path, skipped))
    steps = rl_steps(records)
    settings = _read_settings(os.path.join(run_dir, "config.yaml"))
    compiling = compile_steps(records)
    means = weighted_means(steps, compiling)
    verdict = with_learning(
        diagnose(means, settings),
        judge_learning(
            steps, settings, warm_started=any(r.get("phase") == "warmup" for r in records)
        ),
    )
    no_step = sum(r.get("phase") == "rl" and not is_rl_step(r.get("step")) for r in records)
    if not steps and (skipped or no_step):  # not "before RL": the lines that would say are
        verdict = dataclasses.replace(
            verdict,
            summary=(  # unreadable
                f"no RL step could be read: {len(skipped) + no_step} line(s) of metrics.jsonl "
                "are not JSON or have no step number (damaged?), so nothing is known to bound "
                "the run."
            ),
        )
    spans_path = os.path.join(run_dir, "profile", "spans.jsonl")
    spans_skipped: list[int] = []
    tools = tool_latency_table(spans_path, spans_skipped)
    lines = _header_lines(run_dir, steps, compiling, settings)
    if skipped:
        lines.append(
            f"metrics.jsonl lines that could not be read, skipped: {len(skipped)} "
            f"({_line_numbers(skipped)})"
        )
    if no_step:
        lines.append(
            f"metrics.jsonl RL records whose step is not a whole number >= 1, skipped: {no_step}"
        )
    spans_note = _spans_file_note(spans_path, spans_skipped)
    if spans_note:
        lines.append(spans_note)
    lines += _verdict_lines(verdict, means, bool(steps))
    lines += _losses_section(steps, run_dir)
    lines += _tool_latency_lines(tools)
    return "\n".join(lines) + "\n", verdict


def _read_settings(config_path: str) -> dict[str, Any]:
    """The run's ``config.yaml`` as a nested dict; ``{}`` when it is missing, not YAML or
    not a mapping (the report then gives advice without the run's settings)."""
    import yaml

    if not os.path.exists(config_path):
        return {}
    with open(config_path) as f:
        try:
            settings = yaml.safe_load(f) or {}
        except yaml.YAMLError:
            return {}
    return settings if isinstance(settings, dict) else {}


def _header_lines(
    run_dir: str, steps: list[dict[str, Any]], compiling: set[int], settings: dict[str, Any]
) -> list[str]:
    """The report's first lines: the run directory, the RL steps logged (against the
    planned ``learner.rl_steps``) and the compiling steps left out of the means."""
    left_out = sorted(compiling) if len(steps) - len(compiling) >= 2 else []
    learner_cfg = settings.get("learner")
    planned = learner_cfg.get("rl_steps") if isinstance(learner_cfg, dict) else None
    last = steps[-1]["step"] if steps else 0
    return [
        f"raytunix bottleneck report: {os.path.abspath(run_dir)}",
        f"RL steps logged: {len(steps)}"
        + (
            f" (of {planned} planned: the run is still going or stopped early)"
            if isinstance(planned, int) and not isinstance(planned, bool) and last < planned
            else ""
        )
        + (
            f" (left out of the means, as they include compiling: step"
            f"{'s' if len(left_out) > 1 else ''} {', '.join(map(str, left_out))})"
            if left_out
            else ""
        ),
    ]


def _tool_latency_lines(tools: dict[str, dict[str, float]]) -> list[str]:
    """The report's table of ``tool_latency_table`` (seconds); no lines without tools."""
    if not tools:
        return []
    lines = [
        "",
        "Tool latency in RL steps and evaluations (seconds):",
        f"  {'tool':<20} {'calls':>7} {'p50':>9} {'p90':>9} {'p99':>9}",
    ]
    for tool, row in sorted(tools.items()):
        lines.append(
            f"  {tool:<20} {row['calls']:>7.0f} {row.get('p50', 0):>9.4f} "
            f"{row.get('p90', 0):>9.4f} {row.get('p99', 0):>9.4f}"
        )
    return lines


def _verdict_lines(verdict: Verdict, means: dict[str, float], any_steps: bool) -> list[str]:
    """The report's verdicts: the learning signal first when there is none, then what
    bounded throughput, its advice and evidence; else the learning signal after them."""
    learning = learning_lines(verdict.learning) if verdict.learning and any_steps else []
    none = verdict.learning is not None and verdict.learning.signal == "none"
    lines = [""] + (learning if none else [])
    lines += [f"Bounded by: {verdict.resource}", f"  {verdict.summary}", ""]
    if verdict.advice:
        lines.append("What to change:")
        lines += [f"  - {a}" for a in verdict.advice]
        lines.append("")
    rows = _evidence_rows(means)
    if rows:
        lines.append(
            "Evidence (means over RL steps, weighted by step time; maxima for "
            "staleness and dropped spans):"
        )
        lines += [f"  {key:<34} {value}" for key, value in rows]
    if learning and not none:
        lines += [""] + learning[:-1]
    return lines


def write_report(run_dir: str, out_dir: str | None = None) -> tuple[str, Verdict]:
    """Writes ``report.txt`` (``render_report``) into ``out_dir`` (default: the run
    directory); returns its path and the verdict.

    Raises:
      FileNotFoundError: as ``render_report``.
      OSError: the report cannot be written there.
    """
    text, verdict = render_report(run_dir)
    path = os.path.join(out_dir or run_dir, "report.txt")
    with open(path, "w") as f:
        f.write(text)
    return path, verdict


DROPPED_PREFIX = "generated_tokens_dropped_"


def dropped_tokens_and_env_errors(
    steps: list[dict[str, Any]],
) -> tuple[dict[str, int], dict[str, int]]:
    """Sums over RL step records: ``({kind: generated tokens kept from the loss}, {kind:
    env errors})``, from each step's ``generated_tokens_dropped_<kind>`` and
    ``env_errors`` (``raytunix.rollout.recorder.DROPPED_TOKEN_KINDS``, the learner's
    ``generated_tokens_cut``, ``raytunix.envs.contract``)."""
    dropped: dict[str, int] = {}
    errors: dict[str, int] = {}
    for record in steps:
        for key, value in record.items():
            if key.startswith(DROPPED_PREFIX) and isinstance(value, (int, float)):
                kind = key[len(DROPPED_PREFIX) :]
                dropped[kind] = dropped.get(kind, 0) + int(value)
        by_kind = record.get("env_errors")
        if isinstance(by_kind, dict):
            for kind, value in by_kind.items():
                if isinstance(value, (int, float)):
                    errors[kind] = errors.get(kind, 0) + int(value)
    return dropped, errors


def _losses_section(steps: list[dict[str, Any]], run_dir: str) -> list[str]:
    """Report lines: generated tokens that did not reach the loss, and environment errors,
    by kind (nothing the policy generated is dropped without a number here)."""
    dropped, errors = dropped_tokens_and_env_errors(steps)
    lines: list[str] = []
    if dropped:
        total = sum(dropped.values())
        lines += ["", f"Generated tokens kept from the loss, over the RL steps: {total}"]
        lines += [f"  {kind:<34} {n}" for kind, n in sorted(dropped.items())]
    if errors:
        where: dict[str, str] = {}
        for r in read_jsonl(os.path.join(run_dir, "env_errors.jsonl")):
            if isinstance(r, dict) and "kind" in r:
                where.setdefault(r["kind"], str(r.get("location", "")))
        lines += [
            "",
            "Environment errors by kind, over the RL steps (episodes ended "
            "env_error; the first of each kind with its traceback is in "
            "env_errors.jsonl):",
        ]
        lines += [
            f"  {kind:<44} {n:>6}" + (f"  at {where[kind]}" if kind in where else "")
            for kind, n in sorted(errors.items())
        ]
    return lines


_EVIDENCE = (
    ("engine_busy_fraction", "engine busy", "pct"),
    ("engine_prefill_fraction", "  of it prefill", "pct"),
    ("engine_batch_occupancy", "engine batch occupancy", "pct"),
    ("engine_queue_wait_s_mean", "request wait for a slot (s)", "num"),
    ("learner_busy_fraction", "learner busy (updates)", "pct"),
    ("learner_wait_fraction", "learner waiting for rollouts", "pct"),
    ("episode_generate_fraction", "episode time: generation", "pct"),
    ("episode_env_fraction", "episode time: environment/tools", "pct"),
    ("episode_other_fraction", "episode time: other", "pct"),
    ("orchestrator_cpu_fraction", "orchestrator CPU (cores)", "pct"),
    ("env_cpu_fraction", "env actor CPU (cores, mean)", "pct"),
    ("trajectories_per_s", "trajectories/s", "num"),
    ("generated_tokens_per_s", "generated tokens/s", "num"),
    ("max_concurrent_episodes", "episodes in flight (budget)", "num"),
    ("staleness_max", "staleness, largest (versions)", "num"),
    ("weight_publish_s", "weight publish per step (s)", "num"),
    ("spans_dropped", "spans dropped, most in one step", "num"),
)


def _evidence_rows(means: dict[str, float]) -> list[tuple[str, str]]:
    rows = []
    for key, label, fmt in _EVIDENCE:
        if key in means:
            value = means[key]
            rows.append((label, f"{value:.1%}" if fmt == "pct" else f"{value:.4g}"))
    return rows
