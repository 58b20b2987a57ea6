import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import asyncio
import math

import pytest

from raytunix.inference.engine import InferenceEngine
from raytunix.models.llama import ModelConfig, init_model
from raytunix.models.tokenizer import Tokenizer
from raytunix.types import FinishReason, GenerationRequest, SamplingParams

TOKENIZER = Tokenizer.byte_level()
CONFIG = ModelConfig(vocab_size=TOKENIZER.vocab_size, d_model=32, n_layers=2, n_heads=4,
                     n_kv_heads=2, d_ff=64, max_seq_len=64)
GRAPHDEF, PARAMS = init_model(CONFIG, seed=0)
_, OTHER_PARAMS = init_model(CONFIG, seed=1)


def _engine(params=PARAMS, version=0):
    # Same slot count and buckets everywhere so the jitted steps compile once per module.
    return InferenceEngine(GRAPHDEF, params, CONFIG, TOKENIZER, max_batch_size=8,
                           prefill_len_buckets=(16, 32, 64), policy_version=version)


def _request(rid, prompt, max_new_tokens=8, temperature=0.0, seed=0, **sampling):
    return GenerationRequest(
        request_id=rid, prompt_ids=tuple(prompt), seed=seed,
        sampling=SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                                **sampling))


def _prompt(n, start=11):
    return [(start + 7 * i) % CONFIG.vocab_size for i in range(n)]


async def _wait_for_decode_steps(engine, n):
    while engine.stats()["decode_steps"] < n:
        await asyncio.sleep(0.001)


def test_batched_greedy_equals_one_at_a_time():
    requests = [_request(f"r{i}", _prompt(2 + 5 * i, start=11 + i), max_new_tokens=10)
                for i in range(6)]

    async def main():
        engine = _engine()
        batched = await engine.generate_many(requests)
        single = [await engine.generate(r) for r in requests]
        stats = engine.stats()
        await engine.close()
        return batched, single, stats

    batched, single, stats = asyncio.run(main())
    for b, s, r in zip(batched, single, requests):
        assert b.request_id == r.request_id
        assert b.token_ids == s.token_ids
        assert len(b.token_ids) == 10 and b.finish_reason == FinishReason.LENGTH
        assert max(abs(x - y) for x, y in zip(b.logprobs, s.logprobs)) <= 1e-5
        assert b.policy_versions == (0,) * 10
        assert b.text == TOKENIZER.decode(list(b.token_ids))
    assert stats["requests_finished"] == 12 and stats["tokens_generated"] == 120
    assert stats["mean_active_slots"] > 1.0  # the batched half really decoded together
    assert 0.0 < stats["busy_fraction"] <= 1.0


def test_short_request_is_admitted_while_long_one_decodes():
    long_request = _request("long", _prompt(5), max_new_tokens=40)
    short_request = _request("short", _prompt(3, start=50), max_new_tokens=3)

    async def main():
        engine = _engine()
        alone = await engine.generate(long_request)
        steps_before = engine.stats()["decode_steps"]
        finished = []

        async def run(request):
            result = await engine.generate(request)
            finished.append((request.request_id, engine.stats()["decode_steps"] - steps_before))
            return result

        long_task = asyncio.create_task(run(long_request))
        await _wait_for_decode_steps(engine, steps_before + 5)
        short_result = await run(short_request)
        long_result = await long_task
        await engine.close()
        return alone, long_result, short_result, finished

    alone, long_result, short_result, finished = asyncio.run(main())
    assert [name for name, _ in finished] == ["short", "long"]
    # The long request needs 39 decode steps; the short one rode along in a few of them.
    assert finished[0][1] < 39 and finished[1][1] == 39
    assert len(short_result.token_ids) == 3
    # Sharing the batch did not change the long request's tokens.
    assert long_result.token_ids == alone.token_ids


def test_sampling_is_seeded_per_request():
    prompt = _prompt(6)

    async def main():
        engine = _engine()
        results = await engine.generate_many([
            _request("a", prompt, max_new_tokens=12, temperature=1.0, seed=1),
            _request("b", prompt, max_new_tokens=12, temperature=1.0, seed=2),
            _request("c", prompt, max_new_tokens=12, temperature=1.0, seed=1),
        ])
        alone = await engine.generate(
            _request("d", prompt, max_new_tokens=12, temperature=1.0, seed=1))
        await engine.close()
        return results, alone

    (a, b, c), alone = asyncio.run(main())
    assert a.token_ids == c.token_ids == alone.token_ids
    assert a.token_ids != b.token_ids
    for result in (a, b):
        assert all(math.isfinite(lp) and lp <= 0.0 for lp in result.logprobs)
    # A random tiny model is near uniform: sampled tokens are far from certain.
    assert min(a.logprobs) < -1.0


