"""The KV-cache manager hands blocks to requests, sessions and the prefix cache, and takes
them back, without JAX: every test counts block ids and reference counts by hand."""

import asyncio
import collections

import pytest

from raytunix.inference.kv_cache import NO_KV, KVCacheManager, Sequence
from raytunix.types import GenerationRequest, SamplingParams

BS = 4  # tokens per block in every test


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def _manager(num_blocks=8, kv_mode="recompute"):
    return KVCacheManager(num_blocks, BS, kv_mode, collections.Counter())


def _seq(loop, prompt, rid="r", session_id=None, order=0):
    request = GenerationRequest(
        request_id=rid,
        prompt_ids=tuple(prompt),
        seed=0,
        sampling=SamplingParams(max_new_tokens=4),
        session_id=session_id,
    )
    return Sequence(
        request=request,
        future=loop.create_future(),
        seed_lo=0,
        seed_hi=0,
        order=order,
        context=list(prompt),
        kv_version=NO_KV,
    )


def _write(kv, seq, n, version=0):
    """What a launched call does to a row's bookkeeping: ``n`` more positions written."""
    assert kv.allocate(seq, n, lambda: None, lambda s: None)
    seq.num_cached += n
    seq.kv_version = min(seq.kv_version, version)
    kv.register_blocks(seq, version)


def test_a_second_request_adopts_the_full_blocks_of_a_shared_prompt(loop):
    kv = _manager()
    first, second = _seq(loop, range(10), "a"), _seq(loop, range(10), "b", order=1)
    _write(kv, first, 10)  # blocks [0..3], [4..7] full; [8, 9] partial
    assert len(first.blocks) == 3 and len(kv.prefix) == 2
    kv.adopt_prefix(second, version=0)
    # Both full blocks are reused; the last token is always fed, so 8 of 10 come cached.
    assert second.blocks == first.blocks[:2] and second.num_cached == 8
    assert second.cached_tokens == 8 and kv.counters["prompt_tokens_from_prefix_cache"] == 8
    assert kv.pool.refs(first.blocks[0]) == 3  # first, second and the prefix cache


def test_recompute_mode_does_not_adopt_blocks_of_older_weights(loop):
    kv = _manager()
    _write(kv, _seq(loop, range(10), "a"), 10, version=0)
    late = _seq(loop, range(10), "b")
    kv.adopt_prefix(late, version=1)
    assert late.num_cached == 0 and late.blocks == []


def test_a_finished_session_hands_its_kv_to_the_next_turn(loop):
    kv = _manager()
    turn1 = _seq(loop, range(6), "t1", session_id="s")
    kv.begin(turn1)
    _write(kv, turn1, 6)
    kv.finish(turn1, keep=True)
    assert list(kv.sessions) == ["s"] and "s" not in kv.busy_sessions
    turn2 = _seq(loop, [*range(6), 50, 51], "t2", session_id="s")
    kv.attach(turn2, version=0)
    assert turn2.num_cached == 6 and len(turn2.blocks) == 2 and not kv.sessions
    assert kv.counters["prompt_tokens_from_sessions"] == 6


def test_detach_gives_a_waiting_turn_its_kv_back_to_the_session(loop):
    kv = _manager()
    turn1 = _seq(loop, range(6), "t1", session_id="s")
    _write(kv, turn1, 6)
    kv.finish(turn1, keep=True)
    turn2 = _seq(loop, [*range(6), 7], "t2", session_id="s")
    kv.attach(turn2, version=0)
    kv.detach(turn2)
    assert turn2.blocks == [] and turn2.num_cached == 0 and turn2.cached_tokens == 0
    assert kv.sessions["s"].tokens == list(range(6))
    assert kv.counters["prompt_tokens_from_sessions"] == 0


def test_ending_a_busy_session_keeps_nothing_when_its_request_finishes(loop):
    kv = _manager()
    seq = _seq(loop, range(5), session_id="s")
    kv.begin(seq)
    _write(kv, seq, 5)
    kv.end_session("s")
    kv.finish(seq, keep=True)
    assert not kv.sessions and kv.pool.num_used == len(kv.prefix) == 1


def test_allocation_evicts_the_prefix_cache_then_idle_sessions_then_preempts(loop):
    kv = _manager(num_blocks=4)
    idle = _seq(loop, range(8), "idle", session_id="s")
    _write(kv, idle, 8)  # 2 blocks, both also in the prefix cache
    kv.finish(idle, keep=True)
    running = _seq(loop, range(100, 104), "run")
    _write(kv, running, 4)  # a third block (cached too)
    assert kv.pool.num_free == 1
    new = _seq(loop, range(200, 216), "new")  # needs all 4 blocks
    preempted = []

    def preempt(victim):
        preempted.append(victim)
        kv.release(victim)

    assert kv.allocate(new, 16, lambda: None if preempted else running, preempt)
    assert len(new.blocks) == 4 and kv.counters["session_evictions"] == 1
    assert preempted == [running] and running.blocks == [] and running.num_cached == 0
    assert not kv.allocate(_seq(loop, range(9), "x"), 9, lambda: None, preempt)


def test_a_block_someone_computes_makes_others_wait_for_it(loop):
    kv = _manager()
    a, b = _seq(loop, range(9), "a"), _seq(loop, range(9), "b", order=1)
    kv.start_computing(a, 8)
    assert kv.computed_by_other(b) and not kv.computed_by_other(a)
    _write(kv, a, 8)  # registering the written blocks ends the announcement
    assert not kv.computed_by_other(b)


def test_a_weight_update_drops_every_block(loop):
    kv = _manager()
    seq = _seq(loop, range(10), session_id="s")
    _write(kv, seq, 10)
    other = _seq(loop, range(20, 25), "o", session_id="t")
    _write(kv, other, 5)
    kv.finish(other, keep=True)
    kv.drop_weights_kv([seq])
    assert kv.pool.num_used == 0 and not kv.sessions and not len(kv.prefix)
    assert seq.num_cached == 0 and seq.kv_version == NO_KV
