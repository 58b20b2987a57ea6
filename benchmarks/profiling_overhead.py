"""What does always-on profiling cost? The rollout benchmark with profiling on and off.

The workload is ``rollout_overlap.py``'s async run: an ``OrchestratorActor`` with
``--concurrency`` episodes in flight against one ``EngineActor`` and env actors whose tool
sleeps (``simulated_tool``). With profiling **on**, every process records its spans (the
engine one per device step and per request, the orchestrator several per turn, the env
actors one per step and per tool call) and the driver does what ``raytunix train`` does
at the end of an RL step: at the end of the first batch that closes ``--window-s``
seconds of profiled rollout since the last drain (``run.profile_window_s``, 3 s by
default; every batch with 0), drain every actor into ``profile/spans.jsonl`` and compute
the window's metrics. With profiling **off**, the recorders are switched off in every
process (``profile_set_enabled(False)``) and nothing is drained; its time does not count
towards a window.

On and off alternate as blocks of batches in one rollout stream: one orchestrator, engine
and set of env actors run from start to end, and only the recording switch flips between
blocks. Each block lets ``--settle-batches`` batches pass untimed (batches finished before
the switch can still be queued) and then times ``--block-batches`` batches. Blocks come in
pairs, ordered off-on, on-off, off-on, ... so that a drift of the machine over the run hits
both alike. Short blocks in many pairs beat a few long runs here: on a 2-core machine a
hiccup (another process, a GC pause, the scheduler) slows one block by several percent,
and a robust estimate over many pairs shrugs it off.

Work is counted in generated tokens (the engine's ``tokens_generated`` over the block; a
block whose batches were all made before it began, so that the counter did not move, counts
its batches' tokens and says ``tokens_counted_from: "batches"``):
every trajectory is the same number of turns of the same number of tokens, so seconds per
token is seconds per trajectory without the quantisation of a short block (a block of 256
trajectories ends with ~64 episodes half done, which moves a per-trajectory rate by
several percent either way; the per-trajectory numbers are reported too).
``overhead_fraction`` is the **median over the pairs** of (wall seconds per generated token
with profiling on) / (the same with it off) − 1, with a distribution-free 95% interval for
the median from the pairs' order statistics (``overhead_fraction_ci95``; the sign-test
interval, e.g. Conover, *Practical Nonparametric Statistics*, 3rd ed., section 3.2). The
mean over the pairs (with a normal 95% interval) and the pooled ratio (all "on" wall time
per token over all "off") are reported beside it. ``--null-test`` runs the same schedule
with profiling off in both blocks of every pair: its ``overhead_fraction`` and interval
show what the machine's noise alone gives. Two cross-checks:
``cpu_overhead_fraction``, the same median ratio of the CPU seconds all the run's
processes (driver, orchestrator, engine, env actors) spent per token, and
``estimated_overhead_fraction``, profiling's own work over the cores' time: recording
(the measured cost of one span, a tight loop here, times the spans recorded per second)
plus draining and collecting (the ``profile_drain`` spans the processes record of
themselves, the chunk's serialisation included, and the driver's CPU seconds in its
``profile_collect`` spans; ``profiling_drain_cost.py`` measures a drain's CPU in every
process, Ray's own threads included). ``gc_fraction_by_process_off`` and ``_on``: the
share of each process's wall time spent in Python's garbage collector (``gc.callbacks``),
which is where a process's cost of holding spans would show (``raytunix/cluster/heap.py``).

    python benchmarks/profiling_overhead.py
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import ray  # noqa: E402

from raytunix.config import RunConfig  # noqa: E402
from raytunix.envs.simulated_tool import SimulatedToolEnv  # noqa: E402
from raytunix.profiling import Recorder, spans  # noqa: E402
from raytunix.profiling.collect import Collector, spans_path  # noqa: E402
from raytunix.rollout.env_pool import EnvPool  # noqa: E402

from local_ray import add_ray_address_arg  # noqa: E402
from rollout_overlap import (  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
    add_latency_shape_args,
    env_kwargs,
    machine,
    make_tasks,
    start_engine,
    start_orchestrator,
    wait_engine_idle,
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] + " Prints one JSON object on stdout; the "
        "defaults take about 11 minutes on 2 cores (--pairs 200: about 21).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--pairs",
        type=int,
        default=100,
        help="(off, on) pairs of blocks; the interval is a 95%% one from 6 pairs on",
    )
    p.add_argument(
        "--null-test",
        action="store_true",
        help="keep profiling off in the 'on' blocks too: the noise floor",
    )
    p.add_argument(
        "--drain",
        choices=("per-batch", "between-blocks", "rpc-only"),
        default="per-batch",
        help="what the driver does in an 'on' block: drain and collect at the end of "
        "a batch once --window-s has passed (what `raytunix train` does at the "
        "end of a step); only after the block's clock stops (the block times "
        "recording alone); or drain every actor after every batch but neither "
        "write spans.jsonl nor compute metrics",
    )
    p.add_argument(
        "--window-s",
        type=float,
        default=RunConfig().profile_window_s,
        help="profiled seconds between two drains (run.profile_window_s); 0: after every batch",
    )
    p.add_argument("--block-batches", type=int, default=2, help="timed batches per block")
    p.add_argument(
        "--settle-batches",
        type=int,
        default=0,
        help="untimed batches at the start of each block, after the switch",
    )
    p.add_argument(
        "--warmup-batches",
        type=int,
        default=2,
        help="untimed batches (profiling on) before the first block",
    )
    p.add_argument("--concurrency", type=int, default=64, help="episodes in flight")
    p.add_argument(
        "--batch",
        type=int,
        default=128,
        help="trajectories per batch (the default run's 16 groups x 8): the driver "
        "drains the actors once per batch, as `raytunix train` does per step",
    )
    p.add_argument(
        "--tasks",
        type=int,
        default=4096,
        help="distinct tasks (the orchestrator cycles through them)",
    )
    p.add_argument("--tool-latency-s", type=float, default=0.05, help="median tool latency (s)")
    p.add_argument("--turns", type=int, default=3, help="turns (tool calls) per episode")
    p.add_argument("--max-new-tokens", type=int, default=16, help="tokens generated per turn")
    p.add_argument("--max-batch-size", type=int, default=32, help="engine rows")
    p.add_argument("--max-seq-len", type=int, default=256, help="engine context (tokens)")
    p.add_argument("--d-model", type=int, default=64, help="model width")
    p.add_argument("--n-layers", type=int, default=2, help="model depth")
    p.add_argument("--env-actors", type=int, default=2, help="env actors (EnvPool)")
    p.add_argument(
        "--kv-cache-tokens",
        type=int,
        default=None,
        help="engine KV cache size in tokens (default: the engine's)",
    )
    p.add_argument("--seed", type=int, default=0, help="tool latencies and sampling")
    add_latency_shape_args(p, dist="lognormal", sigma=0.5, jitter=0.0, straggler_fraction=0.0)
    add_ray_address_arg(p)
    args = p.parse_args(argv)
    for name in (
        "pairs",
        "block_batches",
        "batch",
        "tasks",
        "concurrency",
        "turns",
        "max_new_tokens",
        "env_actors",
        "max_batch_size",
        "max_seq_len",
        "d_model",
        "n_layers",
    ):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.kv_cache_tokens is not None and args.kv_cache_tokens < 1:
        p.error(f"--kv-cache-tokens must be >= 1, got {args.kv_cache_tokens}")
    if not args.window_s >= 0:
        p.error(f"--window-s must be >= 0 seconds, got {args.window_s}")
    for name in ("settle_batches", "warmup_batches"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.jitter and args.latency_dist != "uniform":
        p.error(
            f"--jitter {args.jitter} shapes --latency-dist uniform only; "
            "add --latency-dist uniform or drop --jitter"
        )
    try:  # the env's own checks, before Ray starts (names are its constructor's)
        SimulatedToolEnv(**env_kwargs(args, args.tool_latency_s))
    except ValueError as e:
        p.error(
            f"the simulated tool refuses the latency flags (--tool-latency-s, --latency-*, "
            f"--jitter, --straggler-*): {e}"
        )
    return args


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


def median_ci95(values: list[float]) -> tuple[float, float, float]:
    """A distribution-free interval for the median of ``values``: the k-th smallest and
    k-th largest value, k the largest with P(Binomial(n, 1/2) < k) <= 0.025 (the
    sign-test interval), and its coverage, 1 - 2 P(Binomial(n, 1/2) < k): at least 0.95.
    With fewer than 6 values no such k exists: the interval is (min, max) and its coverage
    is below 0.95 (0.5 for 2 values), as the third number says."""
    xs, n = sorted(values), len(values)
    k, below = 0, 0.0  # below: P(Binomial(n, 1/2) < k + 1)
    while True:
        below += math.comb(n, k) / 2**n
        if below > 0.025:
            break
        k += 1
    k = max(k, 1)
    tail = sum(math.comb(n, i) for i in range(k)) / 2**n
    return xs[k - 1], xs[n - k], 1 - 2 * tail


class Stream:
    """One rollout stream: an orchestrator on the shared engine and env actors, its
    batches consumed by this driver, with profiling switched on and off between blocks."""

    def __init__(self, tasks, tokenizer, engine, pool: EnvPool, args, run_dir: str):
        self.orchestrator = start_orchestrator(tasks, tokenizer, engine, pool, args, args.batch)
        self.actors = [
            ("engine 0", engine),
            ("orchestrator", self.orchestrator),
            *[(f"env actor {i}", a) for i, a in enumerate(pool.actors)],
        ]
        self.engine = engine
        self.collector = Collector(run_dir, lambda: self.actors)
        self.profiled = True
        self.batches = 0
        self.window_s = args.window_s
        self.profiled_s = 0.0  # profiled rollout seconds since the last drain
        self.gc_seconds()  # the first reading starts each process's count

    def set_profiled(self, profiled: bool) -> None:
        """Flips recording in every process of the run, this driver included."""
        ray.get([handle.profile_set_enabled.remote(profiled) for _, handle in self.actors])
        spans.recorder().enabled = profiled
        self.profiled = profiled

    def gc_seconds(self) -> dict[str, float]:
        """Seconds every process of the run, this driver included, has spent in Python's
        garbage collector since its first reading (``ProfiledActor.profile_gc``)."""
        readings = ray.get([h.profile_gc.remote() for _, h in self.actors])
        readings.append(spans.gc_stats())
        return {
            name: sum(v for k, v in reading.items() if k.endswith("_s"))
            for name, reading in zip([n for n, _ in self.actors] + ["driver"], readings)
        }

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds so far of every process of the run, this driver included, by
        process."""
        cpu = ray.get([h.profile_cpu_s.remote() for _, h in self.actors])
        return {
            **{name: s for (name, _), s in zip(self.actors, cpu)},
            "driver": time.process_time(),
        }

    def consume(self, batches: int, block: dict | None = None, drain: str = "per-batch") -> int:
        """Takes ``batches`` batches; with profiling on, does after each what ``drain``
        (``--drain``) says: drain and collect once ``--window-s`` profiled seconds have
        passed (``per-batch``, what the driver of ``raytunix train`` does at the end of a
        step), only drain (``rpc-only``) or nothing (``between-blocks``). Counts the spans
        and profiling's own cost into ``block`` when given."""
        n = 0
        last = time.perf_counter()
        for _ in range(batches):
            _, info = ray.get(self.orchestrator.next_batch.remote())
            if self.profiled:
                now = time.perf_counter()
                self.profiled_s += now - last
                last = now
            n += info["num_trajectories"]
            if block is not None:
                block["batch_tokens"] += info["generated_tokens_mean"] * info["num_trajectories"]
            self.batches += 1
            if self.profiled and drain == "rpc-only":
                chunks = [
                    spans.decode_chunk(encoded)
                    for encoded in ray.get([h.profile_drain.remote() for _, h in self.actors])
                ]
                spans.recorder().drain()
                if block is not None:
                    for (name, _), chunk in zip(self.actors, chunks):
                        block["spans_recorded"][name] = block["spans_recorded"].get(name, 0) + len(
                            chunk["spans"]
                        )
            elif self.profiled and drain == "per-batch" and self.profiled_s >= self.window_s:
                self.collect(block)
        return n

    def collect(self, block: dict | None) -> None:
        """One drain and collection (``Collector.window``), counted into ``block``."""
        metrics = self.collector.window("rl", self.batches)
        self.profiled_s = 0.0
        if block is not None:
            for process, count in self.collector.last_span_counts.items():
                block["spans_recorded"][process] = block["spans_recorded"].get(process, 0) + count
            block["drain_and_collect_s"] += metrics.get("profiling_cpu_s", 0.0)

    def block(self, profiled: bool, args) -> dict:
        """Switches recording, lets ``--settle-batches`` pass, times ``--block-batches``.
        With ``--null-test`` recording stays off and ``profiled`` is only the block's
        label."""
        self.set_profiled(profiled and not args.null_test)
        self.consume(args.settle_batches)
        block = {
            "profiled": profiled,
            "recording": self.profiled,
            "spans_recorded": {},
            "drain_and_collect_s": 0.0,
            "batch_tokens": 0.0,
        }
        cpu0, gc0 = self.cpu_seconds(), self.gc_seconds()
        engine0 = ray.get(self.engine.engine_stats.remote())
        start = time.perf_counter()
        n = self.consume(args.block_batches, block, drain=args.drain)
        wall = time.perf_counter() - start
        engine1 = ray.get(self.engine.engine_stats.remote())
        tokens = engine1["tokens_generated"] - engine0["tokens_generated"]
        batch_tokens = block.pop("batch_tokens")
        counted_from = "engine"
        if tokens <= 0 < batch_tokens:
            # A block so short that its batches were all made before it began (the
            # orchestrator runs ahead of its consumer; on a loaded machine it may be a whole
            # buffer ahead): the engine's counter did not move, so count the batches' tokens.
            tokens, counted_from = batch_tokens, "batches"
        if tokens <= 0:
            raise SystemExit(
                f"profiling_overhead: a block of {n} trajectories generated no tokens, so no "
                f"cost per token can be measured: --max-seq-len {args.max_seq_len} leaves no "
                "room after the prompts (the default is 256), or --max-new-tokens is too "
                "small; raise them"
            )
        steps = engine1["decode_steps"] - engine0["decode_steps"]
        rows = (
            engine1["mean_active_slots"] * engine1["decode_steps"]
            - engine0["mean_active_slots"] * engine0["decode_steps"]
        )
        cpu1, gc1 = self.cpu_seconds(), self.gc_seconds()
        by_process = {name: cpu1[name] - cpu0[name] for name in cpu1}
        cpu = sum(by_process.values())
        if self.profiled and args.drain == "between-blocks":
            self.collect(block)  # after the clock: the block timed recording alone
        block.update(
            cpu_ms_per_token_by_process={name: 1e3 * s / tokens for name, s in by_process.items()},
            wall_s=wall,
            trajectories=n,
            trajectories_per_s=n / wall,
            tokens_generated=tokens,
            tokens_counted_from=counted_from,
            tokens_per_s=tokens / wall,
            engine_decode_steps=steps,
            engine_mean_active_slots=rows / steps if steps else 0.0,
            engine_busy_fraction=(engine1["busy_s"] - engine0["busy_s"]) / wall,
            cpu_s=cpu,
            cpu_ms_per_trajectory=1e3 * cpu / n,
            cpu_ms_per_token=1e3 * cpu / tokens,
            gc_fraction_by_process={name: (gc1[name] - gc0[name]) / wall for name in gc1},
            spans_per_s=sum(block["spans_recorded"].values()) / wall,
        )
        return block

    def close(self) -> None:
        ray.get(self.orchestrator.stop.remote())
        ray.kill(self.orchestrator)


