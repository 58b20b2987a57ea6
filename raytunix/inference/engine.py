"""A continuous-batching inference engine over one KV cache kept on the device.

The engine owns ``max_batch_size`` slots. Each slot holds one request's rows of a single
KV cache ``[n_layers, max_batch_size + 1, n_kv_heads, S, head_dim]``; the extra row is a
scratch slot that padding rows of a prefill batch write into. A background asyncio task
runs the scheduler loop::

    while running:
        swap in new weights if any arrived; mark every active slot for re-prefill
        admit waiting requests into free slots
        prefill new and re-prefill slots in (batch bucket x length bucket) sub-batches,
            sampling each one's next token from the logits at its last position
        one decode step for all slots at once (T = 1; empty slots use position -1)
        resolve the requests that hit a stop condition; their slots are free again

A request that arrives while others decode is admitted at the next iteration, not after
the running batch finishes (continuous batching, as in Orca, Yu et al. OSDI 2022, and
vLLM). Device calls run on one worker thread so the event loop keeps accepting requests
while the device computes. Every generated token is stamped with the policy version of
the weights that produced it; a weight swap re-prefills in-flight requests so that no
token is sampled from KV computed under older weights.

Plain Python class, no Ray: an actor wraps it.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import functools
import logging
import math
import time
from typing import Any, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from raytunix.inference.sampling import sample_tokens, split_seed
from raytunix.models.llama import KVCache, ModelConfig, forward, init_kv_cache
from raytunix.types import FinishReason, GenerationRequest, GenerationResult

logger = logging.getLogger(__name__)


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(3,))
def _prefill_step(graphdef, config: ModelConfig, params, cache: KVCache, tokens, positions,
                  slots, last_index, temperature, seed_lo, seed_hi, token_index):
    """Runs a sub-batch of sequences on a fresh cache, scatters their KV rows into
    ``cache[:, slots, :, :T]`` and samples each row's next token at ``last_index``.

    tokens, positions: ``int32[b, T]`` (right padding has position -1);
    slots, last_index, token_index: ``int32[b]``; temperature: ``float32[b]``;
    seed_lo, seed_hi: ``uint32[b]``. Returns ``(cache, tokens int32[b], logprobs f32[b])``.
    """
    batch, length = tokens.shape
    fresh = init_kv_cache(config, batch, max_len=length, dtype=cache.k.dtype)
    logits, fresh = forward(graphdef, params, tokens, positions, fresh)
    last = logits[jnp.arange(batch), last_index]
    next_tokens, logprobs = sample_tokens(last, temperature, seed_lo, seed_hi, token_index)
    cache = KVCache(k=cache.k.at[:, slots, :, :length].set(fresh.k),
                    v=cache.v.at[:, slots, :, :length].set(fresh.v))
    return cache, next_tokens, logprobs


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def _decode_step(graphdef, params, cache: KVCache, tokens, positions, temperature, seed_lo,
                 seed_hi, token_index):
    """One token for every slot: ``tokens``/``positions`` are ``int32[B]`` (position -1
    for an empty slot). Returns ``(cache, tokens int32[B], logprobs f32[B])``."""
    logits, cache = forward(graphdef, params, tokens[:, None], positions[:, None], cache)
    next_tokens, logprobs = sample_tokens(logits[:, 0], temperature, seed_lo, seed_hi,
                                          token_index)
    return cache, next_tokens, logprobs


def _timed_call(fn, *args):
    """Runs a jitted step on the worker thread and waits for its results on the host."""
    start = time.perf_counter()
    cache, tokens, logprobs = fn(*args)
    tokens, logprobs = np.asarray(tokens), np.asarray(logprobs)
    return cache, tokens, logprobs, time.perf_counter() - start


@dataclasses.dataclass(eq=False)
class _Sequence:
    """One request while the engine holds it."""

    request: GenerationRequest
    future: asyncio.Future
    seed_lo: int
    seed_hi: int
    slot: int = -1
    cache_len: int = 0  # positions of this slot's cache row written under current weights
    needs_prefill: bool = True
    prefill_wait: int = 0  # decode steps this sequence's prefill has been held back
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)

    @property
    def context(self) -> list[int]:
        """The tokens whose KV must be in the cache before the next token is sampled."""
        return [*self.request.prompt_ids, *self.tokens]


def _buckets(values: Iterable[int], cap: int, name: str, always_cap: bool
             ) -> tuple[int, ...]:
    values = tuple(values)
    if not values or any(not isinstance(v, int) or v <= 0 for v in values):
        raise ValueError(f"InferenceEngine: {name} must be positive ints, got {values!r}.")
    capped = {min(v, cap) for v in values}
    return tuple(sorted(capped | {cap} if always_cap else capped))


class InferenceEngine:
    """Continuous-batching generation for one model on one device (see module docstring).

    Args:
      graphdef, params: the model, as returned by ``raytunix.models.llama.init_model``.
      model_config: its ``ModelConfig``.
      tokenizer: has ``decode(ids) -> str``; used for stop strings and ``result.text``.
      max_batch_size: number of slots, i.e. requests decoded together.
      max_seq_len: KV cache length S in tokens (prompt + generated); defaults to
        ``model_config.max_seq_len``.
      prefill_batch_buckets: sub-batch sizes a prefill is padded to (capped at
        ``max_batch_size``).
      prefill_len_buckets: sequence lengths a prefill is padded to (capped at, and
        always including, S).
      policy_version: version of ``params``; stamped on the tokens they generate.
      prefill_min_batch, max_prefill_delay_steps: while other requests decode, fewer than
        ``prefill_min_batch`` new arrivals wait up to ``max_prefill_delay_steps`` decode
        steps to be prefilled together (one fuller prefill instead of several padded
        ones); 0 steps turns the wait off.

    Compiles lazily: one decode shape, and at most one prefill shape per
    (batch bucket, length bucket) pair actually used.
    """

    def __init__(self, graphdef, params, model_config: ModelConfig, tokenizer, *,
                 max_batch_size: int = 128, max_seq_len: int | None = None,
                 prefill_batch_buckets: Sequence[int] = (4, 16, 64),
                 prefill_len_buckets: Sequence[int] = (64, 128, 256),
                 policy_version: int = 0, prefill_min_batch: int = 4,
                 max_prefill_delay_steps: int = 4):
        if not isinstance(max_batch_size, int) or max_batch_size <= 0:
            raise ValueError(f"InferenceEngine: max_batch_size must be a positive int, got "
                             f"{max_batch_size!r}.")
        seq_len = model_config.max_seq_len if max_seq_len is None else max_seq_len
        if not isinstance(seq_len, int) or seq_len < 2:
            raise ValueError(f"InferenceEngine: max_seq_len must be an int >= 2, got "
                             f"{seq_len!r}.")
        self._graphdef = graphdef
        self._config = model_config
        self._tokenizer = tokenizer
        self._max_batch_size = max_batch_size
        self._max_seq_len = seq_len
        self._scratch_slot = max_batch_size
        self._batch_buckets = _buckets(prefill_batch_buckets, max_batch_size,
                                       "prefill_batch_buckets", always_cap=False)
        if prefill_min_batch < 1 or max_prefill_delay_steps < 0:
            raise ValueError(
                f"InferenceEngine: prefill_min_batch={prefill_min_batch!r} must be >= 1 and "
                f"max_prefill_delay_steps={max_prefill_delay_steps!r} >= 0.")
        self._prefill_min_batch = prefill_min_batch
        self._max_prefill_delay = max_prefill_delay_steps
        self._len_buckets = _buckets(prefill_len_buckets, seq_len, "prefill_len_buckets",
                                     always_cap=True)
        self._params = jax.device_put(params)
        self._version = int(policy_version)
        self._pending_weights: tuple[Any, int] | None = None

        self._slots: list[_Sequence | None] = [None] * max_batch_size
        self._waiting: collections.deque[_Sequence] = collections.deque()
        self._cache: KVCache | None = None  # None: (re)build before the next device call

        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="raytunix-engine")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None
        self._paused = False
        self._closed = False
        self._epoch = 0  # bumped by pause/close: device results from an older epoch are dropped

        self._first_request_t: float | None = None
        self._busy_s = 0.0
        self._decode_steps = 0
        self._prefill_calls = 0
        self._tokens_generated = 0
        self._active_slot_steps = 0
        self._requests_finished = 0

    # ------------------------------------------------------------------ public API

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        """Generates a completion for one request; returns when it finishes.

        Returns:
          ``GenerationResult`` with N generated tokens, their logprobs (nats) and policy
          versions, and why generation stopped: ``STOP`` (stop token, kept, or stop
          string), ``LENGTH`` (``max_new_tokens``, or prompt + generated reached
          ``max_seq_len``), ``ABORT`` (``pause``/``close``; partial tokens).

        Raises:
          ValueError: empty prompt, prompt longer than ``max_seq_len - 1`` tokens, a
            token id outside ``[0, vocab_size)``, ``max_new_tokens < 1`` or a negative
            temperature.
          RuntimeError: the engine is closed.
        """
        self._validate(request)
        self._ensure_started()
        if self._first_request_t is None:
            self._first_request_t = time.monotonic()
        lo, hi = split_seed(int(request.seed))
        seq = _Sequence(request=request, future=self._loop.create_future(), seed_lo=lo,
                        seed_hi=hi)
        self._waiting.append(seq)
        self._wake.set()
        return await seq.future

    async def generate_many(self, requests: Iterable[GenerationRequest]
                            ) -> list[GenerationResult]:
        """Generates all requests concurrently; results are in request order."""
        return list(await asyncio.gather(*(self.generate(r) for r in requests)))

    def update_weights(self, params, version: int) -> None:
        """Queues new weights; the loop swaps them in between two device steps.

        Every request in flight at the swap is re-prefilled (prompt + its tokens so far)
        under the new weights before it decodes on, so tokens carry ``version`` from
        then on. Safe to call from the event loop or another thread.

        Raises:
          ValueError: ``version`` is lower than the current or already queued version,
            or ``params`` does not have the structure, shapes and dtypes of the
            current weights.
        """
        version = int(version)
        latest = self._version if self._pending_weights is None else self._pending_weights[1]
        if version < latest:
            raise ValueError(f"update_weights: version {version} is older than the engine's "
                             f"version {latest}; policy versions must not decrease.")
        def signature(tree):
            leaves, treedef = jax.tree.flatten(tree)
            return treedef, [(jnp.shape(x), jnp.result_type(x)) for x in leaves]

        if signature(params) != signature(self._params):
            raise ValueError("update_weights: params do not match the engine's model "
                             "(tree structure, shapes or dtypes differ); pass the state of "
                             "the same ModelConfig.")
        self._pending_weights = (jax.device_put(params), version)
        self._notify()

    async def pause(self, timeout_s: float = 5.0) -> None:
        """Aborts every in-flight and waiting request and stops scheduling.

        The requests resolve at once with their partial tokens and ``ABORT``. Then waits
        until the device call in progress (if any) has returned, at most ``timeout_s``
        seconds. Requests submitted while paused wait until ``resume``.
        """
        self._paused = True
        self._abort_all()
        if self._wake is not None:
            self._wake.set()
        if self._idle is not None and self._task is not None and not self._task.done():
            try:
                await asyncio.wait_for(self._idle.wait(), timeout_s)
            except asyncio.TimeoutError:
                logger.warning("InferenceEngine.pause: a device call is still running after "
                               "%.1f s; requests were aborted, the call's results will be "
                               "dropped.", timeout_s)

    def resume(self) -> None:
        """Restarts admission and decoding after ``pause``."""
        self._paused = False
        self._notify()

    def stats(self) -> dict:
        """Counters since construction, JSON-able.

        Keys: ``busy_s`` (seconds inside prefill/decode device calls), ``wall_s``
        (seconds since the first request), ``busy_fraction`` (busy_s / wall_s),
        ``decode_steps``, ``prefill_calls``, ``tokens_generated``, ``mean_active_slots``
        (occupied slots per decode step), ``requests_finished``, ``policy_version``,
        ``active_slots`` and ``waiting`` (now).
        """
        wall = 0.0 if self._first_request_t is None else time.monotonic() - self._first_request_t
        return {
            "busy_s": self._busy_s,
            "wall_s": wall,
            "busy_fraction": self._busy_s / wall if wall > 0 else 0.0,
            "decode_steps": self._decode_steps,
            "prefill_calls": self._prefill_calls,
            "tokens_generated": self._tokens_generated,
            "mean_active_slots": (self._active_slot_steps / self._decode_steps
                                  if self._decode_steps else 0.0),
            "requests_finished": self._requests_finished,
            "policy_version": self._version,
            "active_slots": sum(s is not None for s in self._slots),
            "waiting": len(self._waiting),
        }

    async def close(self) -> None:
        """Aborts all requests, stops the loop and the worker thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._abort_all()
        task = self._task
        if task is not None and not task.done() and self._loop is asyncio.get_running_loop():
            self._wake.set()
            await asyncio.gather(task, return_exceptions=True)
        self._executor.shutdown(wait=False)

    @property
    def max_seq_len(self) -> int:
        """KV cache length S in tokens."""
        return self._max_seq_len

    @property
    def policy_version(self) -> int:
        """Version of the weights in use now (a queued update is not counted yet)."""
        return self._version

    # ------------------------------------------------------------------ plumbing

    def _validate(self, request: GenerationRequest) -> None:
        if self._closed:
            raise RuntimeError("InferenceEngine is closed; build a new one.")
        n = len(request.prompt_ids)
        if n == 0:
            raise ValueError(f"Request {request.request_id!r} has an empty prompt; give at "
                             "least one token.")
        if n > self._max_seq_len - 1:
            raise ValueError(f"Request {request.request_id!r}: prompt has {n} tokens but the "
                             f"engine's limit is max_seq_len - 1 = {self._max_seq_len - 1}; "
                             "shorten the prompt or raise max_seq_len.")
        vocab = self._config.vocab_size
        bad = [t for t in request.prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"Request {request.request_id!r}: token ids {bad[:5]} are outside "
                             f"the vocabulary [0, {vocab}).")
        sampling = request.sampling
        if sampling.max_new_tokens < 1:
            raise ValueError(f"Request {request.request_id!r}: max_new_tokens must be >= 1, "
                             f"got {sampling.max_new_tokens}.")
        if not sampling.temperature >= 0 or math.isinf(sampling.temperature):
            raise ValueError(f"Request {request.request_id!r}: temperature must be a finite "
                             f"number >= 0, got {sampling.temperature}.")

    def _ensure_started(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            # A new event loop (e.g. another asyncio.run): requests of the old one can
            # never be resolved, and its last device call may have consumed the cache.
            self._loop = loop
            self._wake, self._idle = asyncio.Event(), asyncio.Event()
            self._idle.set()
            self._waiting.clear()
            self._slots = [None] * self._max_batch_size
            self._cache = None
            self._task = None
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._run(), name="raytunix-engine-loop")

    def _notify(self) -> None:
        if self._loop is None or self._wake is None or self._loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            self._wake.set()
        else:
            self._loop.call_soon_threadsafe(self._wake.set)

    def _finish(self, seq: _Sequence, reason: FinishReason) -> None:
        if seq.slot >= 0 and self._slots[seq.slot] is seq:
            self._slots[seq.slot] = None
        seq.slot = -1
        self._requests_finished += 1
        if seq.future.done():  # the caller cancelled
            return
        seq.future.set_result(GenerationResult(
            request_id=seq.request.request_id,
            token_ids=tuple(seq.tokens),
            logprobs=tuple(seq.logprobs),
            policy_versions=tuple(seq.versions),
            finish_reason=reason,
            text=self._tokenizer.decode(list(seq.tokens)),
        ))

    def _abort_all(self) -> None:
        self._epoch += 1
        for seq in [s for s in self._slots if s is not None] + list(self._waiting):
            self._finish(seq, FinishReason.ABORT)
        self._waiting.clear()

    def _fail_all(self, error: BaseException) -> None:
        for seq in [s for s in self._slots if s is not None] + list(self._waiting):
            if not seq.future.done():
                seq.future.set_exception(error)
        self._slots = [None] * self._max_batch_size
        self._waiting.clear()

    def _stop_reason(self, seq: _Sequence) -> FinishReason | None:
        sampling = seq.request.sampling
        if seq.tokens[-1] in sampling.stop_token_ids:
            return FinishReason.STOP
        if sampling.stop_strings:
            text = self._tokenizer.decode(list(seq.tokens))
            if any(text.endswith(s) for s in sampling.stop_strings if s):
                return FinishReason.STOP
        if len(seq.tokens) >= sampling.max_new_tokens:
            return FinishReason.LENGTH
        # The next decode would write the newest token at position S: the cache is full.
        if len(seq.request.prompt_ids) + len(seq.tokens) >= self._max_seq_len:
            return FinishReason.LENGTH
        return None

    def _record(self, seq: _Sequence, token: int, logprob: float, version: int) -> None:
        seq.tokens.append(int(token))
        seq.logprobs.append(float(logprob))
        seq.versions.append(version)
        self._tokens_generated += 1
        reason = self._stop_reason(seq)
        if reason is not None:
            self._finish(seq, reason)

    # ------------------------------------------------------------------ scheduler loop

    async def _run(self) -> None:
        try:
            while not self._closed:
                self._wake.clear()
                if self._pending_weights is not None:
                    self._params, self._version = self._pending_weights
                    self._pending_weights = None
                    for seq in self._slots:
                        if seq is not None:
                            seq.needs_prefill = True
                if self._paused:
                    await self._wake.wait()
                    continue
                self._drop_cancelled()
                self._admit()
                todo = self._prefills_due()
                for group in self._prefill_groups(todo):
                    await self._prefill(group)
                if any(s is not None and not s.needs_prefill for s in self._slots):
                    await self._decode()
                elif not self._waiting:
                    await self._wake.wait()
        except asyncio.CancelledError:
            raise
        except Exception as error:  # noqa: BLE001 - every waiting caller must hear of it
            logger.exception("InferenceEngine loop failed; failing all requests.")
            self._cache = None
            self._fail_all(error)

    def _prefills_due(self) -> list[_Sequence]:
        """The sequences to prefill now. While others decode, a few lone arrivals wait (at
        most ``max_prefill_delay_steps`` decode steps) for company, so that prefills run
        as a few fuller batches instead of many padded ones."""
        todo = [s for s in self._slots if s is not None and s.needs_prefill]
        decoding = any(s is not None and not s.needs_prefill for s in self._slots)
        if (todo and decoding and len(todo) < self._prefill_min_batch
                and max(s.prefill_wait for s in todo) < self._max_prefill_delay):
            for seq in todo:
                seq.prefill_wait += 1
            return []
        for seq in todo:
            seq.prefill_wait = 0
        return todo

    def _drop_cancelled(self) -> None:
        for seq in self._slots:
            if seq is not None and seq.future.done():
                self._slots[seq.slot] = None
        self._waiting = collections.deque(s for s in self._waiting if not s.future.done())

    def _admit(self) -> None:
        free = [i for i, s in enumerate(self._slots) if s is None]
        for slot in free:
            if not self._waiting:
                break
            seq = self._waiting.popleft()
            seq.slot, seq.needs_prefill = slot, True
            self._slots[slot] = seq

    def _prefill_groups(self, todo: list[_Sequence]) -> list[list[_Sequence]]:
        """Splits sequences into sub-batches of one length bucket, at most the largest
        batch bucket each, shortest first."""
        by_bucket: dict[int, list[_Sequence]] = collections.defaultdict(list)
        for seq in todo:
            n = len(seq.request.prompt_ids) + len(seq.tokens)
            by_bucket[next(b for b in self._len_buckets if b >= n)].append(seq)
        step = self._batch_buckets[-1]
        return [group[i:i + step] for _, group in sorted(by_bucket.items())
                for i in range(0, len(group), step)]

    def _ensure_cache(self) -> None:
        if self._cache is None:
            self._cache = init_kv_cache(self._config, self._max_batch_size + 1,
                                        max_len=self._max_seq_len)

    async def _device_call(self, fn, *args):
        """Runs ``fn(params, cache, *args)`` on the worker thread; returns host results,
        or None when a pause/close happened meanwhile."""
        self._ensure_cache()
        epoch = self._epoch
        cache, self._cache = self._cache, None  # donated: invalid until the call returns
        self._idle.clear()
        try:
            cache, tokens, logprobs, elapsed = await self._loop.run_in_executor(
                self._executor, _timed_call, fn, self._params, cache, *args)
        finally:
            self._idle.set()
        self._cache = cache
        self._busy_s += elapsed
        return None if epoch != self._epoch else (tokens, logprobs)

    async def _prefill(self, group: list[_Sequence]) -> None:
        length = max(len(s.request.prompt_ids) + len(s.tokens) for s in group)
        seq_bucket = next(b for b in self._len_buckets if b >= length)
        batch = next(b for b in self._batch_buckets if b >= len(group))
        tokens = np.zeros((batch, seq_bucket), np.int32)
        positions = np.full((batch, seq_bucket), -1, np.int32)
        slots = np.full((batch,), self._scratch_slot, np.int32)
        last = np.zeros((batch,), np.int32)
        temperature = np.zeros((batch,), np.float32)
        seed_lo = np.zeros((batch,), np.uint32)
        seed_hi = np.zeros((batch,), np.uint32)
        index = np.zeros((batch,), np.int32)
        for row, seq in enumerate(group):
            context = seq.context
            n = len(context)
            tokens[row, :n] = context
            positions[row, :n] = np.arange(n)
            slots[row], last[row] = seq.slot, n - 1
            temperature[row] = seq.request.sampling.temperature
            seed_lo[row], seed_hi[row] = seq.seed_lo, seq.seed_hi
            index[row] = len(seq.tokens)
        version = self._version
        out = await self._device_call(
            functools.partial(_prefill_step, self._graphdef, self._config),
            tokens, positions, slots, last, temperature, seed_lo, seed_hi, index)
        self._prefill_calls += 1
        if out is None:
            return
        for row, seq in enumerate(group):
            if self._slots[seq.slot] is not seq:
                continue
            seq.cache_len = len(seq.request.prompt_ids) + len(seq.tokens)
            seq.needs_prefill = False
            self._record(seq, out[0][row], out[1][row], version)

    async def _decode(self) -> None:
        rows = self._max_batch_size + 1
        tokens = np.zeros((rows,), np.int32)
        positions = np.full((rows,), -1, np.int32)
        temperature = np.zeros((rows,), np.float32)
        seed_lo = np.zeros((rows,), np.uint32)
        seed_hi = np.zeros((rows,), np.uint32)
        index = np.zeros((rows,), np.int32)
        active = [s for s in self._slots if s is not None and not s.needs_prefill]
        for seq in active:
            i = seq.slot
            tokens[i], positions[i] = seq.tokens[-1], seq.cache_len
            temperature[i] = seq.request.sampling.temperature
            seed_lo[i], seed_hi[i] = seq.seed_lo, seq.seed_hi
            index[i] = len(seq.tokens)
        version = self._version
        out = await self._device_call(
            functools.partial(_decode_step, self._graphdef),
            tokens, positions, temperature, seed_lo, seed_hi, index)
        self._decode_steps += 1
        self._active_slot_steps += len(active)
        if out is None:
            return
        for seq in active:
            if self._slots[seq.slot] is not seq:
                continue
            seq.cache_len += 1
            self._record(seq, out[0][seq.slot], out[1][seq.slot], version)
