"""Does the async orchestrator keep the engine busy while tools are slow and heavy-tailed?

Episodes of ``--turns`` turns each; every turn generates exactly ``--max-new-tokens``
tokens from a random-weight model and then calls a tool that sleeps (``simulated_tool``
env). Tool latency per call is lognormal (``--latency-dist lognormal``, ``--latency-sigma``
the standard deviation of its log) or uniform (``--latency-dist uniform``, ``--jitter``)
around a median L, and a ``--straggler-fraction`` of episodes are stragglers whose every
call takes ``--straggler-factor`` (20) times as long. The same engine actor, env actors
and agent code run the episodes three ways:

* ``lockstep`` (at L): ``max_batch_size`` episodes at a time; each turn, all of them
  generate together, then all take their env step together (the batch waits for its
  slowest tool), turn after turn, batch after batch. The synchronous baseline.
* ``async`` (at L): the ``OrchestratorActor`` with ``--concurrency`` episodes in flight,
  each a coroutine of its own, so the engine decodes some episodes while others wait.
* ``async_zero_latency``: the same orchestrator settings with tools taking no time: the
  throughput the engine allows, measured in the same invocation.

Unless ``--tool-latency-s`` is given, a calibration run (lockstep, tools taking no time)
first measures one generation turn of a full batch, and L is ``--latency-factor`` (5)
times that. The default concurrency follows from Little's law: an episode spends one
generation turn g in the engine per tool call of mean latency T, so keeping every engine
row busy takes ``max_batch_size * (1 + T / g)`` episodes; the default is 1.5 times that,
headroom for the spread of T.

An async run first consumes ``--warmup-trajectories`` (default: the concurrency) untimed,
so the measured window is the steady state rather than the start-up ramp of
``concurrency`` episodes started at once; then ``--trajectories`` are timed. Engine
numbers are ``engine_stats`` deltas over the timed window; ``engine_busy_fraction`` is
the engine's seconds inside prefill and decode device calls over wall seconds.

Prints one JSON object with, at the top: ``engine_busy_fraction`` (async at L),
``throughput_ratio_vs_zero_latency`` (async trajectories/s at L over async at 0) and
``speedup_trajectories_per_s`` (async over lockstep at L), then every run.

    python benchmarks/rollout_overlap.py
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import math
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import ray  # noqa: E402
from local_ray import add_ray_address_arg, init_ray  # noqa: E402
from machine_rates import machine  # noqa: E402, F401 - also imported from here

from raytunix.agents import make_agent  # noqa: E402
from raytunix.envs import SimulatedToolEnv  # noqa: E402
from raytunix.inference.actor import EngineActor  # noqa: E402
from raytunix.models.llama import ModelConfig  # noqa: E402
from raytunix.models.tokenizer import Tokenizer  # noqa: E402
from raytunix.rollout.actor import OrchestratorActor, RayEngineClient  # noqa: E402
from raytunix.rollout.batch import trajectories_to_record_batch  # noqa: E402
from raytunix.rollout.env_pool import EnvPool  # noqa: E402
from raytunix.rollout.episode import run_episode  # noqa: E402
from raytunix.types import EpisodeStatus, FinishReason, SamplingParams, Task  # noqa: E402

_ACTOR_ENV = {"env_vars": {"JAX_PLATFORMS": "cpu"}}
AGENT = "text"  # SimulatedToolEnv.default_agent


def add_latency_shape_args(
    p: argparse.ArgumentParser, dist: str, sigma: float, jitter: float, straggler_fraction: float
) -> None:
    """``simulated_tool``'s latency-shape flags (``env_kwargs`` reads them), with each
    benchmark's defaults."""
    p.add_argument(
        "--latency-dist",
        choices=("lognormal", "uniform"),
        default=dist,
        help="tool latency distribution around the median latency",
    )
    p.add_argument(
        "--latency-sigma",
        type=float,
        default=sigma,
        help="lognormal: standard deviation of the log latency",
    )
    p.add_argument(
        "--jitter", type=float, default=jitter, help="uniform: relative half-width of the latency"
    )
    p.add_argument(
        "--straggler-fraction",
        type=float,
        default=straggler_fraction,
        help="share of episodes whose every tool call is --straggler-factor x slower",
    )
    p.add_argument(
        "--straggler-factor",
        type=float,
        default=20.0,
        help="how much slower a straggler's tool calls are",
    )


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--trajectories",
        type=int,
        default=384,
        help="timed trajectories per async run (a multiple of --max-batch-size)",
    )
    p.add_argument(
        "--lockstep-trajectories",
        type=int,
        default=None,
        help="trajectories per lockstep run (default: a sixth of "
        "--trajectories, at least one batch; lockstep is slow)",
    )
    p.add_argument(
        "--warmup-trajectories",
        type=int,
        default=None,
        help="untimed trajectories before each async window (default: the "
        "concurrency, rounded up to whole batches)",
    )
    p.add_argument(
        "--tool-latency-s",
        type=float,
        default=None,
        help="median tool latency L (s); default: latency factor x calibrated turn",
    )
    p.add_argument("--latency-factor", type=float, default=5.0)
    add_latency_shape_args(p, dist="lognormal", sigma=1.0, jitter=0.5, straggler_fraction=0.05)
    p.add_argument("--turns", type=int, default=3, help="turns (tool calls) per episode")
    p.add_argument("--max-new-tokens", type=int, default=16, help="generated tokens per turn")
    p.add_argument("--max-batch-size", type=int, default=16, help="engine decode rows")
    p.add_argument(
        "--kv-cache-tokens",
        type=int,
        default=None,
        help="engine KV capacity (default: the engine's)",
    )
    p.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="async episodes in flight (default: 1.5 x max_batch_size x "
        "(1 + mean tool latency / generation turn), Little's law)",
    )
    p.add_argument("--env-actors", type=int, default=1)
    p.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="measurements per mode, alternating (medians reported)",
    )
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-layers", type=int, default=3)
    p.add_argument("--max-seq-len", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--batch-sync",
        type=int,
        default=1,
        help="1: also run the batch-synchronous baseline at the async run's "
        "concurrency, with and without stragglers (and async without them)",
    )
    add_ray_address_arg(p)
    args = p.parse_args(argv)
    b = args.max_batch_size
    if args.trajectories < b or args.trajectories % b:
        p.error(
            f"--trajectories ({args.trajectories}) must be a positive multiple of "
            f"--max-batch-size ({b}): trajectories come in batches of that size."
        )
    if args.lockstep_trajectories is None:
        args.lockstep_trajectories = max(b, args.trajectories // 6 // b * b)
    if args.lockstep_trajectories < b or args.lockstep_trajectories % b:
        p.error(
            f"--lockstep-trajectories ({args.lockstep_trajectories}) must be a positive "
            f"multiple of --max-batch-size ({b}): lockstep runs whole batches."
        )
    return args


def make_tasks(n: int, prefix: str) -> list[Task]:
    return [
        Task(task_id=f"{prefix}{i}", question=f"Task {i}: look it up.", answer="") for i in range(n)
    ]


def sampling(args) -> SamplingParams:
    # No stop token of our own: turns end at max_new_tokens (the agent still stops at
    # <|end|>, which a random model draws rarely) and the text agent closes them.
    return SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, stop_token_ids=())


