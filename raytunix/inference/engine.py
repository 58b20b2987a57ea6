"""A continuous-batching inference engine over a paged KV cache kept on the device.

Its cost follows live work, not capacity. The KV cache is a pool of fixed-size blocks
(``KVPages``, PagedAttention as in vLLM, Kwon et al. SOSP 2023); each running request
holds a block table, and every forward call runs on the smallest *batch bucket* that
holds its rows and reads only the blocks named in a *block bucket* just above the
longest row. A background asyncio task runs the scheduler loop::

    while running:
        swap in new weights if any arrived (after the step in flight; recompute or keep
            the KV, per config)
        drop cancelled requests; admit waiting ones (oldest first) while KV allows
        launch step i, without waiting for the device:
            prefill: reuse cached blocks (session, prefix cache), then feed up to
                ``prefill_chunk_tokens`` prompt tokens, oldest requests first
            decode: one token for each of the oldest ``max_batch_size`` requests whose
                context is in the cache (the others keep their KV and wait a step)
        take in the samples of step i - 1; resolve the requests that hit a stop condition

The host works one step ahead of the device, so the device never waits for the
scheduler: while step i runs, the host takes in step i - 1 and plans step i + 1. A decode
row of step i feeds the token step i - 1 sampled for it straight from the device (each
running request has a slot in a small token buffer the steps pass on), before the host
has seen it. A request that stopped at step i - 1 has therefore been decoded once more
in step i; that token is dropped (a request known to reach its length limit is not
decoded further).

Prefill and decode are one jitted function, ``_forward_step``: feed ``T`` tokens per row
at their positions, write their KV into the row's blocks, attend over the row's blocks,
sample the next token at the row's last fed token. Decode is ``T = 1``.

What the engine keeps, and reuses:

* **Sessions.** A request with a ``session_id`` leaves its KV in the engine when it
  finishes; the session's next request (the next turn of an episode: the previous
  context, the environment's reply, the next header) prefills only the tokens that are
  new. Idle sessions are evicted least recently used when blocks run out; an evicted
  session's next request is prefilled again, transparently.
* **Prefix cache.** Every full block computed is indexed by a hash of all tokens up to
  its end; a request whose prompt starts with indexed blocks adopts them. The G samples
  of a group therefore prefill their shared prompt once (a sample that would compute a
  block another sample is computing waits one chunk and adopts it), and a system prompt
  every episode shares is computed once per weight version.
* **Chunked prefill.** At most ``prefill_chunk_tokens`` prompt tokens are fed between
  two decode steps, so a long prompt never stalls the requests that decode.

Every generated token is stamped with the policy version of the weights that sampled it.
After ``update_weights``, ``kv_on_weight_update="recompute"`` drops all KV computed under
the old weights (running requests are re-prefilled, sessions and the prefix cache are
emptied), so no token is sampled from stale KV; ``"keep"`` keeps it and counts, per
request, the tokens sampled while the context held KV of older weights
(``GenerationResult.stale_kv_tokens``).

When KV blocks run out, the engine evicts cached prefixes, then idle sessions, then
preempts the youngest running request (it is re-queued and recomputed later, as vLLM's
recompute preemption). Steps are launched from the event loop (JAX dispatches them
asynchronously) and one waiter thread takes their samples to the host, so the loop keeps
accepting requests while the device computes.

Three parts, as vLLM splits them: ``raytunix.inference.scheduler.Scheduler`` admits
requests and plans each step, ``raytunix.inference.kv_cache.KVCacheManager`` says which
request and session holds which block, and this class runs the device loop (launch the
planned calls, take their samples back, resolve the requests that stopped). The first
two are plain Python, testable without JAX.

Plain Python class, no Ray: an actor wraps it.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import functools
import logging
import time
from typing import Any, Callable, Container, Counter, Iterable, get_args

import jax
import jax.numpy as jnp
import numpy as np

from raytunix.config import KVDtype, KVOnWeightUpdate
from raytunix import profiling
from raytunix.inference.accounting import DeviceAccounting, kv_stats, prompt_stats
from raytunix.inference.kv_cache import NO_KV, KVCacheManager, Sequence
from raytunix.inference.programs import Shape, StepPrograms, programs_in_process, shared_programs
from raytunix.inference.scheduler import Row, Scheduler
from raytunix.inference.sampling import check_sampling_settings, sample_tokens, split_seed
from raytunix.inference.stops import completed_stop
from raytunix.inference.weights import check_weight_update, on_engine_device
from raytunix.models.llama import (
    KVPages,
    ModelConfig,
    forward,
    init_kv_pages,
    kv_bytes_per_token,
)
from raytunix.types import FinishReason, GenerationRequest, GenerationResult

# The request record moved to kv_cache.py with the KV-cache manager; tests written against
# the engine module (shared/cases) still reach it by its old name.
_Sequence = Sequence

logger = logging.getLogger(__name__)

KV_ON_WEIGHT_UPDATE: tuple[str, ...] = get_args(KVOnWeightUpdate)  # engine.kv_on_weight_update
KV_DTYPES: tuple[str, ...] = get_args(KVDtype)  # engine.kv_dtype


def kv_cache_dtype(kv_dtype: str, model_config: ModelConfig) -> jnp.dtype:
    """The KV cache's dtype for the setting ``kv_dtype`` (``KV_DTYPES``; ``"auto"``: the
    model's compute dtype, ``model_config.dtype``).

    Raises:
      ValueError: ``kv_dtype`` is not one of ``KV_DTYPES``.
    """
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"InferenceEngine: kv_dtype must be one of {KV_DTYPES}, got {kv_dtype!r}.")
    return jnp.dtype(model_config.dtype if kv_dtype == "auto" else kv_dtype)


def _forward_step(
    graphdef,
    truncate: bool,
    params,
    pages: KVPages,
    last_tokens,
    tokens,
    positions,
    block_tables,
    last_index,
    temperature,
    top_k,
    top_p,
    seed_lo,
    seed_hi,
    token_index,
    slots,
    from_slot,
):
    """Feeds ``T`` tokens per row, writes their KV into the rows' blocks and samples each
    row's next token after its token ``last_index``.

    tokens, positions: ``int32[b, T]`` (padding has position -1); block_tables:
    ``int32[b, NB]``; last_index, top_k, token_index, slots: ``int32[b]``; temperature,
    top_p: ``float32[b]``; seed_lo, seed_hi: ``uint32[b]``; from_slot: ``bool[b]``.
    ``last_tokens``: ``int32[S]``, the token each sequence slot sampled last; a row with
    ``from_slot`` feeds ``last_tokens[slot]`` as its first token instead of ``tokens``
    (a decode step that follows the step sampling it, before the host has seen it), and
    every row stores its sample at ``last_tokens[slot]``. ``truncate`` False: top-k/top-p
    are off in every row and are not compiled in (their threshold searches cost 32
    reductions over the vocabulary each).
    Returns ``(pages, last_tokens, tokens int32[b], logprobs float32[b])``.
    """
    first = jnp.where(from_slot, last_tokens[slots], tokens[:, 0])
    tokens = tokens.at[:, 0].set(first)
    logits, pages = forward(
        graphdef, params, tokens, positions, pages, block_tables, logit_index=last_index
    )
    truncation = {"top_k": top_k, "top_p": top_p} if truncate else {}
    next_tokens, logprobs = sample_tokens(
        logits[:, 0], temperature, seed_lo, seed_hi, token_index, **truncation
    )
    return pages, last_tokens.at[slots].set(next_tokens), next_tokens, logprobs


_STEP_FNS: dict[Any, Any] = {}  # model graph -> its jitted step, shared by engines


def _step_fn(graphdef):
    """The jitted ``_forward_step`` of one model graph (``truncate`` stays static).

    The graph is bound here, not passed as a static argument: a static argument is hashed
    on every call, and hashing a flax ``GraphDef`` costs about as much host time as a
    decode step of a small model. Engines of equal graphs share one function, so they
    share compiled programs.
    """
    fn = _STEP_FNS.get(graphdef)
    if fn is None:
        fn = _STEP_FNS[graphdef] = jax.jit(
            functools.partial(_forward_step, graphdef), static_argnums=(0,), donate_argnums=(2, 3)
        )
    return fn


def _layout_key(
    params, config: ModelConfig, num_blocks: int, block_size: int, kv_dtype, max_running: int
) -> tuple:
    """What a step program is built for besides its shape: the weights' structure,
    shapes, dtypes and shardings, the KV pages' size and dtype and the token buffer's
    size."""
    leaves, treedef = jax.tree.flatten(params)
    return (
        treedef,
        tuple((x.shape, x.dtype, x.sharding) for x in leaves),
        config,
        num_blocks,
        block_size,
        jnp.dtype(kv_dtype),
        max_running,
    )


def _lower_step(
    step,
    params,
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    kv_dtype,
    max_running: int,
    shape: Shape,
):
    """``step`` lowered for ``shape`` (``jax.stages.Lowered``) from abstract values only:
    safe on any thread while steps run. ``params`` gives only its shapes and shardings
    (later weights have the same: ``update_weights`` checks)."""
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def host(dims, dtype):
        return jax.ShapeDtypeStruct(dims, dtype, sharding=device)

    pages = jax.eval_shape(lambda: init_kv_pages(config, num_blocks, block_size, kv_dtype))
    b, t, i32, f32, u32 = shape.batch, shape.length, np.int32, np.float32, np.uint32
    return step.lower(
        shape.truncate,
        jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params),
        jax.tree.map(lambda x: host(x.shape, x.dtype), pages),
        host((max_running + 1,), i32),
        host((b, t), i32),
        host((b, t), i32),
        host((b, shape.span), i32),
        host((b,), i32),
        host((b,), f32),
        host((b,), i32),
        host((b,), f32),
        host((b,), u32),
        host((b,), u32),
        host((b,), i32),
        host((b,), i32),
        host((b,), bool),
    )


def _step_programs(
    graphdef, layout: tuple, reachable: Callable[[bool], list[Shape]], ahead: bool
) -> StepPrograms:
    """The step programs of one engine: ``layout`` is ``(params, config, num_blocks,
    block_size, kv_dtype, max_running)`` (see ``_layout_key``); programs of an equal layout are
    shared between the engines of a process; ``reachable(truncate)`` lists the shapes the
    scheduler can call, compiled on a background thread from now on when ``ahead``."""
    step = _step_fn(graphdef)
    return StepPrograms(
        shared_programs((step, _layout_key(*layout))),
        functools.partial(_lower_step, step, *layout),
        reachable,
        ahead=ahead,
    )


async def _wait_idle(idle: asyncio.Event, timeout_s: float) -> None:
    """Waits until ``idle`` is set (no device call in flight), at most ``timeout_s``
    seconds; warns when a call is still running then."""
    try:
        await asyncio.wait_for(idle.wait(), timeout_s)
    except asyncio.TimeoutError:
        logger.warning(
            "InferenceEngine.pause: a device call is still running after "
            "%.1f s; requests were aborted, the call's results will be "
            "dropped.",
            timeout_s,
        )


def _wait_ready(tokens, logprobs):
    """Blocks (on the waiter thread) until a launched step's samples are on the host;
    returns them and the ``time.perf_counter()`` at which they were."""
    tokens, logprobs = np.asarray(tokens), np.asarray(logprobs)
    return tokens, logprobs, time.perf_counter()


def _step_inputs(rows: list[Row], shape: Shape, pad_slot: int) -> tuple[tuple, int, int]:
    """The host inputs of one call feeding ``n`` tokens for each ``(sequence, n)`` row,
    padded to ``shape``: ``(tokens, positions, block_tables, last_index, temperature,
    top_k, top_p, seed_lo, seed_hi, token_index, slots, from_slot)`` as ``_forward_step``
    takes them (padding rows write to slot ``pad_slot``), then the prompt tokens and the
    generated tokens fed again (recomputed) among the fed. A row whose token is a sample
    not yet on the host takes it from the device's token buffer (``from_slot``)."""
    batch, length, span = shape.batch, shape.length, shape.span
    samplings = [seq.request.sampling for seq, _ in rows]
    tokens = np.zeros((batch, length), np.int32)
    positions = np.full((batch, length), -1, np.int32)
    tables = np.zeros((batch, span), np.int32)
    # Per-row scalars as lists first: one array each, not one numpy store per row.
    pad = batch - len(rows)
    last = np.array([n - 1 for _, n in rows] + [0] * pad, np.int32)
    temperature = np.array([s.temperature for s in samplings] + [1.0] * pad, np.float32)
    top_k = np.array([s.top_k for s in samplings] + [0] * pad, np.int32)
    top_p = np.array([s.top_p for s in samplings] + [1.0] * pad, np.float32)
    seed_lo = np.array([seq.seed_lo for seq, _ in rows] + [0] * pad, np.uint32)
    seed_hi = np.array([seq.seed_hi for seq, _ in rows] + [0] * pad, np.uint32)
    index = np.array([len(seq.tokens) + seq.pending for seq, _ in rows] + [0] * pad, np.int32)
    slots = np.array([seq.slot for seq, _ in rows] + [pad_slot] * pad, np.int32)
    from_slot = np.zeros((batch,), bool)
    prompt_fed = generated_fed = 0
    for row, (seq, n) in enumerate(rows):
        start = seq.num_cached
        end = len(seq.context) + seq.pending  # tokens known or sampled so far
        if n == 1:
            if start < len(seq.context):
                tokens[row, 0] = seq.context[start]
            else:  # the newest sample, still on the device
                from_slot[row] = True
            positions[row, 0] = start
        else:
            tokens[row, :n] = seq.context[start : start + n]
            positions[row, :n] = np.arange(start, start + n)
        tables[row, : len(seq.blocks)] = seq.blocks
        in_prompt = max(0, min(start + n, len(seq.request.prompt_ids)) - start)
        prompt_fed += in_prompt
        if start + n < end:  # generated tokens fed again
            generated_fed += n - in_prompt
        elif n - in_prompt > 1:
            generated_fed += n - in_prompt - 1
    arrays = (tokens, positions, tables, last, temperature, top_k, top_p)
    return (*arrays, seed_lo, seed_hi, index, slots, from_slot), prompt_fed, generated_fed


