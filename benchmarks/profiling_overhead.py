"""What does always-on profiling cost? The rollout benchmark with profiling on and off.

The workload is ``rollout_overlap.py``'s async run: an ``OrchestratorActor`` with
``--concurrency`` episodes in flight against one ``EngineActor`` and env actors whose tool
sleeps (``simulated_tool``). With profiling **on**, every process records its spans (the
engine one per device step and per request, the orchestrator several per turn, the env
actors one per step and per tool call) and the driver does what ``raytunix train`` does
once per RL step, after every batch: drain every actor into ``profile/spans.jsonl`` and
compute the window's metrics. With profiling **off**, the recorders are switched off in
every process (``profile_set_enabled(False)``) and nothing is drained.

The two alternate in one invocation (off, on, off, on, ...; ``--pairs`` pairs) on the same
engine, env actors and compiled programs, so drift of the machine hits both alike.
``overhead_fraction`` is wall seconds per trajectory with profiling on over off, minus 1,
pooled over the pairs (each pair runs the same tasks, so the same tool latencies), with a
95% interval from the spread of the pairs (``overhead_fraction_ci95``): run-to-run noise
of a few percent on a 2-core machine is larger than the effect, so the interval says what
the measurement can tell. Two cross-checks that depend less on noise:
``cpu_overhead_fraction``, the same ratio of the CPU seconds all the run's processes
(driver, orchestrator, engine, env actors) spent per trajectory, and
``estimated_overhead_fraction``, profiling's own work over the cores' time: recording
(the measured cost of one span, a tight loop here, times the spans recorded per second)
plus draining and collecting (the ``profile_drain`` spans the processes record of
themselves and the driver's CPU seconds in its ``profile_collect`` spans). Ray's
serialisation of a drained chunk in the actor is not in it.

    python benchmarks/profiling_overhead.py
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import ray  # noqa: E402

from raytunix.profiling import Recorder  # noqa: E402
from raytunix.profiling.collect import Collector  # noqa: E402
from raytunix.rollout.actor import OrchestratorActor  # noqa: E402
from raytunix.rollout.env_pool import EnvPool  # noqa: E402

from rollout_overlap import (  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
    _ACTOR_ENV, AGENT, env_kwargs, machine, make_tasks, sampling, start_engine,
    wait_engine_idle)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=4, help="(off, on) pairs of runs")
    p.add_argument("--trajectories", type=int, default=1024, help="timed trajectories per run")
    p.add_argument("--warmup-trajectories", type=int, default=128,
                   help="untimed trajectories before each run's clock starts")
    p.add_argument("--concurrency", type=int, default=64, help="episodes in flight")
    p.add_argument("--batch", type=int, default=128,
                   help="trajectories per batch (the default run's 16 groups x 8): the driver "
                        "drains the actors once per batch, as `raytunix train` does per step")
    p.add_argument("--tool-latency-s", type=float, default=0.05, help="median tool latency (s)")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--max-batch-size", type=int, default=32, help="engine rows")
    p.add_argument("--max-seq-len", type=int, default=256)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--n-layers", type=int, default=2)
    p.add_argument("--env-actors", type=int, default=2)
    p.add_argument("--kv-cache-tokens", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    # simulated_tool's latency shape (rollout_overlap's env_kwargs reads these)
    p.add_argument("--latency-dist", default="lognormal", choices=("lognormal", "uniform"))
    p.add_argument("--latency-sigma", type=float, default=0.5)
    p.add_argument("--jitter", type=float, default=0.0)
    p.add_argument("--straggler-fraction", type=float, default=0.0)
    p.add_argument("--straggler-factor", type=float, default=20.0)
    return p.parse_args(argv)


def span_cost_s(n: int = 200_000) -> float:
    """Seconds to record one span with ``Recorder.add`` (the hot-path call), drain
    included."""
    recorder = Recorder("bench", "bench", capacity=n)
    args = {"rows": 8, "tokens": 8}
    start = time.perf_counter()
    for i in range(n):
        recorder.add("decode", 1.0, 2.0, "steps", args, None)
    recorder.drain()
    return (time.perf_counter() - start) / n


def measure(profiled: bool, tasks, tokenizer, engine, pool: EnvPool, args,
            run_dir: str) -> dict:
    """One run: ``--warmup-trajectories`` untimed, then ``--trajectories`` timed."""
    orchestrator = ray.remote(OrchestratorActor).options(
        num_cpus=0, max_concurrency=10_000, runtime_env=_ACTOR_ENV).remote(
        tasks=tasks, tokenizer=tokenizer, agent_name=AGENT, env_pool=pool, engine=engine,
        group_size=1, groups_per_batch=args.batch, max_concurrent_episodes=args.concurrency,
        max_staleness=10**9,  # no learner runs: admission must never wait for one
        max_turns=args.turns, max_context_tokens=args.max_seq_len, sampling=sampling(args),
        episode_timeout_s=600.0, batch_queue_size=4, seed=args.seed)
    actors = [("engine 0", engine), ("orchestrator", orchestrator),
              *[(f"env actor {i}", a) for i, a in enumerate(pool.actors)]]
    ray.get([handle.profile_set_enabled.remote(profiled) for _, handle in actors])
    collector = Collector(run_dir, lambda: actors) if profiled else None
    spans = collections.Counter()
    own = [0.0]  # seconds of draining (actors) and CPU seconds of collecting (driver)

    def consume(count: int, timed: bool) -> int:
        n = 0
        while n < count:
            _, info = ray.get(orchestrator.next_batch.remote())
            n += info["num_trajectories"]
            if collector is not None:  # what the driver of `raytunix train` does per step
                collector.window("rl", n)
                if timed:
                    for chunk in collector.last_chunks:
                        spans[chunk["process"]] += len(chunk["spans"])
                        own[0] += sum(s[3] - s[2] for s in chunk["spans"]
                                      if s[0] == "profile_drain")
                        own[0] += sum((s[4] or {}).get("cpu_s", 0.0) for s in chunk["spans"]
                                      if s[0] == "profile_collect")
        return n

    def cpu_seconds() -> float:
        """CPU seconds so far of every process of the run (a drain reports them, also
        with recording off), this driver included."""
        chunks = ray.get([handle.profile_drain.remote() for _, handle in actors])
        return sum(chunk["cpu_s"] for chunk in chunks) + time.process_time()

    consume(args.warmup_trajectories, timed=False)
    cpu0, start = cpu_seconds(), time.perf_counter()
    n = consume(args.trajectories, timed=True)
    wall, cpu = time.perf_counter() - start, cpu_seconds() - cpu0
    ray.get(orchestrator.stop.remote())
    ray.kill(orchestrator)
    wait_engine_idle(engine)
    return {"profiled": profiled, "wall_s": wall, "trajectories": n,
            "trajectories_per_s": n / wall, "cpu_s": cpu, "cpu_ms_per_trajectory": 1e3 * cpu / n,
            "spans_recorded": dict(spans), "drain_and_collect_s": own[0],
            "spans_per_s": sum(spans.values()) / wall}


def main(argv=None) -> dict:
    args = parse_args(argv)
    load_before = os.getloadavg()
    tokenizer, model_config, engine = start_engine(args)
    ray.get(engine.warmup.remote())
    pool = EnvPool("simulated_tool", env_kwargs(args, args.tool_latency_s),
                   num_actors=args.env_actors)
    pool.wait_ready()
    per_run = args.warmup_trajectories + 2 * args.trajectories
    runs = []
    with tempfile.TemporaryDirectory() as run_dir:
        measure(True, make_tasks(per_run, "w/"), tokenizer, engine, pool, args, run_dir)
        for pair in range(args.pairs):
            # The same tasks for both runs of a pair: the same tool latencies (seeded by
            # task id), so the pair differs in profiling alone.
            tasks = make_tasks(per_run, f"{pair}/")
            for profiled in (False, True):
                runs.append(measure(profiled, tasks, tokenizer, engine, pool, args, run_dir))
        spans_bytes = os.path.getsize(os.path.join(run_dir, "profile", "spans.jsonl"))
    pairs = list(zip(runs[0::2], runs[1::2]))
    ratios = [on["wall_s"] / on["trajectories"] / (off["wall_s"] / off["trajectories"]) - 1
              for off, on in pairs]
    on_runs = [r for r in runs if r["profiled"]]
    off_runs = [r for r in runs if not r["profiled"]]

    def per_trajectory(rs):
        return sum(r["wall_s"] for r in rs) / sum(r["trajectories"] for r in rs)

    # Pooled over pairs: wall seconds per trajectory, on over off; and a 95% interval
    # from the spread of the pairs (normal approximation).
    pooled = per_trajectory(on_runs) / per_trajectory(off_runs) - 1
    half_width = (1.96 * statistics.stdev(ratios) / len(ratios) ** 0.5
                  if len(ratios) > 1 else float("nan"))
    cpu_ratios = [on["cpu_ms_per_trajectory"] / off["cpu_ms_per_trajectory"] - 1
                  for off, on in pairs]
    cost = span_cost_s()
    spans_per_s = statistics.median(r["spans_per_s"] for r in on_runs)
    own_per_s = statistics.median(r["drain_and_collect_s"] / r["wall_s"] for r in on_runs)
    cores = os.cpu_count() or 1
    report = {
        "benchmark": "profiling_overhead",
        "overhead_fraction": pooled,
        "overhead_fraction_ci95": [pooled - half_width, pooled + half_width],
        "overhead_fraction_per_pair": ratios,
        "estimated_overhead_fraction": (cost * spans_per_s + own_per_s) / cores,
        "recording_cpu_fraction": cost * spans_per_s / cores,
        "drain_and_collect_cpu_fraction": own_per_s / cores,
        "cpu_overhead_fraction": statistics.median(cpu_ratios),
        "cpu_overhead_fraction_per_pair": cpu_ratios,
        "span_record_cost_us": cost * 1e6,
        "spans_per_s": spans_per_s,
        "spans_jsonl_bytes": spans_bytes,
        "trajectories_per_s_off": statistics.median(
            r["trajectories_per_s"] for r in runs if not r["profiled"]),
        "trajectories_per_s_on": statistics.median(
            r["trajectories_per_s"] for r in runs if r["profiled"]),
        "machine": {**machine(), "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "parameters": {**vars(args), "model": {
            "d_model": model_config.d_model, "n_layers": model_config.n_layers,
            "vocab_size": model_config.vocab_size, "max_seq_len": model_config.max_seq_len}},
        "runs": runs,
    }
    ray.shutdown()
    return report


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))
