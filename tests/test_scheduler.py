"""The scheduler's plan of a step, without JAX or a model: admission, prefill chunks and
decode rows for hand-built requests, checked against hand-worked numbers."""

import asyncio
import collections

import pytest

from raytunix.inference.kv_cache import NO_KV, KVCacheManager, Sequence
from raytunix.inference.scheduler import Scheduler, bucket, powers_of_four, row_buckets
from raytunix.types import GenerationRequest, SamplingParams

BS = 4  # tokens per block


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def _scheduler(num_blocks=64, max_batch_size=4, chunk=16, min_batch=1, delay=0):
    counters = collections.Counter()
    kv = KVCacheManager(num_blocks, BS, "recompute", counters)
    return Scheduler(
        kv,
        counters,
        max_batch_size=max_batch_size,
        max_seq_len=32,
        prefill_chunk_tokens=chunk,
        prefill_min_batch=min_batch,
        max_prefill_delay_steps=delay,
    )


def _seq(loop, n, order, rid=None):
    request = GenerationRequest(
        request_id=rid or f"r{order}",
        prompt_ids=tuple(range(order * 100, order * 100 + n)),
        seed=0,
        sampling=SamplingParams(max_new_tokens=8),
    )
    return Sequence(
        request=request,
        future=loop.create_future(),
        seed_lo=0,
        seed_hi=0,
        order=order,
        context=list(request.prompt_ids),
        kv_version=NO_KV,
    )


def _plan(scheduler, version=0):
    """One step as the engine takes it: each call is fed before the next is planned."""
    calls = []
    for rows, prefill in scheduler.schedule(version):
        for seq, n in rows:
            scheduler.fed(seq, n, version)
        calls.append(([(s.request.request_id, n) for s, n in rows], prefill))
    return calls


def test_buckets_pad_to_the_next_size():
    assert row_buckets(40) == (1, 2, 4, 8, 16, 24, 32, 40)
    assert powers_of_four(20) == (1, 4, 16, 20)
    assert bucket((1, 4, 16), 5) == 16


def test_prefill_feeds_the_oldest_first_within_the_chunk_ending_on_a_block_edge(loop):
    scheduler = _scheduler(chunk=16)
    young, old = _seq(loop, 10, order=1), _seq(loop, 10, order=0)
    scheduler.waiting.extend([young, old])
    calls = _plan(scheduler)
    # The old request's 10 tokens fit; the young one gets the 6 left, cut to 4 so that
    # its chunk ends on a block edge. Rows of 4 and 10 tokens fall into the 8- and
    # 16-token buckets: two prefill calls, shorter first; then the old one decodes.
    assert calls == [([("r1", 4)], True), ([("r0", 10)], True), ([("r0", 1)], False)]
    assert old.pending == 2 and young.num_cached == 4 and young.pending == 0


def test_a_prompt_finished_by_a_prefill_call_decodes_in_the_same_step(loop):
    scheduler = _scheduler()
    seq = _seq(loop, 6, order=0)
    scheduler.waiting.append(seq)
    assert _plan(scheduler) == [([("r0", 6)], True), ([("r0", 1)], False)]
    assert seq.pending == 2 and seq.num_cached == 7


def test_admission_waits_while_running_requests_hold_the_kv_a_context_needs(loop):
    scheduler = _scheduler(num_blocks=8, chunk=32)  # 32 tokens of KV
    first, second = _seq(loop, 20, order=0), _seq(loop, 20, order=1)  # 5 blocks each
    scheduler.waiting.append(first)
    _plan(scheduler)  # 20 prompt tokens and a decoded one: 6 blocks held
    assert len(first.blocks) == 6
    scheduler.waiting.append(second)
    scheduler.admit(version=0)
    assert scheduler.running == [first] and list(scheduler.waiting) == [second]
    assert second.slot == -1


def test_few_prefills_wait_for_company_while_others_decode(loop):
    scheduler = _scheduler(min_batch=2, delay=1)
    scheduler.waiting.append(_seq(loop, 3, order=0))
    _plan(scheduler)  # nothing else decodes: prefilled at once
    scheduler.waiting.append(_seq(loop, 5, order=1))
    assert _plan(scheduler) == [([("r0", 1)], False)]  # r1 waits one step ...
    assert _plan(scheduler)[0] == ([("r1", 5)], True)  # ... then goes alone


def test_decode_takes_the_oldest_max_batch_size_rows(loop):
    scheduler = _scheduler(max_batch_size=2)
    seqs = [_seq(loop, 2, order=i) for i in (2, 0, 1)]
    scheduler.waiting.extend(seqs)
    _plan(scheduler)
    decode = [rows for rows, prefill in _plan(scheduler) if not prefill]
    assert decode == [[("r0", 1), ("r1", 1)]]
