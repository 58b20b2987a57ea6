"""Does the async orchestrator keep the engine busy while tools are slow?

Episodes of ``--turns`` turns each; every turn generates exactly ``--max-new-tokens``
tokens from a random-weight model and then calls a tool that sleeps (``simulated_tool``
env, latency jittered ±50%). The same engine actor, env pool and agent code run the
episodes two ways:

* ``lockstep``: ``max_batch_size`` episodes at a time; each turn, all of them generate
  together (one ``generate`` per episode, gathered), then all take their env step
  together (gathered: the batch waits for the slowest tool), turn after turn, batch after
  batch.
* ``async``: the ``OrchestratorActor`` with ``--concurrency`` episodes in flight, each a
  coroutine of its own, so the engine decodes some episodes while others wait for tools.

Unless ``--tool-latency-s`` is given, a calibration run (lockstep, tools taking no time)
first measures the time of one generation turn of a full batch, and the tool latency is
set to ``--latency-factor`` (5) times that. Each mode then runs for ``--trajectories``
trajectories, ``--repeats`` times, alternating. Prints one JSON object: the machine, the
parameters, and per mode trajectories/s, generated tokens/s and the engine busy fraction
(engine seconds inside prefill/decode calls over wall seconds, from ``engine_stats``
deltas), plus the async/lockstep speedup.

    python benchmarks/rollout_overlap.py
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import platform
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import ray  # noqa: E402

from raytunix.agents import make_agent  # noqa: E402
from raytunix.inference.actor import EngineActor  # noqa: E402
from raytunix.models.llama import ModelConfig  # noqa: E402
from raytunix.models.tokenizer import Tokenizer  # noqa: E402
from raytunix.rollout.actor import OrchestratorActor, RayEngineClient  # noqa: E402
from raytunix.rollout.batch import trajectories_to_record_batch  # noqa: E402
from raytunix.rollout.env_pool import EnvPool  # noqa: E402
from raytunix.types import (  # noqa: E402
    EpisodeStatus,
    FinishReason,
    GenerationRequest,
    SamplingParams,
    Task,
)

_ACTOR_ENV = {"env_vars": {"JAX_PLATFORMS": "cpu"}}
AGENT = "text"  # SimulatedToolEnv.default_agent


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trajectories", type=int, default=192, help="per mode and repeat")
    p.add_argument("--tool-latency-s", type=float, default=None,
                   help="mean tool latency (s); default: latency factor x calibrated turn time")
    p.add_argument("--latency-factor", type=float, default=5.0)
    p.add_argument("--jitter", type=float, default=0.5, help="relative tool latency jitter")
    p.add_argument("--turns", type=int, default=3, help="turns (tool calls) per episode")
    p.add_argument("--max-new-tokens", type=int, default=16, help="generated tokens per turn")
    p.add_argument("--max-batch-size", type=int, default=16, help="engine slots")
    p.add_argument("--concurrency", type=int, default=None,
                   help="async episodes in flight (default 6 x max batch size: with tools "
                        "taking 5x a turn's generation, 1 episode in 6 is generating)")
    p.add_argument("--env-actors", type=int, default=1)
    p.add_argument("--repeats", type=int, default=2, help="measurements per mode")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.concurrency is None:
        args.concurrency = 6 * args.max_batch_size
    if args.trajectories % args.max_batch_size:
        p.error(f"--trajectories ({args.trajectories}) must be a multiple of --max-batch-size "
                f"({args.max_batch_size}): lockstep runs whole batches.")
    return args


def machine() -> dict:
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                  if line.startswith("model name")), platform.processor())
    return {"cpu_count": os.cpu_count(), "cpu_model": model, "platform": platform.platform(),
            "python": platform.python_version(), "ray": ray.__version__}


def make_tasks(n: int) -> list[Task]:
    return [Task(task_id=f"t{i}", question=f"Task {i}: look it up.", answer="") for i in range(n)]


def sampling(args) -> SamplingParams:
    # No stop token of our own: turns end at max_new_tokens (the agent still stops at
    # <|end|>, which a random model draws rarely) and the text agent closes them.
    return SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, stop_token_ids=())


def engine_window(before: dict, after: dict, wall_s: float) -> dict:
    busy = after["busy_s"] - before["busy_s"]
    steps = after["decode_steps"] - before["decode_steps"]
    return {"engine_busy_fraction": busy / wall_s,
            "engine_busy_s": busy,
            "engine_decode_steps": steps,
            "engine_prefill_calls": after["prefill_calls"] - before["prefill_calls"],
            "engine_tokens_generated": after["tokens_generated"] - before["tokens_generated"],
            "engine_mean_active_slots":
                (after["mean_active_slots"] * after["decode_steps"]
                 - before["mean_active_slots"] * before["decode_steps"]) / max(steps, 1)}


# ----------------------------------------------------------------------- lockstep baseline

async def lockstep_batch(tasks, tokenizer, engine, pool: EnvPool, args, batch_index: int,
                         turn_times: list[float] | None = None) -> list:
    """One batch of episodes in lockstep; returns their trajectories. Mirrors
    ``run_episode``'s turn logic, but every phase is gathered over the batch."""
    client = RayEngineClient(engine)
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
        requests = [agents[i].next_request(f"l{batch_index}/{i}/{turn}", sampling(args),
                                           args.seed + batch_index * 1000 + i * 10 + turn)
                    for i in live]
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
    trajectories = [agent.to_trajectory(t.task_id, f"l{batch_index}", r, status)
                    for agent, t, r, status in zip(agents, tasks, rewards, statuses)]
    ray.put(trajectories_to_record_batch(trajectories))  # what the orchestrator hands on, too
    return trajectories


