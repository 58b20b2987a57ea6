"""Admission: whether the rollout orchestrator may start another group now, and on which task.

The orchestrator's producer asks ``GroupAdmission.can_start`` before each group and takes
the group's task index from ``start_group``; every way a group ends comes back here
(``release_group``, ``filter``, ``retry_later`` / ``requeue``, ``trained``), so the data
position, the pending indices and the ledger of trained and filtered ones (the exactly-once
accounting that ``state()`` saves) all live in one place.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import random
import time
from typing import Any, Callable, Iterable

from raytunix.rollout.concurrency import ConcurrencyController, EngineLoad, EngineLoadMeter
from raytunix.rollout.faults import Backoff, RateLimitedLog
from raytunix.rollout.ledger import TaskLedger
from raytunix.types import EngineFailure

logger = logging.getLogger(__name__)


class GroupAdmission:
    """Decides when the next group starts and which task index it runs.

    Owns: the episode budget (``max_concurrent_episodes``, moved during the run by an
    optional ``ConcurrencyController``) and the episodes in flight; the staleness window
    (the rule below, from the policy versions); the retry queue, the failures of each task
    index and the cooldown after a failed group; the data position (``next_index``), the
    pending indices (handed out, not yet trained or filtered) and the ``TaskLedger``.

    Args:
      group_size, groups_per_batch, max_concurrent_episodes, max_staleness: see
        ``raytunix.config.RolloutConfig``.
      max_group_retries: a group whose engine stayed down (or whose every member failed by
        infrastructure) is retried this many times, waiting ``retry_backoff`` between
        tries, then its task is filtered (``groups_filtered_engine_error``, ...).
      retry_backoff: delays between the retries of a group.
      concurrency: a controller that moves ``max_concurrent_episodes`` (the start value)
        from the engine's busy fraction (``update_budget``); None keeps it fixed.
      concurrency_interval_s: seconds between two engine stats readings of the controller.
      policy_version: the version the engine holds at start (``v0`` below).
      seed: seeds the jitter of group retries.
      counters: where ``groups_started``, ``groups_retried_<reason>``,
        ``groups_filtered_<reason>`` and ``groups_trained`` are counted (the recorder's).
      wake: called whenever the answer of ``can_start`` may have changed (the producer
        waits for it).
      state: the orchestrator's ``state()`` to resume from (``next_index``, ``pending``,
        ``ledger``), or None.

    Admission rule: with ``v0`` the version at start and ``v`` now, a new group starts
    only if ``groups_started - groups_dropped < (v - v0 + max_staleness + 1) *
    groups_per_batch``, the episode budget has room and the batch queue is not full
    (backpressure: a stalled learner stops the producer). A resumed orchestrator starts
    with ``v0`` = the version it is given, so the rule holds across a checkpoint and
    restore.

    Raises:
      ValueError: a controller that does not start at ``max_concurrent_episodes``, or a
        ``concurrency_interval_s`` that is not > 0.
      raytunix.rollout.ledger.LedgerError: a ``state`` whose ledger disagrees with its
        data position or pending indices.
    """

    def __init__(
        self,
        *,
        group_size: int,
        groups_per_batch: int,
        max_concurrent_episodes: int,
        max_staleness: int,
        max_group_retries: int,
        retry_backoff: Backoff,
        concurrency: ConcurrencyController | None,
        concurrency_interval_s: float,
        policy_version: int,
        seed: int,
        counters: collections.Counter,
        wake: Callable[[], None],
        state: dict[str, Any] | None = None,
    ):
        if concurrency is not None and concurrency.budget != max_concurrent_episodes:
            raise ValueError(
                f"RolloutOrchestrator: the concurrency controller starts at {concurrency.budget} "
                f"episodes but max_concurrent_episodes={max_concurrent_episodes}; build the "
                "controller with initial=max_concurrent_episodes."
            )
        if not concurrency_interval_s > 0:
            raise ValueError(
                f"RolloutOrchestrator: concurrency_interval_s="
                f"{concurrency_interval_s!r} must be > 0 seconds."
            )
        self.group_size = group_size
        self.groups_per_batch = groups_per_batch
        self.max_concurrent_episodes = max_concurrent_episodes
        self.max_staleness = max_staleness
        self.max_group_retries = max_group_retries
        self.retry_backoff = retry_backoff
        self.concurrency = concurrency
        self.concurrency_interval_s = concurrency_interval_s
        self.version0 = policy_version
        self.version = policy_version
        self.counters = counters
        self._wake = wake
        self._rng = random.Random(seed)  # jitter of group retries
        self._log = RateLimitedLog(logger)
        self._budget_binding = False  # the budget alone held a group back since the last reading
        self._backlogged = False  # the batch queue was full since the last reading
        self._cooldown_until = 0.0  # monotonic time before which no new group starts

        state = state or {}
        self.next_index = int(state.get("next_index", 0))
        self._retry = collections.deque(int(i) for i in state.get("pending", []))
        self.ledger = TaskLedger.from_json(state.get("ledger"))
        if "ledger" in state:  # a state saved before the ledger existed has nothing to check
            self.ledger.check(self.next_index, self._retry)
        self.pending: set[int] = set()  # handed out, not yet trained or filtered
        self._failures: collections.Counter = collections.Counter()  # failed tries per index
        self.groups_started = 0
        self.groups_dropped = 0
        self.in_flight_episodes = 0

    def can_start(self, backlog: bool) -> bool:
        """Whether a new group may start now (the admission rule); ``backlog``: the batch
        queue is full (the learner is behind)."""
        room = self.in_flight_episodes == 0 or (
            self.in_flight_episodes + self.group_size <= self.max_concurrent_episodes
        )
        allowed = (self.version - self.version0 + self.max_staleness + 1) * self.groups_per_batch
        fresh = self.groups_started - self.groups_dropped < allowed
        # For the concurrency controller: raising the budget only helps when it alone holds
        # a group back; behind a full queue or the staleness rule it would only wind up.
        if backlog:
            self._backlogged = True
        elif not room and fresh:
            self._budget_binding = True
        return room and not backlog and fresh

    def cooldown_s(self) -> float:
        """Seconds before a new group may start after a failed one (<= 0: none to wait)."""
        return self._cooldown_until - time.monotonic()

    def start_group(self) -> int:
        """Hands out the next task index (a retried one first) and counts its group's
        episodes in flight at once: the producer starts groups without yielding, so a
        count taken later would let every admissible group in at once."""
        if self._retry:
            index = self._retry.popleft()
        else:
            index, self.next_index = self.next_index, self.next_index + 1
        self.pending.add(index)
        self.in_flight_episodes += self.group_size
        self.groups_started += 1
        self.counters["groups_started"] += 1
        return index

    def release_group(self) -> None:
        """A group's episodes ended (however): their budget is free again."""
        self.in_flight_episodes -= self.group_size
        self._wake()

    def succeeded(self, index: int) -> None:
        """The group of ``index`` made data: its failed tries are forgotten."""
        self._failures.pop(index, None)

    def filter(self, index: int, reason: str) -> None:
        """Settles ``index`` as filtered for ``reason`` (``groups_filtered_<reason>``)."""
        self.ledger.record_filtered(index, reason)
        self.pending.discard(index)
        self.groups_dropped += 1
        self.counters[f"groups_filtered_{reason}"] += 1
        self._wake()

    def retry_later(self, index: int, reason: str, cause: Any) -> float | None:
        """The group of ``index`` made no data (``reason``, ``cause`` for the log). Returns
        the seconds to wait before ``requeue(index)`` (no new group starts meanwhile), or
        None once it failed ``max_group_retries + 1`` times: then the task is filtered."""
        self._failures[index] += 1
        failures = self._failures[index]
        if failures > self.max_group_retries:
            self._failures.pop(index, None)
            logger.error(
                "group g%d failed %d times (last: %s); task index %d is filtered",
                index,
                failures,
                cause,
                index,
            )
            self.filter(index, reason)
            return None
        self.counters[f"groups_retried_{reason}"] += 1
        self.groups_dropped += 1  # this try is over; the retry is a new group
        self._wake()
        delay = self.retry_backoff.delay_s(failures - 1, self._rng)
        self._cooldown_until = max(self._cooldown_until, time.monotonic() + delay)
        self._log.log(
            logging.WARNING,
            f"group_retry_{reason}",
            "group g%d failed (%s: %s); task index %d is retried in %.1f s",
            index,
            reason,
            cause,
            index,
            delay,
        )
        return delay

    def requeue(self, index: int) -> None:
        """After ``retry_later``'s wait: ``index`` is the next task handed out. It stayed
        pending until now, so a checkpoint taken meanwhile keeps the task."""
        self.pending.discard(index)
        self._retry.append(index)
        self._wake()

    def trained(self, indices: Iterable[int]) -> None:
        """The learner trained on the groups of ``indices``: they are settled."""
        for index in indices:
            self.ledger.record_trained(index)
            self.pending.discard(index)
            self.counters["groups_trained"] += 1

    def set_version(self, policy_version: int) -> None:
        """The engine now holds ``policy_version``: the staleness window moves."""
        self.version = policy_version
        self._wake()

    def check_engine(self, engine: Any) -> None:
        """Raises TypeError when the controller is on and ``engine`` cannot report its
        load (no ``engine_stats``), naming the fix."""
        if self.concurrency is not None and not callable(getattr(engine, "engine_stats", None)):
            raise TypeError(
                f"adaptive concurrency reads the engine's load, but the engine client "
                f"{type(engine).__name__} has no engine_stats(); give it one "
                "(see RayEngineClient) or turn it off (rollout.adaptive_concurrency=false)."
            )

    async def control_budget(
        self,
        engine: Any,
        can_start: Callable[[], bool],
        halt: Callable[[BaseException], None],
    ) -> None:
        """Runs the concurrency controller: every ``concurrency_interval_s`` reads the
        engine's stats (``await engine.engine_stats()``, one ``InferenceEngine.stats()``
        per replica) and moves the budget (``update_budget``). An engine that cannot
        answer leaves the budget as it is; a bug in the stats path is handed to ``halt``,
        which ends the loop. ``can_start`` is the orchestrator's full admission check.
        ``check_engine(engine)`` first."""
        meter = EngineLoadMeter()
        while True:
            await asyncio.sleep(self.concurrency_interval_s)
            try:
                replicas = await asyncio.wait_for(
                    engine.engine_stats(), timeout=10 * self.concurrency_interval_s
                )
            except (EngineFailure, ConnectionError, TimeoutError) as error:
                self._log.log(
                    logging.WARNING,
                    "engine_stats",
                    "adaptive concurrency: no engine stats (%r); the budget holds",
                    error,
                )
                continue
            except Exception as error:  # noqa: BLE001 - a bug: stop the run, do not hide it
                halt(error)
                return
            load = meter.update(replicas)
            can_start()  # counts a budget that binds right now, too
            self.update_budget(load)

    def update_budget(self, load: EngineLoad | None) -> None:
        """One reading of the engine's load (None: no reading this time): the controller
        moves ``max_concurrent_episodes``, raising it only if the budget alone held groups
        back since the last reading and the engine and the batch queue took more."""
        limit_reached, self._budget_binding = self._budget_binding, False
        backlog, self._backlogged = self._backlogged, False
        if load is None or self.concurrency is None:
            return
        self.max_concurrent_episodes = self.concurrency.update(
            load.busy_fraction,
            limit_reached=limit_reached,
            backpressure=load.saturated or backlog,
        )
        self._wake()

    def concurrency_info(self) -> dict[str, Any]:
        """The episode budget now and the controller's last engine reading (absent until
        it has one: a -1 stand-in read as a busy fraction in every metrics sink)."""
        info: dict[str, Any] = {"max_concurrent_episodes": self.max_concurrent_episodes}
        if self.concurrency is not None:
            busy = self.concurrency.last_busy_fraction
            if busy is not None:
                info["engine_busy_fraction_last_window"] = busy
            info["concurrency_changes"] = self.concurrency.changes
        return info

    def state(self) -> dict[str, Any]:
        """The JSON-able part of the resume state admission owns: ``next_index``,
        ``ledger`` and ``pending`` (handed out and not settled, retries included)."""
        return {
            "next_index": self.next_index,
            "ledger": self.ledger.to_json(),
            "pending": sorted(self.pending | set(self._retry)),
        }
