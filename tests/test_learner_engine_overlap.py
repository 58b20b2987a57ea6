"""Colocated placement (issue 9 item 8): the learner's update and the engine's decoding
share one process, and neither waits for the other. ``PolicyActor`` runs the update in its
learner thread while the engine keeps stepping; the profiling spans both record show
decode steps that begin and end inside the update. In-process, no Ray."""

from __future__ import annotations

import asyncio

import numpy as np
import pyarrow as pa
import pytest

from raytunix import profiling
from raytunix.config import load_config
from raytunix.learner.actor import PolicyActor
from raytunix.learner.train_state import RLHyperparams
from raytunix.models.llama import ModelConfig
from raytunix.models.tokenizer import Tokenizer
from raytunix.rollout.batch import TRAJECTORY_SCHEMA
from raytunix.types import GenerationRequest, SamplingParams

TOKENIZER = Tokenizer.byte_level()
# Small enough to compile fast, wide enough that one update on 16 trajectories of 64
# tokens lasts many decode steps of 4 requests.
MODEL = ModelConfig(
    vocab_size=TOKENIZER.vocab_size,
    d_model=128,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    d_ff=384,
    max_seq_len=128,
)


def record_batch(num: int, seq_len: int, seed: int) -> pa.RecordBatch:
    """``num`` trajectories in groups of 4, prompt = first quarter, random rewards."""
    rng = np.random.default_rng(seed)
    prompt = seq_len // 4
    columns = {name: [] for name in TRAJECTORY_SCHEMA.names}
    for i in range(num):
        generated = seq_len - prompt
        columns["task_id"].append(f"t{i // 4}")
        columns["group_id"].append(f"g{i // 4}")
        columns["token_ids"].append(rng.integers(3, 250, size=seq_len).tolist())
        columns["loss_mask"].append([0] * prompt + [1] * generated)
        columns["logprobs"].append([0.0] * prompt + [-5.5] * generated)
        columns["policy_versions"].append([-1] * prompt + [0] * generated)
        columns["reward"].append(float(rng.integers(0, 2)))
        columns["status"].append("completed")
        columns["num_turns"].append(1)
    return pa.RecordBatch.from_pydict(columns, schema=TRAJECTORY_SCHEMA)


def ready(value):
    future = asyncio.get_running_loop().create_future()
    future.set_result(value)
    return future


@pytest.mark.slow
def test_engine_decodes_while_the_colocated_learner_updates():
    cfg = load_config(None, ["learner.mesh_data=1"])
    hp = RLHyperparams.from_config(cfg)
    sampling = SamplingParams(max_new_tokens=48, temperature=1.0, stop_token_ids=())

    async def main():
        actor = PolicyActor(
            MODEL, 0, TOKENIZER, {"max_batch_size": 4, "block_size": 16, "kv_cache_tokens": 1024}
        )
        actor.start_rl(hp)

        async def generate(n, tag):
            return await asyncio.gather(
                *(
                    actor.generate(
                        GenerationRequest(f"{tag}{i}", tuple(range(10, 30)), sampling, seed=i)
                    )
                    for i in range(n)
                )
            )

        # Compile the update and the engine's programs first, so what follows is steady state.
        await actor.train_step([ready(record_batch(16, 64, seed=0))])
        await generate(4, "warm")
        profiling.recorder().drain()

        async def generate_during_update():
            while not update_started.is_set():
                await asyncio.sleep(0)
            results = []
            while not update.done():  # keep the engine fed for the whole update
                results += await generate(4, f"r{len(results)}-")
            return results

        update_started = asyncio.Event()
        loop = asyncio.get_running_loop()
        original = actor._in_thread

        async def in_thread(fn, *args):  # marks the moment the update enters the thread
            loop.call_soon(update_started.set)
            return await original(fn, *args)

        actor._in_thread = in_thread
        update = asyncio.ensure_future(actor.train_step([ready(record_batch(16, 64, seed=1))]))
        results = await generate_during_update()
        metrics = await update
        return metrics, results, profiling.recorder().drain()["spans"]

    metrics, results, spans = asyncio.run(main())
    assert metrics["policy_version"] == 2
    assert results and all(len(r.token_ids) == 48 for r in results)
    [(u0, u1)] = [(s[2], s[3]) for s in spans if s[0] == "update"]
    decode = [(s[2], s[3]) for s in spans if s[0] == "decode"]
    inside = [(a, b) for a, b in decode if u0 < a and b < u1]
    # Serialised on one lock, no decode step could start and end within the update.
    assert len(inside) >= 10, (len(decode), u1 - u0)