def gc_fractions(blocks: list[dict]) -> dict[str, float]:
    """Each process's time in the garbage collector over the blocks' wall time (pooled:
    a full collection is a rare, long event)."""
    wall = sum(b["wall_s"] for b in blocks)
    return {
        name: sum(b["gc_fraction_by_process"][name] * b["wall_s"] for b in blocks) / wall
        for name in blocks[0]["gc_fraction_by_process"]
    }


def summarize(blocks: list[dict], cores: int) -> dict:
    """The estimates (module docstring) from consecutive (off, on) or (on, off) blocks."""
    pairs = []
    for first, second in zip(blocks[0::2], blocks[1::2]):
        off, on = (first, second) if not first["profiled"] else (second, first)
        assert not off["profiled"] and on["profiled"], (first, second)
        pairs.append((off, on))
    on_blocks = [on for _, on in pairs]
    off_blocks = [off for off, _ in pairs]

    def ratios(cost):  # per pair: cost with profiling on over off, minus 1
        return [cost(on) / cost(off) - 1 for off, on in pairs]

    def pooled(num, den):
        return (
            sum(b[num] for b in on_blocks)
            / sum(b[den] for b in on_blocks)
            / (sum(b[num] for b in off_blocks) / sum(b[den] for b in off_blocks))
            - 1
        )

    per_token = ratios(lambda b: b["wall_s"] / b["tokens_generated"])
    per_trajectory = ratios(lambda b: b["wall_s"] / b["trajectories"])
    cpu_per_token = ratios(lambda b: b["cpu_ms_per_token"])
    low, high, coverage = median_ci95(per_token)
    mean = statistics.fmean(per_token)
    half_width = (
        1.96 * statistics.stdev(per_token) / len(per_token) ** 0.5
        if len(per_token) > 1
        else float("nan")
    )
    cost = span_cost_s()
    # pooled over the "on" blocks: a window's spans are drained in whichever block closes it
    on_wall = sum(b["wall_s"] for b in on_blocks)
    spans_per_s = sum(b["spans_per_s"] * b["wall_s"] for b in on_blocks) / on_wall
    own_per_s = sum(b["drain_and_collect_s"] for b in on_blocks) / on_wall
    per_process = {
        name: statistics.median(
            on["cpu_ms_per_token_by_process"][name] / off["cpu_ms_per_token_by_process"][name] - 1
            for off, on in pairs
        )
        for name in on_blocks[0]["cpu_ms_per_token_by_process"]
    }
    return {
        # The acceptance keys: all "on" time over all "off" time, and the upper end of
        # the mean's normal 95% interval.
        "overhead_pooled": pooled("wall_s", "tokens_generated"),
        "overhead_mean_upper95": mean + half_width,
        "overhead_fraction": statistics.median(per_token),
        "overhead_fraction_ci95": [low, high],
        "overhead_fraction_ci_coverage": coverage,
        "overhead_fraction_mean": mean,
        "overhead_fraction_mean_ci95": [mean - half_width, mean + half_width],
        "overhead_fraction_pooled": pooled("wall_s", "tokens_generated"),
        "overhead_fraction_per_pair": per_token,
        "overhead_fraction_per_trajectory": statistics.median(per_trajectory),
        "overhead_fraction_per_trajectory_ci95": list(median_ci95(per_trajectory)[:2]),
        "overhead_fraction_per_trajectory_pooled": pooled("wall_s", "trajectories"),
        "cpu_overhead_fraction": statistics.median(cpu_per_token),
        "cpu_overhead_fraction_ci95": list(median_ci95(cpu_per_token)[:2]),
        "cpu_overhead_fraction_per_pair": cpu_per_token,
        "cpu_overhead_fraction_by_process": per_process,
        "estimated_overhead_fraction": (cost * spans_per_s + own_per_s) / cores,
        "recording_cpu_fraction": cost * spans_per_s / cores,
        "drain_and_collect_cpu_fraction": own_per_s / cores,
        "span_record_cost_us": cost * 1e6,
        "spans_per_s": spans_per_s,
        "gc_fraction_by_process_off": gc_fractions(off_blocks),
        "gc_fraction_by_process_on": gc_fractions(on_blocks),
        "tokens_per_s_off": statistics.median(b["tokens_per_s"] for b in off_blocks),
        "tokens_per_s_on": statistics.median(b["tokens_per_s"] for b in on_blocks),
        "trajectories_per_s_off": statistics.median(b["trajectories_per_s"] for b in off_blocks),
        "trajectories_per_s_on": statistics.median(b["trajectories_per_s"] for b in on_blocks),
    }


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.pairs < 6:
        print(
            f"profiling_overhead: with {args.pairs} pairs the median's interval covers less "
            "than 95% (overhead_fraction_ci_coverage); use 6 or more",
            file=sys.stderr,
        )
    load_before = os.getloadavg()
    tokenizer, model_config, engine = start_engine(args)
    ray.get(engine.warmup.remote())
    pool = EnvPool(
        "simulated_tool", env_kwargs(args, args.tool_latency_s), num_actors=args.env_actors
    )
    pool.wait_ready()
    blocks = []
    with tempfile.TemporaryDirectory() as run_dir:
        stream = Stream(make_tasks(args.tasks, "t/"), tokenizer, engine, pool, args, run_dir)
        stream.set_profiled(not args.null_test)
        stream.consume(args.warmup_batches)
        for pair in range(args.pairs):
            order = (False, True) if pair % 2 == 0 else (True, False)
            for profiled in order:
                blocks.append(stream.block(profiled, args))
        stream.close()
        path = spans_path(run_dir)
        spans_bytes = os.path.getsize(path) if os.path.exists(path) else 0
    report = {
        "benchmark": "profiling_overhead",
        **summarize(blocks, os.cpu_count() or 1),
        "spans_jsonl_bytes": spans_bytes,
        "machine": {**machine(), "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "parameters": {
            **vars(args),
            "model": {
                "d_model": model_config.d_model,
                "n_layers": model_config.n_layers,
                "vocab_size": model_config.vocab_size,
                "max_seq_len": model_config.max_seq_len,
            },
        },
        "blocks": blocks,
    }
    wait_engine_idle(engine)
    ray.shutdown()
    return report


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))
