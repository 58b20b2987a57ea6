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
CONFIG = ModelConfig(
    vocab_size=TOKENIZER.vocab_size,
    d_model=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    d_ff=64,
    max_seq_len=64,
)
GRAPHDEF, PARAMS = init_model(CONFIG, seed=0)
_, OTHER_PARAMS = init_model(CONFIG, seed=1)


def _engine(params=PARAMS, version=0, **kwargs):
    # Same rows, blocks and chunk everywhere so the jitted steps compile once per module.
    return InferenceEngine(
        GRAPHDEF,
        params,
        CONFIG,
        TOKENIZER,
        max_batch_size=8,
        block_size=8,
        prefill_chunk_tokens=32,
        policy_version=version,
        **kwargs,
    )


@pytest.fixture(scope="module", autouse=True)
def _compiled_once():
    """Compiles every program shape of the module's engine once, up front."""
    _engine().warmup()


def _request(rid, prompt, max_new_tokens=8, temperature=0.0, seed=0, **sampling):
    return GenerationRequest(
        request_id=rid,
        prompt_ids=tuple(prompt),
        seed=seed,
        sampling=SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, **sampling),
    )


def _prompt(n, start=11):
    return [(start + 7 * i) % CONFIG.vocab_size for i in range(n)]


async def _wait_for_decode_steps(engine, n):
    while engine.stats()["decode_steps"] < n:
        await asyncio.sleep(0.001)


@pytest.mark.slow
def test_batched_greedy_equals_one_at_a_time():
    requests = [
        _request(f"r{i}", _prompt(2 + 5 * i, start=11 + i), max_new_tokens=10) for i in range(6)
    ]

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


@pytest.mark.slow
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
        results = await engine.generate_many(
            [
                _request("a", prompt, max_new_tokens=12, temperature=1.0, seed=1),
                _request("b", prompt, max_new_tokens=12, temperature=1.0, seed=2),
                _request("c", prompt, max_new_tokens=12, temperature=1.0, seed=1),
            ]
        )
        alone = await engine.generate(
            _request("d", prompt, max_new_tokens=12, temperature=1.0, seed=1)
        )
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
            _request("tok", prompt, max_new_tokens=12, stop_token_ids=(stop_token,))
        )
        stop_string = TOKENIZER.decode(gen[:5])[-2:]
        by_string = await engine.generate(
            _request("str", prompt, max_new_tokens=12, stop_strings=("never there", stop_string))
        )
        by_length = await engine.generate(_request("len", prompt, max_new_tokens=3))
        # 60 prompt tokens + 4 generated fill the 64-position cache.
        context_full = await engine.generate(_request("ctx", _prompt(60), max_new_tokens=50))
        await engine.close()
        return gen, stop_token, by_token, stop_string, by_string, by_length, context_full

    gen, stop_token, by_token, stop_string, by_string, by_length, context_full = asyncio.run(main())
    first = gen.index(stop_token)
    assert by_token.token_ids == tuple(gen[: first + 1])
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
            _request("cont", prompt + list(swapped.token_ids[:k]), max_new_tokens=30 - k)
        )
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
        tasks = [
            asyncio.create_task(
                engine.generate(_request(f"r{i}", _prompt(4 + i), max_new_tokens=50))
            )
            for i in range(3)
        ]
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


def _session_request(rid, prompt, session, **kwargs):
    request = _request(rid, prompt, **kwargs)
    return GenerationRequest(
        request_id=request.request_id,
        prompt_ids=request.prompt_ids,
        sampling=request.sampling,
        seed=request.seed,
        session_id=session,
    )


def _alone(requests, **kwargs):
    """Each request on a fresh engine of its own: the reference output."""

    async def main():
        out = []
        for request in requests:
            engine = _engine(**kwargs)
            out.append(await engine.generate(request))
            await engine.close()
        return out

    return asyncio.run(main())


