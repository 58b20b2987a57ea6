"""How close is the learner's update to a bare jitted JAX train step of the same model?

Claim (issue 9): the learner's GRPO update processes at least 0.85x the tokens/s of a
bare jitted train step on the same model and the same batch (``ratio_vs_bare``).

Two configs, each measured in one invocation:

* ``tiny``: the default run's model (d_model 128, 3 layers, 4 heads, 2 KV heads, d_ff
  384, vocabulary 384, context 128) on 128 trajectories of 128 tokens (16 groups x 8).
* ``100m``: a Llama-style model of ~100M parameters (d_model 768, 12 layers, 12 heads,
  4 KV heads, d_ff 2048, vocabulary 32,000, tied embeddings, context 256) on 4
  trajectories of 256 tokens, so a step takes seconds on 2 CPU cores.
* ``qwen2.5-0.5b`` (only when named): the shapes of Qwen2.5-0.5B with random weights
  (vocabulary 151,936, d_model 896, 24 layers, 14 query / 2 KV heads, head_dim 64, d_ff
  4864, QKV bias, tied embeddings), on 2 trajectories of 128 tokens by default: the LM head
  and log-softmax over a real vocabulary, which the others leave out.

The batch: random token ids; each trajectory a prompt (loss mask 0) followed by generated
tokens (loss mask 1, behaviour logprobs drawn around -log V, policy version 0), lengths
spread over the upper half of the context with the longest filling it, rewards 0 or 1,
groups of 8 (or the whole batch when smaller). It is packed into an Arrow record batch
(``TRAJECTORY_SCHEMA``) and turned into a ``Batch`` by ``Batch.from_record_batch``, as
``Learner.train_step`` does; that host step is timed apart (``batch_build_s``).

What is timed, each after one compiling call and one warm call, then ``--steps`` steps
alternating learner, bare, learner, bare... (so drift of a shared machine hits both), the
median step reported:

* **learner**: ``make_policy_update`` with ``RLHyperparams`` defaults (rollout sampling
  at temperature 1, no top-k/top-p), ``make_optimizer_from`` and ``create_train_state``,
  called on the ``Batch`` with the metrics fetched to the host (as ``train_step`` does)
  and the new state ready.
* **bare**: one ``jax.jit`` of: ``forward`` of the same model, ``log_softmax`` and the
  target tokens' logprobs, a PPO-clip loss (clip 0.2 / 0.28) over the masked tokens with
  advantages computed once beforehand, ``jax.value_and_grad``, ``optax.adamw`` at the
  same learning rate. No metrics, no gradient clipping, no entropy or mismatch statistics.

Tokens/s counts every token of the padded batch (B x T, prompt and padding included: the
tokens the forward pass runs over); ``trainable_tokens`` gives the loss-masked count. The
ratio is the same either way. Prints one JSON object; top-level ``ratio_vs_bare`` is the
``100m`` config's when it ran, else ``tiny``'s, else the one config's. Each config also
reports ``peak_memory`` (the process's peak RSS; the device's peak where it is reported).

With ``--packing`` each config also compares the update on the batch padded to its
longest trajectory (``padded_update_s``) with the same update on the batch packed several
trajectories to a row (``learner.sequence_packing``; ``packed_update_s``), on a batch with
a realistic length spread: lengths uniform over 15/64 of the context to all of it (30-128
tokens for tiny), the longest filling it; both timed alternately like the above, the
packing's host step (``pack_build_s``) apart. Key ``packing_speedup`` = padded / packed.

    python benchmarks/learner_step.py                 # both configs
    python benchmarks/learner_step.py --config tiny --steps 3
    python benchmarks/learner_step.py --config tiny --packing
    python benchmarks/learner_step.py --config qwen2.5-0.5b --steps 3
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pyarrow as pa
from machine_rates import gemm_gflops, machine  # benchmarks/ is on sys.path as a script

from raytunix.config import RolloutConfig
from raytunix.learner.batch import Batch, PackedBatch
from raytunix.learner.train_state import (
    RLHyperparams,
    create_train_state,
    make_optimizer_from,
    make_policy_update,
)
from raytunix.models.llama import ModelConfig, count_params, forward, init_model
from raytunix.rollout.batch import TRAJECTORY_SCHEMA

# name -> (model, default trajectories per batch)
CONFIGS = {
    "tiny": (
        ModelConfig(
            vocab_size=384,
            d_model=128,
            n_layers=3,
            n_heads=4,
            n_kv_heads=2,
            d_ff=384,
            max_seq_len=128,
        ),
        128,
    ),
    "100m": (
        ModelConfig(
            vocab_size=32000,
            d_model=768,
            n_layers=12,
            n_heads=12,
            n_kv_heads=4,
            d_ff=2048,
            max_seq_len=256,
        ),
        4,
    ),
    "qwen2.5-0.5b": (
        ModelConfig(
            vocab_size=151936,
            d_model=896,
            n_layers=24,
            n_heads=14,
            n_kv_heads=2,
            head_dim=64,
            d_ff=4864,
            max_seq_len=128,
            rope_theta=1000000.0,
            norm_eps=1e-6,
            tie_embeddings=True,
            qkv_bias=True,
        ),
        2,
    ),
}
GROUP_SIZE = 8


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", choices=(*CONFIGS, "both"), default="both")
    p.add_argument(
        "--steps",
        type=int,
        default=5,
        help="timed steps of each (learner and bare alternate), after 2 untimed",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="trajectories per batch (default: 128 for tiny, 4 for 100m, 2 for qwen2.5-0.5b)",
    )
    p.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help="padded tokens per trajectory and the model's context (default: 128 "
        "for tiny, 256 for 100m, 128 for qwen2.5-0.5b)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--packing",
        action="store_true",
        help="also time the update padded vs sequence-packed on a batch with "
        "lengths over 15/64 of the context to all of it",
    )
    p.add_argument(
        "--pack-lengths",
        type=int,
        nargs=2,
        default=None,
        metavar=("MIN", "MAX"),
        help="with --packing: trajectory lengths uniform over [MIN, MAX] tokens "
        "instead (MAX <= the context; the padded batch is then MAX's bucket)",
    )
    p.add_argument(
        "--pack-longest",
        type=int,
        default=None,
        metavar="N",
        help="with --packing: the first trajectory has N tokens (default MAX), "
        "e.g. one long episode among short ones, as in the default run",
    )
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    if args.seq_len is not None and args.seq_len < 8:
        p.error(f"--seq-len must be >= 8 tokens, got {args.seq_len}")
    if args.pack_lengths and not 2 <= args.pack_lengths[0] <= args.pack_lengths[1]:
        p.error(f"--pack-lengths needs 2 <= MIN <= MAX, got {args.pack_lengths}")
    if args.batch_size is not None and args.batch_size < 1:
        p.error(f"--batch-size must be >= 1, got {args.batch_size}")
    return args


def synthetic_record_batch(
    batch_size: int,
    seq_len: int,
    vocab: int,
    seed: int,
    min_length: int | None = None,
    max_length: int | None = None,
    longest: int | None = None,
) -> pa.RecordBatch:
    """``batch_size`` trajectories of ``min_length`` (default ``seq_len // 2``) to
    ``max_length`` (default ``seq_len``) tokens in ``TRAJECTORY_SCHEMA`` (see the module
    docstring); the first is exactly ``longest`` (default ``max_length``) long, so the
    learner pads the batch to its bucket. The prompt is a quarter of the context, at most
    half the trajectory."""
    rng = np.random.default_rng(seed)
    max_length = max_length or seq_len
    lengths = rng.integers(min_length or seq_len // 2, max_length + 1, size=batch_size)
    lengths[0] = longest or max_length
    group = min(GROUP_SIZE, batch_size)
    columns = {name: [] for name in TRAJECTORY_SCHEMA.names}
    for i, length in enumerate(lengths):
        prompt = max(1, min(seq_len // 4, int(length) // 2))
        generated = int(length) - prompt
        columns["task_id"].append(f"task{i // group}")
        columns["group_id"].append(f"group{i // group}")
        columns["token_ids"].append(rng.integers(0, vocab, size=length).tolist())
        columns["loss_mask"].append([0] * prompt + [1] * generated)
        logprobs = -np.log(vocab) + rng.normal(0.0, 0.5, size=generated)
        columns["logprobs"].append([0.0] * prompt + logprobs.astype(np.float32).tolist())
        columns["policy_versions"].append([-1] * prompt + [0] * generated)
        columns["reward"].append(float(rng.integers(0, 2)))
        columns["status"].append("completed")
        columns["num_turns"].append(1)
    return pa.RecordBatch.from_pydict(columns, schema=TRAJECTORY_SCHEMA)


def make_bare_step(graphdef, learning_rate: float, clip_low: float, clip_high: float):
    """``(optimizer, step)``: ``step(params, opt_state, tokens, mask, old, adv) -> (params,
    opt_state, loss)``, one jitted PPO-clip train step with nothing but the math.

    ``tokens`` int32[B, T]; ``mask`` and ``old`` float32[B, T-1] (the targets
    ``tokens[:, 1:]``); ``adv`` float32[B, 1]."""
    optimizer = optax.adamw(learning_rate, weight_decay=0.0)

    def loss_fn(params, tokens, mask, old, adv):
        inputs = tokens[:, :-1]
        positions = jnp.broadcast_to(jnp.arange(inputs.shape[1], dtype=jnp.int32), inputs.shape)
        logits, _ = forward(graphdef, params, inputs, positions)
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        logp = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
        ratio = jnp.exp(logp - old)
        per_token = -jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - clip_low, 1 + clip_high) * adv)
        return jnp.sum(per_token * mask) / jnp.maximum(jnp.sum(mask), 1.0)

    @jax.jit
    def step(params, opt_state, tokens, mask, old, adv):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, mask, old, adv)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return optimizer, step


def update_flops(config: ModelConfig, params, rows: int, length: int) -> int:
    """FLOPs of one forward and backward pass over a ``rows x length`` batch: 6 per matmul
    weight per token (2 forward, 4 backward; the embedding table counts only when tied,
    as the LM head) and 12 per position pair per head dimension per layer for attention
    over the full square the program computes (Kaplan et al. 2020, arXiv:2001.08361).
    A lower bound of the update's work: optimizer, softmax and norms are left out."""
    total = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    embed = config.vocab_size * config.d_model
    weights = total - (0 if config.tie_embeddings else embed)
    attention = 12 * config.n_layers * config.n_heads * config.head_dim * length * length
    return 6 * weights * rows * length + attention * rows


def group_advantages(batch: Batch) -> np.ndarray:
    """GRPO advantages float32[B, 1] on the host: (reward - group mean) / (group std + 1e-6)."""
    adv = np.zeros(len(batch.rewards), np.float32)
    for g in np.unique(batch.group_ids):
        rows = batch.group_ids == g
        r = batch.rewards[rows]
        adv[rows] = (r - r.mean()) / (r.std() + 1e-6)
    return adv[:, None]


def measure(name: str, args) -> dict:
    model_config, default_batch = CONFIGS[name]
    seq_len = args.seq_len or model_config.max_seq_len
    batch_size = args.batch_size or default_batch
    model_config = dataclasses.replace(model_config, max_seq_len=seq_len)
    graphdef, params = init_model(model_config, seed=args.seed)
    record_batch = synthetic_record_batch(batch_size, seq_len, model_config.vocab_size, args.seed)

    t0 = time.perf_counter()
    batch = Batch.from_record_batch(record_batch, pad_id=0, max_seq_len=seq_len)
    batch_build_s = time.perf_counter() - t0
    tokens = int(batch.tokens.size)
    trainable = int(batch.loss_mask[:, 1:].sum())

    hp = RLHyperparams(
        temperature=RolloutConfig.temperature, top_k=RolloutConfig.top_k, top_p=RolloutConfig.top_p
    )
    optimizer = make_optimizer_from(hp)
    update = make_policy_update(graphdef, optimizer, hp, max_seq_len=seq_len)
    learner = {"state": create_train_state(graphdef, params, optimizer, args.seed)}

    def learner_step() -> float:
        t0 = time.perf_counter()
        learner["state"], metrics = update(learner["state"], None, batch)
        jax.device_get(metrics)
        jax.block_until_ready(learner["state"])
        return time.perf_counter() - t0

    bare_optimizer, bare_fn = make_bare_step(
        graphdef, hp.learning_rate, hp.clip_eps_low, hp.clip_eps_high
    )
    bare = {"params": params, "opt_state": bare_optimizer.init(params)}
    # Host arrays, as the learner's update gets them: each call copies them in.
    bare_inputs = (
        batch.tokens,
        np.ascontiguousarray(batch.loss_mask[:, 1:]),
        np.ascontiguousarray(batch.logprobs[:, 1:]),
        group_advantages(batch),
    )

    def bare_step() -> float:
        t0 = time.perf_counter()
        bare["params"], bare["opt_state"], loss = bare_fn(
            bare["params"], bare["opt_state"], *bare_inputs
        )
        jax.block_until_ready((bare["params"], bare["opt_state"], loss))
        return time.perf_counter() - t0

    compile_s = {"learner": learner_step(), "bare": bare_step()}  # compiles
    learner_step(), bare_step()  # warm
    times = {"learner": [], "bare": []}
    for _ in range(args.steps):
        times["learner"].append(learner_step())
        times["bare"].append(bare_step())
    median = {k: statistics.median(v) for k, v in times.items()}
    flops = update_flops(model_config, params, *batch.tokens.shape)
    return {
        "flops_per_update": flops,
        "update_gflops": round(flops / median["learner"] / 1e9, 2),
        "bare_gflops": round(flops / median["bare"] / 1e9, 2),
        "model": {
            k: getattr(model_config, k)
            for k in (
                "vocab_size",
                "d_model",
                "n_layers",
                "n_heads",
                "n_kv_heads",
                "d_ff",
                "max_seq_len",
                "tie_embeddings",
            )
        },
        "params": count_params(params),
        "batch": {
            "trajectories": batch_size,
            "padded_tokens": tokens,
            "trainable_tokens": trainable,
        },
        "batch_build_s": round(batch_build_s, 4),
        "first_call_s": {k: round(v, 2) for k, v in compile_s.items()},
        "step_s": {k: [round(x, 4) for x in v] for k, v in times.items()},
        "learner_step_s": round(median["learner"], 4),
        "bare_step_s": round(median["bare"], 4),
        "learner_tokens_per_s": round(tokens / median["learner"], 1),
        "bare_tokens_per_s": round(tokens / median["bare"], 1),
        "learner_trainable_tokens_per_s": round(trainable / median["learner"], 1),
        "ratio_vs_bare": round(median["bare"] / median["learner"], 3),
        # Learner.train_step also builds the Batch from Arrow on the host each step.
        "ratio_vs_bare_with_batch_build": round(
            median["bare"] / (median["learner"] + batch_build_s), 3
        ),
        "peak_memory": peak_memory(),
    }


def peak_memory() -> dict:
    """The process's peak resident memory so far (GiB; it only grows, so a config measured
    after another reads at least that one's peak) and, where the backend reports it, the
    first device's peak bytes in use."""
    out = {
        "process_peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)
    }
    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        out["device_peak_gib"] = round(stats["peak_bytes_in_use"] / 2**30, 3)
    return out


def measure_packing(name: str, args) -> dict:
    """The default update on one batch, padded (``Batch``) vs packed (``PackedBatch``);
    see the module docstring."""
    model_config, default_batch = CONFIGS[name]
    seq_len = args.seq_len or model_config.max_seq_len
    batch_size = args.batch_size or default_batch
    model_config = dataclasses.replace(model_config, max_seq_len=seq_len)
    graphdef, params = init_model(model_config, seed=args.seed)
    low, high = args.pack_lengths or (max(2, seq_len * 15 // 64), seq_len)
    record_batch = synthetic_record_batch(
        batch_size,
        seq_len,
        model_config.vocab_size,
        args.seed,
        min_length=low,
        max_length=min(high, seq_len),
        longest=args.pack_longest and min(args.pack_longest, seq_len),
    )
    t0 = time.perf_counter()
    padded = Batch.from_record_batch(record_batch, pad_id=0, max_seq_len=seq_len)
    t1 = time.perf_counter()
    packed = PackedBatch.from_record_batch(record_batch, pad_id=0, max_seq_len=seq_len)
    t2 = time.perf_counter()
    hp = RLHyperparams(
        temperature=RolloutConfig.temperature, top_k=RolloutConfig.top_k, top_p=RolloutConfig.top_p
    )
    optimizer = make_optimizer_from(hp)
    update = make_policy_update(graphdef, optimizer, hp, max_seq_len=seq_len)
    states = {
        k: create_train_state(graphdef, params, optimizer, args.seed) for k in ("padded", "packed")
    }
    batches = {"padded": padded, "packed": packed}

    def step(kind: str) -> float:
        t0 = time.perf_counter()
        states[kind], metrics = update(states[kind], None, batches[kind])
        jax.device_get(metrics)
        jax.block_until_ready(states[kind])
        return time.perf_counter() - t0

    first = {k: step(k) for k in batches}  # compiles
    for k in batches:
        step(k)  # warm
    times = {k: [] for k in batches}
    for _ in range(args.steps):
        for k in batches:
            times[k].append(step(k))
    median = {k: statistics.median(v) for k, v in times.items()}
    lengths = np.diff(record_batch.column("token_ids").offsets.to_numpy())
    return {
        "trajectories": batch_size,
        "tokens": int(lengths.sum()),
        "length_min_max": [int(lengths.min()), int(lengths.max())],
        "padded_shape": list(padded.tokens.shape),
        "packed_shape": list(packed.tokens.shape),
        "batch_build_s": round(t1 - t0, 4),
        "pack_build_s": round(t2 - t1, 4),
        "first_call_s": {k: round(v, 2) for k, v in first.items()},
        "step_s": {k: [round(x, 4) for x in v] for k, v in times.items()},
        "padded_update_s": round(median["padded"], 4),
        "packed_update_s": round(median["packed"], 4),
        "packing_speedup": round(median["padded"] / median["packed"], 3),
    }


def main(argv=None) -> dict:
    args = parse_args(argv)
    load_before = os.getloadavg()
    names = ["tiny", "100m"] if args.config == "both" else [args.config]
    t0 = time.monotonic()
    results = {name: measure(name, args) for name in names}
    if args.packing:
        for name in names:
            results[name]["packing"] = measure_packing(name, args)
    headline = results.get("100m") or results.get("tiny") or next(iter(results.values()))
    # The machine's matmul rate, in this run; the fractions use the rate as reported, so
    # that they can be checked from the JSON.
    gemm = round(gemm_gflops(), 1)
    for result in results.values():
        result["fraction_of_gemm_rate"] = round(result["update_gflops"] / gemm, 3)
    return {
        "benchmark": "learner_step",
        "ratio_vs_bare": headline["ratio_vs_bare"],
        "fraction_of_gemm_rate": headline["fraction_of_gemm_rate"],
        "gemm_gflops": gemm,
        "tokens_counted": "padded batch tokens (B x T); trainable_tokens per config",
        "configs": results,
        "steps": args.steps,
        "wall_s": round(time.monotonic() - t0, 1),
        "machine": {
            **machine(),
            "jax": jax.__version__,
            "backend": jax.default_backend(),
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
        },
    }


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))
