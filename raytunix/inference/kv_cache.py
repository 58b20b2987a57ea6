"""The engine's KV-cache manager: which request and session holds which KV block.

No JAX here: the blocks' contents live on the device (``KVPages``); this module decides
which block ids each request's forward calls read and write, over a ``BlockPool`` and a
``PrefixCache`` (``raytunix.inference.kv_blocks``), as vLLM's KV-cache manager does over
its block pool.

* A request (``Sequence``) holds the blocks of its context; ``num_cached`` positions of
  it have their KV written (or launched).
* An idle session (``Session``) keeps the KV of its last request for its next turn;
  ``attach`` hands the matching part to that turn, ``detach`` hands it back while the
  turn must wait.
* The prefix cache indexes every full block by a hash of all tokens up to its end;
  ``adopt_prefix`` reuses them, ``register_blocks`` adds them, and ``computing`` tells
  who is writing a block now (so a second request waits and adopts it).
* ``allocate`` evicts cached prefixes, then idle sessions, then asks its caller to
  preempt a younger running request, when blocks run out.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
from typing import Callable, Counter, Iterable

from raytunix.inference.kv_blocks import ROOT_KEY, BlockPool, PrefixCache, block_key
from raytunix.types import GenerationRequest

NO_KV = 1 << 62  # kv_version of a sequence that holds no KV yet


@dataclasses.dataclass(eq=False)
class Sequence:
    """One request while the engine holds it."""

    request: GenerationRequest
    future: asyncio.Future
    seed_lo: int
    seed_hi: int
    order: int  # arrival order: older requests are scheduled first
    context: list[int]  # prompt, then the tokens generated so far
    kv_version: int  # oldest weights version among the KV this sequence attends to
    blocks: list[int] = dataclasses.field(default_factory=list)
    keys: list[bytes] = dataclasses.field(default_factory=list)  # of full blocks, in order
    num_cached: int = 0  # positions of the context whose KV is in ``blocks``
    computing: list[bytes] = dataclasses.field(default_factory=list)  # keys being written now
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens whose KV came from a session or the prefix cache
    stale_tokens: int = 0
    prefill_wait: int = 0
    session_kv_version: int = NO_KV  # of the KV taken over from the session
    attached: bool = False
    running: bool = False
    done: bool = False
    slot: int = -1  # row of the device token buffer while running
    arrived_s: float = 0.0  # perf_counter when the request came in
    admitted_s: float = 0.0  # perf_counter when it last got a slot
    pending: int = 0  # tokens sampled by launched steps the host has not taken in yet
    epoch: int = 0  # bumped by preemption: samples of steps launched before are dropped

    @property
    def remaining(self) -> int:
        """Tokens of the context (pending samples included) still to feed; 1 means
        "decode the last token"."""
        return len(self.context) + self.pending - self.num_cached


@dataclasses.dataclass(eq=False)
class Session:
    """KV an idle session keeps between two requests."""

    tokens: list[int]  # the context whose KV is in ``blocks``
    blocks: list[int]
    keys: list[bytes]
    kv_version: int
    order: int  # arrival order of the session's first request


class KVCacheManager:
    """Blocks of running requests, idle sessions and the prefix cache, in one pool.

    Args:
      num_blocks: blocks in the pool (the device's ``KVPages`` has as many).
      block_size: tokens per block.
      kv_mode: ``"recompute"`` (KV of weights older than the version passed in is not
        reused) or ``"keep"``.
      counters: the engine's counters; this class adds ``prompt_tokens_from_sessions``,
        ``prompt_tokens_from_prefix_cache`` and ``session_evictions`` to it.
    """

    def __init__(self, num_blocks: int, block_size: int, kv_mode: str, counters: Counter[str]):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.kv_mode = kv_mode
        self.counters = counters
        self.reset()

    def reset(self) -> None:
        """Forgets every session and cached block: the pool is empty again."""
        self.pool = BlockPool(self.num_blocks)
        self.prefix = PrefixCache(self.pool)
        self.sessions: collections.OrderedDict[str, Session] = collections.OrderedDict()
        self.busy_sessions: dict[str, Sequence] = {}  # sessions with a request in flight
        self.ended_sessions: set[str] = set()  # busy sessions to drop when they finish
        self.computing: dict[bytes, Sequence] = {}  # block key -> who writes it now

    # ------------------------------------------------------------------ sessions

    def begin(self, seq: Sequence) -> None:
        """Marks the request's session busy until ``finish``."""
        if seq.request.session_id is not None:
            self.busy_sessions[seq.request.session_id] = seq

    def end_session(self, session_id: str) -> None:
        """Frees the KV a session keeps; a request of it in flight keeps nothing."""
        session = self.sessions.pop(session_id, None)
        if session is not None:
            self.pool.release(session.blocks)
        if session_id in self.busy_sessions:
            self.ended_sessions.add(session_id)

    def finish(self, seq: Sequence, keep: bool) -> None:
        """Hands a finished request's blocks to its session (``keep``, unless the session
        was ended meanwhile) or back to the pool."""
        self.stop_computing(seq)
        session_id = seq.request.session_id
        if session_id is None:
            keep = False
        else:
            keep = keep and session_id not in self.ended_sessions
            self.busy_sessions.pop(session_id, None)
            self.ended_sessions.discard(session_id)
        if keep:
            assert session_id is not None
            self.sessions[session_id] = Session(
                tokens=seq.context[: seq.num_cached],
                blocks=seq.blocks,
                keys=seq.keys,
                kv_version=seq.kv_version,
                order=seq.order,
            )
            self.sessions.move_to_end(session_id)
        else:
            self.pool.release(seq.blocks)
        seq.blocks = []

    def attach(self, seq: Sequence, version: int) -> None:
        """Gives a newly admitted request the KV its session kept, where it matches;
        ``version`` is the engine's weights version now."""
        seq.attached = True
        session_id = seq.request.session_id
        session = self.sessions.pop(session_id, None) if session_id is not None else None
        if session is None:
            return
        if self.kv_mode == "recompute" and session.kv_version < version:
            self.pool.release(session.blocks)
            return
        prompt = seq.context
        limit = min(len(session.tokens), len(prompt) - 1)  # at least one token is fed
        common = 0
        while common < limit and session.tokens[common] == prompt[common]:
            common += 1
        bs = self.block_size
        keep_blocks = -(-common // bs)
        if common % bs and self.pool.refs(session.blocks[keep_blocks - 1]) > 1:
            keep_blocks -= 1  # a shared block is never written: recompute its part
            common = keep_blocks * bs
        self.pool.release(session.blocks[keep_blocks:])
        seq.blocks = session.blocks[:keep_blocks]
        seq.keys = session.keys[: common // bs]
        seq.num_cached = common
        seq.session_kv_version = session.kv_version
        if common:
            seq.kv_version = min(seq.kv_version, session.kv_version)
        seq.cached_tokens += common
        self.counters["prompt_tokens_from_sessions"] += common

    def detach(self, seq: Sequence) -> None:
        """Hands the KV of a request that must keep waiting back to its session, where
        eviction can reach it (a waiting request's blocks could be freed by nobody)."""
        seq.attached = False
        if not seq.blocks:
            return
        session_id = seq.request.session_id
        assert session_id is not None  # only a session hands a waiting request blocks
        self.sessions[session_id] = Session(
            tokens=seq.context[: seq.num_cached],
            blocks=seq.blocks,
            keys=seq.keys,
            kv_version=seq.session_kv_version,
            order=seq.order,
        )
        seq.cached_tokens -= seq.num_cached
        self.counters["prompt_tokens_from_sessions"] -= seq.num_cached
        seq.blocks, seq.keys, seq.num_cached, seq.kv_version = [], [], 0, NO_KV

    # ------------------------------------------------------------------ prefix cache

    def adopt_prefix(self, seq: Sequence, version: int) -> None:
        """Takes the longest run of cached full blocks that continues the sequence (of
        weights ``version`` or newer in recompute mode)."""
        bs = self.block_size
        min_version = version if self.kv_mode == "recompute" else None
        while seq.num_cached % bs == 0 and seq.num_cached + bs <= len(seq.context) - 1:
            i = seq.num_cached // bs
            key = block_key(
                seq.keys[-1] if seq.keys else ROOT_KEY, seq.context[i * bs : (i + 1) * bs]
            )
            entry = self.prefix.get(key, min_version)
            if entry is None:
                return
            self.pool.release(seq.blocks[i:])  # written past num_cached: nothing to keep
            del seq.blocks[i:]
            self.pool.share(entry.block)
            seq.blocks.append(entry.block)
            seq.keys.append(key)
            seq.num_cached += bs
            seq.kv_version = min(seq.kv_version, entry.version)
            prompt_part = max(
                0, min(seq.num_cached, len(seq.request.prompt_ids)) - (seq.num_cached - bs)
            )
            seq.cached_tokens += prompt_part
            self.counters["prompt_tokens_from_prefix_cache"] += prompt_part

    def next_key(self, seq: Sequence) -> bytes | None:
        """Key of the block the sequence writes next, if it starts a full block."""
        bs = self.block_size
        start = seq.num_cached
        if start % bs or start + bs > len(seq.context):
            return None
        return block_key(seq.keys[-1] if seq.keys else ROOT_KEY, seq.context[start : start + bs])

    def computed_by_other(self, seq: Sequence) -> bool:
        """Another request is writing the block this one would write next."""
        owner = self.computing.get(self.next_key(seq) or b"")
        return owner is not None and owner is not seq

    def start_computing(self, seq: Sequence, n: int) -> None:
        """Announces the full blocks the next ``n`` fed tokens complete."""
        bs = self.block_size
        parent = seq.keys[-1] if seq.keys else ROOT_KEY
        for i in range(len(seq.keys), (seq.num_cached + n) // bs):
            parent = block_key(parent, seq.context[i * bs : (i + 1) * bs])
            if parent not in self.computing:
                self.computing[parent] = seq
                seq.computing.append(parent)

    def stop_computing(self, seq: Sequence) -> None:
        for key in seq.computing:
            if self.computing.get(key) is seq:
                del self.computing[key]
        seq.computing = []

    def register_blocks(self, seq: Sequence, version: int) -> None:
        """Indexes the full blocks the sequence has finished writing."""
        bs = self.block_size
        # Blocks whose tokens the host knows: a pending sample's KV may be launched already.
        for i in range(len(seq.keys), min(seq.num_cached, len(seq.context)) // bs):
            parent = seq.keys[-1] if seq.keys else ROOT_KEY
            key = block_key(parent, seq.context[i * bs : (i + 1) * bs])
            seq.keys.append(key)
            self.prefix.put(key, seq.blocks[i], min(version, seq.kv_version))
        self.stop_computing(seq)

    # ------------------------------------------------------------------ allocation

    def blocks_to_admit(self, seq: Sequence) -> int:
        """Blocks the request's whole context needs beyond those it holds."""
        return -(-len(seq.context) // self.block_size) - len(seq.blocks)

    def evict_one(self) -> bool:
        """Frees KV nobody is running on: cached prefixes first, then idle sessions."""
        if self.prefix.evict_one():
            return True
        if self.sessions:
            _, session = self.sessions.popitem(last=False)
            self.pool.release(session.blocks)
            self.counters["session_evictions"] += 1
            return True
        return False

    def allocate(
        self,
        seq: Sequence,
        n: int,
        victim: Callable[[], Sequence | None],
        preempt: Callable[[Sequence], None],
    ) -> bool:
        """Gives the sequence the blocks that ``n`` more fed tokens need; when blocks run
        out, evicts, then ``preempt``s the running request ``victim()`` names, until it
        names none (False: the blocks cannot be had)."""
        need = -(-(seq.num_cached + n) // self.block_size) - len(seq.blocks)
        while self.pool.num_free < need:
            if self.evict_one():
                continue
            other = victim()
            if other is None:
                return False
            preempt(other)
        for _ in range(need):
            seq.blocks.append(self.pool.allocate())
        return True

    def release(self, seq: Sequence) -> None:
        """Drops all of a (preempted) request's KV: it is computed again from the start."""
        self.stop_computing(seq)
        self.pool.release(seq.blocks)
        seq.blocks, seq.keys, seq.num_cached = [], [], 0
        seq.kv_version = NO_KV

    def drop_weights_kv(self, seqs: Iterable[Sequence]) -> None:
        """After a weight swap in recompute mode: no KV of older weights survives, in the
        prefix cache, the sessions or the requests ``seqs``."""
        self.prefix.clear()
        for session in self.sessions.values():
            self.pool.release(session.blocks)
        self.sessions.clear()
        self.computing.clear()
        for seq in seqs:
            seq.computing = []
            self.pool.release(seq.blocks)
            seq.blocks, seq.keys, seq.num_cached = [], [], 0
            seq.kv_version = NO_KV