def env_kwargs(args, latency_s: float) -> dict:
    kwargs = {
        "tool_latency_s": latency_s,
        "turns": args.turns,
        "seed": args.seed,
        "latency_dist": args.latency_dist,
        "straggler_fraction": args.straggler_fraction,
        "straggler_factor": args.straggler_factor,
    }
    if args.latency_dist == "lognormal":
        kwargs["latency_sigma"] = args.latency_sigma
    else:
        kwargs["jitter"] = args.jitter
    return kwargs


def engine_window(before: dict, after: dict, wall_s: float) -> dict:
    def delta(key):
        return after[key] - before[key]

    steps = delta("decode_steps")
    return {
        "engine_busy_fraction": delta("busy_s") / wall_s,
        "engine_busy_s": delta("busy_s"),
        "engine_prefill_s": delta("busy_prefill_s"),
        "engine_decode_steps": steps,
        "engine_prefill_calls": delta("prefill_calls"),
        "engine_tokens_generated": delta("tokens_generated"),
        "engine_mean_decode_rows": (
            after["mean_active_slots"] * after["decode_steps"]
            - before["mean_active_slots"] * before["decode_steps"]
        )
        / max(steps, 1),
        "engine_prompt_tokens_computed": delta("prompt_tokens_computed"),
        "engine_session_evictions": delta("session_evictions"),
        "engine_preemptions": delta("preemptions"),
        "compiled_during_run": delta("compiled_programs"),
    }


