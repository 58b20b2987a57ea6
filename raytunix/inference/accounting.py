"""What an engine's device did, and when it had work: busy time by prefill and decode,
tokens through the model with their padding, and host gaps (requests held while no step
ran on the device). Plain Python; the engine calls it as requests come and go and as it
takes in each step's samples."""

from __future__ import annotations

import collections
import time
from collections.abc import Mapping

from raytunix import profiling
from raytunix.inference.kv_cache import KVCacheManager


class DeviceAccounting:
    """Counters of one engine's device work (``InferenceEngine.stats`` merges ``stats()``).

    Busy time of a step runs from its launch, or from the end of the step before it if
    that was later (the device runs calls in order), to its samples being ready on the
    host, so steps in flight together are not counted twice. Work time runs while the
    engine holds at least one request; work time with no step on the device is a host gap
    (scheduling, tokenisation, compiles, weight swaps).
    """

    def __init__(self) -> None:
        self.counters: collections.defaultdict[str, float] = collections.defaultdict(float)
        self._last_ready = 0.0  # perf_counter when the last step taken in was done
        self._work_since: float | None = None  # perf_counter since when requests are held

    def request_arrived(self) -> None:
        if self._work_since is None:
            self._work_since = time.perf_counter()

    def requests_all_done(self) -> None:
        """The engine holds no request any more."""
        if self._work_since is not None:
            self.counters["work_s"] += time.perf_counter() - self._work_since
            self._work_since = None

    def launched(self, rows: int, tokens_per_row: int) -> None:
        """A program of ``rows x tokens_per_row`` tokens ran (padding included)."""
        self.counters["padded_tokens"] += rows * tokens_per_row

    def step_done(
        self,
        *,
        prefill: bool,
        start: float,
        ready: float,
        rows: int,
        prompt_fed: int,
        generated_fed: int,
    ) -> None:
        """One launched call's samples were ready at ``ready`` (perf_counter seconds); it
        was launched at ``start``, fed ``rows`` rows, ``prompt_fed`` prompt tokens and
        ``generated_fed`` generated tokens again."""
        began = max(start, self._last_ready)
        busy = max(0.0, ready - began)
        self._last_ready = max(self._last_ready, ready)
        profiling.add(
            "prefill" if prefill else "decode",
            began,
            max(began, ready),
            "steps",
            {"rows": rows, "tokens": prompt_fed + generated_fed if prefill else rows},
        )
        c = self.counters
        c["busy_s"] += busy
        c["busy_prefill_s" if prefill else "busy_decode_s"] += busy
        c["prompt_tokens_computed"] += prompt_fed
        c["generated_tokens_recomputed"] += generated_fed
        if prefill:
            c["prefill_calls"] += 1
        else:
            c["decode_steps"] += 1
            c["decode_rows"] += rows

    def stats(self, wall_s: float, tokens_generated: int) -> dict:
        """Keys: ``busy_s`` (seconds the device had a step to run; ``busy_prefill_s`` and
        ``busy_decode_s`` split it, ``prefill_share_of_busy`` is the first over it),
        ``busy_fraction`` (over ``wall_s``), ``work_s`` (seconds the engine held at least
        one request), ``host_gap_s`` (``work_s - busy_s``) and ``host_gap_fraction`` (over
        ``work_s``), ``padded_tokens`` (rows x tokens per row of every program run) and
        ``padded_tokens_per_generated_token``, ``decode_steps``, ``prefill_calls``,
        ``mean_active_slots`` (rows per decode step), ``prompt_tokens_computed`` and
        ``generated_tokens_recomputed`` (fed through the model)."""
        c = self.counters
        work = c["work_s"] + (
            0.0 if self._work_since is None else time.perf_counter() - self._work_since
        )
        busy = c["busy_s"]
        gap = max(0.0, work - busy)
        return {
            "busy_s": busy,
            "busy_fraction": busy / wall_s if wall_s > 0 else 0.0,
            "busy_prefill_s": c["busy_prefill_s"],
            "busy_decode_s": c["busy_decode_s"],
            "prefill_share_of_busy": c["busy_prefill_s"] / busy if busy else 0.0,
            "work_s": work,
            "host_gap_s": gap,
            "host_gap_fraction": gap / work if work > 0 else 0.0,
            "padded_tokens": int(c["padded_tokens"]),
            "padded_tokens_per_generated_token": (
                c["padded_tokens"] / tokens_generated if tokens_generated else 0.0
            ),
            "decode_steps": int(c["decode_steps"]),
            "prefill_calls": int(c["prefill_calls"]),
            "mean_active_slots": (
                c["decode_rows"] / c["decode_steps"] if c["decode_steps"] else 0.0
            ),
            "prompt_tokens_computed": int(c["prompt_tokens_computed"]),
            "generated_tokens_recomputed": int(c["generated_tokens_recomputed"]),
        }


def prompt_stats(counters: Mapping[str, int]) -> dict[str, float | int]:
    """An engine's prompt accounting, in tokens, from its counters: ``prompt_tokens``
    (requested), ``prompt_tokens_from_sessions`` and ``prompt_tokens_from_prefix_cache``
    (reused KV), ``prefix_cache_hit_rate`` (prefix-cache tokens / prompt tokens)."""
    prompt = counters["prompt_tokens"]
    from_prefix = counters["prompt_tokens_from_prefix_cache"]
    return {
        "prompt_tokens": prompt,
        "prompt_tokens_from_sessions": counters["prompt_tokens_from_sessions"],
        "prompt_tokens_from_prefix_cache": from_prefix,
        "prefix_cache_hit_rate": from_prefix / prompt if prompt else 0.0,
    }


def kv_stats(kv: KVCacheManager, token_bytes: int) -> dict[str, int]:
    """What the KV cache holds now, with ``token_bytes`` bytes of KV per token:
    ``kv_bytes_in_use``, ``kv_bytes_capacity``, ``kv_blocks_in_use``, ``kv_blocks_total``,
    ``sessions_held``, ``prefix_cache_blocks``."""
    return {
        "kv_bytes_in_use": kv.pool.num_used * kv.block_size * token_bytes,
        "kv_bytes_capacity": kv.num_blocks * kv.block_size * token_bytes,
        "kv_blocks_in_use": kv.pool.num_used,
        "kv_blocks_total": kv.num_blocks,
        "sessions_held": len(kv.sessions),
        "prefix_cache_blocks": len(kv.prefix),
    }
