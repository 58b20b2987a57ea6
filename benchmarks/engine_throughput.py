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

A ladder of limits, measured in the same run (``limits``): the bare loop above; a
*matched* loop (the engine's own step function at its row and span buckets for this
workload, no scheduler); a *tuned* loop (``tuned_step_fn``: per-layer KV arrays, attention
over the live span only, one random number per row, unrolled steps; its greedy tokens are
checked against the model's); a large fp32 matmul (``gemm_gflops``) and copy
(``copy_gb_per_s``); and the model's FLOPs and bytes per generated token. Each run reports
``fraction_of_tuned_limit`` beside ``fraction_of_bare_limit``, and the device work counted
with its padding (``padded_tokens_per_generated_token``), the prefill share of device time
and the host gaps (``host_gap_fraction``).

Cold start (``cold_start``): fresh processes with the training run's default engine
settings serve the 64-episode workload once at start and twice more later; lazily
compiled, compiling ahead with the workload sent at once, and compiling ahead with the
workload sent after start-up; each with an empty and with a warm persistent compilation
cache (``cold_over_warm`` for each).

Prints one JSON object. Run: ``python benchmarks/engine_throughput.py`` (about 15 minutes
on 2 CPU cores; ``--cold-start 0`` skips the cold start). ``--engine-path`` lets another
checkout's engine run the same workload.
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
    parser.add_argument(
        "--long-max-seq-len",
        type=int,
        default=2048,
        help="also run the 64-concurrency, no-latency workload with this max_seq_len (0 = skip)",
    )
    parser.add_argument(
        "--max-batch-size",
        type=int,
        default=24,
        help="the engine's decode rows; fewer than the concurrency makes "
        "older episodes finish first",
    )
    parser.add_argument(
        "--max-batch-size-bare",
        type=int,
        default=64,
        help="rows of the bare decode loop (the limit)",
    )
    parser.add_argument("--bare-steps", type=int, default=96)
    parser.add_argument(
        "--max-prefill-delay-steps",
        type=int,
        default=None,
        help="the engine's setting (default: the engine's default)",
    )
    parser.add_argument(
        "--engine-path",
        default=None,
        help="import raytunix from this directory (e.g. an older checkout)",
    )
    parser.add_argument(
        "--model-scale",
        choices=["default", "0.5b"],
        default="default",
        help="0.5b: a ~0.5B-parameter config, for an accelerator",
    )
    parser.add_argument(
        "--cold-start",
        type=int,
        default=1,
        help="1: also measure the first episodes of a fresh engine process "
        "(default engine settings) against later repeats; 0 = skip",
    )
    parser.add_argument(
        "--cold-start-only",
        choices=["ahead_after_startup", "ahead", "lazy"],
        default=None,
        help=argparse.SUPPRESS,
    )  # the fresh process of that measurement
    return parser.parse_args()


ARGS = _parse_args()
if ARGS.engine_path:
    sys.path.insert(0, ARGS.engine_path)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from machine_rates import best_rate, machine_rates  # noqa: E402 - benchmarks/ is on sys.path

from raytunix.inference.engine import InferenceEngine  # noqa: E402
from raytunix.inference.sampling import sample_tokens  # noqa: E402
from raytunix.models.llama import (  # noqa: E402
    ModelConfig,
    apply_rope,
    forward,
    init_kv_cache,
    init_model,
)
from raytunix.types import GenerationRequest, SamplingParams  # noqa: E402


class IdText:
    """Decodes token ids as their numbers: the workload's tokens are random ids, and the
    engine only needs text for stop strings (none here) and ``result.text``."""

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(map(str, ids))


def model_config(max_seq_len: int) -> ModelConfig:
    if ARGS.model_scale == "0.5b":
        return ModelConfig(
            vocab_size=ARGS.vocab,
            d_model=1024,
            n_layers=24,
            n_heads=16,
            n_kv_heads=4,
            d_ff=4096,
            max_seq_len=max_seq_len,
        )
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
    prompts = [
        system + [rng.randrange(ARGS.vocab) for _ in range(ARGS.question_tokens)]
        for _ in range(ARGS.prompts)
    ]
    tool_replies = [
        [rng.randrange(ARGS.vocab) for _ in range(ARGS.tool_tokens)]
        for _ in range(ARGS.prompts * ARGS.group_size * ARGS.turns)
    ]
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
                    request_id=f"ep{index}/t{turn}",
                    prompt_ids=tuple(context),
                    sampling=SamplingParams(max_new_tokens=ARGS.new_tokens, temperature=1.0),
                    seed=index * 1000 + turn,
                    **extra,
                )
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
        computed_prompt = (
            computed
            - before["prompt_tokens_computed"]
            + after["generated_tokens_recomputed"]
            - before["generated_tokens_recomputed"]
        )
    return {
        "generated_tokens": generated,
        "wall_s": round(wall, 3),
        "generated_tokens_per_s": round(generated / wall, 1),
        "prompt_tokens_per_generated_token": (
            None if computed_prompt is None else round(computed_prompt / generated, 3)
        ),
        "first_group_fraction": round(min(group_done.values()) / wall, 3),
        "engine_busy_fraction": round((after["busy_s"] - before["busy_s"]) / wall, 3),
        "prefill_s": _delta(before, after, "busy_prefill_s"),
        "decode_s": _delta(before, after, "busy_decode_s"),
        "prefill_calls": _delta(before, after, "prefill_calls"),
        "decode_steps": _delta(before, after, "decode_steps"),
        "mean_decode_rows": round(
            (after["tokens_generated"] - before["tokens_generated"])
            / max(1, after["decode_steps"] - before["decode_steps"]),
            1,
        ),
        "compiled_during_run": (
            after["compiled_programs"] - before["compiled_programs"]
            if "compiled_programs" in after
            else None
        ),
        **_device_accounting(before, after),
    }