def run_summary(wall: float, n: int, tokens: float, turns: float, statuses) -> dict:
    return {
        "wall_s": wall,
        "trajectories": n,
        "trajectories_per_s": n / wall,
        "generated_tokens_per_s": tokens / wall,
        "mean_turns": turns / n,
        "mean_tokens_per_turn": tokens / max(turns, 1),
        "statuses": dict(statuses),
    }


# ----------------------------------------------------------------------- lockstep baseline


async def lockstep_batch(
    tasks,
    tokenizer,
    client,
    pool: EnvPool,
    args,
    batch_index: int,
    turn_times: list[float] | None = None,
) -> list:
    """One batch of episodes in lockstep; returns their trajectories. Mirrors
    ``run_episode``'s turn logic, but every phase is gathered over the batch."""
    leases = [pool.lease(f"l{batch_index}") for _ in tasks]
    envs = [env for env, _ in leases]
    agents = [make_agent(AGENT, tokenizer) for _ in tasks]
    observations = await asyncio.gather(*(env.reset(t) for env, t in zip(envs, tasks)))
    for agent, task, obs in zip(agents, tasks, observations):
        agent.reset(task, obs)
    rewards = [0.0] * len(tasks)
    statuses = [EpisodeStatus.TRUNCATED] * len(tasks)
    live = list(range(len(tasks)))
    for turn in range(args.turns):
        requests = [
            agents[i].next_request(
                f"l{batch_index}/{i}/{turn}",
                sampling(args),
                args.seed + batch_index * 1000 + i * 10 + turn,
            )
            for i in live
        ]
        t0 = time.perf_counter()
        results = await asyncio.gather(*(client.generate(r) for r in requests))
        if turn_times is not None:
            turn_times.append(time.perf_counter() - t0)
        actions = {}
        for i, result in zip(live, results):
            action = agents[i].on_generation(result)
            if result.finish_reason != FinishReason.ABORT and agents[i].turn_finished:
                actions[i] = action
        stepping = list(actions)
        steps = await asyncio.gather(*(envs[i].step(actions[i]) for i in stepping))
        live = []
        for i, step in zip(stepping, steps):
            rewards[i] += step.reward
            if step.done:
                statuses[i] = step.status or EpisodeStatus.COMPLETED
            elif turn + 1 < args.turns:
                agents[i].on_observation(step.observation)
                live.append(i)
        if not live:
            break
    await asyncio.gather(*(env.close() for env in envs))
    for _, index in leases:
        pool.release(index)
    trajectories = [
        agent.to_trajectory(t.task_id, f"l{batch_index}", r, status)
        for agent, t, r, status in zip(agents, tasks, rewards, statuses)
    ]
    ray.put(trajectories_to_record_batch(trajectories))  # what the orchestrator hands on, too
    return trajectories