def test_greedy_output_is_the_same_alone_batched_joining_and_in_reused_blocks():
    requests = [
        _request(f"r{i}", _prompt(3 + 9 * i, start=5 + i), max_new_tokens=12) for i in range(5)
    ]
    reference = _alone(requests)

    async def main():
        engine = _engine()
        batched = await engine.generate_many(requests)
        # Joining: the others arrive while the first decodes.
        first = asyncio.create_task(engine.generate(requests[0]))
        await _wait_for_decode_steps(engine, engine.stats()["decode_steps"] + 3)
        joined = [await first, *(await engine.generate_many(requests[1:]))]
        # Reused blocks: the pool has recycled every block by now; run again.
        reused = await engine.generate_many(requests[::-1])
        stats = engine.stats()
        await engine.close()
        return batched, joined, reused[::-1], stats

    batched, joined, reused, stats = asyncio.run(main())
    for ref, *others in zip(reference, batched, joined, reused):
        for other in others:
            assert other.token_ids == ref.token_ids
            assert max(abs(a - b) for a, b in zip(other.logprobs, ref.logprobs)) < 1e-4
    assert stats["kv_blocks_in_use"] <= stats["prefix_cache_blocks"]  # only cached prefixes


def test_session_turns_prefill_only_their_new_tokens():
    rng = __import__("random").Random(0)

    async def main():
        engine = _engine()
        context, per_turn = _prompt(9), []
        for turn in range(5):
            before = engine.stats()["prompt_tokens_computed"]
            result = await engine.generate(
                _session_request(f"t{turn}", context, "ep", max_new_tokens=4)
            )
            computed = engine.stats()["prompt_tokens_computed"] - before
            per_turn.append((list(context), result, computed))
            context += list(result.token_ids) + [rng.randrange(3, 200) for _ in range(3)]
        stats = engine.stats()
        engine.end_session("ep")
        after_end = engine.stats()
        await engine.close()
        return per_turn, stats, after_end

    per_turn, stats, after_end = asyncio.run(main())
    references = _alone(
        [_request(f"ref{i}", prompt, max_new_tokens=4) for i, (prompt, _, _) in enumerate(per_turn)]
    )
    previous = None
    for (prompt, result, computed), reference in zip(per_turn, references):
        assert result.token_ids == reference.token_ids
        if previous is None:
            assert computed == len(prompt) and result.num_cached_tokens == 0
        else:
            # Everything up to the previous turn's last token was in the session; that
            # token (sampled, never fed) and the 3 new ones are computed.
            cached = len(previous[0]) + len(previous[1].token_ids) - 1
            assert result.num_cached_tokens == cached
            assert computed == len(prompt) - cached == 4
        previous = (prompt, result)
    assert stats["prompt_tokens_from_sessions"] == sum(r.num_cached_tokens for _, r, _ in per_turn)
    assert stats["sessions_held"] == 1 and after_end["sessions_held"] == 0


def test_group_samples_prefill_their_prompt_once():
    prompt = _prompt(45)
    group = [
        _request(f"g{i}", prompt, max_new_tokens=6, temperature=1.0, seed=100 + i) for i in range(4)
    ]
    reference = _alone(group)

    async def main():
        engine = _engine()
        results = await engine.generate_many(group)
        stats = engine.stats()
        await engine.close()
        return results, stats

    results, stats = asyncio.run(main())
    for result, ref in zip(results, reference):
        assert result.token_ids == ref.token_ids  # sharing KV changes no sample
    # 5 full blocks (40 tokens) are computed once; each other sample feeds only the 5
    # tokens of the partly filled last block.
    assert stats["prompt_tokens_computed"] == 45 + 3 * 5
    assert stats["prompt_tokens_from_prefix_cache"] == 3 * 40
    assert sorted(r.num_cached_tokens for r in results) == [0, 40, 40, 40]
    assert len({r.token_ids for r in results}) > 1  # distinct seeds still differ