def _device_accounting(before: dict, after: dict) -> dict:
    """What the device did in the run, padding counted: tokens through the model (rows x
    tokens per row of every program, pad rows included) per generated token, the prefill
    share of device time, and host gaps (requests held, no step on the device). {} for an
    engine that does not count them."""
    if "padded_tokens" not in after:
        return {}
    d = {
        k: after[k] - before[k]
        for k in (
            "padded_tokens",
            "tokens_generated",
            "busy_s",
            "busy_prefill_s",
            "work_s",
            "compile_stall_s",
            "compile_stalls",
            "compiles",
        )
    }
    return {
        "padded_tokens_per_generated_token": round(
            d["padded_tokens"] / max(1, d["tokens_generated"]), 3
        ),
        "prefill_share_of_device_time": round(d["busy_prefill_s"] / max(1e-9, d["busy_s"]), 3),
        "host_gap_fraction": round(max(0.0, d["work_s"] - d["busy_s"]) / max(1e-9, d["work_s"]), 3),
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
            tokens, _ = sample_tokens(
                logits[:, 0],
                jnp.ones((batch,), jnp.float32),
                seeds,
                seeds,
                jnp.full((batch,), i, jnp.int32),
            )
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


def work_per_token(config: ModelConfig, params, context: int, rows: int) -> dict:
    """FLOPs and bytes one decode step spends per generated token at ``context`` positions
    attended and ``rows`` rows sharing the weights: 2 FLOPs per weight of every matmul
    (the embedding table is a lookup unless tied), 4 per attended position per head and
    head dimension (scores and values); bytes = the weights once per step over the rows,
    plus the keys and values attended."""
    total = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    embed = config.vocab_size * config.d_model
    matmul_weights = total - (0 if config.tie_embeddings else embed)
    attn = 4 * config.n_layers * config.n_heads * config.head_dim * context
    kv_bytes = 2 * config.n_layers * config.n_kv_heads * config.head_dim * context * 4
    return {
        "flops_per_token": 2 * matmul_weights + attn,
        "bytes_per_token": round(4 * matmul_weights / rows + kv_bytes),
        "context": context,
        "rows": rows,
    }


def make_matched_loop(graphdef, params, config, rows: int, span_blocks: int, block_size: int = 16):
    """``measure() -> tokens/s`` of the engine's own step (``_forward_step``: paged KV,
    block tables of ``span_blocks`` blocks, its sampler) for ``rows`` rows in a jitted loop:
    the engine's kernel with no scheduler and no host work between steps."""
    from raytunix.inference.engine import _forward_step
    from raytunix.models.llama import init_kv_pages

    steps = ARGS.bare_steps
    start_pos = ARGS.system_tokens + ARGS.question_tokens
    pages = init_kv_pages(config, rows * span_blocks + 1, block_size)
    tables = jnp.arange(rows * span_blocks, dtype=jnp.int32).reshape(rows, span_blocks)

    @functools.partial(jax.jit, donate_argnums=(1,))
    def loop(params, pages, last_tokens):
        def body(i, carry):
            pages, last = carry
            zeros = jnp.zeros((rows,), jnp.int32)
            pages, last, _, _ = _forward_step(
                graphdef,
                False,
                params,
                pages,
                last,
                zeros[:, None],
                jnp.full((rows, 1), start_pos, jnp.int32) + i,
                tables,
                zeros,
                jnp.ones((rows,), jnp.float32),
                zeros,
                jnp.ones((rows,), jnp.float32),
                zeros.astype(jnp.uint32),
                zeros.astype(jnp.uint32),
                zeros + i,
                jnp.arange(rows, dtype=jnp.int32),
                jnp.ones((rows,), bool),
            )
            return pages, last

        return jax.lax.fori_loop(0, steps, body, (pages, last_tokens))

    state = {"pages": pages, "last": jnp.zeros((rows + 1,), jnp.int32)}

    def run():
        state["pages"], state["last"] = loop(params, state["pages"], state["last"])
        return state["last"]

    return lambda: best_rate(run, rows * steps)


def tuned_step_fn(graphdef, config, rows: int, span: int, unroll: int):
    """A decode loop built for speed rather than generality: each layer's keys and values
    are an array of their own (``[rows, kv_heads, span, head_dim]``, written in place at
    the step's position), attention reads only the ``span`` live positions, and sampling
    draws one uniform number per row (inverse CDF over the softmax) instead of one per
    vocabulary entry. Same weights, same arithmetic per token otherwise."""
    from flax import nnx

    groups = config.n_heads // config.n_kv_heads
    hd = config.head_dim

    def step(model, caches, tokens, pos, u, temperature):
        x = model.embed_tokens(tokens[:, None])  # [B, 1, d]
        positions = jnp.full((rows, 1), pos, jnp.int32)
        new = []
        for layer, (block, (ck, cv)) in enumerate(zip(model.layers, caches)):
            attn = block.self_attn
            h = block.input_layernorm(x)
            q = attn.q_proj(h).reshape(rows, 1, config.n_heads, hd)
            k = attn.k_proj(h).reshape(rows, 1, config.n_kv_heads, hd)
            v = attn.v_proj(h).reshape(rows, 1, config.n_kv_heads, hd)
            if attn.q_norm is not None:
                q, k = attn.q_norm(q), attn.k_norm(k)
            q = apply_rope(q, positions, config.rope_theta, config.rope_scaling)
            k = apply_rope(k, positions, config.rope_theta, config.rope_scaling)
            ck = jax.lax.dynamic_update_slice(ck, k.transpose(0, 2, 1, 3), (0, 0, pos, 0))
            cv = jax.lax.dynamic_update_slice(cv, v.transpose(0, 2, 1, 3), (0, 0, pos, 0))
            new.append((ck, cv))
            qg = q.reshape(rows, config.n_kv_heads, groups, hd)
            scores = jnp.einsum("bkgd,bksd->bkgs", qg, ck) / np.sqrt(hd)
            scores = jnp.where(jnp.arange(span) <= pos, scores, -1e30)
            out = jnp.einsum("bkgs,bksd->bkgd", jax.nn.softmax(scores, axis=-1), cv)
            x = x + attn.o_proj(out.reshape(rows, 1, config.n_heads * hd))
            x = x + block.mlp(block.post_attention_layernorm(x))
        logits = model.logits(model.norm(x))[:, 0]
        probs = jax.nn.softmax(logits / temperature[:, None], axis=-1)
        cdf = jnp.cumsum(probs, axis=-1)
        sampled = jnp.argmax(cdf >= u[:, None] * cdf[:, -1:], axis=-1).astype(jnp.int32)
        greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return new, jnp.where(temperature > 0, sampled, greedy)

    @functools.partial(jax.jit, static_argnums=(4,), donate_argnums=(1,))
    def loop(params, caches, tokens, temperature, steps, start_pos, key):
        model = nnx.merge(graphdef, params)
        draws = jax.random.uniform(key, (steps, rows))  # one number per row per step

        def body(i, carry):
            caches, tokens = carry
            caches, tokens = step(model, caches, tokens, start_pos + i, draws[i], temperature)
            return caches, tokens

        return jax.lax.fori_loop(0, steps, body, (caches, tokens), unroll=unroll)

    def caches():
        shape = (rows, config.n_kv_heads, span, hd)
        return [
            (jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32))
            for _ in range(config.n_layers)
        ]

    return loop, caches