async def run_lockstep(tasks, tokenizer, engine, pool, args, turn_times=None) -> list:
    client = RayEngineClient(engine)
    trajectories = []
    b = args.max_batch_size
    for k in range(len(tasks) // b):
        trajectories += await lockstep_batch(
            tasks[k * b : (k + 1) * b], tokenizer, client, pool, args, k, turn_times
        )
    return trajectories


def measure_rollout(engine, rollout) -> dict:
    """Runs the coroutine ``rollout`` (returns trajectories) with the clock and the
    engine's counters around it."""
    before = ray.get(engine.engine_stats.remote())
    start = time.perf_counter()
    trajectories = asyncio.run(rollout)
    wall = time.perf_counter() - start
    after = ray.get(engine.engine_stats.remote())
    tokens = sum(sum(t.loss_mask) for t in trajectories)
    turns = sum(t.num_turns for t in trajectories)
    statuses = collections.Counter(t.status.value for t in trajectories)
    return {
        **run_summary(wall, len(trajectories), tokens, turns, statuses),
        **engine_window(before, after, wall),
    }


def measure_lockstep(tasks, tokenizer, engine, pool, args) -> dict:
    return measure_rollout(engine, run_lockstep(tasks, tokenizer, engine, pool, args))


# ----------------------------------------------------------------------- batch-synchronous baseline


async def run_batch_sync(tasks, tokenizer, engine, pool, args, size: int) -> list:
    """Batch-synchronous rollout with ``size`` episodes in flight: each batch's episodes
    run as independent coroutines through ``run_episode`` (the engine batches their turns
    continuously, as in the async run), and the next batch starts only once the slowest
    episode of this one has ended: a synchronous RL loop that collects a batch, then
    trains. The async run's concurrency, so only the waiting for stragglers differs."""
    client = RayEngineClient(engine)
    trajectories: list = []
    for start in range(0, len(tasks), size):
        chunk = tasks[start : start + size]
        group = f"b{start}"
        leases = [pool.lease(group) for _ in chunk]

        async def one(i: int, task: Task, env):
            return await run_episode(
                task,
                group,
                make_agent(AGENT, tokenizer),
                env,
                client,
                sampling(args),
                max_turns=args.turns,
                max_context_tokens=args.max_seq_len,
                seed=args.seed + start + i,
                timeout_s=600.0,
            )

        try:
            batch = await asyncio.gather(
                *(one(i, t, env) for i, (t, (env, _)) in enumerate(zip(chunk, leases)))
            )
        finally:
            for _, index in leases:
                pool.release(index)
        ray.put(trajectories_to_record_batch(batch))  # what the orchestrator hands on, too
        trajectories += batch
    return trajectories


def measure_batch_sync(tasks, tokenizer, engine, pool, args) -> dict:
    return {
        **measure_rollout(
            engine, run_batch_sync(tasks, tokenizer, engine, pool, args, args.concurrency)
        ),
        "concurrency": args.concurrency,
    }


# ----------------------------------------------------------------------- async orchestrator


def start_orchestrator(tasks, tokenizer, engine, pool, args, groups_per_batch: int):
    """An ``OrchestratorActor`` of one-trajectory groups on ``engine`` and ``pool``, with
    ``--concurrency`` episodes in flight and no learner to wait for."""
    return (
        ray.remote(OrchestratorActor)
        .options(num_cpus=0, max_concurrency=10_000, runtime_env=_ACTOR_ENV)
        .remote(
            tasks=tasks,
            tokenizer=tokenizer,
            agent_name=AGENT,
            env_pool=pool,
            engine=engine,
            group_size=1,
            groups_per_batch=groups_per_batch,
            max_concurrent_episodes=args.concurrency,
            max_staleness=10**9,  # no learner runs: admission must never wait for one
            max_turns=args.turns,
            max_context_tokens=args.max_seq_len,
            sampling=sampling(args),
            episode_timeout_s=600.0,
            batch_queue_size=4,
            seed=args.seed,
        )
    )


def measure_async(tasks, tokenizer, engine, pool, args, warmup: int) -> dict:
    orchestrator = start_orchestrator(tasks, tokenizer, engine, pool, args, args.max_batch_size)

    def consume(count: int):
        n, tokens, turns, statuses = 0, 0.0, 0.0, collections.Counter()
        while n < count:
            _, info = ray.get(orchestrator.next_batch.remote())
            k = info["num_trajectories"]
            n += k
            tokens += info["generated_tokens_mean"] * k
            turns += info["turns_mean"] * k
            statuses.update(info["statuses"])
        return n, tokens, turns, statuses

    consume(warmup)  # the start-up ramp: every episode starts at once
    before = ray.get(engine.engine_stats.remote())
    start = time.perf_counter()
    n, tokens, turns, statuses = consume(args.trajectories)
    wall = time.perf_counter() - start
    after = ray.get(engine.engine_stats.remote())
    ray.get(orchestrator.stop.remote())
    ray.kill(orchestrator)
    wait_engine_idle(engine)
    return {
        **run_summary(wall, n, tokens, turns, statuses),
        "warmup_trajectories": warmup,
        **engine_window(before, after, wall),
    }


def wait_engine_idle(engine, timeout_s: float = 60.0) -> None:
    """Waits out the requests of episodes cancelled at the end of a run, so that they do
    not run into the next measurement."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = ray.get(engine.engine_stats.remote())
        if stats["active_slots"] == 0 and stats["waiting"] == 0:
            return
        time.sleep(0.05)
    raise TimeoutError(f"engine still busy {timeout_s} s after the async run: {stats}")


# ----------------------------------------------------------------------- main


def summarize(runs: list[dict]) -> dict:
    """Medians of the repeats at the top (what ratios use), and per key the mean, median
    and worst (lowest rate, longest wall)."""
    keys = ("trajectories_per_s", "generated_tokens_per_s", "engine_busy_fraction", "wall_s")
    spread = {
        k: {
            "mean": statistics.fmean(r[k] for r in runs),
            "median": statistics.median(r[k] for r in runs),
            "worst": (max if k == "wall_s" else min)(r[k] for r in runs),
        }
        for k in keys
    }
    return {**{k: spread[k]["median"] for k in keys}, "repeats": spread, "runs": runs}


def calibrate(tokenizer, engine, pool: EnvPool, args) -> float:
    """Median seconds of one generation turn of a full lockstep batch on ``pool``, whose
    tools take no time."""
    b = args.max_batch_size
    tasks = make_tasks(2 * b, "calibrate")
    turn_times: list[float] = []
    asyncio.run(run_lockstep(tasks[:b], tokenizer, engine, pool, args))
    asyncio.run(run_lockstep(tasks[b:], tokenizer, engine, pool, args, turn_times))
    return statistics.median(turn_times)


def start_engine(args: argparse.Namespace):
    """Starts local Ray (or connects to ``--ray-address``) and one ``EngineActor`` of a
    random-weight model sized by ``args`` (``d_model``, ``n_layers``, ``max_seq_len``,
    ``max_batch_size``, ``kv_cache_tokens``, ``seed``); returns ``(tokenizer,
    model_config, engine)``."""
    init_ray(args.ray_address, _ACTOR_ENV)
    tokenizer = Tokenizer.byte_level()
    model_config = ModelConfig(
        vocab_size=tokenizer.vocab_size,
        d_model=args.d_model,
        n_layers=args.n_layers,
        max_seq_len=args.max_seq_len,
    )
    engine_kwargs = {"max_batch_size": args.max_batch_size}
    if args.kv_cache_tokens is not None:
        engine_kwargs["kv_cache_tokens"] = args.kv_cache_tokens
    engine = (
        ray.remote(EngineActor)
        .options(num_cpus=0, max_concurrency=10_000, runtime_env=_ACTOR_ENV)
        .remote(model_config, args.seed, tokenizer, engine_kwargs)
    )
    return tokenizer, model_config, engine


def main(argv=None) -> dict:
    args = parse_args(argv)
    load_before = os.getloadavg()
    tokenizer, model_config, engine = start_engine(args)
    t0 = time.perf_counter()
    shapes = ray.get(engine.warmup.remote())  # no compilation inside a measurement
    warmup_s = time.perf_counter() - t0

    # The zero-latency pool calibrates too: one env actor process fewer to start.
    instant = EnvPool("simulated_tool", env_kwargs(args, 0.0), num_actors=args.env_actors)
    turn_s = calibrate(tokenizer, engine, instant, args)
    latency = args.tool_latency_s
    if latency is None:
        latency = args.latency_factor * turn_s
    mean_latency = SimulatedToolEnv(**env_kwargs(args, latency)).mean_latency_s
    if args.concurrency is None:
        args.concurrency = math.ceil(1.5 * args.max_batch_size * (1 + mean_latency / turn_s))
    warmup = args.warmup_trajectories
    if warmup is None:
        warmup = -(-args.concurrency // args.max_batch_size) * args.max_batch_size

    smooth = {**env_kwargs(args, latency), "straggler_fraction": 0.0}
    pools = {
        "slow": EnvPool("simulated_tool", env_kwargs(args, latency), num_actors=args.env_actors),
        "no_stragglers": EnvPool("simulated_tool", smooth, num_actors=args.env_actors),
        "instant": instant,
    }
    for pool in pools.values():
        pool.wait_ready()
    # Whole batches of the async run's concurrency, at least as many as one async window.
    sync_n = max(1, -(-args.trajectories // args.concurrency)) * args.concurrency
    results: dict[str, list[dict]] = {
        "lockstep": [],
        "async": [],
        "async_zero_latency": [],
        "batch_sync": [],
        "async_no_stragglers": [],
        "batch_sync_no_stragglers": [],
    }
    for r in range(args.repeats):
        # Fresh task ids per run: a task's straggler draw is seeded by its id.
        results["async"].append(
            measure_async(
                make_tasks(warmup + 2 * args.trajectories, f"a{r}/"),
                tokenizer,
                engine,
                pools["slow"],
                args,
                warmup,
            )
        )
        results["async_zero_latency"].append(
            measure_async(
                make_tasks(warmup + 2 * args.trajectories, f"z{r}/"),
                tokenizer,
                engine,
                pools["instant"],
                args,
                warmup,
            )
        )
        results["lockstep"].append(
            measure_lockstep(
                make_tasks(args.lockstep_trajectories, f"l{r}/"),
                tokenizer,
                engine,
                pools["slow"],
                args,
            )
        )
        if args.batch_sync:
            results["batch_sync"].append(
                measure_batch_sync(
                    make_tasks(sync_n, f"b{r}/"), tokenizer, engine, pools["slow"], args
                )
            )
            results["async_no_stragglers"].append(
                measure_async(
                    make_tasks(warmup + 2 * args.trajectories, f"n{r}/"),
                    tokenizer,
                    engine,
                    pools["no_stragglers"],
                    args,
                    warmup,
                )
            )
            results["batch_sync_no_stragglers"].append(
                measure_batch_sync(
                    make_tasks(sync_n, f"m{r}/"), tokenizer, engine, pools["no_stragglers"], args
                )
            )
    summary = {mode: summarize(runs) for mode, runs in results.items() if runs}

    def speedup(fast: str, slow: str):
        if fast not in summary or slow not in summary:
            return None
        return summary[fast]["trajectories_per_s"] / summary[slow]["trajectories_per_s"]

    report = {
        "benchmark": "rollout_overlap",
        "engine_busy_fraction": summary["async"]["engine_busy_fraction"],
        "throughput_ratio_vs_zero_latency": (
            summary["async"]["trajectories_per_s"]
            / summary["async_zero_latency"]["trajectories_per_s"]
        ),
        # Equal settings: the same concurrency, engine, env actors and tools.
        "speedup_vs_batch_sync": speedup("async", "batch_sync"),
        "speedup_vs_batch_sync_no_stragglers": speedup(
            "async_no_stragglers", "batch_sync_no_stragglers"
        ),
        # Not equal settings: lockstep runs max_batch_size episodes at a time.
        "speedup_trajectories_per_s": speedup("async", "lockstep"),
        "machine": {**machine(), "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "parameters": {
            **vars(args),
            "tool_latency_s": latency,
            "mean_tool_latency_s": mean_latency,
            "warmup_trajectories": warmup,
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
            "compile_s": warmup_s,
        },
        **summary,
    }
    ray.shutdown()
    return report


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))