def test_a_shared_system_prompt_is_computed_once_per_weight_version():
    system = _prompt(24, start=3)
    questions = [system + _prompt(5 + i, start=90 + i) for i in range(3)]

    async def main():
        engine = _engine()
        for i, prompt in enumerate(questions):
            await engine.generate(_request(f"q{i}", prompt, max_new_tokens=2))
        warm = engine.stats()
        engine.update_weights(OTHER_PARAMS, version=1)
        await engine.generate(_request("after", questions[0], max_new_tokens=2))
        after = engine.stats()
        await engine.close()
        return warm, after

    warm, after = asyncio.run(main())
    assert warm["prompt_tokens_from_prefix_cache"] == 2 * 24
    # Recomputed after the update: KV of the old weights is not reused.
    assert after["prompt_tokens_from_prefix_cache"] == warm["prompt_tokens_from_prefix_cache"]


def test_no_compilation_after_warmup_across_mixed_requests():
    import random

    rng = random.Random(7)

    async def main():
        engine = _engine()
        compiled = engine.stats()["compiled_programs"]
        assert compiled > 0
        done = 0
        while done < 200:
            wave = rng.randint(1, 12)  # more than the 8 rows at times: requests queue
            requests = []
            for i in range(wave):
                session = f"s{rng.randrange(6)}" if rng.random() < 0.3 else None
                requests.append(
                    _session_request(
                        f"m{done + i}",
                        [rng.randrange(3, 250) for _ in range(rng.randint(1, 60))],
                        session if session not in {r.session_id for r in requests} else None,
                        max_new_tokens=rng.randint(1, 20),
                        temperature=rng.choice([0.0, 1.0]),
                        seed=done + i,
                    )
                )
            await engine.generate_many(requests)
            done += wave
        stats = engine.stats()
        await engine.close()
        return compiled, stats

    compiled, stats = asyncio.run(main())
    assert stats["requests_finished"] >= 200
    assert stats["compiled_programs"] == compiled


def test_decode_cost_follows_live_requests():
    async def main():
        engine = _engine()
        await engine.generate(_request("one", _prompt(5), max_new_tokens=10))
        alone = set(engine._shapes)
        await engine.close()
        return alone

    shapes = asyncio.run(main())
    # One live request decodes as 1 row, not as all 8 rows the engine has.
    assert {s[0] for s in shapes if s[1] == 1} == {1}


def test_weight_update_in_keep_mode_counts_stale_tokens():
    prompt = _prompt(5)

    async def main():
        engine = _engine(kv_on_weight_update="keep")
        task = asyncio.create_task(
            engine.generate(_session_request("r", prompt, "s", max_new_tokens=30))
        )
        await _wait_for_decode_steps(engine, 4)
        engine.update_weights(OTHER_PARAMS, version=2)
        result = await task
        # The session's KV survives the update in keep mode.
        follow = await engine.generate(
            _session_request("r2", prompt + list(result.token_ids) + [9], "s", max_new_tokens=3)
        )
        stats = engine.stats()
        await engine.close()
        return result, follow, stats

    result, follow, stats = asyncio.run(main())
    k = result.policy_versions.index(2)
    assert k >= 4 and result.policy_versions == (0,) * k + (2,) * (30 - k)
    assert result.stale_kv_tokens == 30 - k  # every token after the swap read old KV
    assert follow.num_cached_tokens == len(prompt) + 30 - 1
    assert follow.stale_kv_tokens == 3
    assert stats["stale_kv_tokens"] == 30 - k + 3


