"""How much CPU does the rollout orchestrator spend per turn at 1,000 concurrent episodes?

The orchestrator is one asyncio process for the whole run (DESIGN.md: at ~10k concurrent
episodes it must stay under a few percent of one core per thousand turns per second), so
its cost per turn bounds the turns/s a run can reach. This script runs the real
``RolloutOrchestrator`` in-process, without Ray, with everything around it taking no time:

* engine: ``InstantEngine``, an ``EngineClient`` that answers every request at the next
  turn of the event loop (all requests of one loop iteration in one batch, as a
  continuous-batching engine would), with ``--max-new-tokens`` seeded random byte tokens
  per reply, finish reason ``length``;
* environment: ``simulated_tool`` in-process (``LocalEnv``) with zero tool latency;
  every episode takes ``--turns`` turns;
* agent: the ``text`` agent with the byte-level tokenizer: every reply is decoded and
  every observation tokenized, as in a real run.

After ``--warmup-turns`` it measures ``time.process_time()`` (CPU seconds of the
process, all threads) over windows of ``--turns-measured`` turns (engine calls) and
divides by the turns made meanwhile; the median of ``--repeats`` windows is reported. The work counted per turn: the episode loop, the agent's
tokenization and parsing, the environment's (zero-latency) step, trajectory assembly,
group handling, packing into Arrow record batches, admission and accounting. Ray's own
per-call costs (serialization, RPC) are not in it: they depend on the deployment, not on
this code.

With ``--ray 1`` (the default) the same workload also runs the way ``raytunix train``
runs it: an ``OrchestratorActor`` whose engine is an actor answering as ``InstantEngine``
does (``InstantEngineActor``) and whose environments are ``simulated_tool`` env actors of
an ``EnvPool`` with zero latency. Then the orchestrator actor's process CPU seconds
(``psutil``) per turn are its cost with Ray's calls in: ``ray_cpu_ms_per_turn``.

Prints one JSON object; the key ``cpu_ms_per_turn`` is the claim's number (target < 0.5),
``ray_cpu_ms_per_turn`` the same with Ray in the loop. ``--profile`` adds the top
functions of a cProfile run of the measured window (in-process).

    python benchmarks/orchestrator_overhead.py
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import os
import platform
import pstats
import random
import statistics
import sys
import time

from local_ray import add_ray_address_arg, init_ray

from raytunix.agents import make_agent
from raytunix.models.tokenizer import Tokenizer
from raytunix.rollout.env_pool import LocalEnv
from raytunix.rollout.orchestrator import RolloutOrchestrator
from raytunix.types import FinishReason, GenerationRequest, GenerationResult, SamplingParams, Task


class InstantEngine:
    """An ``EngineClient`` with no compute: every request is answered at the next turn of
    the event loop, all requests that arrived in one turn together.

    Each reply is the first ``sampling.max_new_tokens`` tokens of one of 1024 random
    strings of lowercase letters and spaces, drawn once (the request's seed picks which),
    with logprob -1.0 and ``policy_version`` each, finish reason ``LENGTH``. Replies are
    precomputed so that the engine's own cost stays out of the orchestrator's.

    Args:
      tokenizer: the byte-level ``Tokenizer``; replies are ids of its single-byte tokens.
      max_new_tokens: the longest reply asked for.
      policy_version: stamped on every generated token.
      seed: seeds the replies.
    """

    def __init__(
        self, tokenizer: Tokenizer, max_new_tokens: int, policy_version: int = 0, seed: int = 0
    ):
        ids = sorted(
            {tokenizer.encode(chr(c))[0] for c in range(ord("a"), ord("z") + 1)}
            | {tokenizer.encode(" ")[0]}
        )
        rng = random.Random(seed)
        self._replies = [tuple(rng.choices(ids, k=max_new_tokens)) for _ in range(1024)]
        self._logprobs = (-1.0,) * max_new_tokens
        self._versions = (policy_version,) * max_new_tokens
        self.policy_version = policy_version
        self.requests = 0
        self.sessions_ended = 0
        self._batch: list[tuple[GenerationRequest, asyncio.Future]] = []

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        if not self._batch:
            loop.call_soon(self._step)
        self._batch.append((request, future))
        self.requests += 1
        return await future

    def end_session(self, session_id: str) -> None:
        self.sessions_ended += 1

    def _step(self) -> None:
        batch, self._batch = self._batch, []
        for request, future in batch:
            if future.done():  # the episode was cancelled
                continue
            n = request.sampling.max_new_tokens
            future.set_result(
                GenerationResult(
                    request_id=request.request_id,
                    token_ids=self._replies[request.seed % len(self._replies)][:n],
                    logprobs=self._logprobs[:n],
                    policy_versions=self._versions[:n],
                    finish_reason=FinishReason.LENGTH,
                )
            )


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=1000, help="episodes in flight")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--groups-per-batch", type=int, default=16)
    p.add_argument("--turns", type=int, default=4, help="turns (tool calls) per episode")
    p.add_argument("--max-new-tokens", type=int, default=32, help="generated tokens per turn")
    p.add_argument(
        "--turns-measured",
        type=int,
        default=20_000,
        help="turns (engine calls) per measured window",
    )
    p.add_argument(
        "--warmup-turns",
        type=int,
        default=5_000,
        help="turns before the first window (the start-up ramp)",
    )
    p.add_argument("--repeats", type=int, default=3, help="measured windows (median taken)")
    p.add_argument(
        "--profile",
        action="store_true",
        help="also print the top functions (cProfile) of one more window",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--ray",
        type=int,
        default=1,
        help="1: also measure the OrchestratorActor with an instant engine actor "
        "and instant env actors (ray_cpu_ms_per_turn)",
    )
    p.add_argument(
        "--ray-concurrency", type=int, default=256, help="episodes in flight in the Ray measurement"
    )
    p.add_argument("--env-actors", type=int, default=2, help="env actors (Ray measurement)")
    add_ray_address_arg(p)
    args = p.parse_args(argv)
    for name in ("turns_measured", "warmup_turns"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}.")
    if args.concurrency < args.group_size:
        p.error(
            f"--concurrency ({args.concurrency}) must hold one group "
            f"(--group-size {args.group_size})."
        )
    return args


async def measure(args) -> dict:
    tokenizer = Tokenizer.byte_level()
    engine = InstantEngine(tokenizer, args.max_new_tokens, seed=args.seed)
    env_kwargs = {"tool_latency_s": 0.0, "turns": args.turns}
    tasks = [
        Task(task_id=f"t{i}", question=f"Task {i}: look it up.", answer="") for i in range(10_000)
    ]
    orchestrator = RolloutOrchestrator(
        tasks=tasks,
        agent_factory=lambda: make_agent("text", tokenizer),
        engine=engine,
        env_provider=lambda group_id: (LocalEnv("simulated_tool", env_kwargs), lambda: None),
        group_size=args.group_size,
        groups_per_batch=args.groups_per_batch,
        max_concurrent_episodes=args.concurrency,
        max_staleness=10**9,  # no learner: admission never waits for one
        max_turns=args.turns,
        max_context_tokens=4096,
        sampling=SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0),
        episode_timeout_s=600.0,
        batch_queue_size=64,
        seed=args.seed,
    )
    consumed = {"trajectories": 0, "batches": 0}

    async def consume() -> None:
        while True:
            _, info = await orchestrator.next_batch()
            orchestrator.mark_trained(info["batch_id"], 0)  # the ledger path, as in a run
            consumed["trajectories"] += info["num_trajectories"]
            consumed["batches"] += 1

    async def turns_done(count: int, in_flight: list[int] | None = None) -> None:
        # Sampled after each sleep, while the window's turns run: a sample taken at its
        # first instant can fall between one batch's episodes and the next admission.
        target = engine.requests + count
        while engine.requests < target:
            await asyncio.sleep(0.002)
            if in_flight is not None:
                in_flight.append(orchestrator.stats()["episodes_in_flight"])

    async def window(profiler: cProfile.Profile | None = None) -> dict:
        in_flight: list[int] = []
        requests0, trajectories0 = engine.requests, consumed["trajectories"]
        cpu0, wall0 = time.process_time(), time.perf_counter()
        if profiler is not None:
            profiler.enable()
        await turns_done(args.turns_measured, in_flight)
        if profiler is not None:
            profiler.disable()
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        turns = engine.requests - requests0
        return {
            "turns": turns,
            "trajectories": consumed["trajectories"] - trajectories0,
            "cpu_s": cpu,
            "wall_s": wall,
            "cpu_ms_per_turn": 1000 * cpu / turns,
            "turns_per_s": turns / wall,
            "mean_episodes_in_flight": statistics.mean(in_flight) if in_flight else None,
        }

    # The learner side is instant too, but a consumer runs only when the event loop gets
    # to it; a few of them keep the batch queue from filling and stopping admission.
    consumers = [asyncio.create_task(consume()) for _ in range(4)]
    await turns_done(args.warmup_turns)
    runs = [await window() for _ in range(args.repeats)]
    profile = None
    if args.profile:
        profiler = cProfile.Profile()
        await window(profiler)
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(25)
        profile = out.getvalue()
    for consumer in consumers:
        consumer.cancel()
    await orchestrator.stop()
    return {"runs": runs, "profile": profile, "counters": dict(orchestrator.counters)}


class InstantEngineActor:
    """``InstantEngine`` as a Ray actor, with the calls the orchestrator makes of an engine
    actor (``generate``, ``end_session``, ``abort``, ``engine_stats``)."""

    def __init__(self, max_new_tokens: int, seed: int):
        self.engine = InstantEngine(Tokenizer.byte_level(), max_new_tokens, seed=seed)

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        return await self.engine.generate(request)

    def end_session(self, session_id: str) -> None:
        self.engine.end_session(session_id)

    def abort(self, request_id: str) -> bool:
        return False

    def engine_stats(self) -> dict:
        return {
            "requests": self.engine.requests,
            "busy_s": 0.0,
            "wall_s": 0.0,
            "active_slots": 0,
            "waiting": 0,
        }


def measure_ray(args) -> dict:
    """The orchestrator actor's CPU per turn with Ray in the loop (see module docstring)."""
    import psutil
    import ray

    from raytunix.rollout.actor import OrchestratorActor
    from raytunix.rollout.env_pool import EnvPool

    init_ray(args.ray_address, {"env_vars": {"JAX_PLATFORMS": "cpu"}})
    try:
        tokenizer = Tokenizer.byte_level()
        engine = (
            ray.remote(InstantEngineActor)
            .options(num_cpus=0, max_concurrency=10_000)
            .remote(args.max_new_tokens, args.seed)
        )
        pool = EnvPool(
            "simulated_tool",
            {"tool_latency_s": 0.0, "turns": args.turns},
            num_actors=args.env_actors,
        )
        pool.wait_ready()
        tasks = [
            Task(task_id=f"r{i}", question=f"Task {i}: look it up.", answer="")
            for i in range(10_000)
        ]
        orchestrator = (
            ray.remote(OrchestratorActor)
            .options(num_cpus=0, max_concurrency=10_000)
            .remote(
                tasks=tasks,
                tokenizer=tokenizer,
                agent_name="text",
                env_pool=pool,
                engine=engine,
                group_size=args.group_size,
                groups_per_batch=args.groups_per_batch,
                max_concurrent_episodes=args.ray_concurrency,
                max_staleness=10**9,
                max_turns=args.turns,
                max_context_tokens=4096,
                sampling=SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0),
                episode_timeout_s=600.0,
                batch_queue_size=64,
                seed=args.seed,
            )
        )
        process = psutil.Process(
            ray.get(orchestrator.__ray_call__.remote(lambda self: os.getpid()))
        )

        def consume(turns: int) -> dict:
            done, trajectories = 0.0, 0
            while done < turns:
                _, info = ray.get(orchestrator.next_batch.remote())
                orchestrator.mark_trained.remote(info["batch_id"], 0)
                done += info["turns_mean"] * info["num_trajectories"]
                trajectories += info["num_trajectories"]
            return {"turns": done, "trajectories": trajectories}

        consume(args.warmup_turns // 4)
        runs = []
        for _ in range(args.repeats):
            cpu0 = sum(process.cpu_times()[:2])
            wall0 = time.perf_counter()
            got = consume(args.turns_measured // 4)
            cpu = sum(process.cpu_times()[:2]) - cpu0
            wall = time.perf_counter() - wall0
            runs.append(
                {
                    **got,
                    "cpu_s": cpu,
                    "wall_s": wall,
                    "cpu_ms_per_turn": 1000 * cpu / got["turns"],
                    "turns_per_s": got["turns"] / wall,
                }
            )
        ray.get(orchestrator.stop.remote())
        return {"runs": runs, "concurrency": args.ray_concurrency, "env_actors": args.env_actors}
    finally:
        ray.shutdown()


def _spread(values: list[float]) -> dict:
    return {
        "mean": statistics.fmean(values),
        "median": statistics.median(values),
        "worst": max(values),
    }


def main(argv=None) -> dict:
    args = parse_args(argv)
    load_before = os.getloadavg()
    result = asyncio.run(measure(args))
    ray_result = measure_ray(args) if args.ray else None
    runs = result["runs"]
    report = {
        "benchmark": "orchestrator_overhead",
        "cpu_ms_per_turn": statistics.median(r["cpu_ms_per_turn"] for r in runs),
        "cpu_ms_per_turn_repeats": _spread([r["cpu_ms_per_turn"] for r in runs]),
        "ray_cpu_ms_per_turn": (
            None
            if ray_result is None
            else statistics.median(r["cpu_ms_per_turn"] for r in ray_result["runs"])
        ),
        "ray_cpu_ms_per_turn_repeats": (
            None
            if ray_result is None
            else _spread([r["cpu_ms_per_turn"] for r in ray_result["runs"]])
        ),
        "ray": ray_result,
        "turns_per_s": statistics.median(r["turns_per_s"] for r in runs),
        "mean_episodes_in_flight": statistics.median(r["mean_episodes_in_flight"] for r in runs),
        "machine": {
            "cpu_count": os.cpu_count(),
            "processor": platform.processor(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
        },
        "parameters": vars(args),
        "runs": runs,
        "counters": result["counters"],
    }
    if result["profile"] is not None:
        print(result["profile"], file=sys.stderr)
    return report


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))
