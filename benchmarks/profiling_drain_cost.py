"""What does one profiling drain cost, in CPU, in every process it touches?

``profiling_overhead.py`` answers the question that matters (wall time with profiling on
against off) but a 2-core machine's noise leaves it a ±1% interval after 20 minutes. This
benchmark measures the one part of profiling that runs per RL step, the drain and
collection (``Collector.window``: one ``profile_drain`` call to every actor, the chunks
decoded, the window's metrics computed, ``spans.jsonl`` appended), in CPU milliseconds,
which a quiet machine resolves to a few percent in a minute.

Actors shaped like the rollout benchmark's processes (an engine, an orchestrator and
``--env-actors`` env actors) record, per round, the spans that ``profiling_overhead.py``'s
processes record per batch of ``--batch`` episodes of ``--turns`` turns, with the same
names, tracks, arguments and flow ids, through the same ``profiling.add`` hot path. Rounds
alternate: a **baseline** round only has the actors record; a **drain** round then runs
``Collector.window`` from this driver. The CPU time of every process of the run (this
driver, each actor, the raylet, the GCS) and of the whole machine, read from
``psutil``, is summed over each kind of round; a drain's cost is the difference of the two
sums per round. ``psutil`` counts every thread of a process, so Ray's own serialisation
and transport threads are in it.

Keys: ``cpu_ms_per_drain`` (the machine's, from ``psutil.cpu_times``: user + system +
nice), ``cpu_ms_per_drain_by_process``, ``wall_ms_per_drain`` (the driver's ``window``
call), and ``machine_fraction_at_interval``: the drain's CPU over the cores' time between
two drains, ``--interval-s`` apart (default: the batch interval the rollout benchmark
measured on 2 cores, 1.4 s; ``raytunix train``'s default run takes ~5 s per step).

    python benchmarks/profiling_drain_cost.py
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import psutil
import ray
from local_ray import add_ray_address_arg, init_ray

from raytunix.profiling import ProfiledActor, configure, recorder
from raytunix.profiling import add as record
from raytunix.profiling.collect import Collector


class ShapedActor(ProfiledActor):
    """Records the spans one rollout process records per batch (``record_batch``)."""

    def __init__(self, process: str, kind: str):
        configure(process, kind)
        self.kind = kind
        self.batch = 0

    def pid(self) -> int:
        return os.getpid()

    def record_batch(
        self, episodes: int, turns: int, tokens: int, env_actors: int, index: int
    ) -> int:
        """Records one batch's spans of this process's kind; returns how many."""
        before = recorder()._recorded
        t = time.perf_counter()
        first = self.batch * episodes
        self.batch += 1
        for e in range(first, first + episodes):
            flow = f"g{e}/{e}"
            if self.kind == "orchestrator":
                record("env_reset", t, t + 0.01, "episodes", None, flow)
                for turn in range(turns):
                    record(
                        "turn",
                        t,
                        t + 0.15,
                        "episodes",
                        {"turn": turn, "tokens": tokens, "generate_s": 0.1, "env_s": 0.05},
                        flow,
                    )
                record(
                    "episode",
                    t,
                    t + 0.5,
                    "episodes",
                    {
                        "task_id": f"t/{e}",
                        "status": "success",
                        "turns": turns,
                        "reward": 1.0,
                        "generate_s": 0.3,
                        "env_s": 0.15,
                    },
                    flow,
                )
            elif self.kind == "engine":
                for turn in range(turns):
                    record(
                        "request",
                        t,
                        t + 0.1,
                        f"slot {e % 32}",
                        {
                            "request_id": f"{flow}/{turn}",
                            "reason": "stop",
                            "prompt_tokens": 40 + 20 * turn,
                            "cached_tokens": 20 * turn,
                            "generated": tokens,
                            "queued_s": 0.001,
                        },
                        flow,
                    )
                # ~1.9 decode steps and ~1 prefill per episode (32 rows, 3 x 16 tokens)
                record("decode", t, t + 0.005, "steps", {"rows": 31, "tokens": 31})
                if e % 10:
                    record("decode", t, t + 0.005, "steps", {"rows": 24, "tokens": 24})
                record("prefill", t, t + 0.004, "steps", {"rows": 3, "tokens": 120})
            elif e % env_actors == index:  # an env actor: its share of the episodes
                record("env_reset", t, t + 0.001, "env", None, flow)
                for _ in range(turns):
                    record("env_step", t, t + 0.05, "env", None, flow)
        return recorder()._recorded - before


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument(
        "--rounds", type=int, default=200, help="rounds of each kind (baseline, drain), alternated"
    )
    p.add_argument("--batch", type=int, default=128, help="episodes per batch (per round)")
    p.add_argument("--turns", type=int, default=3, help="turns per episode")
    p.add_argument("--tokens", type=int, default=16, help="tokens generated per turn")
    p.add_argument("--env-actors", type=int, default=2, help="env actors")
    p.add_argument(
        "--interval-s",
        type=float,
        default=1.4,
        help="seconds between two drains, for machine_fraction_at_interval",
    )
    add_ray_address_arg(p)
    args = p.parse_args(argv)
    for name in ("rounds", "batch", "turns", "tokens", "env_actors"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 < args.interval_s < float("inf"):
        p.error(f"--interval-s must be a finite number of seconds > 0, got {args.interval_s}")
    if args.rounds < 50:
        print(
            f"profiling_drain_cost: {args.rounds} rounds of each kind resolve ~1 ms at best; "
            "a process's CPU clock ticks in 10 ms, so use 200 or more for the numbers",
            file=sys.stderr,
        )
    return args


def ray_processes() -> dict[str, psutil.Process]:
    """This session's raylet and GCS server: the local cluster ``ray.init`` started, so
    children of this process (another cluster's on the host are not; with
    ``--ray-address`` there are none, and neither is counted)."""
    found = {}
    for proc in psutil.Process().children(recursive=True):
        try:
            name = proc.name()
        except psutil.Error:
            continue
        if name.startswith("raylet"):
            found["raylet"] = proc
        elif name.startswith("gcs_server"):
            found["gcs"] = proc
    return found


def cpu_seconds(processes: dict[str, psutil.Process]) -> dict[str, float]:
    out = {}
    for name, proc in processes.items():
        try:
            times = proc.cpu_times()
            out[name] = times.user + times.system
        except psutil.Error:
            out[name] = float("nan")
    machine = psutil.cpu_times()
    out["machine"] = machine.user + machine.system + machine.nice
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    init_ray(args.ray_address)
    shaped = ray.remote(ShapedActor).options(num_cpus=0)
    actors = [
        ("engine 0", shaped.remote("engine 0", "engine")),
        ("orchestrator", shaped.remote("orchestrator", "orchestrator")),
    ]
    actors += [
        (f"env actor {i}", shaped.remote(f"env actor {i}", "env")) for i in range(args.env_actors)
    ]
    processes = {"driver": psutil.Process()}
    processes.update(
        (name, psutil.Process(pid))
        for (name, _), pid in zip(actors, ray.get([handle.pid.remote() for _, handle in actors]))
    )
    processes.update(ray_processes())

    def record_batch() -> int:
        return sum(
            ray.get(
                [
                    handle.record_batch.remote(
                        args.batch, args.turns, args.tokens, args.env_actors, i - 2
                    )
                    for i, (_, handle) in enumerate(actors)
                ]
            )
        )

    totals = {
        kind: dict.fromkeys(processes, 0.0) | {"machine": 0.0} for kind in ("baseline", "drain")
    }
    spans, window_s, step = 0, 0.0, 0
    with tempfile.TemporaryDirectory() as run_dir:
        collector = Collector(run_dir, lambda: actors, max_batch_size=32)
        record_batch()
        collector.window("rl", step)  # warm: first calls, imports
        # baseline, drain, drain, baseline, ...: a drift of the machine hits both alike
        for r in range(2 * args.rounds):
            kind = "drain" if (r % 4) in (1, 2) else "baseline"
            before = cpu_seconds(processes)
            n = record_batch()
            if kind == "drain":
                spans += n
                step += 1
                start = time.perf_counter()
                collector.window("rl", step)
                window_s += time.perf_counter() - start
            else:
                collector.start_window()
            after = cpu_seconds(processes)
            for name in after:
                totals[kind][name] += after[name] - before[name]
            if kind == "baseline":
                recorder().drain()
                ray.get([handle.profile_drain.remote() for _, handle in actors])  # untimed
        spans_bytes = os.path.getsize(os.path.join(run_dir, "profile", "spans.jsonl"))
    ray.shutdown()
    by_process = {
        name: 1e3 * (totals["drain"][name] - totals["baseline"][name]) / args.rounds
        for name in processes
    }
    machine_ms = 1e3 * (totals["drain"]["machine"] - totals["baseline"]["machine"]) / args.rounds
    cores = os.cpu_count() or 1
    report = {
        "benchmark": "profiling_drain_cost",
        "cpu_ms_per_drain": machine_ms,
        "cpu_ms_per_drain_by_process": by_process,
        "cpu_ms_per_drain_processes_sum": sum(by_process.values()),
        "wall_ms_per_drain": 1e3 * window_s / args.rounds,
        "spans_per_drain": spans / args.rounds,
        "cpu_us_per_span": 1e3 * machine_ms / (spans / args.rounds),
        "spans_jsonl_bytes_per_drain": spans_bytes / (args.rounds + 1),
        "machine_fraction_at_interval": machine_ms / (1e3 * args.interval_s * cores),
        "machine": {"cpu_count": cores, "python": sys.version.split()[0], "ray": ray.__version__},
        "parameters": vars(args),
    }
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
