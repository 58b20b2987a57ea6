"""The engine's scheduler: which requests run, and what the next step feeds.

No JAX here. ``schedule()`` plans one step (as vLLM's scheduler does): it admits waiting
requests (oldest first) while the KV they need can be had, then returns the device calls
of the step, each a list of ``(sequence, tokens to feed)`` rows:

* prefill: reuse cached blocks (session, prefix cache), then feed up to
  ``prefill_chunk_tokens`` prompt tokens, oldest requests first, grouped into calls of
  one (rows, tokens) bucket each;
* decode: one token for each of the oldest ``max_batch_size`` requests whose context is
  in the cache (the others keep their KV and wait a step).

``fed(seq, n, version)`` takes back what a launched call did to a row. Shapes are padded
to buckets (``all_buckets``) so that few programs are compiled.
"""

from __future__ import annotations

import collections
import time
from typing import Iterator
from typing import Sequence as Seq

from raytunix.inference.kv_cache import KVCacheManager, Sequence
from raytunix.inference.programs import Shape

Row = tuple[Sequence, int]  # (request, tokens fed)


def span_buckets(cap: int, block_size: int) -> tuple[int, ...]:
    """Block counts an attention span is padded to: one bucket for everything up to 256
    tokens (attention over that many is cheap beside the rest of a step, and each bucket
    is a program to compile), then every multiple of 8 blocks up to ``cap``. A long
    context pays for at most 7 blocks it does not use, and the programs a workload needs
    depend on its lengths, not on ``max_seq_len``."""
    first = max(1, 256 // block_size)
    values = {first} | {v for v in range(8, cap, 8) if v > first}
    return tuple(sorted({v for v in values if v < cap} | {cap}))


def row_buckets(cap: int) -> tuple[int, ...]:
    """Decode batch sizes: 1, 2, 4, 8, 16, 24, 32, then multiples of 32 up to ``cap``.
    Fine where a step's rows are few and cost the most per row, coarse above: each size
    is a program to compile (about a second on a CPU)."""
    values = {1, 2, 4, 8, 16, 24} | set(range(32, cap, 32))
    return tuple(sorted({v for v in values if v < cap} | {cap}))


def powers_of_four(cap: int) -> tuple[int, ...]:
    values, v = [], 1
    while v < cap:
        values.append(v)
        v *= 4
    return (*values, cap)


def all_buckets(
    max_batch_size: int, max_blocks: int, block_size: int, longest_chunk: int
) -> tuple[tuple[int, ...], ...]:
    """Decode rows, prefill rows, span blocks and tokens per prefill row a program may
    have. Prefill calls take coarser row counts (they are few, and each shape compiles);
    tokens per prefill row go 8, 32, 128, ... (x4) up to the chunk."""
    chunks = {t for t in (8, 32, 128, 512, 2048, 8192) if t < longest_chunk} | {longest_chunk}
    return (
        row_buckets(max_batch_size),
        powers_of_four(max_batch_size),
        span_buckets(max_blocks, block_size),
        tuple(sorted(chunks)),
    )


def bucket(buckets: Seq[int], n: int) -> int:
    """The smallest of ``buckets`` (ascending) that is at least ``n``."""
    return next(b for b in buckets if b >= n)


class Scheduler:
    """Running and waiting requests, and the plan of each step.

    Args:
      kv: the KV-cache manager the requests' blocks come from.
      counters: the engine's counters (this class adds ``preemptions``).
      max_batch_size: most rows of a decode step.
      max_seq_len: longest context in tokens.
      prefill_chunk_tokens: most prompt tokens fed between two decode steps.
      prefill_min_batch, max_prefill_delay_steps: while others decode, fewer than
        ``prefill_min_batch`` requests to prefill wait up to that many steps for company.
    """

    def __init__(
        self,
        kv: KVCacheManager,
        counters: collections.Counter,
        *,
        max_batch_size: int,
        max_seq_len: int,
        prefill_chunk_tokens: int,
        prefill_min_batch: int,
        max_prefill_delay_steps: int,
    ):
        self.kv = kv
        self.counters = counters
        self.max_batch_size = max_batch_size
        # Requests holding KV: the decoded rows plus half as many ready to take a row the
        # moment one frees. More would prefill young requests early, delaying old ones.
        self.max_running = max_batch_size + (max_batch_size + 1) // 2
        self.max_seq_len = max_seq_len
        self.chunk = prefill_chunk_tokens
        self.prefill_min_batch = prefill_min_batch
        self.max_prefill_delay = max_prefill_delay_steps
        self.max_blocks = -(-max_seq_len // kv.block_size)  # blocks of one full context
        (
            self.batch_buckets,
            self.prefill_batch_buckets,
            self.span_buckets,
            self.chunk_buckets,
        ) = all_buckets(
            max_batch_size, self.max_blocks, kv.block_size, min(prefill_chunk_tokens, max_seq_len)
        )
        self.reset()

    def reset(self) -> None:
        """Forgets every request."""
        self.running: list[Sequence] = []
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.free_slots = list(range(self.max_running))

    # ------------------------------------------------------------------ one step

    def schedule(self, version: int) -> Iterator[tuple[list[Row], bool]]:
        """Admits what fits and plans one step under weights ``version``; yields its
        device calls as ``(rows, prefill)``, prefill calls first.

        The decode call is planned after the prefill calls were taken (and ``fed``): a
        row whose prompt a prefill call finishes is decoded in the same step, from the
        sample that call leaves on the device.
        """
        self.admit(version)
        yield from ((group, True) for group in self.plan_prefill(version))
        decode = self.plan_decode()
        if decode:
            yield decode, False

    def requests(self) -> list[Sequence]:
        """Every request held: running ones, then waiting ones."""
        return [*self.running, *self.waiting]

    def fed(self, seq: Sequence, n: int, version: int) -> bool:
        """Takes back that a launched call fed ``n`` tokens of ``seq`` under weights
        ``version``; True when that call samples the row's next token."""
        samples = seq.num_cached + n == len(seq.context) + seq.pending
        seq.num_cached += n
        seq.kv_version = min(seq.kv_version, version)
        if samples:
            seq.pending += 1
        # Its KV is as good as written for every later call: others may adopt it.
        self.kv.register_blocks(seq, version)
        return samples

    def shape_for(self, rows: list[Row], prefill: bool) -> Shape:
        """The program shape a call of ``rows`` needs."""
        samplings = [seq.request.sampling for seq, _ in rows]
        return Shape(
            truncate=any(s.top_k > 0 or s.top_p < 1.0 for s in samplings),
            batch=bucket(self.prefill_batch_buckets if prefill else self.batch_buckets, len(rows)),
            length=(bucket(self.chunk_buckets, max(n for _, n in rows)) if prefill else 1),
            span=bucket(self.span_buckets, max(len(s.blocks) for s, _ in rows)),
        )

    # ------------------------------------------------------------------ planning

    def admit(self, version: int) -> None:
        """Moves waiting requests (oldest first) to the running set while it has room and
        the KV they need can be had without preempting anyone."""
        if not self.waiting or len(self.running) >= self.max_running:
            return  # the common case of a decode step: skip the bookkeeping below
        if len(self.waiting) > 1:
            self.waiting = collections.deque(sorted(self.waiting, key=lambda s: s.order))
        held = {b for s in self.running for b in s.blocks}
        while self.waiting and len(self.running) < self.max_running:
            seq = self.waiting[0]
            if not seq.attached:
                self.kv.attach(seq, version)
            need = self.kv.blocks_to_admit(seq)
            if self.kv.num_blocks - len(held) - len(set(seq.blocks) - held) < need:
                self.kv.detach(seq)
                break  # wait for running requests to finish
            self.waiting.popleft()
            seq.running = True
            seq.slot = self.free_slots.pop()
            seq.admitted_s = time.perf_counter()
            seq.prefill_wait = 0
            self.running.append(seq)
            held.update(seq.blocks)

    def plan_prefill(self, version: int) -> list[list[Row]]:
        """Chooses up to ``prefill_chunk_tokens`` tokens to feed, oldest requests first,
        and groups the rows into calls of one (rows, tokens) bucket each."""
        todo = [s for s in self.running if s.remaining > 1]
        for seq in todo:
            self.kv.adopt_prefix(seq, version)
        todo = [s for s in todo if s.remaining > 1]
        if not todo:
            return []
        decoding = any(s.remaining == 1 for s in self.running)
        if (
            decoding
            and len(todo) < self.prefill_min_batch
            and max(s.prefill_wait for s in todo) < self.max_prefill_delay
        ):
            for seq in todo:
                seq.prefill_wait += 1
            return []
        budget, rows, protected = self.chunk, [], set[Sequence]()
        bs = self.kv.block_size
        for seq in sorted(todo, key=lambda s: s.order):
            if budget < 2:
                break
            if self.kv.computed_by_other(seq):
                continue  # another request is computing this block: adopt it next step
            n = min(seq.remaining, budget)
            if n < seq.remaining and n >= bs:
                n -= (seq.num_cached + n) % bs  # end chunks on a block edge
            if not seq.running or not self._allocate(seq, n, protected):
                break
            protected.add(seq)
            self.kv.start_computing(seq, n)
            seq.prefill_wait = 0
            rows.append((seq, n))
            budget -= n
        return self._group_prefill([(s, n) for s, n in rows if s.running])

    def _group_prefill(self, rows: list[Row]) -> list[list[Row]]:
        """Prefill rows grouped into calls of one tokens bucket, at most
        ``prefill_batch_cap`` rows each (rows preempted meanwhile are left out)."""
        groups: dict[int, list[Row]] = collections.defaultdict(list)
        for seq, n in rows:
            groups[bucket(self.chunk_buckets, n)].append((seq, n))
        calls = []
        for length, members in sorted(groups.items()):
            width = self.prefill_batch_cap(length)
            calls += [members[i : i + width] for i in range(0, len(members), width)]
        return calls

    def prefill_batch_cap(self, length: int) -> int:
        """Most rows of one prefill call feeding ``length`` tokens each."""
        fits = [b for b in self.prefill_batch_buckets if b * length <= max(self.chunk, length)]
        return fits[-1]

    def plan_decode(self) -> list[Row]:
        """The oldest ``max_batch_size`` requests ready to decode; the others keep their
        KV and wait a step (a row is not a reservation: an episode back from its tool
        takes a row from a younger one at once). A request whose pending samples reach
        its length limit is done already and is not decoded further."""
        rows: list[Row] = []
        protected = set[Sequence]()
        ready = sorted(
            (
                s
                for s in self.running
                if s.remaining == 1
                and len(s.tokens) + s.pending < s.request.sampling.max_new_tokens
                and len(s.context) + s.pending < self.max_seq_len
            ),
            key=lambda s: s.order,
        )
        for seq in ready[: self.max_batch_size]:
            if not seq.running:
                continue  # preempted to make room for an older row
            if self._allocate(seq, 1, protected):
                protected.add(seq)
                rows.append((seq, 1))
        return [(s, n) for s, n in rows if s.running]

    def all_shapes(self) -> list[tuple[int, int, int]]:
        """Every (rows, tokens per row, span blocks) a planned call can have."""
        shapes = [(b, 1, s) for b in self.batch_buckets for s in self.span_buckets]
        for length in self.chunk_buckets:
            min_span = -(-(length // 4 + 1) // self.kv.block_size)  # rows feed > length / 4
            cap = self.prefill_batch_cap(length)
            shapes += [
                (b, length, s)
                for b in self.prefill_batch_buckets
                if b <= cap
                for s in self.span_buckets
                if s >= min_span
            ]
        return shapes

    # ------------------------------------------------------------------ running set

    def _allocate(self, seq: Sequence, n: int, protected: set[Sequence]) -> bool:
        """Blocks for ``n`` more tokens of ``seq``, preempting the youngest running
        request younger than it (outside ``protected``) when evicting is not enough."""

        def victim() -> Sequence | None:
            victims = [
                s
                for s in self.running
                if s is not seq and s not in protected and s.order > seq.order
            ]
            return max(victims, key=lambda s: s.order) if victims else None

        return self.kv.allocate(seq, n, victim, self.preempt)

    def stop_running(self, seq: Sequence) -> None:
        """Takes a request off its row and slot; samples still in flight are dropped."""
        seq.running = False
        self.running.remove(seq)
        self.free_slots.append(seq.slot)
        seq.slot, seq.pending = -1, 0
        seq.epoch += 1

    def preempt(self, seq: Sequence) -> None:
        """Takes a running request off the device; it is re-queued first in line and its
        context recomputed when it is admitted again (vLLM's recompute preemption)."""
        self.counters["preemptions"] += 1
        self.stop_running(seq)  # a sample in flight is dropped; it is drawn again later
        self.kv.release(seq)
        self.waiting.appendleft(seq)
