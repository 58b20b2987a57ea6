"""The sampler's cost at a real vocabulary, old against new in one run.

Claim (issue 23 item 3): the engine's sampler (``raytunix.inference.sampling.sample_tokens``)
no longer sorts the vocabulary or draws a random number per vocabulary entry, so at a
Qwen vocabulary (151,936 tokens) it costs less per decode step, with or without top-k
and top-p.

Each setting is timed for both samplers on the same random logits (normal, scale 3), as
the engine calls it: per-row ``temperature`` (1.0) and, where truncation is on, per-row
``top_k``/``top_p`` arrays (truncation off passes None, the engine's ``truncate=False``
program). The old sampler is ``raytunix/inference/sampling.py`` at ``--baseline-ref``,
read with ``git show``. Each (rows, setting, sampler) is compiled, then called
``--repeats`` times; times are wall seconds to ``block_until_ready``.

``--decode-rows`` also times one decode step of a Qwen2.5-0.5B-shaped model (random
float32 weights, tied embeddings, a KV cache of ``--cache-len`` positions, one new token
per row, logits for it only), so that each sampler's share of a step (sampler / (forward
+ sampler)) can be read beside it.

Prints one JSON object. Run: ``python benchmarks/sampler_cost.py`` (a few minutes on 2 CPU
cores).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
import types
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from raytunix.inference import sampling  # noqa: E402
from raytunix.models.llama import ModelConfig, forward, init_kv_cache, init_model  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SETTINGS = {  # name -> (top_k, top_p) per row, None = off in every row
    "off": (None, None),
    "top_k=50": (50, None),
    "top_p=0.95": (None, 0.95),
    "top_k=50,top_p=0.95": (50, 0.95),
}
QWEN2_5_0_5B = dict(  # the shapes of Qwen/Qwen2.5-0.5B's config.json
    vocab_size=151_936,
    d_model=896,
    n_layers=24,
    n_heads=14,
    n_kv_heads=2,
    d_ff=4864,
    rope_theta=1_000_000.0,
    norm_eps=1e-6,
    tie_embeddings=True,
    qkv_bias=True,
)


def _parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--baseline-ref",
        default="2f9fde3",
        help="git ref whose raytunix/inference/sampling.py is the old sampler",
    )
    p.add_argument("--decode-rows", type=int, nargs="*", default=[8])
    p.add_argument("--cache-len", type=int, default=256)
    return p.parse_args()


def _old_sampling(ref: str) -> types.ModuleType:
    """The sampling module as it was at ``ref``, imported under another name."""
    source = subprocess.run(
        ["git", "-C", str(REPO), "show", f"{ref}:raytunix/inference/sampling.py"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    module = types.ModuleType("old_sampling")
    exec(compile(source, f"{ref}:raytunix/inference/sampling.py", "exec"), module.__dict__)
    return module


def _timed(fn, args, repeats: int) -> dict:
    """Compiles ``fn`` on ``args`` then times ``repeats`` calls: mean/median/worst ms."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return {
        "mean_ms": round(1e3 * statistics.fmean(times), 2),
        "median_ms": round(1e3 * statistics.median(times), 2),
        "worst_ms": round(1e3 * max(times), 2),
    }


def _sampler_args(rows: int, vocab: int, top_k, top_p) -> tuple:
    logits = 3.0 * jax.random.normal(jax.random.key(rows), (rows, vocab), jnp.float32)
    seeds = jnp.arange(rows, dtype=jnp.uint32)
    args = (logits, jnp.ones((rows,), jnp.float32), seeds, seeds, jnp.zeros((rows,), jnp.int32))
    if top_k is None and top_p is None:
        return args
    k = jnp.full((rows,), top_k or 0, jnp.int32)
    p = jnp.full((rows,), 1.0 if top_p is None else top_p, jnp.float32)
    return (*args, k, p)


def _decode_step_ms(rows: int, cache_len: int, repeats: int) -> dict:
    """One decode step of the Qwen2.5-0.5B shapes, without sampling."""
    config = ModelConfig(**QWEN2_5_0_5B, max_seq_len=cache_len)
    graphdef, params = init_model(config, seed=0)

    @jax.jit
    def step(params, cache, tokens, positions):
        logits, cache = forward(graphdef, params, tokens, positions, cache)
        return logits[:, 0], cache

    cache = init_kv_cache(config, rows, cache_len)
    tokens = jnp.ones((rows, 1), jnp.int32)
    positions = jnp.full((rows, 1), cache_len // 2, jnp.int32)
    return _timed(step, (params, cache, tokens, positions), repeats)


def main() -> None:
    args = _parse_args()
    samplers = {
        "old": _old_sampling(args.baseline_ref).sample_tokens,
        "new": sampling.sample_tokens,
    }
    results = []
    for rows in args.rows:
        for name, (top_k, top_p) in SETTINGS.items():
            inputs = _sampler_args(rows, args.vocab, top_k, top_p)
            timing = {
                impl: _timed(jax.jit(fn), inputs, args.repeats) for impl, fn in samplers.items()
            }
            results.append(
                {
                    "rows": rows,
                    "setting": name,
                    **{impl: t for impl, t in timing.items()},
                    "median_speedup": round(
                        timing["old"]["median_ms"] / timing["new"]["median_ms"], 2
                    ),
                }
            )
    decode = []
    for rows in args.decode_rows:
        forward_ms = _decode_step_ms(rows, args.cache_len, args.repeats)
        row = {"rows": rows, "forward": forward_ms}
        for r in results:
            if r["rows"] == rows:
                step = forward_ms["median_ms"]
                row[r["setting"]] = {
                    impl: round(r[impl]["median_ms"] / (step + r[impl]["median_ms"]), 3)
                    for impl in samplers
                }
        decode.append(row)
    print(
        json.dumps(
            {
                "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
                f"JAX {jax.__version__} on {jax.default_backend()}",
                "load_average": [round(x, 2) for x in os.getloadavg()],
                "vocab": args.vocab,
                "baseline_ref": args.baseline_ref,
                "repeats": args.repeats,
                "sampler": results,
                "decode_step_share": decode,
            }
        )
    )


if __name__ == "__main__":
    main()