def test_session_is_recomputed_after_a_weight_update_by_default():
    prompt = _prompt(12)

    async def main():
        engine = _engine()
        first = await engine.generate(_session_request("a", prompt, "s", max_new_tokens=4))
        engine.update_weights(OTHER_PARAMS, version=1)
        follow_prompt = prompt + list(first.token_ids) + [7, 8]
        follow = await engine.generate(_session_request("b", follow_prompt, "s", max_new_tokens=4))
        await engine.close()
        return follow, follow_prompt

    follow, follow_prompt = asyncio.run(main())
    (reference,) = _alone(
        [_request("ref", follow_prompt, max_new_tokens=4)], params=OTHER_PARAMS, version=1
    )
    assert follow.num_cached_tokens == 0 and follow.stale_kv_tokens == 0
    assert follow.token_ids == reference.token_ids
    assert follow.policy_versions == (1,) * 4


def test_cancelled_and_aborted_requests_free_their_rows_within_one_step():
    async def main():
        engine = _engine()
        task = asyncio.create_task(engine.generate(_request("c", _prompt(6), max_new_tokens=50)))
        other = asyncio.create_task(engine.generate(_request("a", _prompt(7), max_new_tokens=50)))
        await _wait_for_decode_steps(engine, 3)
        task.cancel()
        while not task.done():  # the cancellation reaches the engine's future
            await asyncio.sleep(0)
        steps = engine.stats()["decode_steps"]  # the step in flight cannot be interrupted
        while engine.stats()["active_slots"] > 1:
            await asyncio.sleep(0)  # look after every step the engine takes
        freed_after = engine.stats()["decode_steps"] - steps
        assert engine.abort("a") is True
        aborted = await other
        assert engine.abort("a") is False  # no longer in flight
        stats = engine.stats()
        await engine.close()
        return freed_after, aborted, stats

    freed_after, aborted, stats = asyncio.run(main())
    assert freed_after <= 1
    assert aborted.finish_reason == FinishReason.ABORT and 3 <= len(aborted.token_ids) < 50
    assert stats["active_slots"] == 0 and stats["decode_steps"] < 40


def test_top_k_one_and_tiny_top_p_sample_the_argmax():
    prompt = _prompt(10)

    async def main():
        engine = _engine()
        greedy = await engine.generate(_request("g", prompt, max_new_tokens=10))
        top_k = await engine.generate(
            _request("k", prompt, max_new_tokens=10, temperature=1.0, seed=3, top_k=1)
        )
        top_p = await engine.generate(
            _request("p", prompt, max_new_tokens=10, temperature=0.7, seed=4, top_p=1e-6)
        )
        free = await engine.generate(
            _request("f", prompt, max_new_tokens=10, temperature=1.0, seed=3)
        )
        await engine.close()
        return greedy, top_k, top_p, free

    greedy, top_k, top_p, free = asyncio.run(main())
    assert top_k.token_ids == top_p.token_ids == greedy.token_ids
    # The only allowed token has probability 1 under the truncated distribution.
    assert max(abs(lp) for lp in top_k.logprobs + top_p.logprobs) < 1e-5
    assert free.token_ids != greedy.token_ids


@pytest.mark.slow
def test_memory_pressure_evicts_sessions_and_preempts_without_changing_outputs():
    # 12 blocks of 8 tokens: less than the four 40-token requests need at once.
    requests = [
        _request(f"p{i}", _prompt(10 + i, start=20 + i), max_new_tokens=30) for i in range(4)
    ]
    kwargs = {"kv_cache_tokens": 96}
    reference = _alone(requests, **kwargs)

    async def main():
        engine = _engine(**kwargs)
        first = await engine.generate(_session_request("s1", _prompt(30), "old", max_new_tokens=2))
        results = await engine.generate_many(requests)
        stats = engine.stats()
        # The evicted session's next turn is prefilled again, transparently.
        follow_prompt = _prompt(30) + list(first.token_ids) + [5]
        follow = await engine.generate(
            _session_request("s2", follow_prompt, "old", max_new_tokens=5)
        )
        await engine.close()
        return results, stats, follow, follow_prompt

    results, stats, follow, follow_prompt = asyncio.run(main())
    for result, ref in zip(results, reference):
        assert result.token_ids == ref.token_ids
    assert stats["session_evictions"] == 1 and stats["preemptions"] >= 1
    assert follow.num_cached_tokens < 30
    (follow_ref,) = _alone([_request("ref", follow_prompt, max_new_tokens=5)], **kwargs)
    assert follow.token_ids == follow_ref.token_ids