async def run_lockstep(tasks, tokenizer, engine, pool, args, turn_times=None) -> list:
    trajectories = []
    b = args.max_batch_size
    for k in range(len(tasks) // b):
        trajectories += await lockstep_batch(tasks[k * b:(k + 1) * b], tokenizer, engine, pool,
                                             args, k, turn_times)
    return trajectories


def measure_lockstep(tasks, tokenizer, engine, pool, args) -> dict:
    before = ray.get(engine.engine_stats.remote())
    start = time.perf_counter()
    trajectories = asyncio.run(run_lockstep(tasks, tokenizer, engine, pool, args))
    wall = time.perf_counter() - start
    after = ray.get(engine.engine_stats.remote())
    tokens = sum(sum(t.loss_mask) for t in trajectories)
    turns = sum(t.num_turns for t in trajectories)
    statuses = collections.Counter(t.status.value for t in trajectories)
    return {"wall_s": wall, "trajectories": len(trajectories),
            "trajectories_per_s": len(trajectories) / wall,
            "generated_tokens_per_s": tokens / wall, "mean_turns": turns / len(trajectories),
            "mean_tokens_per_turn": tokens / max(turns, 1), "statuses": dict(statuses),
            **engine_window(before, after, wall)}


# ----------------------------------------------------------------------- async orchestrator

def measure_async(tasks, tokenizer, engine, pool, args, max_context_tokens: int) -> dict:
    orchestrator = ray.remote(OrchestratorActor).options(
        num_cpus=0, max_concurrency=10_000, runtime_env=_ACTOR_ENV).remote(
        tasks=tasks, tokenizer=tokenizer, agent_name=AGENT, env_pool=pool, engine=engine,
        group_size=1, groups_per_batch=args.max_batch_size,
        max_concurrent_episodes=args.concurrency,
        max_staleness=10**9,  # no learner runs: admission must never wait for one
        max_turns=args.turns, max_context_tokens=max_context_tokens,
        sampling=sampling(args), episode_timeout_s=600.0, batch_queue_size=4, seed=args.seed)
    ray.get(orchestrator.stats.remote())  # constructed and ready before the clock starts
    before = ray.get(engine.engine_stats.remote())
    start = time.perf_counter()
    n, tokens, turns, statuses = 0, 0.0, 0.0, collections.Counter()
    while n < args.trajectories:
        _, info = ray.get(orchestrator.next_batch.remote())
        k = info["num_trajectories"]
        n += k
        tokens += info["generated_tokens_mean"] * k
        turns += info["turns_mean"] * k
        statuses.update(info["statuses"])
    wall = time.perf_counter() - start
    after = ray.get(engine.engine_stats.remote())
    ray.get(orchestrator.stop.remote())
    ray.kill(orchestrator)
    wait_engine_idle(engine)
    return {"wall_s": wall, "trajectories": n, "trajectories_per_s": n / wall,
            "generated_tokens_per_s": tokens / wall, "mean_turns": turns / n,
            "mean_tokens_per_turn": tokens / max(turns, 1), "statuses": dict(statuses),
            **engine_window(before, after, wall)}


def wait_engine_idle(engine, timeout_s: float = 60.0) -> None:
    """Waits out the requests of episodes cancelled at the end of a run, which the engine
    still finishes, so that they do not run into the next measurement."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = ray.get(engine.engine_stats.remote())
        if stats["active_slots"] == 0 and stats["waiting"] == 0:
            return
        time.sleep(0.05)
    raise TimeoutError(f"engine still busy {timeout_s} s after the async run: {stats}")


# ----------------------------------------------------------------------- main

def warm_up(engine, args) -> None:
    """Compiles every prefill shape (batch bucket x length bucket) the runs can hit, and the
    decode step, so no measurement includes a compilation."""
    async def main():
        client = RayEngineClient(engine)
        for n_prompts in sorted({1, min(4, args.max_batch_size), args.max_batch_size}):
            for length in (16, 96, 160):
                await asyncio.gather(*(client.generate(GenerationRequest(
                    request_id=f"warm{n_prompts}/{length}/{i}", prompt_ids=(11,) * length,
                    sampling=SamplingParams(max_new_tokens=2))) for i in range(n_prompts)))
    asyncio.run(main())


def summarize(runs: list[dict]) -> dict:
    keys = ("trajectories_per_s", "generated_tokens_per_s", "engine_busy_fraction", "wall_s")
    return {**{k: statistics.median(r[k] for r in runs) for k in keys}, "runs": runs}


def main() -> None:
    args = parse_args()
    ray.init(address="local", include_dashboard=False, num_cpus=os.cpu_count() or 2,
             object_store_memory=128 * 1024**2, log_to_driver=False, runtime_env=_ACTOR_ENV)
    load_before = os.getloadavg()
    tokenizer = Tokenizer.byte_level()
    model_config = ModelConfig(vocab_size=tokenizer.vocab_size)
    engine = ray.remote(EngineActor).options(
        num_cpus=0, max_concurrency=10_000, runtime_env=_ACTOR_ENV).remote(
        model_config, args.seed, tokenizer, {"max_batch_size": args.max_batch_size})
    warm_up(engine, args)

    calibration = {}
    latency = args.tool_latency_s
    if latency is None:
        pool = EnvPool("simulated_tool", {"tool_latency_s": 0.0, "turns": args.turns},
                       num_actors=1)
        turn_times: list[float] = []
        tasks = make_tasks(2 * args.max_batch_size)
        asyncio.run(run_lockstep(tasks[:args.max_batch_size], tokenizer, engine, pool, args))
        asyncio.run(run_lockstep(tasks[args.max_batch_size:], tokenizer, engine, pool, args,
                                 turn_times))
        for actor in pool.actors:
            ray.kill(actor)
        turn_s = statistics.median(turn_times)
        latency = args.latency_factor * turn_s
        calibration = {"generation_turn_s": turn_s, "turn_samples": len(turn_times)}

    pool = EnvPool("simulated_tool", {"tool_latency_s": latency, "turns": args.turns,
                                      "jitter": args.jitter, "seed": args.seed},
                   num_actors=args.env_actors)
    pool.wait_ready()
    results: dict[str, list[dict]] = {"lockstep": [], "async": []}
    for _ in range(args.repeats):
        tasks = make_tasks(args.trajectories)
        results["lockstep"].append(measure_lockstep(tasks, tokenizer, engine, pool, args))
        results["async"].append(measure_async(tasks, tokenizer, engine, pool, args,
                                              model_config.max_seq_len))
    summary = {mode: summarize(runs) for mode, runs in results.items()}
    print(json.dumps({
        "benchmark": "rollout_overlap",
        "machine": {**machine(), "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "parameters": {**vars(args), "tool_latency_s": latency, "model": {
            "d_model": model_config.d_model, "n_layers": model_config.n_layers,
            "vocab_size": model_config.vocab_size}},
        "calibration": calibration,
        **summary,
        "speedup_trajectories_per_s":
            summary["async"]["trajectories_per_s"] / summary["lockstep"]["trajectories_per_s"],
    }, indent=2))
    ray.shutdown()


if __name__ == "__main__":
    main()
