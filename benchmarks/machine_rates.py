"""The machine's compute and memory ceilings, measured in the run that compares against
them: a large float32 matmul (GFLOP/s) and a large elementwise copy (GB/s, bytes read plus
written), each the fastest of a few calls after one that compiles. Imported by the
benchmarks (``benchmarks/`` is on ``sys.path`` when they run as scripts)."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import time

import jax
import jax.numpy as jnp


def best_rate(run, work: float, repeats: int = 3) -> float:
    """``work / seconds`` of the fastest of ``repeats`` calls of ``run`` (one call first,
    untimed, to compile)."""
    jax.block_until_ready(run())
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(run())
        best = min(best, time.perf_counter() - t0)
    return work / best


def gemm_gflops(n: int = 2048) -> float:
    """GFLOP/s of an ``n x n`` float32 matmul (``2 n^3`` FLOPs)."""
    a = jnp.ones((n, n), jnp.float32)
    b = jnp.full((n, n), 0.5, jnp.float32)
    matmul = jax.jit(lambda a, b: a @ b)
    return best_rate(lambda: matmul(a, b), 2 * n**3) / 1e9


def copy_gb_per_s(megabytes: int = 256) -> float:
    """GB/s of ``x + 1`` over a ``megabytes`` float32 array (read once, written once)."""
    x = jnp.ones((megabytes * 1024 * 1024 // 4,), jnp.float32)
    add = jax.jit(lambda x: x + 1.0)
    return best_rate(lambda: add(x), 2 * x.nbytes) / 1e9


def machine_rates() -> dict:
    return {"gemm_gflops": round(gemm_gflops(), 1), "copy_gb_per_s": round(copy_gb_per_s(), 2)}


def machine() -> dict:
    """The host: CPU count and model, platform, Python, and Ray's version where installed
    (the device check runs where Ray is not)."""
    model = next(
        (
            line.split(":", 1)[1].strip()
            for line in open("/proc/cpuinfo")
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    try:
        ray_version = importlib.metadata.version("ray")
    except importlib.metadata.PackageNotFoundError:
        ray_version = None
    return {
        "cpu_count": os.cpu_count(),
        "cpu_model": model,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "ray": ray_version,
    }