def test_bad_requests_get_clear_errors_and_the_engine_keeps_serving():
    async def main():
        engine = _engine()
        running = asyncio.create_task(
            engine.generate(_session_request("x", _prompt(5), "s", max_new_tokens=20))
        )
        await asyncio.sleep(0)
        with pytest.raises(ValueError, match="already in flight"):
            await engine.generate(_request("x", _prompt(5)))
        with pytest.raises(ValueError, match="session 's' already has a request"):
            await engine.generate(_session_request("y", _prompt(5), "s"))
        with pytest.raises(ValueError, match="top_p"):
            await engine.generate(_request("z", _prompt(5), top_p=0.0))
        result = await running
        await engine.close()
        return result

    assert len(asyncio.run(main()).token_ids) == 20


def test_kv_memory_is_reported():
    async def main():
        engine = _engine()
        await engine.generate(_session_request("a", _prompt(20), "s", max_new_tokens=4))
        held = engine.stats()
        engine.end_session("s")
        await engine.close()
        return held

    held = asyncio.run(main())
    bytes_per_block = 8 * 2 * CONFIG.n_layers * CONFIG.n_kv_heads * CONFIG.head_dim * 4
    assert held["kv_blocks_in_use"] == 3  # 23 tokens of KV in 8-token blocks
    assert held["kv_bytes_in_use"] == 3 * bytes_per_block
    assert held["kv_bytes_capacity"] == held["kv_blocks_total"] * bytes_per_block
    assert held["sessions_held"] == 1


def test_a_session_continues_from_its_kv_after_another_session_was_evicted():
    kwargs = {"kv_cache_tokens": 96}  # 12 blocks of 8 tokens
    a_prompt, b_prompt = _prompt(20, start=40), _prompt(20, start=60)

    async def main():
        engine = _engine(**kwargs)
        await engine.generate(_session_request("a1", a_prompt, "a", max_new_tokens=2))
        b = await engine.generate(_session_request("b1", b_prompt, "b", max_new_tokens=2))
        # 7 blocks more than the 12 minus the sessions' 6: the least recent session goes.
        await engine.generate(_request("big", _prompt(40, start=80), max_new_tokens=10))
        evicted = engine.stats()["session_evictions"]
        follow_prompt = b_prompt + list(b.token_ids) + [9, 10]
        follow = await engine.generate(_session_request("b2", follow_prompt, "b", max_new_tokens=6))
        await engine.close()
        return evicted, follow, follow_prompt

    evicted, follow, follow_prompt = asyncio.run(main())
    (reference,) = _alone([_request("ref", follow_prompt, max_new_tokens=6)], **kwargs)
    assert evicted == 1  # session "a"
    assert follow.num_cached_tokens == len(b_prompt) + 2 - 1  # "b" kept all its KV
    assert follow.token_ids == reference.token_ids


def test_a_waiting_session_turn_never_blocks_a_running_request():
    # One context of KV: a session's next turn that must wait gives its blocks back, so
    # the running request can still grow (found by a new user: the engine hung).
    kwargs = {"kv_cache_tokens": 64}

    async def main():
        engine = _engine(**kwargs)
        first = await engine.generate(_session_request("s1", _prompt(30), "S", max_new_tokens=2))
        running = asyncio.create_task(
            engine.generate(_request("R", _prompt(10, 3), max_new_tokens=50))
        )
        await _wait_for_decode_steps(engine, engine.stats()["decode_steps"] + 3)
        turn = asyncio.create_task(
            engine.generate(
                _session_request(
                    "s2",
                    _prompt(30) + list(first.token_ids) + _prompt(25, 5),
                    "S",
                    max_new_tokens=5,
                )
            )
        )
        done, _ = await asyncio.wait([running, turn], timeout=60)
        results = [t.result() for t in done]
        await engine.close()
        return results

    results = asyncio.run(main())
    assert len(results) == 2 and all(r.finish_reason != FinishReason.ABORT for r in results)


