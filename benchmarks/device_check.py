"""The device check (issue 23 item 7): a real-shape model's engine and learner on one
accelerator, against the device's own limits, in one run that prints one JSON object.

What it measures, at the shapes of Qwen2.5-0.5B (random weights; ``--shape tiny`` for a
CPU smoke run) in ``--dtype`` (bfloat16 by default):

* ``decode.bare``: a jitted loop of ``--decode-steps`` decode steps over ``--rows`` rows
  with a dense KV cache (no scheduler, no host work between steps), tokens/s and that as
  a fraction of the HBM-bandwidth roofline: a decode step must read every weight once
  and each row's keys and values, so ``roofline = rows x bandwidth / (weight bytes + KV
  bytes read per step)`` (the memory-bound limit of decoding; Pope et al. 2022,
  "Efficiently Scaling Transformer Inference", arXiv:2211.05102, section 2).
* ``decode.engine``: the ``InferenceEngine`` at the same rows, prompt and output lengths
  (a first round compiles, the second is measured): generated tokens/s over the decode
  device time, its fraction of the bare loop and of the roofline, and the device's idle
  fraction between engine steps (``host_gap_fraction``: time with requests held and no
  step on the device, from the engine's own accounting; ``--trace DIR`` also writes a
  ``jax.profiler`` trace of the round for a look in a profile viewer).
* ``prefill``: one jitted forward over ``--rows`` x ``--prompt`` tokens: tokens/s and
  model FLOPs utilisation (MFU) against the device's dense bf16 peak.
* ``learner``: the learner's policy update (``make_policy_update``, fp32 master weights,
  compute in ``--dtype``) on ``--learner-rows`` x ``--learner-seq`` tokens: tokens/s and
  MFU (``learner_step.update_flops``: 6 FLOPs per weight per token plus attention).
* ``publish``: what a weight publish moves (the params cast to the compute dtype, read to
  the host, put back on the device for the engine): bytes and seconds.

Peaks come from the vendors' data sheets (``PEAKS``, dense, no sparsity) by the device's
``device_kind``; ``--peak-tflops`` / ``--hbm-gbps`` override them. The in-run rates of a
large matmul and copy are reported beside them (``machine``).

    python benchmarks/device_check.py                       # on a GPU or TPU
    python benchmarks/device_check.py --shape tiny --rows 4 --prompt 32 --decode-steps 8 \\
        --learner-rows 2 --learner-seq 64                   # a smoke run on a CPU
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from learner_step import CONFIGS, synthetic_record_batch, update_flops
from machine_rates import copy_gb_per_s, gemm_gflops

from raytunix.inference.engine import InferenceEngine
from raytunix.inference.sampling import sample_tokens
from raytunix.inference.weights import cast_params, on_engine_device
from raytunix.learner.batch import Batch
from raytunix.learner.train_state import (
    RLHyperparams,
    create_train_state,
    make_optimizer_from,
    make_policy_update,
)
from raytunix.models.llama import ModelConfig, forward, init_kv_cache, init_model
from raytunix.types import GenerationRequest, SamplingParams

# device_kind substring -> (dense bf16 FLOP/s, HBM bytes/s), from the vendors' data sheets;
# the first match wins, so the more specific names come first.
PEAKS: list[tuple[str, tuple[float, float]]] = [
    ("H200", (989e12, 4.8e12)),
    ("H100 PCIe", (756e12, 2.0e12)),
    ("H100", (989e12, 3.35e12)),
    ("A100", (312e12, 2.0e12)),
    ("L4", (121e12, 0.3e12)),
    ("TPU v6 lite", (918e12, 1.64e12)),
    ("TPU v5 lite", (197e12, 0.819e12)),
    ("TPU v5", (459e12, 2.765e12)),
    ("TPU v4", (275e12, 1.2e12)),
]
SHAPES = {
    "qwen2.5-0.5b": CONFIGS["qwen2.5-0.5b"][0],
    "tiny": ModelConfig(vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=tuple(SHAPES), default="qwen2.5-0.5b")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--rows", type=int, default=64, help="decode rows (engine and bare loop)")
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens per row")
    p.add_argument("--decode-steps", type=int, default=128, help="tokens generated per row")
    p.add_argument("--learner-rows", type=int, default=8)
    p.add_argument("--learner-seq", type=int, default=1024)
    p.add_argument("--learner-steps", type=int, default=3)
    p.add_argument("--peak-tflops", type=float, default=0.0, help="override the bf16 peak")
    p.add_argument("--hbm-gbps", type=float, default=0.0, help="override the HBM bandwidth")
    p.add_argument("--trace", default="", help="write a jax.profiler trace of the engine here")
    return p.parse_args(argv)


def device_peaks(args) -> dict:
    """The first device's kind and its dense bf16 peak (FLOP/s) and HBM bandwidth
    (bytes/s): the flags, else ``PEAKS``, else None (a CPU has no entry)."""
    kind = jax.devices()[0].device_kind
    flops, bandwidth = next((p for name, p in PEAKS if name in kind), (None, None))
    return {
        "platform": jax.devices()[0].platform,
        "device_kind": kind,
        "peak_flops": args.peak_tflops * 1e12 or flops,
        "hbm_bytes_per_s": args.hbm_gbps * 1e9 or bandwidth,
    }


def matmul_weights(config: ModelConfig, params) -> int:
    """Weights that take part in a matmul per token (the embedding only as a tied head)."""
    total = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    return total - (0 if config.tie_embeddings else config.vocab_size * config.d_model)


def decode_step_bytes(config: ModelConfig, params, rows: int, context: float) -> float:
    """Bytes one decode step must read: every weight once, in the compute dtype, and
    each row's keys and values at ``context`` positions, in the KV dtype (the same)."""
    itemsize = jnp.dtype(config.dtype).itemsize
    total = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    kv = 2 * config.n_layers * config.n_kv_heads * config.head_dim * itemsize
    return total * itemsize + rows * context * kv