def check_tuned_loop(graphdef, params, config) -> int:
    """Greedy tokens of the tuned loop against the model's own dense forward, 6 steps
    from a 5-token prompt on 2 rows; returns how many agree (12 when the loop is right)."""
    rows, prompt, steps, span = 2, 5, 6, 16
    tokens = jnp.array([[3, 9, 27, 81, 243 % config.vocab_size]] * rows, jnp.int32)
    cache = init_kv_cache(config, rows, span)
    logits, cache = forward(
        graphdef, params, tokens, jnp.tile(jnp.arange(prompt), (rows, 1)), cache
    )
    ref, nxt = [], jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
    for t in range(steps):
        ref.append(nxt)
        logits, cache = forward(
            graphdef, params, nxt[:, None], jnp.full((rows, 1), prompt + t, jnp.int32), cache
        )
        nxt = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
    loop, _ = tuned_step_fn(graphdef, config, rows, span, unroll=1)
    # The dense pass's KV; the loop writes each position before it attends to it.
    kv = [(cache.k[i], cache.v[i]) for i in range(config.n_layers)]
    got, fed = [], ref[0]
    for t in range(steps - 1):
        kv, fed = loop(
            params, kv, fed, jnp.zeros((rows,), jnp.float32), 1, prompt + t, jax.random.PRNGKey(0)
        )
        got.append(fed)
    agree = rows + sum(int((a == b).sum()) for a, b in zip(got, ref[1:]))
    return agree


