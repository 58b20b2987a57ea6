"""The engine compiles the step programs a run can reach on a background thread, so that
live requests never wait for the compiler after start-up; a step whose own program is not
built yet runs on a built one that holds it, with the same samples."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import asyncio
import json
import random
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from raytunix.inference.engine import InferenceEngine
from raytunix.inference.programs import Shape, StepPrograms, shared_programs
from raytunix.models.llama import ModelConfig, init_model
from raytunix.models.tokenizer import Tokenizer
from raytunix.types import GenerationRequest, SamplingParams

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER = Tokenizer.byte_level()
# Its own sizes (d_model 24): the programs of other test modules' engines are not shared.
CONFIG = ModelConfig(
    vocab_size=TOKENIZER.vocab_size,
    d_model=24,
    n_layers=1,
    n_heads=2,
    n_kv_heads=1,
    d_ff=48,
    max_seq_len=64,
)
GRAPHDEF, PARAMS = init_model(CONFIG, seed=0)


def _engine(**kwargs):
    return InferenceEngine(
        GRAPHDEF,
        PARAMS,
        CONFIG,
        TOKENIZER,
        max_batch_size=8,
        block_size=8,
        prefill_chunk_tokens=32,
        **kwargs,
    )


def _request(rid, prompt, max_new_tokens=8, temperature=0.0, seed=0, session_id=None, **sampling):
    return GenerationRequest(
        request_id=rid,
        prompt_ids=tuple(prompt),
        seed=seed,
        session_id=session_id,
        sampling=SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, **sampling),
    )


def _mixed_workload(seed, n=120):
    """Waves of requests of every length, some in sessions, greedy and sampled, with and
    without top-p: every kind of step program."""
    rng = random.Random(seed)
    waves, done = [], 0
    while done < n:
        wave = []
        for i in range(rng.randint(1, 12)):  # above the 8 rows at times: requests queue
            wave.append(
                _request(
                    f"m{done + i}",
                    [rng.randrange(3, 250) for _ in range(rng.randint(1, 50))],
                    max_new_tokens=rng.randint(1, 12),
                    temperature=rng.choice([0.0, 1.0]),
                    seed=done + i,
                    top_p=rng.choice([1.0, 1.0, 0.9]),
                )
            )
        waves.append(wave)
        done += len(wave)
    return waves


async def _serve(engine, waves):
    results = []
    for wave in waves:
        results += await engine.generate_many(wave)
    return results


@pytest.mark.slow
def test_after_start_up_no_step_waits_for_a_compile():
    async def main():
        engine = _engine(compile_ahead=True)
        # Top-p requests have programs of their own; the first one queues them.
        await engine.generate(_request("first", [5, 6, 7], top_p=0.9, temperature=1.0))
        assert await asyncio.to_thread(engine.wait_until_compiled, 600)
        before = engine.stats()
        results = await _serve(engine, _mixed_workload(seed=3))
        after = engine.stats()
        await engine.close()
        return before, after, results

    before, after, results = asyncio.run(main())
    assert len(results) >= 120
    assert before["compile_queue"] == 0
    assert after["compile_stalls"] == before["compile_stalls"]
    assert after["compile_stall_s"] == before["compile_stall_s"]
    assert after["compiles"] == before["compiles"]
    assert after["compiled_programs"] == before["compiled_programs"]
    # Start-up built everything the scheduler can reach, mostly on the background thread.
    assert before["compiles_ahead"] > before["compiles"] / 2


def test_a_lazy_engine_counts_the_seconds_steps_waited_for_the_compiler():
    async def main():
        engine = InferenceEngine(
            GRAPHDEF,
            PARAMS,
            CONFIG,
            TOKENIZER,
            max_batch_size=4,
            block_size=8,
            prefill_chunk_tokens=16,
        )
        await engine.generate(_request("a", list(range(3, 20)), max_new_tokens=4))
        stats = engine.stats()
        await engine.close()
        return stats

    stats = asyncio.run(main())
    # A prefill and a decode program at least, each compiled while the request waited.
    assert stats["compile_stalls"] >= 2 and stats["compiles"] == stats["compile_stalls"]
    assert stats["compile_stall_s"] > 0 and stats["compiles_ahead"] == 0
    assert stats["steps_on_larger_program"] == 0


@pytest.mark.slow
def test_steps_on_larger_programs_sample_what_their_own_programs_sample():
    waves = _mixed_workload(seed=11, n=40)

    async def run(force_largest):
        engine = _engine()
        engine.warmup()
        if force_largest:
            programs = engine._programs
            plain = programs.program_for

            def largest(shape):  # the most padded program that holds the step
                ready = programs._table.ready
                best = max((s for s in ready if s.holds(shape)), key=lambda s: s.cost)
                assert plain(best)[1] == best
                return ready[best], best

            programs.program_for = largest
        results = await _serve(engine, waves)
        await engine.close()
        return results, engine._shapes

    own, own_shapes = asyncio.run(run(False))
    padded, padded_shapes = asyncio.run(run(True))
    assert own_shapes != padded_shapes  # the second run really ran other programs
    for a, b in zip(own, padded):
        assert a.request_id == b.request_id
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= 1e-4


# A tiny real jitted function stands in for the engine's step: StepPrograms only lowers,
# compiles and picks programs; what they compute is the engine tests' business.
def _lower_for(fn):
    def lower(shape):
        x = jax.ShapeDtypeStruct((shape.batch, shape.length, shape.span), jnp.float32)
        return fn.lower(x)

    return lower


def _shapes(truncate):
    return [Shape(truncate, b, 1, s) for b in (1, 4) for s in (2, 4)] + [
        Shape(truncate, 1, 8, s) for s in (2, 4)
    ]


def test_the_cheapest_built_program_that_holds_a_step_runs_it_while_its_own_is_built():
    fn = jax.jit(lambda x: x * 2.0)
    table = shared_programs(("test-holders", id(fn)))
    lazy = StepPrograms(table, _lower_for(fn), _shapes, ahead=False)
    lazy.compile_now([Shape(False, 4, 1, 4), Shape(False, 4, 1, 2), Shape(False, 1, 8, 4)])
    ahead = StepPrograms(table, _lower_for(fn), _shapes, ahead=True)
    try:
        program, shape = ahead.program_for(Shape(False, 1, 1, 2))
        if shape != Shape(False, 1, 1, 2):  # its own was not built yet: the cheapest holder
            assert shape == Shape(False, 4, 1, 2)
            assert ahead.stats()["steps_on_larger_program"] == 1
        out = program(np.ones((shape.batch, shape.length, shape.span), np.float32))
        assert float(out.sum()) == 2.0 * shape.batch * shape.length * shape.span
        assert ahead.wait_until_compiled(120)
        assert ahead.program_for(Shape(False, 1, 1, 2))[1] == Shape(False, 1, 1, 2)
        assert all(s in table.ready for s in _shapes(False))
        assert not any(s.truncate for s in table.ready)  # swept only when first asked for
        assert ahead.stats()["compile_stalls"] == 0
        # A prefill step never runs on a decode program (nor the other way round).
        assert not Shape(False, 4, 1, 4).holds(Shape(False, 1, 8, 2))
        assert not Shape(True, 4, 1, 4).holds(Shape(False, 1, 1, 2))
    finally:
        ahead.close()


def test_a_step_with_no_built_holder_compiles_its_own_and_counts_the_wait():
    fn = jax.jit(lambda x: x + 1.0)
    table = shared_programs(("test-stall", id(fn)))
    programs = StepPrograms(table, _lower_for(fn), _shapes, ahead=False)
    _, shape = programs.program_for(Shape(True, 4, 1, 4))
    assert shape == Shape(True, 4, 1, 4)
    stats = programs.stats()
    assert stats["compile_stalls"] == 1 and stats["compiles"] == 1
    assert stats["compile_stall_s"] > 0
    programs.program_for(Shape(True, 4, 1, 4))  # built: no second stall
    assert programs.stats()["compile_stalls"] == 1


# A fresh process: an engine compiling ahead, then a request, counting JAX's persistent
# cache events (a hit loads a program, a miss compiles and stores it).
ENGINE_PROCESS = textwrap.dedent("""
    import asyncio, json, os
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from jax import monitoring
    counts = {}
    monitoring.register_event_listener(
        lambda name, **kw: counts.__setitem__(name, counts.get(name, 0) + 1))
    from raytunix.inference.engine import InferenceEngine
    from raytunix.models.llama import ModelConfig, init_model
    from raytunix.models.tokenizer import Tokenizer
    from raytunix.types import GenerationRequest, SamplingParams
    tok = Tokenizer.byte_level()
    config = ModelConfig(vocab_size=tok.vocab_size, d_model=16, n_layers=1, n_heads=2,
                         n_kv_heads=1, d_ff=32, max_seq_len=32)
    graphdef, params = init_model(config, seed=0)

    async def main():
        engine = InferenceEngine(graphdef, params, config, tok, max_batch_size=2, block_size=8,
                                 prefill_chunk_tokens=16, compile_ahead=True)
        assert await asyncio.to_thread(engine.wait_until_compiled, 300)
        await engine.generate(GenerationRequest(request_id="r", prompt_ids=(5, 6, 7), seed=0,
                              sampling=SamplingParams(max_new_tokens=3, temperature=0.0)))
        stats = engine.stats()
        await engine.close()
        return stats

    stats = asyncio.run(main())
    print(json.dumps({"cache": {k.rsplit("/", 1)[-1]: v for k, v in counts.items()
                                if "compilation_cache" in k},
                      "compile_stalls": stats["compile_stalls"]}))
""")


@pytest.mark.slow
def test_a_second_engine_process_with_the_same_cache_dir_compiles_nothing(tmp_path):
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("JAX_COMPILATION_CACHE") and not k.startswith("JAX_PERSISTENT_CACHE")
    }
    env.update(
        PYTHONPATH=ROOT,
        JAX_PLATFORMS="cpu",
        JAX_COMPILATION_CACHE_DIR=str(tmp_path / "cache"),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )

    def run():
        out = subprocess.run(
            [sys.executable, "-c", ENGINE_PROCESS],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            check=True,
        )
        return json.loads(out.stdout.strip().splitlines()[-1])

    first, second = run(), run()
    assert first["cache"].get("cache_misses", 0) > 0
    assert first["compile_stalls"] == 0 and second["compile_stalls"] == 0
    assert second["cache"].get("cache_misses", 0) == 0, second
    assert second["cache"].get("cache_hits", 0) >= first["cache"]["cache_misses"]