def roofline(peaks: dict, config, params, rows: int, context: float) -> float | None:
    """Decode tokens/s the memory bandwidth allows (see the module docstring)."""
    if not peaks["hbm_bytes_per_s"]:
        return None
    return rows * peaks["hbm_bytes_per_s"] / decode_step_bytes(config, params, rows, context)


def bare_decode(graphdef, params, config, args) -> float:
    """Tokens/s of the jitted decode loop (best of 3 after a compiling call)."""
    rows, steps, start = args.rows, args.decode_steps, args.prompt

    @functools.partial(jax.jit, donate_argnums=(1,))
    def loop(params, cache, tokens):
        def body(i, carry):
            cache, tokens = carry
            positions = jnp.full((rows, 1), start, jnp.int32) + i
            logits, cache = forward(graphdef, params, tokens[:, None], positions, cache)
            seeds = jnp.arange(rows, dtype=jnp.uint32)
            tokens, _ = sample_tokens(
                logits[:, 0], jnp.ones((rows,), jnp.float32), seeds, seeds, jnp.full((rows,), i)
            )
            return cache, tokens

        return jax.lax.fori_loop(0, steps, body, (cache, tokens))

    kv_dtype = jnp.dtype(config.dtype)
    state = {"cache": init_kv_cache(config, rows, start + steps + 1, dtype=kv_dtype)}
    tokens = jnp.zeros((rows,), jnp.int32)
    best = float("inf")
    for i in range(4):  # the first compiles
        t0 = time.perf_counter()
        state["cache"], out = loop(params, state["cache"], tokens)
        out.block_until_ready()
        if i:
            best = min(best, time.perf_counter() - t0)
    return rows * steps / best


def engine_decode(graphdef, params, config, args) -> dict:
    """The engine's round of ``rows`` requests (prompt, then ``decode_steps`` tokens),
    the second of two (the first compiles); its tokens/s, decode device time and idle
    fraction between steps."""
    engine = InferenceEngine(
        graphdef,
        params,
        config,
        _IdText(),
        max_batch_size=args.rows,
        max_seq_len=args.prompt + args.decode_steps + 16,
    )
    rng = np.random.default_rng(0)
    sampling = SamplingParams(max_new_tokens=args.decode_steps, temperature=1.0)

    async def one_round(tag: str) -> float:
        requests = [
            GenerationRequest(
                f"{tag}-{i}",
                tuple(int(x) for x in rng.integers(0, config.vocab_size, args.prompt)),
                sampling,
                seed=i,
            )
            for i in range(args.rows)
        ]
        t0 = time.perf_counter()
        results = await engine.generate_many(requests)
        assert all(len(r.token_ids) == args.decode_steps for r in results), "a row stopped early"
        return time.perf_counter() - t0

    async def both() -> tuple[dict, float, dict]:
        await one_round("compile")
        before = engine.stats()
        if args.trace:
            jax.profiler.start_trace(args.trace)
        wall = await one_round("measure")
        if args.trace:
            jax.profiler.stop_trace()
        return before, wall, engine.stats()

    before, wall, after = asyncio.run(both())

    def delta(key: str) -> float:
        return float(after[key]) - float(before[key])

    generated = args.rows * args.decode_steps
    work_s, gap_s = delta("work_s"), delta("host_gap_s")
    return {
        "wall_s": round(wall, 3),
        "tokens_per_s": round(generated / wall, 1),
        "decode_tokens_per_s": round(generated / max(delta("busy_decode_s"), 1e-9), 1),
        "prefill_s": round(delta("busy_prefill_s"), 3),
        "decode_s": round(delta("busy_decode_s"), 3),
        "decode_steps": int(delta("decode_steps")),
        "idle_fraction_between_steps": round(gap_s / work_s, 4) if work_s > 0 else None,
    }


