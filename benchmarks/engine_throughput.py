"""Engine throughput on a multi-turn agentic workload, beside a bare decode loop.

Claim (issue "Inference engine at the throughput limit"): on a workload shaped like
agentic RL, the engine's generated tokens/s at 64 concurrent episodes reach at least 0.6
of a bare jitted static-batch decode loop of the same model (the limit), the prompt
tokens it computes stay at most 1.5 per generated token, and its cost follows live work
(few concurrent episodes, or a longer ``max_seq_len``, do not make it pay for capacity).

Workload: 64 episodes = 16 prompts x 4 samples (a GRPO group per prompt). A prompt is a
system prompt all episodes share (200 tokens) and a question of its own (150 tokens). An
episode takes 3 turns of 32 generated tokens (temperature 1, no stop token); after each
turn a tool runs (latency 0, or 200 ms jittered +-50%) and its reply (20 tokens) is
appended. Each turn continues the episode's session, so the engine may keep its KV.
Episodes start as soon as one of ``concurrency`` places is free.

Model: the default ``ModelConfig`` dims (d_model 128, 3 layers, 4 heads, 2 KV heads,
d_ff 384) with a 4096-token vocabulary and random weights; token ids are random too.

Bare limit: ``jax.lax.fori_loop`` over decode steps of the same model, all 64 rows in
lockstep over a dense KV cache of 640 positions, sampling at temperature 1, no Python
between steps: the tokens/s no scheduler can beat on this machine.

Prints one JSON object. Run: ``python benchmarks/engine_throughput.py`` (about 5 minutes
on 2 CPU cores). ``--engine-path`` lets another checkout's engine run the same workload.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import inspect
import json
import os
import platform
import random
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--latencies-ms", type=float, nargs="+", default=[0.0, 200.0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=200)
    parser.add_argument("--question-tokens", type=int, default=150)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--tool-tokens", type=int, default=20)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--max-seq-len", type=int, default=640)
    parser.add_argument("--long-max-seq-len", type=int, default=2048,
                        help="also run the 64-concurrency, no-latency workload with this "
                             "max_seq_len (0 = skip)")
    parser.add_argument("--max-batch-size", type=int, default=24,
                        help="the engine's decode rows; fewer than the concurrency makes "
                             "older episodes finish first")
    parser.add_argument("--max-batch-size-bare", type=int, default=64,
                        help="rows of the bare decode loop (the limit)")
    parser.add_argument("--bare-steps", type=int, default=96)
    parser.add_argument("--max-prefill-delay-steps", type=int, default=None,
                        help="the engine's setting (default: the engine's default)")
    parser.add_argument("--engine-path", default=None,
                        help="import raytunix from this directory (e.g. an older checkout)")
    parser.add_argument("--model-scale", choices=["default", "0.5b"], default="default",
                        help="0.5b: a ~0.5B-parameter config, for an accelerator")
    parser.add_argument("--cold-start", type=int, default=1,
                        help="1: also measure the first episodes of a fresh engine process "
                             "(default engine settings) against later repeats; 0 = skip")
    parser.add_argument("--cold-start-only", choices=["ahead", "lazy"], default=None,
                        help=argparse.SUPPRESS)  # the fresh process of that measurement
    return parser.parse_args()


ARGS = _parse_args()
if ARGS.engine_path:
    sys.path.insert(0, ARGS.engine_path)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from raytunix.inference.engine import InferenceEngine  # noqa: E402
from raytunix.inference.sampling import sample_tokens  # noqa: E402
from raytunix.models.llama import ModelConfig, forward, init_kv_cache, init_model  # noqa: E402
from raytunix.types import GenerationRequest, SamplingParams  # noqa: E402


class IdText:
    """Decodes token ids as their numbers: the workload's tokens are random ids, and the
    engine only needs text for stop strings (none here) and ``result.text``."""

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(map(str, ids))


def model_config(max_seq_len: int) -> ModelConfig:
    if ARGS.model_scale == "0.5b":
        return ModelConfig(vocab_size=ARGS.vocab, d_model=1024, n_layers=24, n_heads=16,
                           n_kv_heads=4, d_ff=4096, max_seq_len=max_seq_len)
    return ModelConfig(vocab_size=ARGS.vocab, max_seq_len=max_seq_len)


def make_engine(graphdef, params, config, max_seq_len):
    """The engine under test, built with the arguments its constructor takes."""
    accepted = inspect.signature(InferenceEngine.__init__).parameters
    kwargs = {"max_batch_size": ARGS.max_batch_size, "max_seq_len": max_seq_len}
    if "prefill_len_buckets" in accepted:  # the engine before paged KV (94fdd8d)
        kwargs["prefill_len_buckets"] = (64, 128, 256, 512, max_seq_len)
    if ARGS.max_prefill_delay_steps is not None:
        kwargs["max_prefill_delay_steps"] = ARGS.max_prefill_delay_steps
    return InferenceEngine(graphdef, params, config, IdText(), **kwargs)


def workload(seed: int = 0):
    rng = random.Random(seed)
    system = [rng.randrange(ARGS.vocab) for _ in range(ARGS.system_tokens)]
    prompts = [system + [rng.randrange(ARGS.vocab) for _ in range(ARGS.question_tokens)]
               for _ in range(ARGS.prompts)]
    tool_replies = [[rng.randrange(ARGS.vocab) for _ in range(ARGS.tool_tokens)]
                    for _ in range(ARGS.prompts * ARGS.group_size * ARGS.turns)]
    return prompts, tool_replies


async def run_workload(engine, concurrency: int, latency_s: float, seed: int = 0) -> dict:
    prompts, tool_replies = workload(seed)
    has_sessions = "session_id" in inspect.signature(GenerationRequest).parameters
    jitter = random.Random(seed + 1)
    places = asyncio.Semaphore(concurrency)
    group_done: dict[int, float] = {}
    remaining = {g: ARGS.group_size for g in range(ARGS.prompts)}
    generated = 0
    start = time.monotonic()

    async def episode(index: int):
        nonlocal generated
        group = index // ARGS.group_size
        async with places:
            context = list(prompts[group])
            for turn in range(ARGS.turns):
                extra = {"session_id": f"ep{index}"} if has_sessions else {}
                request = GenerationRequest(
                    request_id=f"ep{index}/t{turn}", prompt_ids=tuple(context),
                    sampling=SamplingParams(max_new_tokens=ARGS.new_tokens, temperature=1.0),
                    seed=index * 1000 + turn, **extra)
                result = await engine.generate(request)
                generated += len(result.token_ids)
                context += result.token_ids
                if latency_s > 0:
                    await asyncio.sleep(latency_s * jitter.uniform(0.5, 1.5))
                context += tool_replies[index * ARGS.turns + turn]
            if has_sessions:
                engine.end_session(f"ep{index}")
        remaining[group] -= 1
        if remaining[group] == 0:
            group_done[group] = time.monotonic() - start

    before = engine.stats()
    await asyncio.gather(*(episode(i) for i in range(ARGS.prompts * ARGS.group_size)))
    wall = time.monotonic() - start
    after = engine.stats()
    computed = after.get("prompt_tokens_computed")
    if computed is None:  # the old engine re-prefilled every prompt in full
        computed_prompt = None
    else:
        computed_prompt = (computed - before["prompt_tokens_computed"]
                           + after["generated_tokens_recomputed"]
                           - before["generated_tokens_recomputed"])
    return {
        "generated_tokens": generated,
        "wall_s": round(wall, 3),
        "generated_tokens_per_s": round(generated / wall, 1),
        "prompt_tokens_per_generated_token": (None if computed_prompt is None
                                              else round(computed_prompt / generated, 3)),
        "first_group_fraction": round(min(group_done.values()) / wall, 3),
        "engine_busy_fraction": round((after["busy_s"] - before["busy_s"]) / wall, 3),
        "prefill_s": _delta(before, after, "busy_prefill_s"),
        "decode_s": _delta(before, after, "busy_decode_s"),
        "prefill_calls": _delta(before, after, "prefill_calls"),
        "decode_steps": _delta(before, after, "decode_steps"),
        "mean_decode_rows": round(
            (after["tokens_generated"] - before["tokens_generated"])
            / max(1, after["decode_steps"] - before["decode_steps"]), 1),
        "compiled_during_run": (after["compiled_programs"] - before["compiled_programs"]
                                if "compiled_programs" in after else None),
        **_device_accounting(before, after),
    }


def _device_accounting(before: dict, after: dict) -> dict:
    """What the device did in the run, padding counted: tokens through the model (rows x
    tokens per row of every program, pad rows included) per generated token, the prefill
    share of device time, and host gaps (requests held, no step on the device). {} for an
    engine that does not count them."""
    if "padded_tokens" not in after:
        return {}
    d = {k: after[k] - before[k] for k in ("padded_tokens", "tokens_generated", "busy_s",
                                           "busy_prefill_s", "work_s", "compile_stall_s",
                                           "compile_stalls", "compiles")}
    return {
        "padded_tokens_per_generated_token": round(
            d["padded_tokens"] / max(1, d["tokens_generated"]), 3),
        "prefill_share_of_device_time": round(d["busy_prefill_s"] / max(1e-9, d["busy_s"]), 3),
        "host_gap_fraction": round(max(0.0, d["work_s"] - d["busy_s"]) / max(1e-9, d["work_s"]),
                                   3),
        "compiles": d["compiles"],
        "compile_stalls": d["compile_stalls"],
        "compile_stall_s": round(d["compile_stall_s"], 3),
    }


def _delta(before: dict, after: dict, key: str):
    if key not in after:
        return None
    return round(after[key] - before[key], 3)


def make_bare_loop(graphdef, params, config):
    """Returns ``measure() -> tokens/s`` of a jitted static-batch decode loop (see module
    docstring), compiled once."""
    batch, steps, cache_len = ARGS.max_batch_size_bare, ARGS.bare_steps, ARGS.max_seq_len
    start_pos = ARGS.system_tokens + ARGS.question_tokens

    @functools.partial(jax.jit, donate_argnums=(1,))
    def loop(params, cache, tokens):
        def body(i, carry):
            cache, tokens = carry
            positions = jnp.full((batch, 1), start_pos, jnp.int32) + i
            logits, cache = forward(graphdef, params, tokens[:, None], positions, cache)
            seeds = jnp.arange(batch, dtype=jnp.uint32)
            tokens, _ = sample_tokens(logits[:, 0], jnp.ones((batch,), jnp.float32), seeds,
                                      seeds, jnp.full((batch,), i, jnp.int32))
            return cache, tokens
        return jax.lax.fori_loop(0, steps, body, (cache, tokens))

    tokens = jnp.zeros((batch,), jnp.int32)
    state = {"cache": init_kv_cache(config, batch, cache_len)}
    state["cache"], out = loop(params, state["cache"], tokens)  # compile
    out.block_until_ready()

    def measure(repeats: int = 3) -> float:
        best = 0.0
        for _ in range(repeats):
            t0 = time.perf_counter()
            state["cache"], out = loop(params, state["cache"], tokens)
            out.block_until_ready()
            best = max(best, batch * steps / (time.perf_counter() - t0))
        return best

    return measure


async def measure(graphdef, params, config, max_seq_len, concurrency, latency_s) -> dict:
    engine = make_engine(graphdef, params, config, max_seq_len)
    try:
        return await run_workload(engine, concurrency, latency_s)
    finally:
        await engine.close()


async def cold_start_process(mode: str) -> dict:
    """In a fresh process: an engine with the training run's default settings
    (``EngineConfig``, compiling ahead or lazily) serves the 64-episode workload at once
    after it is built (cold), then twice more once its compiler is idle (warm)."""
    from raytunix.config import EngineConfig

    config = model_config(ARGS.max_seq_len)
    graphdef, params = init_model(config, seed=0)
    kwargs = {**EngineConfig().engine_kwargs(), "compile_ahead": mode == "ahead"}
    engine = InferenceEngine(graphdef, params, config, IdText(), max_seq_len=ARGS.max_seq_len,
                             **kwargs)
    top = max(ARGS.concurrency)
    try:
        cold = await run_workload(engine, top, 0.0, seed=0)
        await asyncio.to_thread(engine.wait_until_compiled, 1800)
        # Other prompts (seeds): the prefix cache helps the repeats no more than the first.
        warm = [await run_workload(engine, top, 0.0, seed=seed) for seed in (1, 2)]
        stats = engine.stats()
    finally:
        await engine.close()
    rates = [w["generated_tokens_per_s"] for w in warm]
    return {"compile_ahead": mode == "ahead", "concurrency": top,
            "max_batch_size": kwargs["max_batch_size"],
            "cold_tokens_per_s": cold["generated_tokens_per_s"],
            "warm_tokens_per_s": rates, "cold_over_warm": round(
                cold["generated_tokens_per_s"] / float(np.mean(rates)), 3),
            "cold_wall_s": cold["wall_s"], "cold_compile_stall_s": cold.get("compile_stall_s"),
            "cold_compile_stalls": cold.get("compile_stalls"),
            "warm_compile_stalls": [w.get("compile_stalls") for w in warm],
            "programs_compiled": stats["compiles"],
            "programs_compiled_ahead": stats["compiles_ahead"],
            "compile_s": round(stats["compile_s"], 1)}


def measure_cold_start() -> dict:
    """``cold_start_process`` for each mode in fresh processes: first with an empty
    persistent compilation cache (a first run on a machine), then again with the cache the
    first left (every later run: ``run.compilation_cache_dir`` is on by default)."""
    import subprocess
    import tempfile

    out: dict = {}
    for mode in ("ahead", "lazy"):
        with tempfile.TemporaryDirectory(prefix="raytunix-bench-jax-cache-") as cache:
            env = {k: v for k, v in os.environ.items()
                   if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))}
            env.update(JAX_COMPILATION_CACHE_DIR=cache,
                       JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                       JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
            argv = [sys.executable, os.path.abspath(__file__), "--cold-start-only", mode,
                    "--max-seq-len", str(ARGS.max_seq_len), "--vocab", str(ARGS.vocab),
                    "--model-scale", ARGS.model_scale, "--concurrency",
                    *map(str, ARGS.concurrency)]
            if ARGS.engine_path:
                argv += ["--engine-path", ARGS.engine_path]
            runs = {}
            for disk in ("empty_compilation_cache", "warm_compilation_cache"):
                done = subprocess.run(argv, env=env, capture_output=True, text=True,
                                      check=True)
                runs[disk] = json.loads(done.stdout)
            out["compile_ahead" if mode == "ahead" else "lazy"] = runs
    ahead = out["compile_ahead"]["empty_compilation_cache"]
    return {"cold_over_warm": ahead["cold_over_warm"], **out}


async def main() -> dict:
    config = model_config(ARGS.max_seq_len)
    graphdef, params = init_model(config, seed=0)
    cold_start = measure_cold_start() if ARGS.cold_start else None
    t0 = time.monotonic()
    # Warm-up: every run once, so the programs each needs are compiled before timing.
    for latency_ms in ARGS.latencies_ms:
        for concurrency in ARGS.concurrency:
            await measure(graphdef, params, config, ARGS.max_seq_len, concurrency,
                          latency_ms / 1000)
    warmup_s = time.monotonic() - t0
    bare = make_bare_loop(graphdef, params, config)
    limits = []

    results: dict = {}
    for latency_ms in ARGS.latencies_ms:
        per = {}
        for concurrency in ARGS.concurrency:
            # The limit is measured right before and after each run (the machine's speed
            # drifts), and the faster of the two counts: the fraction errs low.
            before = bare()
            run = await measure(graphdef, params, config, ARGS.max_seq_len, concurrency,
                                latency_ms / 1000)
            limit = max(before, bare())
            limits.append(limit)
            run["bare_limit_tokens_per_s"] = round(limit, 1)
            run["fraction_of_bare_limit"] = round(run["generated_tokens_per_s"] / limit, 3)
            per[str(concurrency)] = run
        results[f"tool_latency_{latency_ms:g}ms"] = per
    limit = float(np.median(limits))

    long_run = None
    if ARGS.long_max_seq_len:
        long_config = model_config(ARGS.long_max_seq_len)
        top = max(ARGS.concurrency)
        await measure(graphdef, params, long_config, ARGS.long_max_seq_len, top, 0.0)  # warm
        long_run = await measure(graphdef, params, long_config, ARGS.long_max_seq_len, top, 0.0)
        short = results[f"tool_latency_{ARGS.latencies_ms[0]:g}ms"][str(top)]
        long_run["ratio_to_max_seq_len_%d" % ARGS.max_seq_len] = round(
            long_run["generated_tokens_per_s"] / short["generated_tokens_per_s"], 3)
        long_run["max_seq_len"] = ARGS.long_max_seq_len
        long_run["concurrency"] = top

    return {
        "benchmark": "engine_throughput",
        "engine": ARGS.engine_path or "this checkout",
        "machine": {"processor": platform.processor() or platform.machine(),
                    "cpus": os.cpu_count(), "python": platform.python_version(),
                    "jax": jax.__version__, "backend": jax.default_backend(),
                    "load_average_1min": round(os.getloadavg()[0], 2)},
        "workload": {k: getattr(ARGS, k) for k in (
            "prompts", "group_size", "system_tokens", "question_tokens", "turns",
            "new_tokens", "tool_tokens", "vocab", "max_seq_len", "max_batch_size",
            "max_batch_size_bare", "model_scale")},
        "bare_limit_tokens_per_s": round(limit, 1),  # median of the per-run limits
        "warmup_s": round(warmup_s, 1),
        "runs": results,
        "long_context": long_run,
        "cold_start": cold_start,
    }


if __name__ == "__main__":
    if ARGS.cold_start_only:
        print(json.dumps(asyncio.run(cold_start_process(ARGS.cold_start_only))))
    else:
        print(json.dumps(asyncio.run(main()), indent=2))