def make_tuned_loop(graphdef, params, config, rows: int, span: int, unroll: int = 4):
    """``measure() -> tokens/s`` of ``tuned_step_fn``'s loop: ``rows`` rows decoding
    ``bare_steps`` tokens from the workload's prompt length, attending over ``span``."""
    steps = ARGS.bare_steps
    start_pos = ARGS.system_tokens + ARGS.question_tokens
    loop, caches = tuned_step_fn(graphdef, config, rows, span, unroll)
    state = {"kv": caches()}
    tokens = jnp.zeros((rows,), jnp.int32)
    temperature = jnp.ones((rows,), jnp.float32)

    def run():
        state["kv"], out = loop(
            params, state["kv"], tokens, temperature, steps, start_pos, jax.random.PRNGKey(1)
        )
        return out

    return lambda: best_rate(run, rows * steps)


def limit_ladder(graphdef, params, config, bare) -> dict:
    """The limits the engine is held against, measured here, fastest of 3 each: today's
    bare loop (dense 640-position cache, 64 rows, the engine's sampler), a *matched* loop
    (the engine's own step at its row bucket and span bucket for this workload), a *tuned*
    loop (``tuned_step_fn``, at the bare loop's rows, attending the live span), and the
    machine's matmul and copy rates; with the model's FLOPs and bytes per generated token
    at the tuned loop's settings, and the GFLOP/s each loop reaches."""
    from raytunix.inference.scheduler import bucket, row_buckets, span_buckets

    block = 16
    longest = (
        ARGS.system_tokens
        + ARGS.question_tokens
        + ARGS.turns * (ARGS.new_tokens + ARGS.tool_tokens)
    )
    rows = bucket(row_buckets(ARGS.max_batch_size), ARGS.max_batch_size)
    span_blocks = bucket(span_buckets(-(-ARGS.max_seq_len // block), block), -(-longest // block))
    live_span = -(-(ARGS.system_tokens + ARGS.question_tokens + ARGS.bare_steps) // 8) * 8
    tuned_rows = ARGS.max_batch_size_bare
    agree = check_tuned_loop(graphdef, params, config)
    out = {
        "bare_tokens_per_s": round(bare(), 1),
        "matched_bare_tokens_per_s": round(
            make_matched_loop(graphdef, params, config, rows, span_blocks, block)(), 1
        ),
        "tuned_bare_tokens_per_s": round(
            make_tuned_loop(graphdef, params, config, tuned_rows, live_span)(), 1
        ),
        **machine_rates(),
        "matched": {"rows": rows, "span_positions": span_blocks * block},
        "tuned": {
            "rows": tuned_rows,
            "span_positions": live_span,
            "unroll": 4,
            "greedy_tokens_agreeing_with_the_model": f"{agree}/12",
        },
        "work_per_token": work_per_token(config, params, live_span, tuned_rows),
    }
    out["tuned_over_bare"] = round(out["tuned_bare_tokens_per_s"] / out["bare_tokens_per_s"], 2)
    flops = out["work_per_token"]["flops_per_token"]
    out["gflops"] = {
        k: round(out[f"{k}_tokens_per_s"] * flops / 1e9, 2)
        for k in ("bare", "matched_bare", "tuned_bare")
    }
    return out


async def measure(graphdef, params, config, max_seq_len, concurrency, latency_s) -> dict:
    engine = make_engine(graphdef, params, config, max_seq_len)
    try:
        return await run_workload(engine, concurrency, latency_s)
    finally:
        await engine.close()


async def cold_start_process(mode: str) -> dict:
    """In a fresh process: an engine with the training run's default settings
    (``EngineConfig``) serves the 64-episode workload (cold), then twice more once its
    compiler is idle (warm). ``lazy``: compiling on first use; ``ahead``: compiling ahead,
    the workload sent the moment the engine is built; ``ahead_after_startup``: the
    workload sent once the engine's start-up compile is done (``startup_s`` from its
    construction), as in ``raytunix train``, whose warm start runs meanwhile."""
    from raytunix.config import EngineConfig

    config = model_config(ARGS.max_seq_len)
    graphdef, params = init_model(config, seed=0)
    kwargs = {**EngineConfig().engine_kwargs(), "compile_ahead": mode != "lazy"}
    t0 = time.perf_counter()
    engine = InferenceEngine(
        graphdef, params, config, IdText(), max_seq_len=ARGS.max_seq_len, **kwargs
    )
    startup_s = None
    if mode == "ahead_after_startup":
        await asyncio.to_thread(engine.wait_until_compiled, 1800)
        startup_s = round(time.perf_counter() - t0, 2)
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
    return {
        "mode": mode,
        "startup_s": startup_s,
        "concurrency": top,
        "max_batch_size": kwargs["max_batch_size"],
        "cold_tokens_per_s": cold["generated_tokens_per_s"],
        "warm_tokens_per_s": rates,
        "cold_over_warm": round(cold["generated_tokens_per_s"] / float(np.mean(rates)), 3),
        "cold_wall_s": cold["wall_s"],
        "cold_compile_stall_s": cold.get("compile_stall_s"),
        "cold_compile_stalls": cold.get("compile_stalls"),
        "warm_compile_stalls": [w.get("compile_stalls") for w in warm],
        "programs_compiled": stats["compiles"],
        "programs_compiled_ahead": stats["compiles_ahead"],
        "compile_s": round(stats["compile_s"], 1),
    }


def measure_cold_start() -> dict:
    """``cold_start_process`` for each mode in fresh processes: first with an empty
    persistent compilation cache (a first run on a machine), then again with the cache the
    first left (every later run: ``run.compilation_cache_dir`` is on by default)."""
    import subprocess
    import tempfile

    out: dict = {}
    for mode in ("lazy", "ahead", "ahead_after_startup"):
        with tempfile.TemporaryDirectory(prefix="raytunix-bench-jax-cache-") as cache:
            env = {
                k: v
                for k, v in os.environ.items()
                if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))
            }
            env.update(
                JAX_COMPILATION_CACHE_DIR=cache,
                JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
            )
            argv = [
                sys.executable,
                os.path.abspath(__file__),
                "--cold-start-only",
                mode,
                "--model-scale",
                ARGS.model_scale,
                "--concurrency",
                *map(str, ARGS.concurrency),
            ]
            for name in (
                "prompts",
                "group_size",
                "system_tokens",
                "question_tokens",
                "turns",
                "new_tokens",
                "tool_tokens",
                "vocab",
                "max_seq_len",
            ):
                argv += ["--" + name.replace("_", "-"), str(getattr(ARGS, name))]
            if ARGS.engine_path:
                argv += ["--engine-path", ARGS.engine_path]
            runs = {}
            for disk in ("empty_compilation_cache", "warm_compilation_cache"):
                done = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
                runs[disk] = json.loads(done.stdout)
            out[mode] = runs
    return {
        "cold_over_warm": out["ahead"]["empty_compilation_cache"]["cold_over_warm"],
        "cold_over_warm_after_startup": out["ahead_after_startup"]["empty_compilation_cache"][
            "cold_over_warm"
        ],
        **out,
    }


async def main() -> dict:
    config = model_config(ARGS.max_seq_len)
    graphdef, params = init_model(config, seed=0)
    cold_start = measure_cold_start() if ARGS.cold_start else None
    t0 = time.monotonic()
    # Warm-up: every run once, so the programs each needs are compiled before timing.
    for latency_ms in ARGS.latencies_ms:
        for concurrency in ARGS.concurrency:
            await measure(
                graphdef, params, config, ARGS.max_seq_len, concurrency, latency_ms / 1000
            )
    warmup_s = time.monotonic() - t0
    bare = make_bare_loop(graphdef, params, config)
    ladder = limit_ladder(graphdef, params, config, bare)
    limits = []

    results: dict = {}
    for latency_ms in ARGS.latencies_ms:
        per = {}
        for concurrency in ARGS.concurrency:
            # The limit is measured right before and after each run (the machine's speed
            # drifts), and the faster of the two counts: the fraction errs low.
            before = bare()
            run = await measure(
                graphdef, params, config, ARGS.max_seq_len, concurrency, latency_ms / 1000
            )
            limit = max(before, bare())
            limits.append(limit)
            run["bare_limit_tokens_per_s"] = round(limit, 1)
            run["fraction_of_bare_limit"] = round(run["generated_tokens_per_s"] / limit, 3)
            run["fraction_of_tuned_limit"] = round(
                run["generated_tokens_per_s"] / ladder["tuned_bare_tokens_per_s"], 3
            )
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
            long_run["generated_tokens_per_s"] / short["generated_tokens_per_s"], 3
        )
        long_run["max_seq_len"] = ARGS.long_max_seq_len
        long_run["concurrency"] = top

    return {
        "benchmark": "engine_throughput",
        "engine": ARGS.engine_path or "this checkout",
        "machine": {
            "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "jax": jax.__version__,
            "backend": jax.default_backend(),
            "load_average_1min": round(os.getloadavg()[0], 2),
        },
        "workload": {
            k: getattr(ARGS, k)
            for k in (
                "prompts",
                "group_size",
                "system_tokens",
                "question_tokens",
                "turns",
                "new_tokens",
                "tool_tokens",
                "vocab",
                "max_seq_len",
                "max_batch_size",
                "max_batch_size_bare",
                "model_scale",
            )
        },
        "bare_limit_tokens_per_s": round(limit, 1),  # median of the per-run limits
        "limits": ladder,
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
