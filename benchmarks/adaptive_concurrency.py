"""Does adaptive concurrency bring the engine to its busy target from a bad start, within
the staleness bound?

The rollout starts with ``--start-concurrency`` (4) episodes in flight, far too few for
slow tools: each episode spends most of its time waiting for a tool, so the engine idles.
The ``ConcurrencyController`` reads the engine's stats every ``--interval-s`` and raises the
episode budget; the staleness admission rule (``--max-staleness``) applies on top.

Workload (as in ``rollout_overlap.py``, whose helpers this script uses): a random-weight
model in an ``EngineActor``, ``simulated_tool`` environments (every action is a tool call
that sleeps; latency uniform ±50% around L by default), the ``text`` agent, ``--turns``
tool calls per episode, ``--max-new-tokens`` per turn. Unless ``--tool-latency-s`` is given,
L is ``--latency-factor`` (5) times one calibrated generation turn of a full batch.

A stand-in learner drives the run: per step it takes one batch (``--group-size`` x
``--groups-per-batch`` trajectories), waits ``--train-s`` (the update), publishes weights
to the engine with the next policy version (the same values: the model is random, only
versions matter here), and marks the batch trained. So tokens age, staleness is real, and
admission opens one batch per step, as in a run.

Per step: the episode budget (``max_concurrent_episodes`` when the batch was handed out),
the engine busy fraction over the step (engine device seconds / wall seconds, from
``engine_stats`` deltas between step ends), and the batch's maximal token staleness.
The controller's upper bound is by default what admission can ever let in,
``(max_staleness + 1) * groups_per_batch * group_size``; with ``--max-staleness 1`` the
admission rule itself caps the episodes in flight below what slow tools need, and the
controller, seeing that the budget does not bind, holds instead of winding up.
Reports the first step whose busy fraction is within ``--dead-band`` of the target, and the
largest staleness seen against the bound. ``--baseline-steps`` steps with the budget fixed
at the start value run first, for comparison.

    python benchmarks/adaptive_concurrency.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import ray  # noqa: E402

from raytunix.models.llama import init_model  # noqa: E402
from raytunix.rollout.actor import OrchestratorActor  # noqa: E402
from raytunix.rollout.concurrency import ConcurrencyController  # noqa: E402
from raytunix.rollout.env_pool import EnvPool  # noqa: E402

from rollout_overlap import (  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
    _ACTOR_ENV,
    AGENT,
    add_latency_shape_args,
    calibrate,
    engine_window,
    env_kwargs,
    machine,
    start_engine,
    make_tasks,
    sampling,
    wait_engine_idle,
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=16, help="learner steps of the adaptive run")
    p.add_argument(
        "--baseline-steps",
        type=int,
        default=1,
        help="steps with the budget fixed at the start value, run first (0: none)",
    )
    p.add_argument(
        "--start-concurrency", type=int, default=4, help="max_concurrent_episodes at start"
    )
    p.add_argument(
        "--max-concurrency",
        type=int,
        default=0,
        help="the controller's upper bound (0: what admission can ever let in, "
        "(max_staleness + 1) x groups_per_batch x group_size)",
    )
    p.add_argument("--target-busy", type=float, default=0.9)
    p.add_argument("--dead-band", type=float, default=0.05)
    p.add_argument(
        "--interval-s",
        type=float,
        default=1.0,
        help="seconds between two engine stats readings of the controller",
    )
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--groups-per-batch", type=int, default=16)
    p.add_argument(
        "--max-staleness",
        type=int,
        default=2,
        help="admission lets at most (max_staleness + 1) x groups_per_batch groups be "
        "in flight or waiting for the learner; 2 leaves room for the ~24 groups "
        "in flight that slow tools need on 16 rows",
    )
    p.add_argument("--train-s", type=float, default=0.3, help="the stand-in learner's update time")
    p.add_argument(
        "--tool-latency-s",
        type=float,
        default=None,
        help="median tool latency L (s); default: latency factor x calibrated turn",
    )
    p.add_argument("--latency-factor", type=float, default=5.0)
    add_latency_shape_args(p, dist="uniform", sigma=1.0, jitter=0.5, straggler_fraction=0.0)
    p.add_argument("--turns", type=int, default=3, help="turns (tool calls) per episode")
    p.add_argument("--max-new-tokens", type=int, default=16, help="generated tokens per turn")
    p.add_argument("--max-batch-size", type=int, default=16, help="engine decode rows")
    p.add_argument("--kv-cache-tokens", type=int, default=None)
    p.add_argument("--env-actors", type=int, default=1)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-layers", type=int, default=3)
    p.add_argument("--max-seq-len", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.start_concurrency < 1 or args.steps < 1 or args.baseline_steps < 0:
        p.error("--start-concurrency and --steps must be >= 1, --baseline-steps >= 0.")
    return args


def run_steps(
    args,
    tokenizer,
    engine,
    pool,
    params,
    version: int,
    steps: int,
    controller: ConcurrencyController | None,
    prefix: str,
) -> tuple[list[dict], int]:
    """``steps`` learner steps against a fresh orchestrator; returns one record per step
    and the policy version reached."""
    batch = args.group_size * args.groups_per_batch
    orchestrator = (
        ray.remote(OrchestratorActor)
        .options(num_cpus=0, max_concurrency=10_000, runtime_env=_ACTOR_ENV)
        .remote(
            tasks=make_tasks(batch * (steps + args.max_staleness + 4), prefix),
            tokenizer=tokenizer,
            agent_name=AGENT,
            env_pool=pool,
            engine=engine,
            group_size=args.group_size,
            groups_per_batch=args.groups_per_batch,
            max_concurrent_episodes=args.start_concurrency,
            max_staleness=args.max_staleness,
            max_turns=args.turns,
            max_context_tokens=args.max_seq_len,
            sampling=sampling(args),
            episode_timeout_s=600.0,
            batch_queue_size=2,
            concurrency=controller,
            concurrency_interval_s=args.interval_s,
            seed=args.seed,
            policy_version=version,
        )
    )
    ray.get(orchestrator.stats.remote())  # constructed before the clock starts
    records = []
    start = previous_t = time.perf_counter()
    previous = ray.get(engine.engine_stats.remote())
    for step in range(1, steps + 1):
        _, info = ray.get(orchestrator.next_batch.remote())
        time.sleep(args.train_s)  # the update
        version += 1
        ray.get(engine.update_weights.remote((params, version)))
        ray.get(orchestrator.mark_trained.remote(info["batch_id"], version))
        now_t, now = time.perf_counter(), ray.get(engine.engine_stats.remote())
        window = engine_window(previous, now, now_t - previous_t)
        records.append(
            {
                "step": step,
                "max_concurrent_episodes": info["max_concurrent_episodes"],
                "episodes_in_flight": info["episodes_in_flight"],
                "engine_busy_fraction": window["engine_busy_fraction"],
                "controller_busy_reading": info.get("engine_busy_fraction_last_window"),
                "staleness_max": info["staleness_max"],
                "step_s": now_t - previous_t,
                "elapsed_s": now_t - start,
                "trajectories_per_s": info["num_trajectories"] / (now_t - previous_t),
                "engine_mean_decode_rows": window["engine_mean_decode_rows"],
                "engine_preemptions": window["engine_preemptions"],
            }
        )
        previous_t, previous = now_t, now
    ray.get(orchestrator.stop.remote())
    ray.kill(orchestrator)
    wait_engine_idle(engine)
    return records, version


def main(argv=None) -> dict:
    args = parse_args(argv)
    load_before = os.getloadavg()
    tokenizer, model_config, engine = start_engine(args)
    # The engine's own initial weights, as numpy: what the stand-in learner publishes.
    params = jax.device_get(init_model(model_config, args.seed)[1])
    t0 = time.perf_counter()
    shapes = ray.get(engine.warmup.remote())  # no compilation inside a measurement
    compile_s = time.perf_counter() - t0
    turn_s = calibrate(tokenizer, engine, args)
    latency = (
        args.tool_latency_s if args.tool_latency_s is not None else args.latency_factor * turn_s
    )
    pool = EnvPool("simulated_tool", env_kwargs(args, latency), num_actors=args.env_actors)
    pool.wait_ready()

    maximum = args.max_concurrency or max(
        args.start_concurrency, (args.max_staleness + 1) * args.groups_per_batch * args.group_size
    )
    version = 0
    baseline = []
    if args.baseline_steps:
        baseline, version = run_steps(
            args, tokenizer, engine, pool, params, version, args.baseline_steps, None, "fixed/"
        )
    controller = ConcurrencyController(
        initial=args.start_concurrency,
        minimum=min(args.group_size, args.start_concurrency),
        maximum=maximum,
        target_busy=args.target_busy,
        granularity=args.group_size,
        dead_band=args.dead_band,
    )
    steps, version = run_steps(
        args, tokenizer, engine, pool, params, version, args.steps, controller, "adaptive/"
    )

    reached = next(
        (r for r in steps if r["engine_busy_fraction"] >= args.target_busy - args.dead_band), None
    )
    after = [r["engine_busy_fraction"] for r in steps if reached and r["step"] >= reached["step"]]
    staleness_seen = max(r["staleness_max"] for r in steps)
    report = {
        "benchmark": "adaptive_concurrency",
        "target_engine_busy": args.target_busy,
        "dead_band": args.dead_band,
        "step_reached_target": reached["step"] if reached else None,
        "seconds_to_target": reached["elapsed_s"] if reached else None,
        "engine_busy_fraction_from_target_step_median": statistics.median(after) if after else None,
        "max_concurrent_episodes_start": args.start_concurrency,
        "max_concurrent_episodes_final": steps[-1]["max_concurrent_episodes"],
        "max_concurrent_episodes_bound": maximum,
        "max_staleness_seen": staleness_seen,
        "staleness_bound": args.max_staleness,
        "staleness_within_bound": staleness_seen <= args.max_staleness,
        "steps": steps,
        "fixed_start_baseline": {
            "steps": baseline,
            "engine_busy_fraction_median": (
                statistics.median(r["engine_busy_fraction"] for r in baseline) if baseline else None
            ),
            "trajectories_per_s_median": (
                statistics.median(r["trajectories_per_s"] for r in baseline) if baseline else None
            ),
        },
        "adaptive_trajectories_per_s_last_half_median": statistics.median(
            r["trajectories_per_s"] for r in steps[len(steps) // 2 :]
        ),
        "machine": {**machine(), "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "parameters": {
            **vars(args),
            "tool_latency_s": latency,
            "model": {
                "d_model": model_config.d_model,
                "n_layers": model_config.n_layers,
                "vocab_size": model_config.vocab_size,
                "max_seq_len": model_config.max_seq_len,
            },
        },
        "calibration": {
            "generation_turn_s": turn_s,
            "compiled_shapes": shapes,
            "compile_s": compile_s,
        },
    }
    ray.shutdown()
    return report


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))