def test_a_cancelled_request_frees_its_id_and_session_at_once():
    async def main():
        engine = _engine()
        await engine.pause()
        task = asyncio.create_task(engine.generate(_session_request("c", _prompt(5), "Z")))
        await asyncio.sleep(0)
        task.cancel()
        await asyncio.sleep(0)
        again = asyncio.create_task(
            engine.generate(_session_request("c", _prompt(5), "Z", max_new_tokens=3))
        )
        await asyncio.sleep(0)
        engine.resume()
        result = await again
        await engine.close()
        with pytest.raises(RuntimeError, match="closed"):
            engine.update_weights(OTHER_PARAMS, version=1)
        return result

    assert len(asyncio.run(main()).token_ids) == 3


def test_turns_after_a_stop_continue_from_the_right_kv_while_the_engine_runs_ahead():
    # The engine launches a request's next decode step before it has seen the token the
    # step before sampled; a request that stopped was therefore decoded once more. That
    # extra token must not reach the result, and the session's KV (written by the extra
    # step up to the stop token) must be the KV a fresh computation gives.
    prompt = _prompt(9)

    async def main():
        engine = _engine()
        gen = list((await engine.generate(_request("ref", prompt, max_new_tokens=12))).token_ids)
        stop = gen[5]
        others = [
            engine.generate(_request(f"o{i}", _prompt(4 + i, start=3 + i), max_new_tokens=12))
            for i in range(3)
        ]
        first, *_ = await asyncio.gather(
            engine.generate(
                _session_request("t0", prompt, "ep", max_new_tokens=12, stop_token_ids=(stop,))
            ),
            *others,
        )
        second_prompt = prompt + list(first.token_ids) + [41, 42, 43]
        second = await engine.generate(
            _session_request("t1", second_prompt, "ep", max_new_tokens=8)
        )
        await engine.close()
        return gen, stop, first, second_prompt, second

    gen, stop, first, second_prompt, second = asyncio.run(main())
    assert first.token_ids == tuple(gen[: gen.index(stop) + 1])
    assert first.finish_reason == FinishReason.STOP
    (reference,) = _alone([_request("ref2", second_prompt, max_new_tokens=8)])
    assert second.token_ids == reference.token_ids
    assert second.num_cached_tokens >= len(prompt) + len(first.token_ids) - 1


def test_device_work_is_counted_with_its_padding_and_idle_time_is_not_work():
    async def main():
        engine = _engine()
        await engine.generate(_request("one", _prompt(5), max_new_tokens=10))
        first = engine.stats()
        await asyncio.sleep(0.3)  # no request held: wall time, not work time
        idle = engine.stats()
        await engine.close()
        return first, idle

    first, idle = asyncio.run(main())
    # A 5-token prompt runs in a prefill program of 1 row x 8 tokens; each decode step in
    # one of 1 row x 1 token.
    assert first["prefill_calls"] == 1
    assert first["padded_tokens"] == 8 + first["decode_steps"]
    assert first["padded_tokens_per_generated_token"] == first["padded_tokens"] / 10
    assert 0.0 <= first["host_gap_s"] <= first["work_s"] <= first["wall_s"] + 1e-3
    assert first["host_gap_fraction"] == pytest.approx(first["host_gap_s"] / first["work_s"])
    assert 0.0 < first["prefill_share_of_busy"] < 1.0
    assert idle["work_s"] == first["work_s"] and idle["wall_s"] >= first["wall_s"] + 0.25
