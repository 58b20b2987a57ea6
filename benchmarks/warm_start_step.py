"""How much does packing the warm start's demonstrations save per supervised step?

Claim: the default run's warm start (most of ``raytunix train``'s wall time on 2 cores)
takes about half the time per step when its demonstrations are packed several to a row
(``raytunix.learner.batch.pack_demonstrations``, what ``Learner.sft_steps`` does) instead
of one per row padded to the widest (what it did before), at the same loss.

Setup, as the default run builds it: the default config's task (reasoning-gym
``basic_arithmetic``, ``--tasks`` train tasks), its byte-level BPE tokenizer trained on
them, the demonstrations rendered by the agent (``prepare.demonstration_arrays``), the
default model (``model.*`` defaults) and warm-start optimizer (``warmup.*``). Each step
draws ``warmup.batch_size`` demonstrations with the same generator for both paths:

* **padded**: the drawn rows as they are, ``[batch_size, T]`` (T the widest
  demonstration rounded up to 16);
* **packed**: the same rows packed (``pack_demonstrations``, rows a multiple of 4) and
  passed with their positions and segment ids; its host step is timed too
  (``pack_build_ms``) and counted in ``packed_step_ms``.

Both run ``make_sft_update`` from the same initial state; each path's first calls (one
per shape: compiles) are timed apart (``compile_s``), then ``--steps`` steps alternate
padded, packed, padded... so that a shared machine's drift hits both. Per path: mean,
median and worst step (ms, the new state and metrics ready) and tokens through the model
per step; ``speedup`` = padded median / packed median; ``loss_gap`` = the largest
relative difference of the two paths' per-step losses on the same rows (both
trained from one state per step, so the paths stay comparable).

    python benchmarks/warm_start_step.py
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np
from machine_rates import machine  # benchmarks/ is on sys.path when run as a script

from raytunix.config import load_config
from raytunix.data.demonstrations import tokenizer_corpus
from raytunix.data.tasks import generator_splits
from raytunix.driver import prepare
from raytunix.learner.batch import pack_demonstrations
from raytunix.learner.learner import SFT_ROW_MULTIPLE
from raytunix.learner.train_state import SFTHyperparams, create_train_state, make_sft_update
from raytunix.models.llama import init_model
from raytunix.models.tokenizer import Tokenizer


def _stats(values: list[float]) -> dict[str, float]:
    return {
        "mean": statistics.fmean(values),
        "median": statistics.median(values),
        "worst": max(values),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=40, help="timed steps per path")
    p.add_argument("--tasks", type=int, default=4000, help="train tasks to build demos from")
    args = p.parse_args()

    cfg = load_config(None, [])
    train, _ = generator_splits(
        dataclasses.replace(cfg.data, train_size=args.tasks, heldout_size=10)
    )
    tokenizer = Tokenizer.train(tokenizer_corpus(train[:3000]), cfg.model.tokenizer_vocab_size)
    tokens, mask, _ = prepare.demonstration_arrays(
        cfg, prepare.arithmetic_demonstrations(cfg, train), tokenizer
    )
    model_config = prepare.model_config(cfg, tokenizer)
    graphdef, params = init_model(model_config, seed=0)
    w = cfg.warmup
    optimizer = SFTHyperparams(
        learning_rate=w.learning_rate, warmup_steps=w.warmup_steps
    ).optimizer()
    update = make_sft_update(graphdef, optimizer)
    state = create_train_state(graphdef, params, optimizer, seed=0)
    rng = np.random.default_rng(0)
    multiple = min(SFT_ROW_MULTIPLE, w.batch_size)

    def padded_step(rows):
        t0 = time.perf_counter()
        out, metrics = update(state, tokens[rows], mask[rows])
        jax.block_until_ready((out, metrics))
        return time.perf_counter() - t0, float(metrics["loss"]), tokens[rows].size

    def packed_step(rows):
        t0 = time.perf_counter()
        packed = pack_demonstrations(tokens[rows], mask[rows], row_multiple=multiple)
        built = time.perf_counter() - t0
        out, metrics = update(
            state, packed["tokens"], packed["loss_mask"], packed["positions"], packed["segment_ids"]
        )
        jax.block_until_ready((out, metrics))
        return (
            time.perf_counter() - t0,
            float(metrics["loss"]),
            packed["tokens"].size,
            built,
            packed["tokens"].shape[0],
        )

    # Compile every shape the timed steps will meet (packed row counts vary a little).
    draws = [rng.integers(0, len(tokens), size=w.batch_size) for _ in range(args.steps)]
    t0 = time.perf_counter()
    padded_step(draws[0])
    compile_padded = time.perf_counter() - t0
    row_counts = sorted(
        {
            pack_demonstrations(tokens[r], mask[r], row_multiple=multiple)["tokens"].shape[0]
            for r in draws
        }
    )
    t0 = time.perf_counter()
    seen = set()
    for r in draws:
        n = pack_demonstrations(tokens[r], mask[r], row_multiple=multiple)["tokens"].shape[0]
        if n not in seen:
            seen.add(n)
            packed_step(r)
    compile_packed = time.perf_counter() - t0

    padded, packed, build, gaps, padded_tokens, packed_tokens = [], [], [], [], [], []
    for rows in draws:
        s, loss_a, n = padded_step(rows)
        padded.append(s * 1e3)
        padded_tokens.append(n)
        s, loss_b, n, built, _ = packed_step(rows)
        packed.append(s * 1e3)
        packed_tokens.append(n)
        build.append(built * 1e3)
        gaps.append(abs(loss_a - loss_b) / max(abs(loss_a), 1e-12))
    result = {
        "benchmark": "warm_start_step",
        "machine": machine(),
        "command": "python benchmarks/warm_start_step.py"
        + (f" --steps {args.steps}" if args.steps != 40 else ""),
        "demonstrations": {
            "count": int(len(tokens)),
            "width": int(tokens.shape[1]),
            "mean_tokens": float((mask.shape[1] - np.argmax((mask > 0)[:, ::-1], axis=1)).mean()),
        },
        "batch_size": w.batch_size,
        "padded": {
            "step_ms": _stats(padded),
            "tokens_per_step": statistics.fmean(padded_tokens),
            "compile_s": compile_padded,
        },
        "packed": {
            "step_ms": _stats(packed),
            "tokens_per_step": statistics.fmean(packed_tokens),
            "pack_build_ms": _stats(build),
            "row_counts": row_counts,
            "compile_s": compile_packed,
        },
        "speedup": statistics.median(padded) / statistics.median(packed),
        "loss_gap": max(gaps),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