def prefill(graphdef, params, config, peaks, args) -> dict:
    """One forward over ``rows x prompt`` tokens: seconds (best of 3), tokens/s, MFU."""
    tokens = jnp.zeros((args.rows, args.prompt), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(args.prompt, dtype=jnp.int32), tokens.shape)
    run = jax.jit(lambda p, t, pos: forward(graphdef, p, t, pos)[0])
    run(params, tokens, positions).block_until_ready()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        run(params, tokens, positions).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    n = args.rows * args.prompt
    attention = 4 * config.n_layers * config.n_heads * config.head_dim * args.prompt * n
    flops = 2 * matmul_weights(config, params) * n + attention
    return {
        "seconds": round(best, 4),
        "tokens_per_s": round(n / best, 1),
        "mfu": round(flops / best / peaks["peak_flops"], 4) if peaks["peak_flops"] else None,
    }


def learner(graphdef, params, config, peaks, args) -> dict:
    """The policy update on a synthetic batch: median seconds, tokens/s, MFU."""
    record_batch = synthetic_record_batch(
        args.learner_rows, args.learner_seq, config.vocab_size, seed=0
    )
    batch = Batch.from_record_batch(record_batch, pad_id=0, max_seq_len=args.learner_seq)
    hp = RLHyperparams(temperature=1.0, top_k=0, top_p=1.0)  # the rollout sampling
    optimizer = make_optimizer_from(hp)
    update = make_policy_update(graphdef, optimizer, hp, max_seq_len=args.learner_seq)
    state = create_train_state(graphdef, params, optimizer, 0)
    times = []
    for i in range(args.learner_steps + 1):  # the first compiles
        t0 = time.perf_counter()
        state, metrics = update(state, None, batch)
        jax.device_get(metrics)
        jax.block_until_ready(state)
        if i:
            times.append(time.perf_counter() - t0)
    seconds = statistics.median(times)
    flops = update_flops(config, params, *batch.tokens.shape)
    return {
        "seconds": round(seconds, 4),
        "tokens_per_s": round(batch.tokens.size / seconds, 1),
        "mfu": round(flops / seconds / peaks["peak_flops"], 4) if peaks["peak_flops"] else None,
    }


def publish(params, config) -> dict:
    """A publish's bytes and seconds: cast to the compute dtype on the learner's device,
    read to the host, put on the engine's device (``on_engine_device``)."""
    t0 = time.perf_counter()
    host = jax.device_get(cast_params(params, config.dtype))
    t1 = time.perf_counter()
    jax.block_until_ready(on_engine_device(host, config.dtype))
    t2 = time.perf_counter()
    nbytes = sum(x.nbytes for x in jax.tree.leaves(host))
    return {"bytes": nbytes, "to_host_s": round(t1 - t0, 4), "to_engine_s": round(t2 - t1, 4)}


class _IdText:
    def decode(self, ids, skip_special_tokens=False):
        return " ".join(map(str, ids))


def main(argv=None) -> dict:
    args = parse_args(argv)
    t0 = time.monotonic()
    config = dataclasses.replace(
        SHAPES[args.shape],
        dtype=args.dtype,
        max_seq_len=max(args.prompt + args.decode_steps + 16, args.learner_seq),
    )
    graphdef, params = init_model(config, seed=0)  # float32 master weights
    peaks = device_peaks(args)
    engine_params = on_engine_device(params, config.dtype)
    context = args.prompt + args.decode_steps / 2  # positions attended, on average
    limit = roofline(peaks, config, params, args.rows, context)
    bare = bare_decode(graphdef, engine_params, config, args)
    engine = engine_decode(graphdef, params, config, args)
    result = {
        "benchmark": "device_check",
        "device": peaks,
        "model": {
            "shape": args.shape,
            "dtype": args.dtype,
            "params": int(sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))),
        },
        "decode": {
            "rows": args.rows,
            "prompt": args.prompt,
            "steps": args.decode_steps,
            "bytes_per_step": int(decode_step_bytes(config, params, args.rows, context)),
            "roofline_tokens_per_s": round(limit, 1) if limit else None,
            "bare_tokens_per_s": round(bare, 1),
            "bare_fraction_of_roofline": round(bare / limit, 4) if limit else None,
            "engine": engine,
            "engine_over_bare": round(engine["decode_tokens_per_s"] / bare, 4),
            "engine_fraction_of_roofline": round(engine["decode_tokens_per_s"] / limit, 4)
            if limit
            else None,
        },
        "prefill": prefill(graphdef, engine_params, config, peaks, args),
        "learner": learner(graphdef, params, config, peaks, args),
        "publish": publish(params, config),
        "machine": {
            "gemm_gflops_fp32": round(gemm_gflops(), 1),
            "copy_gb_per_s": round(copy_gb_per_s(), 2),
            "jax": jax.__version__,
            "backend": jax.default_backend(),
        },
        "wall_s": round(time.monotonic() - t0, 1),
    }
    return result


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    print(json.dumps(main(), indent=2))