def test_stop_token_stop_string_and_lengths():
    prompt = _prompt(7)

    async def main():
        engine = _engine()
        reference = await engine.generate(_request("ref", prompt, max_new_tokens=12))
        gen = list(reference.token_ids)
        stop_token = gen[4]
        by_token = await engine.generate(
            _request("tok", prompt, max_new_tokens=12, stop_token_ids=(stop_token,)))
        stop_string = TOKENIZER.decode(gen[:5])[-2:]
        by_string = await engine.generate(
            _request("str", prompt, max_new_tokens=12, stop_strings=("never there",
                                                                     stop_string)))
        by_length = await engine.generate(_request("len", prompt, max_new_tokens=3))
        # 60 prompt tokens + 4 generated fill the 64-position cache.
        context_full = await engine.generate(_request("ctx", _prompt(60), max_new_tokens=50))
        await engine.close()
        return gen, stop_token, by_token, stop_string, by_string, by_length, context_full

    gen, stop_token, by_token, stop_string, by_string, by_length, context_full = (
        asyncio.run(main()))
    first = gen.index(stop_token)
    assert by_token.token_ids == tuple(gen[:first + 1])
    assert by_token.finish_reason == FinishReason.STOP

    end = next(k for k in range(1, 13) if TOKENIZER.decode(gen[:k]).endswith(stop_string))
    assert end <= 5
    assert by_string.token_ids == tuple(gen[:end])
    assert by_string.finish_reason == FinishReason.STOP
    assert by_string.text.endswith(stop_string)

    assert by_length.token_ids == tuple(gen[:3])
    assert by_length.finish_reason == FinishReason.LENGTH
    assert len(context_full.token_ids) == 4
    assert context_full.finish_reason == FinishReason.LENGTH


def test_invalid_prompts_are_rejected():
    async def main():
        engine = _engine()
        with pytest.raises(ValueError, match=r"64 tokens.*63"):
            await engine.generate(_request("long", _prompt(64)))
        with pytest.raises(ValueError, match="empty prompt"):
            await engine.generate(_request("empty", []))
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await engine.generate(_request("oov", [CONFIG.vocab_size]))
        ok = await engine.generate(_request("max", _prompt(63), max_new_tokens=5))
        await engine.close()
        return ok

    ok = asyncio.run(main())
    assert len(ok.token_ids) == 1 and ok.finish_reason == FinishReason.LENGTH


def test_update_weights_stamps_versions_and_reprefills():
    prompt = _prompt(5)

    async def main():
        engine = _engine()
        task = asyncio.create_task(engine.generate(_request("r", prompt, max_new_tokens=30)))
        await _wait_for_decode_steps(engine, 4)
        engine.update_weights(OTHER_PARAMS, version=3)
        with pytest.raises(ValueError, match="older"):
            engine.update_weights(OTHER_PARAMS, version=2)
        swapped = await task
        after_swap = await engine.generate(_request("after", prompt, max_new_tokens=10))
        version = engine.stats()["policy_version"]
        await engine.close()

        k = swapped.policy_versions.index(3)
        fresh = _engine(OTHER_PARAMS, version=3)
        continued = await fresh.generate(
            _request("cont", prompt + list(swapped.token_ids[:k]), max_new_tokens=30 - k))
        from_scratch = await fresh.generate(_request("new", prompt, max_new_tokens=10))
        await fresh.close()
        return swapped, k, continued, after_swap, from_scratch, version

    swapped, k, continued, after_swap, from_scratch, version = asyncio.run(main())
    assert version == 3
    assert k >= 4 and swapped.policy_versions == (0,) * k + (3,) * (30 - k)
    # Tokens after the swap are those the new weights give for the same context, so the
    # KV computed under the old weights was not reused.
    assert swapped.token_ids[k:] == continued.token_ids
    assert after_swap.token_ids == from_scratch.token_ids
    assert after_swap.policy_versions == (3,) * 10


def test_pause_aborts_with_partial_tokens_and_resume_continues():
    async def main():
        engine = _engine()
        tasks = [asyncio.create_task(engine.generate(_request(f"r{i}", _prompt(4 + i),
                                                              max_new_tokens=50)))
                 for i in range(3)]
        await _wait_for_decode_steps(engine, 3)
        await engine.pause(timeout_s=5.0)
        done_at_return = [t.done() for t in tasks]
        aborted = [await t for t in tasks]

        queued = asyncio.create_task(engine.generate(_request("q", _prompt(4), max_new_tokens=4)))
        await asyncio.sleep(0.05)
        queued_while_paused = queued.done()
        engine.resume()
        after = await queued
        await engine.close()
        return done_at_return, aborted, queued_while_paused, after

    done_at_return, aborted, queued_while_paused, after = asyncio.run(main())
    assert all(done_at_return)
    for result in aborted:
        assert result.finish_reason == FinishReason.ABORT
        assert 1 <= len(result.token_ids) < 50
        assert len(result.logprobs) == len(result.policy_versions) == len(result.token_ids)
    assert not queued_while_paused
    assert after.finish_reason == FinishReason.LENGTH and len(after.token_ids) == 4