def _check_request(request: GenerationRequest, max_seq_len: int, vocab_size: int) -> None:
    """Raises ValueError naming what is wrong with a request on its own: its prompt's
    length or token ids, or its sampling settings."""
    rid = request.request_id
    n = len(request.prompt_ids)
    if n == 0:
        raise ValueError(f"Request {rid!r} has an empty prompt; give at least one token.")
    if n > max_seq_len - 1:
        raise ValueError(
            f"Request {rid!r}: prompt has {n} tokens but the engine's limit "
            f"is max_seq_len - 1 = {max_seq_len - 1}; shorten the "
            "prompt or raise max_seq_len."
        )
    bad = [t for t in request.prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(
            f"Request {rid!r}: token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})."
        )
    sampling = request.sampling
    if sampling.max_new_tokens < 1:
        raise ValueError(
            f"Request {rid!r}: max_new_tokens must be >= 1, got {sampling.max_new_tokens}."
        )
    try:
        check_sampling_settings(
            sampling.temperature, sampling.top_k, sampling.top_p, allow_greedy=True
        )
    except ValueError as error:
        raise ValueError(f"Request {rid!r}: {error}") from None


def _check_not_in_flight(
    request: GenerationRequest, in_flight: Container[str], busy_sessions: Container[str]
) -> None:
    """Raises ValueError when a request's id is already in flight (a key of
    ``in_flight``) or its session already has a request in flight (in ``busy_sessions``)."""
    rid = request.request_id
    if rid in in_flight:
        raise ValueError(
            f"Request id {rid!r} is already in flight; request ids must be "
            "unique among requests in flight."
        )
    if request.session_id is not None and request.session_id in busy_sessions:
        raise ValueError(
            f"Request {rid!r}: session {request.session_id!r} already has a "
            "request in flight; a session's turns must come one at a time."
        )


def _new_sequence(request: GenerationRequest, future: asyncio.Future, order: int) -> Sequence:
    """The record of a request just arrived: its prompt as the context, no KV yet, its
    seed split into the two 32-bit halves the sampler takes, scheduled by ``order``."""
    lo, hi = split_seed(int(request.seed))
    return Sequence(
        request=request,
        future=future,
        seed_lo=lo,
        seed_hi=hi,
        order=order,
        context=list(request.prompt_ids),
        kv_version=NO_KV,
        arrived_s=time.perf_counter(),
    )


def _stop_reason(
    seq: Sequence, decode: Callable[[list[int]], str], max_seq_len: int
) -> FinishReason | None:
    """Why ``seq`` stops after its newest token, or None to go on: ``STOP`` for a stop
    token or a stop string the newest token completes (``decode`` turns token ids into
    text), ``LENGTH`` for ``max_new_tokens`` generated or a context of ``max_seq_len``."""
    sampling = seq.request.sampling
    if seq.tokens[-1] in sampling.stop_token_ids:
        return FinishReason.STOP
    if (
        sampling.stop_strings
        and completed_stop(decode, seq.tokens, sampling.stop_strings) is not None
    ):
        return FinishReason.STOP
    if len(seq.tokens) >= sampling.max_new_tokens:
        return FinishReason.LENGTH
    # The next token would sit at position max_seq_len: the context is full.
    if len(seq.context) >= max_seq_len:
        return FinishReason.LENGTH
    return None


def _append_sample(
    seq: Sequence, token: int, logprob: float, version: int, counters: Counter[str]
) -> None:
    """Appends one sampled token (its logprob in nats, the policy version that sampled
    it) to ``seq``; counts it in ``tokens_generated``, and in ``stale_kv_tokens`` when the
    context held KV of older weights."""
    seq.tokens.append(int(token))
    seq.context.append(int(token))
    seq.logprobs.append(float(logprob))
    seq.versions.append(version)
    counters["tokens_generated"] += 1
    if seq.kv_version < version:
        seq.stale_tokens += 1
        counters["stale_kv_tokens"] += 1


def _result(
    seq: Sequence, reason: FinishReason, decode: Callable[[list[int]], str]
) -> GenerationResult:
    """The result of a finished request: its tokens, logprobs, versions and text."""
    return GenerationResult(
        request_id=seq.request.request_id,
        token_ids=tuple(seq.tokens),
        logprobs=tuple(seq.logprobs),
        policy_versions=tuple(seq.versions),
        finish_reason=reason,
        text=decode(list(seq.tokens)),
        num_cached_tokens=seq.cached_tokens,
        stale_kv_tokens=seq.stale_tokens,
    )


def _set_event(loop: asyncio.AbstractEventLoop, event: asyncio.Event) -> None:
    """Sets an event of ``loop`` from any thread (at once on the loop's own thread)."""
    if loop.is_closed():
        return
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        event.set()
    else:
        loop.call_soon_threadsafe(event.set)


def _request_span(seq: Sequence, reason: FinishReason) -> None:
    """Records a finished request's profiling span."""
    # One span per request on the track of the slot it held: who occupied the
    # batch row, from admission to its end, and how long it queued before.
    profiling.add(
        "request",
        seq.admitted_s,
        time.perf_counter(),
        f"slot {seq.slot}",
        {
            "request_id": seq.request.request_id,
            "reason": reason.value,
            "prompt_tokens": len(seq.request.prompt_ids),
            "cached_tokens": seq.cached_tokens,
            "generated": len(seq.tokens),
            "queued_s": round(seq.admitted_s - seq.arrived_s, 6),
        },
        seq.request.session_id,
    )


def kv_pool_blocks(
    seq_len: int, block_size: int, max_batch_size: int, kv_cache_tokens: int | None
) -> int:
    """The KV blocks the engine's pool holds (``init_kv_pages``' ``num_blocks``):
    ``kv_cache_tokens`` rounded up to whole blocks, or by default ``4 * max_batch_size``
    full contexts of ``seq_len`` tokens (each context rounded up to whole blocks); 0 for a
    ``kv_cache_tokens`` that is not an int (``_check_settings`` refuses it)."""
    if kv_cache_tokens is None:
        kv_cache_tokens = 4 * max_batch_size * -(-seq_len // block_size) * block_size
    return -(-kv_cache_tokens // block_size) if isinstance(kv_cache_tokens, int) else 0


def _check_settings(
    seq_len: int, kv_cache_tokens: int | None, kv_on_weight_update: str, **ints: int
) -> int:
    """Checks the engine's settings; returns the number of KV blocks.

    Raises:
      ValueError: a setting out of range (named in the message), or a KV capacity below
        one full context.
    """
    for name, low in (
        ("max_batch_size", 1),
        ("max_seq_len", 2),
        ("block_size", 1),
        ("prefill_chunk_tokens", 2),
        ("prefill_min_batch", 1),
        ("max_prefill_delay_steps", 0),
    ):
        value = seq_len if name == "max_seq_len" else ints[name]
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"InferenceEngine: {name} must be an int >= {low}, got {value!r}.")
    if kv_on_weight_update not in KV_ON_WEIGHT_UPDATE:
        raise ValueError(
            f"InferenceEngine: kv_on_weight_update must be one of "
            f"{KV_ON_WEIGHT_UPDATE}, got {kv_on_weight_update!r}."
        )
    block_size = ints["block_size"]
    max_blocks = -(-seq_len // block_size)  # blocks of one full context
    num_blocks = kv_pool_blocks(seq_len, block_size, ints["max_batch_size"], kv_cache_tokens)
    if num_blocks < max_blocks:
        raise ValueError(
            f"InferenceEngine: kv_cache_tokens={kv_cache_tokens!r} holds less than one "
            f"context of max_seq_len={seq_len} tokens; give at least {seq_len}."
        )
    return num_blocks


@dataclasses.dataclass(eq=False)
class _Launch:
    """One device call launched and not yet taken in."""

    rows: list[tuple[Sequence, int, int, bool]]  # (sequence, tokens fed, its epoch, samples)
    prefill: bool
    version: int  # weights it runs with
    epoch: int  # the engine's epoch at launch (pause and close bump it)
    start: float  # perf_counter at launch
    result: asyncio.Future  # -> (tokens, logprobs, perf_counter when they were ready)
    prompt_fed: int  # prompt tokens it feeds
    generated_fed: int  # generated tokens it feeds again (recomputed)

    def count_done(self, device: DeviceAccounting, ready: float) -> None:
        """Counts the call as done on ``device``, its samples ready at ``ready``
        (perf_counter seconds)."""
        device.step_done(
            prefill=self.prefill,
            start=self.start,
            ready=ready,
            rows=len(self.rows),
            prompt_fed=self.prompt_fed,
            generated_fed=self.generated_fed,
        )


class InferenceEngine:
    """Continuous-batching generation for one model on one device (see module docstring).

    Args:
      graphdef, params: the model (``init_model``), its weights held in ``model_config.dtype``.
      model_config: its ``ModelConfig``.
      tokenizer: has ``decode(ids) -> str``; used for stop strings and ``result.text``.
      max_batch_size: most requests decoded together (rows of a decode step); the oldest
        ready requests get the rows, and up to half as many more hold their KV meanwhile.
      max_seq_len: longest context (prompt + generated) in tokens; defaults to
        ``model_config.max_seq_len``.
      block_size: tokens per KV block.
      kv_cache_tokens: KV capacity in tokens, shared by running requests, idle sessions
        and the prefix cache; rounded up to whole blocks. Default: ``4 * max_batch_size``
        full contexts (requests waiting for a row and idle sessions keep their KV too).
      prefill_chunk_tokens: most prompt tokens fed between two decode steps.
      policy_version: version of ``params``; stamped on the tokens they generate.
      kv_on_weight_update: ``"recompute"`` (KV computed under older weights is dropped
        and recomputed) or ``"keep"`` (kept, and counted as stale per token).
      sessions: keep a session's KV between its requests; False ignores ``session_id``
        (every turn is prefilled from the prefix cache or computed).
      kv_dtype: the KV cache's dtype, ``"float32"``, ``"bfloat16"`` or ``"auto"`` (the model's).
      prefill_min_batch, max_prefill_delay_steps: while other requests decode, fewer than
        ``prefill_min_batch`` requests to prefill wait up to ``max_prefill_delay_steps``
        decode steps for company (one fuller prefill instead of several padded ones);
        0 steps turns the wait off.
      compile_ahead: compile every step program the scheduler can reach on a background
        thread from construction, largest first; a step whose own program is not built
        yet runs on the cheapest built one that holds it (more rows, a longer span: the
        same samples) while its own is built next. False: each program is compiled on
        the step that first needs it, while every live request waits.

    Raises:
      ValueError: a setting out of range (named in the message), or a KV capacity below
        one full context.

    One program per (truncation, batch bucket, tokens fed per row, block bucket) shape
    (``raytunix.inference.programs``); ``warmup()`` compiles them all on the caller's
    thread, and ``stats()`` counts compiles and the seconds steps waited on them.
    """

    def __init__(
        self,
        graphdef,
        params,
        model_config: ModelConfig,
        tokenizer,
        *,
        max_batch_size: int = 128,
        max_seq_len: int | None = None,
        block_size: int = 16,
        kv_cache_tokens: int | None = None,
        prefill_chunk_tokens: int = 256,
        policy_version: int = 0,
        kv_on_weight_update: str = "recompute",
        sessions: bool = True,
        kv_dtype: str = "auto",
        prefill_min_batch: int = 4,
        max_prefill_delay_steps: int = 4,
        compile_ahead: bool = False,
    ):
        seq_len = model_config.max_seq_len if max_seq_len is None else max_seq_len
        num_blocks = _check_settings(
            seq_len,
            kv_cache_tokens,
            kv_on_weight_update,
            max_batch_size=max_batch_size,
            block_size=block_size,
            prefill_chunk_tokens=prefill_chunk_tokens,
            prefill_min_batch=prefill_min_batch,
            max_prefill_delay_steps=max_prefill_delay_steps,
        )
        self._config = model_config
        pages = (model_config, num_blocks, block_size, kv_cache_dtype(kv_dtype, model_config))
        self._new_pages = functools.partial(init_kv_pages, *pages)  # empty KV pages
        self._kv_token_bytes = kv_bytes_per_token(model_config, pages[3])
        self._tokenizer = tokenizer
        self._max_seq_len = seq_len
        self._kv_mode = kv_on_weight_update
        self._keep_sessions = bool(sessions)
        self._counters: collections.Counter[str] = collections.Counter()
        self._kv = KVCacheManager(num_blocks, block_size, kv_on_weight_update, self._counters)
        self._scheduler = Scheduler(
            self._kv,
            self._counters,
            max_batch_size=max_batch_size,
            max_seq_len=seq_len,
            prefill_chunk_tokens=prefill_chunk_tokens,
            prefill_min_batch=prefill_min_batch,
            max_prefill_delay_steps=max_prefill_delay_steps,
        )
        self._params = on_engine_device(params, model_config.dtype)
        self._version = int(policy_version)
        self._pending_weights: tuple[Any, int] | None = None
        layout = (self._params, *pages, self._scheduler.max_running)
        self._programs = _step_programs(graphdef, layout, self._reachable, bool(compile_ahead))
        self._pages: KVPages | None = None  # None: (re)build before the next device call
        # Token each running request sampled last, by slot; the last slot is padding's.
        self._last_tokens: jax.Array | None = None
        self._launched: collections.deque[list[_Launch]] = collections.deque()  # by step
        self._by_id: dict[str, Sequence] = {}
        self._arrivals = 0
        # Waits for launched steps' samples, in launch order.
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="raytunix-engine"
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None
        self._paused = False
        self._closed = False
        self._epoch = 0  # bumped by pause/close: device results from an older epoch are dropped
        self._first_request_t: float | None = None
        self._device = DeviceAccounting()
        self._shapes: set[tuple[int, int, int]] = set()

    # ------------------------------------------------------------------ public API

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        """Generates a completion for one request; returns when it finishes.

        Returns:
          ``GenerationResult`` with N generated tokens, their logprobs (nats) and policy
          versions, and why generation stopped: ``STOP`` (stop token, kept, or stop
          string, ending at the token that completes it: ``inference.stops``),
          ``LENGTH`` (``max_new_tokens``, or prompt + generated reached
          ``max_seq_len``), ``ABORT`` (``abort``, ``pause`` or ``close``; partial tokens).
          ``num_cached_tokens`` says how many prompt tokens came from the cache.

        Raises:
          ValueError: empty prompt, prompt longer than ``max_seq_len - 1`` tokens, a
            token id outside ``[0, vocab_size)``, bad sampling settings, a request id
            already in flight, or a session that already has a request in flight.
          RuntimeError: the engine is closed.
        """
        if request.session_id is not None and not self._keep_sessions:
            request = dataclasses.replace(request, session_id=None)
        self._validate(request)
        self._ensure_started()
        if self._first_request_t is None:
            self._first_request_t = time.monotonic()
        self._device.request_arrived()
        session = self._kv.sessions.get(request.session_id) if request.session_id else None
        # A session's turns keep the place of its first request: older episodes go first,
        # so groups finish one after another instead of all at the end.
        order = session.order if session is not None else self._arrivals
        seq = _new_sequence(request, self._loop.create_future(), order)
        self._arrivals += 1
        self._by_id[request.request_id] = seq
        self._kv.begin(seq)
        self._counters["prompt_tokens"] += len(request.prompt_ids)
        self._scheduler.waiting.append(seq)
        seq.future.add_done_callback(self._on_future_done(seq))
        self._wake.set()
        return await seq.future

    def _on_future_done(self, seq: Sequence):
        def done(future: asyncio.Future) -> None:
            if future.cancelled():  # the caller gave up: free its id, session and KV now
                self._finish(seq, FinishReason.ABORT)
            self._notify()

        return done

    async def generate_many(self, requests: Iterable[GenerationRequest]) -> list[GenerationResult]:
        """Generates all requests concurrently; results are in request order."""
        return list(await asyncio.gather(*(self.generate(r) for r in requests)))

    def abort(self, request_id: str) -> bool:
        """Stops one request now: it resolves with its partial tokens and ``ABORT`` and
        its row and KV blocks are free for the next step. False if no such request is in
        flight (it finished already, or never came)."""
        seq = self._by_id.get(request_id)
        if seq is None:
            return False
        self._finish(seq, FinishReason.ABORT)
        self._notify()
        return True

    def end_session(self, session_id: str) -> None:
        """Frees the KV a session keeps (call when its episode ends). A request of the
        session still in flight finishes normally and keeps nothing."""
        self._kv.end_session(session_id)

    def update_weights(self, params, version: int) -> None:
        """Queues new weights; the loop swaps them in between two device steps.

        Tokens sampled after the swap carry ``version``. With
        ``kv_on_weight_update="recompute"`` every request in flight is re-prefilled
        (prompt + its tokens so far) under the new weights, and sessions and the prefix
        cache are emptied. Weights are cast to the model's compute dtype. Safe to call
        from the event loop or another thread.

        Raises:
          ValueError: ``version`` is lower than the current or already queued version,
            or ``params`` does not have the structure and shapes of the current weights.
          RuntimeError: the engine is closed.
        """
        if self._closed:
            raise RuntimeError("InferenceEngine is closed; build a new one.")
        params = on_engine_device(params, self._config.dtype)
        version = check_weight_update(params, version, self._params, self._received_version())
        self._pending_weights = (params, version)
        self._notify()

    async def pause(self, timeout_s: float = 5.0) -> None:
        """Aborts every in-flight and waiting request and stops scheduling.

        The requests resolve at once with their partial tokens and ``ABORT``. Then waits
        until the device calls in flight (at most two steps) have returned, at most
        ``timeout_s`` seconds. Requests submitted while paused wait until ``resume``.
        """
        self._paused = True
        self._abort_all()
        if self._wake is not None:
            self._wake.set()
        if self._idle is not None and self._task is not None and not self._task.done():
            await _wait_idle(self._idle, timeout_s)

    def resume(self) -> None:
        """Restarts admission and decoding after ``pause``."""
        self._paused = False
        self._notify()

    def warmup(self) -> int:
        """Compiles every program the scheduler can call, so that serving never waits
        for the compiler; returns the number of shapes compiled. Call before serving
        (it runs on the caller's thread)."""
        shapes = self._reachable(False)
        self._programs.compile_now(shapes)
        return len(shapes)

    def wait_until_compiled(self, timeout_s: float | None = None) -> bool:
        """With ``compile_ahead``: blocks until every program queued ahead is built (True),
        or ``timeout_s`` passes (False). Without it: True at once."""
        return self._programs.wait_until_compiled(timeout_s)

    def stats(self) -> dict:
        """Counters since construction, JSON-able.

        The device's work (``DeviceAccounting.stats``: busy, work and host-gap seconds,
        padded tokens, steps, tokens fed), ``wall_s`` (seconds since the first request),
        ``tokens_generated``, ``requests_finished``, ``policy_version`` (of the weights in
        use) and ``policy_version_received`` (newest weights handed over, swapped in at the
        next step), ``active_slots`` and ``waiting`` (now); prompt accounting in tokens
        (``accounting.prompt_stats``) and the KV cache's memory (``accounting.kv_stats``);
        ``stale_kv_tokens`` (tokens sampled over KV of older weights), ``preemptions``,
        ``session_evictions``; ``compiled_shapes`` (program shapes this engine used) and
        ``compiled_programs`` (programs compiled in this process, all engines: constant
        once warm); compiling (``StepPrograms``): ``compiles``, ``compile_s``,
        ``compiles_ahead``, ``compile_stalls`` and ``compile_stall_s`` (steps that waited
        for a program to be built, and the seconds every live request waited with them),
        ``steps_on_larger_program``, ``compile_queue``.
        """
        c = self._counters
        wall = 0.0 if self._first_request_t is None else time.monotonic() - self._first_request_t
        return {
            **self._device.stats(wall, c["tokens_generated"]),
            "wall_s": wall,
            "tokens_generated": c["tokens_generated"],
            "requests_finished": c["requests_finished"],
            "policy_version": self._version,
            "policy_version_received": self._received_version(),
            "active_slots": len(self._scheduler.running),
            "waiting": len(self._scheduler.waiting),
            **prompt_stats(c),
            **kv_stats(self._kv, self._kv_token_bytes),
            "stale_kv_tokens": c["stale_kv_tokens"],
            "preemptions": c["preemptions"],
            "session_evictions": c["session_evictions"],
            "compiled_shapes": len(self._shapes),
            "compiled_programs": programs_in_process(),
            **self._programs.stats(),
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
        self._programs.close()

    @property
    def max_seq_len(self) -> int:
        """Longest context in tokens."""
        return self._max_seq_len

    @property
    def policy_version(self) -> int:
        """Version of the weights in use now (a queued update is not counted yet)."""
        return self._version

    def _received_version(self) -> int:
        """Version of the newest weights handed over (queued, or in use if none is)."""
        return self._version if self._pending_weights is None else self._pending_weights[1]

    # ------------------------------------------------------------------ plumbing

    def _validate(self, request: GenerationRequest) -> None:
        if self._closed:
            raise RuntimeError("InferenceEngine is closed; build a new one.")
        _check_request(request, self._max_seq_len, self._config.vocab_size)
        _check_not_in_flight(request, self._by_id, self._kv.busy_sessions)

    def _ensure_started(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            # A new event loop (e.g. another asyncio.run): requests of the old one can
            # never be resolved, and its last device call may have consumed the cache.
            self._loop = loop
            self._wake, self._idle = asyncio.Event(), asyncio.Event()
            self._idle.set()
            self._reset_state()
            self._task = None
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._run(), name="raytunix-engine-loop")

    def _reset_state(self) -> None:
        """Forgets every request, session and cached block (the pages are rebuilt)."""
        self._scheduler.reset()
        self._kv.reset()
        self._by_id.clear()
        self._pages = None
        self._last_tokens = None
        self._launched.clear()
        if self._idle is not None:
            self._idle.set()

    def _notify(self) -> None:
        if self._loop is not None and self._wake is not None:
            _set_event(self._loop, self._wake)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Resolves a request and hands its KV blocks to its session or back to the pool."""
        if seq.done:
            return
        seq.done = True
        self._counters["requests_finished"] += 1
        self._by_id.pop(seq.request.request_id, None)
        if seq.running:
            _request_span(seq, reason)
            self._scheduler.stop_running(seq)
        else:
            try:
                self._scheduler.waiting.remove(seq)
            except ValueError:
                pass
        if not self._scheduler.running and not self._scheduler.waiting:
            self._device.requests_all_done()
        self._kv.finish(seq, keep=reason != FinishReason.ABORT and not seq.future.done())
        if seq.future.done():  # the caller cancelled
            return
        seq.future.set_result(_result(seq, reason, self._tokenizer.decode))

    def _abort_all(self) -> None:
        self._epoch += 1
        for seq in self._scheduler.requests():
            self._finish(seq, FinishReason.ABORT)

    def _fail_all(self, error: BaseException) -> None:
        for seq in self._scheduler.requests():
            if not seq.future.done():
                seq.future.set_exception(error)
        self._reset_state()

    def _stop_reason(self, seq: Sequence) -> FinishReason | None:
        return _stop_reason(seq, self._tokenizer.decode, self._max_seq_len)

    def _record(self, seq: Sequence, token: int, logprob: float, version: int) -> None:
        _append_sample(seq, token, logprob, version, self._counters)
        reason = self._stop_reason(seq)
        if reason is not None:
            self._finish(seq, reason)

    # ------------------------------------------------------------------ device buffers

    def _ensure_buffers(self) -> None:
        """Builds the KV pages and the token buffer if there are none (first use, reset)."""
        if self._pages is None:
            self._pages = self._new_pages()
        if self._last_tokens is None:
            self._last_tokens = jnp.zeros((self._scheduler.max_running + 1,), jnp.int32)

    # ------------------------------------------------------------------ scheduler loop

    async def _run(self) -> None:
        try:
            while not self._closed:
                self._wake.clear()
                if self._pending_weights is not None:
                    swap_start = time.perf_counter()
                    await self._drain()  # every sample in flight keeps its version
                    self._params, self._version = self._pending_weights
                    self._pending_weights = None
                    if self._kv_mode == "recompute":
                        self._kv.drop_weights_kv(self._scheduler.requests())
                    args = {"version": self._version}
                    profiling.add("weight_swap", swap_start, time.perf_counter(), "weights", args)
                if self._paused:
                    await self._drain()
                    await self._wake.wait()
                    continue
                self._drop_cancelled()
                # Each call is launched before the next is planned: a row whose prompt a
                # prefill call finishes decodes in the same step.
                step = [
                    self._launch(rows, prefill)
                    for rows, prefill in self._scheduler.schedule(self._version)
                ]
                step = [launch for launch in step if launch is not None]
                if step:
                    self._launched.append(step)
                # One step ahead: the device runs the step just launched while the host
                # takes in the one before it.
                if len(self._launched) > 1 or (self._launched and not step):
                    await self._take_in_step()
                elif not step:
                    await self._wake.wait()
        except asyncio.CancelledError:
            raise
        except Exception as error:  # noqa: BLE001 - every waiting caller must hear of it
            logger.exception("InferenceEngine loop failed; failing all requests.")
            self._fail_all(error)

    def _drop_cancelled(self) -> None:
        for seq in self._scheduler.requests():
            if seq.future.done():
                self._finish(seq, FinishReason.ABORT)

    def _reachable(self, truncate: bool) -> list[Shape]:
        return [Shape(truncate, b, t, s) for b, t, s in self._scheduler.all_shapes()]

    def _launch(self, rows: list[Row], prefill: bool) -> _Launch | None:
        """Launches one device call feeding ``n`` tokens for each ``(sequence, n)`` row,
        without waiting for it, and counts its tokens as fed: the next step may build on
        them (JAX orders the calls)."""
        # A row preempted while planning this step has no blocks.
        rows = [(seq, n) for seq, n in rows if seq.running]
        if not rows:
            return None
        program, shape = self._programs.program_for(self._scheduler.shape_for(rows, prefill))
        inputs, prompt_fed, generated_fed = _step_inputs(rows, shape, self._scheduler.max_running)
        version = self._version
        launched_rows = [
            (seq, n, seq.epoch, self._scheduler.fed(seq, n, version)) for seq, n in rows
        ]
        self._shapes.add((shape.batch, shape.length, shape.span))
        self._device.launched(shape.batch, shape.length)
        self._ensure_buffers()
        start_s = time.perf_counter()
        self._pages, self._last_tokens, sampled, logprobs = program(
            self._params, self._pages, self._last_tokens, *inputs
        )
        result = asyncio.wrap_future(self._executor.submit(_wait_ready, sampled, logprobs))
        self._idle.clear()
        return _Launch(
            rows=launched_rows,
            prefill=prefill,
            version=version,
            epoch=self._epoch,
            start=start_s,
            result=result,
            prompt_fed=prompt_fed,
            generated_fed=generated_fed,
        )

    async def _take_in_step(self) -> None:
        """Waits for the oldest launched step and records its samples."""
        step = self._launched[0]
        try:
            for launch in step:
                sampled, logprobs, ready = await launch.result
                # Counted when done, so stats() describes steps the device has finished.
                launch.count_done(self._device, ready)
                if launch.epoch != self._epoch:
                    continue  # a pause or close happened meanwhile
                for row, (seq, n, epoch, samples) in enumerate(launch.rows):
                    if not samples or seq.epoch != epoch or not seq.running:
                        continue  # finished, aborted or preempted since its launch
                    seq.pending -= 1
                    self._record(seq, sampled[row], logprobs[row], launch.version)
                    if seq.running:
                        self._kv.register_blocks(seq, launch.version)
        finally:
            self._launched.popleft()
            if not self._launched:
                self._idle.set()

    async def _drain(self) -> None:
        """Takes in every launched step."""
        while self._launched:
            await self._take_in_step()
