"""The rollout orchestrator: many episodes in flight, finished groups out as Arrow batches.

Episodes run as asyncio coroutines, so while one waits for a tool the engine keeps
decoding the others. The G episodes of one task form a group; every ``groups_per_batch``
finished groups are packed into one Arrow record batch, put into the object store by this
process (so it owns the data) and queued for the learner in a bounded queue.

Staleness control (see ``RolloutOrchestrator`` for the exact rules): a group is only
started when the batch it will land in is consumed at most ``max_staleness`` policy versions
after the version running now; a group that would still be too stale when packed is dropped
and counted.

Exactly-once accounting: every task index handed out is either trained on (its batch was
consumed by an update), filtered with a counted reason, or still pending; ``state()``
records the pending ones so that a resumed run starts them again.

Failures, by kind:

* an engine outage: each call is retried with backoff inside the episode; if the engine
  stays down the whole group is retried later (backoff again; no new group starts
  meanwhile), and only after ``max_group_retries`` is its task filtered. A short outage
  costs time, not tasks.
* an env actor that dies: the episode is re-run on a live actor, up to
  ``max_episode_restarts`` times; then it ends as ``env_error``.
* an infrastructure failure in a trajectory (env error, timeout, abort): the trajectory
  keeps its tokens with a zero loss mask and is left out of the group's statistics; a
  group with no valid member is retried like an engine failure. A failure the policy
  caused (``tool_error_limit``) is the policy's outcome and is trained on.
* no environment left, or ``max_consecutive_failures`` episodes failed in a row: the run
  cannot make data, so ``next_batch`` raises ``RolloutHalted`` once (the breaker) instead
  of producing batches of failures. A bug (any other exception from agent, parser or
  client code) is raised from ``next_batch`` too, never retried as an engine failure.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import random
import time
from typing import Any, Callable, Sequence

import numpy as np

from raytunix.rollout.batch import trajectories_to_record_batch
from raytunix.rollout.episode import run_episode
from raytunix.rollout.faults import Backoff, FailureBreaker, RateLimitedLog
from raytunix.types import (
    TOOL_ERRORS_KEY,
    EngineClient,
    EngineFailure,
    EnvClient,
    EpisodeStatus,
    RolloutHalted,
    SamplingParams,
    Task,
    Trajectory,
    is_infrastructure_failure,
)

logger = logging.getLogger(__name__)

# (env client, release callback) for one episode of one group.
EnvProvider = Callable[[str], tuple[EnvClient, Callable[[], None]]]


class RolloutOrchestrator:
    """Runs GRPO groups concurrently and emits trajectory batches.

    Args:
      tasks: the training tasks; task index i is ``tasks[i % len(tasks)]``.
      agent_factory: builds a fresh agent for one episode.
      engine: where generations come from.
      env_provider: gives each episode its environment.
      put: stores a record batch and returns a handle for the learner (``ray.put`` in an
        actor; identity in tests).
      group_size, groups_per_batch, max_concurrent_episodes, max_staleness, max_turns,
      max_context_tokens, sampling, episode_timeout_s, batch_queue_size,
      drop_failed_groups: see ``raytunix.config.RolloutConfig`` / ``EnvConfig``.
      max_group_retries: a group whose engine stayed down (or whose every member failed
        by infrastructure) is retried this many times, waiting ``retry_backoff`` between
        tries, then its task is filtered (``groups_filtered_engine_error``,
        ``groups_filtered_env_error``, ...).
      engine_backoff: retry schedule of one engine call inside an episode.
      retry_backoff: delays between retries of a group and re-runs of an episode.
      max_episode_restarts: an episode whose env actor died is re-run this many times.
      max_consecutive_failures: the breaker: after this many episodes in a row failed by
        infrastructure (engine down, env error, timeout), ``next_batch`` raises
        ``RolloutHalted``; 0 turns it off.
      seed: base seed; sample j of task index i uses its own seed.
      policy_version: the version the engine holds now.
      state: a dict from ``state()`` to resume from (data position, pending tasks).

    Admission rule: with ``v0`` the version at start and ``v`` now, a new group starts
    only if ``groups_started - groups_dropped < (v - v0 + max_staleness + 1) *
    groups_per_batch``, the episode budget has room and the batch queue is not full
    (backpressure: a stalled learner stops the producer). Packing rule: batch k (counted
    from 0 since start) is consumed at version ``v0 + k``; a group whose oldest generated
    token is older than ``v0 + k - max_staleness`` is dropped as stale.
    """

    def __init__(
        self,
        *,
        tasks: Sequence[Task],
        agent_factory: Callable[[], Any],
        engine: EngineClient,
        env_provider: EnvProvider,
        put: Callable[[Any], Any] = lambda x: x,
        group_size: int,
        groups_per_batch: int,
        max_concurrent_episodes: int,
        max_staleness: int,
        max_turns: int,
        max_context_tokens: int,
        sampling: SamplingParams,
        episode_timeout_s: float = 120.0,
        batch_queue_size: int = 2,
        drop_failed_groups: bool = False,
        max_group_retries: int = 3,
        engine_backoff: Backoff = Backoff(),
        retry_backoff: Backoff = Backoff(initial_delay_s=0.5, max_delay_s=30.0),
        max_episode_restarts: int = 2,
        max_consecutive_failures: int = 256,
        seed: int = 0,
        policy_version: int = 0,
        state: dict[str, Any] | None = None,
    ):
        if not tasks:
            raise ValueError("RolloutOrchestrator got no tasks; give it a non-empty dataset.")
        self._tasks = list(tasks)
        self._agent_factory = agent_factory
        self._engine = engine
        self._env_provider = env_provider
        self._put = put
        self.group_size = group_size
        self.groups_per_batch = groups_per_batch
        self.max_concurrent_episodes = max_concurrent_episodes
        self.max_staleness = max_staleness
        self.max_turns = max_turns
        self.max_context_tokens = max_context_tokens
        self.sampling = sampling
        self.episode_timeout_s = episode_timeout_s
        self.drop_failed_groups = drop_failed_groups
        self.max_group_retries = max_group_retries
        self.engine_backoff = engine_backoff
        self.retry_backoff = retry_backoff
        self.max_episode_restarts = max_episode_restarts
        self.seed = seed
        self._breaker = FailureBreaker(max_consecutive_failures)
        self._rng = random.Random(seed)  # jitter of group retries
        self._log = RateLimitedLog(logger)
        self._halt_error: BaseException | None = None
        self._cooldown_until = 0.0  # monotonic time before which no new group starts
        self._halted: asyncio.Event | None = None

        self._version0 = policy_version
        self._version = policy_version
        state = state or {}
        self._next_index = int(state.get("next_index", 0))
        self._retry = collections.deque(int(i) for i in state.get("pending", []))
        self.counters: collections.Counter = collections.Counter(state.get("counters", {}))
        self._pending: set[int] = set()  # handed out, not yet trained or filtered
        self._failures: collections.Counter = collections.Counter()  # engine errors per task index
        self._batch_members: dict[int, list[int]] = {}  # batch id -> task indices
        self._groups_started = 0
        self._groups_dropped = 0
        self._batches_formed = 0
        self._in_flight_episodes = 0
        self._finished: list[tuple[int, list[Trajectory]]] = []
        self._queue: asyncio.Queue | None = None
        self._queue_size = batch_queue_size
        self._wake: asyncio.Event | None = None
        self._pack_lock: asyncio.Lock | None = None
        self._producer: asyncio.Task | None = None
        self._group_tasks: set[asyncio.Task] = set()
        self._created = time.monotonic()

    # ----------------------------------------------------------------- producer side
    def _can_start_group(self) -> bool:
        if self._halt_error is not None:
            return False
        room = self._in_flight_episodes == 0 or (
            self._in_flight_episodes + self.group_size <= self.max_concurrent_episodes)
        allowed = (self._version - self._version0 + self.max_staleness + 1) * self.groups_per_batch
        backlog = self._queue is not None and self._queue.full()  # the learner is behind
        return room and not backlog and self._groups_started - self._groups_dropped < allowed

    def _take_index(self) -> int:
        if self._retry:
            return self._retry.popleft()
        index, self._next_index = self._next_index, self._next_index + 1
        return index

    async def _produce(self) -> None:
        while True:
            while not self._can_start_group():
                self._wake.clear()
                await self._wake.wait()
            pause_s = self._cooldown_until - time.monotonic()
            if pause_s > 0:  # a group just failed for want of an engine or env: do not
                await asyncio.sleep(pause_s)  # spin through the dataset meanwhile
                continue
            index = self._take_index()
            self._pending.add(index)
            # Counted here, not when the task first runs: this loop starts groups without
            # yielding, so a count taken later would let every admissible group in at once.
            self._in_flight_episodes += self.group_size
            self._groups_started += 1
            self.counters["groups_started"] += 1
            task = asyncio.create_task(self._run_group(index))
            self._group_tasks.add(task)
            task.add_done_callback(self._group_tasks.discard)

    async def _run_group(self, index: int) -> None:
        task = self._tasks[index % len(self._tasks)]
        group_id = f"g{index}"
        try:
            # A TaskGroup (unlike gather) cancels and awaits the other episodes when one
            # raises, so none keeps running, unbudgeted, after the group is given up.
            async with asyncio.TaskGroup() as episodes:
                runs = [episodes.create_task(self._episode(
                    task, group_id, self.sampling,
                    seed=(self.seed * 1_000_003 + index * self.group_size + j) % 2**31))
                    for j in range(self.group_size)]
            trajectories = [run.result() for run in runs]
        except asyncio.CancelledError:
            self._release_group()
            raise
        except Exception as error:  # noqa: BLE001 - sorted by kind below; cancellation passes
            self._release_group()
            errors = list(error.exceptions) if isinstance(error, BaseExceptionGroup) else [error]
            fatal = next((e for e in errors if not isinstance(e, EngineFailure)), None)
            if fatal is not None:  # a bug, or the rollout cannot go on: stop, do not retry
                self._halt(fatal)
                return
            for _ in range(self.group_size):
                self._record_episode(ok=False, failure=f"engine: {errors[0]}")
            await self._retry_or_filter(index, "engine_error", errors[0])
            return
        self._release_group()
        for t in trajectories:
            self._count_episode(t)
        infra_failed = [t for t in trajectories if is_infrastructure_failure(t.status)]
        if len(infra_failed) == len(trajectories):  # nothing to learn from: try again later
            await self._retry_or_filter(index, infra_failed[0].status.value,
                                        f"every episode ended as {infra_failed[0].status.value}")
            return
        self._failures.pop(index, None)
        if infra_failed and self.drop_failed_groups:
            self._drop(index, "failed_episode")
            return
        for t in infra_failed:  # keep the group's shape; the failed member teaches nothing
            t.loss_mask = [0] * len(t.loss_mask)
        self._finished.append((index, list(trajectories)))
        await self._pack_ready_batches()

    def _release_group(self) -> None:
        self._in_flight_episodes -= self.group_size
        self._wake.set()

    def _count_episode(self, t: Trajectory) -> None:
        self.counters[f"episodes_{t.status.value}"] += 1
        self.counters["tool_errors"] += int(t.metrics.get(TOOL_ERRORS_KEY, 0))
        for key, value in t.metrics.items():
            if key.startswith(f"{TOOL_ERRORS_KEY}/"):
                self.counters[f"tool_errors_{key.split('/', 1)[1]}"] += int(value)
        self.counters["engine_retries"] += int(t.metrics.get("engine_retries", 0))
        failed = is_infrastructure_failure(t.status)
        if failed:
            self.counters["episodes_failed_infrastructure"] += 1
        elif t.status == EpisodeStatus.TOOL_ERROR_LIMIT:
            self.counters["episodes_failed_policy"] += 1
        self._record_episode(ok=not failed, failure=f"episode ended as {t.status.value}")

    def _record_episode(self, ok: bool, failure: str) -> None:
        if self._breaker.record(ok, failure) and self._halt_error is None:
            self._halt(RolloutHalted(
                f"{self._breaker.consecutive} episodes in a row failed by infrastructure (last: "
                f"{failure}); the engine or the environments look down for good. The run stops "
                "here; checkpoints and the data ledger are kept. Fix the cause and resume, or "
                "raise the breaker's threshold (max_consecutive_failures)."))

    async def _retry_or_filter(self, index: int, reason: str, cause: Any) -> None:
        """The group made no data: its task goes back in the queue after a backoff, or is
        filtered once it has failed ``max_group_retries + 1`` times."""
        self._failures[index] += 1
        failures = self._failures[index]
        if failures > self.max_group_retries:
            self._failures.pop(index, None)
            logger.error("group g%d failed %d times (last: %s); task index %d is filtered",
                         index, failures, cause, index)
            self._drop(index, reason)
            return
        self.counters[f"groups_retried_{reason}"] += 1
        self._groups_dropped += 1  # this try is over; the retry is a new group
        self._wake.set()
        delay = self.retry_backoff.delay_s(failures - 1, self._rng)
        self._cooldown_until = max(self._cooldown_until, time.monotonic() + delay)
        self._log.log(logging.WARNING, f"group_retry_{reason}",
                      "group g%d failed (%s: %s); task index %d is retried in %.1f s",
                      index, reason, cause, index, delay)
        await asyncio.sleep(delay)  # still pending meanwhile: a checkpoint keeps the task
        self._pending.discard(index)
        self._retry.append(index)
        self._wake.set()

    def _halt(self, error: BaseException) -> None:
        if self._halt_error is None:
            self._halt_error = error
            logger.error("rollout halted: %r", error)
        self._halted.set()
        self._wake.set()

    async def _episode(self, task: Task, group_id: str, sampling: SamplingParams, seed: int) -> Trajectory:
        """One episode; re-run on a fresh environment (after a backoff) while its env actor
        died under it, up to ``max_episode_restarts`` times."""
        rng = random.Random(seed)
        for attempt in range(self.max_episode_restarts + 1):
            env, release = self._env_provider(group_id)
            try:
                trajectory = await run_episode(
                    task, group_id, self._agent_factory(), env, self._engine, sampling,
                    max_turns=self.max_turns, max_context_tokens=self.max_context_tokens,
                    seed=seed, timeout_s=self.episode_timeout_s,
                    engine_backoff=self.engine_backoff)
            finally:
                release()
            if not trajectory.metrics.get("env_failure_retryable") or attempt == self.max_episode_restarts:
                return trajectory
            self.counters["episodes_restarted_env_error"] += 1
            await asyncio.sleep(self.retry_backoff.delay_s(attempt, rng))
        raise AssertionError("unreachable: the last attempt returns")

    def _drop(self, index: int, reason: str) -> None:
        self._pending.discard(index)
        self._groups_dropped += 1
        self.counters[f"groups_filtered_{reason}"] += 1
        self._wake.set()

    async def _pack_ready_batches(self) -> None:
        # One packer at a time: a coroutine waiting in queue.put can be overtaken by a later
        # put, and batch k must reach the learner k-th (it is checked against version v0 + k).
        async with self._pack_lock:
            await self._pack_ready_batches_locked()

    async def _pack_ready_batches_locked(self) -> None:
        while len(self._finished) >= self.groups_per_batch:
            consume_version = self._version0 + self._batches_formed
            fresh = []
            for index, group in self._finished:
                versions = [v for t in group for v, m in zip(t.policy_versions, t.loss_mask) if m]
                if versions and min(versions) < consume_version - self.max_staleness:
                    self._drop(index, "stale")
                else:
                    fresh.append((index, group))
            self._finished = fresh
            if len(fresh) < self.groups_per_batch:
                return
            chosen, self._finished = fresh[: self.groups_per_batch], fresh[self.groups_per_batch:]
            batch_id = self._batches_formed
            self._batches_formed += 1
            trajectories = [t for _, group in chosen for t in group]
            self._batch_members[batch_id] = [index for index, _ in chosen]
            record_batch = trajectories_to_record_batch(trajectories)
            info = self._batch_info(batch_id, consume_version, trajectories)
            await self._queue.put((self._put(record_batch), info))

    def _batch_info(self, batch_id: int, consume_version: int, trajectories: list[Trajectory]) -> dict:
        rewards = np.array([t.reward for t in trajectories], np.float32)
        statuses = collections.Counter(t.status.value for t in trajectories)
        infra_failed = sum(is_infrastructure_failure(t.status) for t in trajectories)
        staleness = [consume_version - v for t in trajectories
                     for v, m in zip(t.policy_versions, t.loss_mask) if m]
        used_tool = [t.metrics.get("tool_calls", 0) > 0 for t in trajectories]
        return {
            "batch_id": batch_id,
            "consume_version": consume_version,
            "num_trajectories": len(trajectories),
            "reward_mean": float(rewards.mean()),
            "tool_use_rate": float(np.mean(used_tool)),
            "turns_mean": float(np.mean([t.num_turns for t in trajectories])),
            "generated_tokens_mean": float(np.mean([t.metrics.get("generated_tokens", 0.0) for t in trajectories])),
            "episode_generate_s_mean": float(np.mean([t.metrics.get("generate_s", 0.0) for t in trajectories])),
            "episode_env_s_mean": float(np.mean([t.metrics.get("env_s", 0.0) for t in trajectories])),
            "staleness_max": int(max(staleness, default=0)),
            "staleness_mean": float(np.mean(staleness)) if staleness else 0.0,
            "valid_trajectories": len(trajectories) - infra_failed,
            "tool_errors_mean": float(np.mean([t.metrics.get(TOOL_ERRORS_KEY, 0.0) for t in trajectories])),
            "statuses": dict(statuses),
        }

    # ----------------------------------------------------------------- learner side
    def start(self) -> None:
        """Starts producing on the running event loop (idempotent)."""
        if self._producer is None:
            self._queue = asyncio.Queue(maxsize=self._queue_size)
            self._wake = asyncio.Event()
            self._halted = asyncio.Event()
            self._pack_lock = asyncio.Lock()
            self._producer = asyncio.create_task(self._produce())

    async def next_batch(self) -> tuple[list[Any], dict]:
        """Waits for the next batch; returns ``([handle], info)``.

        The handle is wrapped in a list so that Ray passes the object reference on instead
        of resolving it in this actor.

        Raises:
          RolloutHalted: the breaker tripped or no environment can run (the message says
            which); no more batches will come.
          Exception: a bug in agent, parser or client code, as it was raised.
        """
        self.start()
        getter = asyncio.ensure_future(self._queue.get())
        halted = asyncio.ensure_future(self._halted.wait())
        try:
            await asyncio.wait({getter, halted}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            halted.cancel()
            if not getter.done():
                getter.cancel()
        if not getter.done() or getter.cancelled():
            raise self._halt_error
        handle, info = getter.result()
        self._wake.set()  # the queue has room again
        info["queue_depth"] = self._queue.qsize()
        info["episodes_in_flight"] = self._in_flight_episodes
        return [handle], info

    def mark_trained(self, batch_id: int, policy_version: int) -> None:
        """The learner finished the update on ``batch_id``; the engine now runs
        ``policy_version``. Its tasks leave the pending set; admission opens."""
        for index in self._batch_members.pop(batch_id, []):
            self._pending.discard(index)
            self.counters["groups_trained"] += 1
        self.set_policy_version(policy_version)

    def set_policy_version(self, policy_version: int) -> None:
        self._version = policy_version
        if self._wake is not None:
            self._wake.set()

    def state(self) -> dict[str, Any]:
        """JSON-able resume state: data position, tasks to redo, counters."""
        return {
            "next_index": self._next_index,
            "pending": sorted(self._pending | set(self._retry)),
            "counters": dict(self.counters),
        }

    def stats(self) -> dict[str, Any]:
        return {
            "episodes_in_flight": self._in_flight_episodes,
            "groups_started": self._groups_started,
            "groups_dropped": self._groups_dropped,
            "batches_formed": self._batches_formed,
            "queue_depth": self._queue.qsize() if self._queue else 0,
            "counters": dict(self.counters),
            "uptime_s": time.monotonic() - self._created,
        }

    async def stop(self) -> None:
        """Cancels the producer and every in-flight episode (their tasks stay pending)."""
        if self._producer is not None:
            self._producer.cancel()
        for task in list(self._group_tasks):
            task.cancel()
        await asyncio.gather(*self._group_tasks, return_exceptions=True)
        self._producer = None

    # ----------------------------------------------------------------- evaluation
    async def evaluate(self, tasks: Sequence[Task], max_new_tokens: int,
                       max_concurrent: int | None = None) -> dict[str, Any]:
        """Greedy episodes on ``tasks`` (one each); returns success and tool-use rates.

        ``tool_path_accuracy`` is the success rate among episodes that called a tool.
        """
        sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0,
                                  stop_token_ids=self.sampling.stop_token_ids,
                                  stop_strings=self.sampling.stop_strings)
        limit = asyncio.Semaphore(max_concurrent or self.max_concurrent_episodes)

        async def one(i: int, task: Task) -> Trajectory:
            async with limit:
                return await self._episode(task, f"eval{i}", sampling, seed=i)

        trajectories = await asyncio.gather(*[one(i, t) for i, t in enumerate(tasks)])
        success = np.array([t.reward >= 1.0 for t in trajectories])
        used_tool = np.array([t.metrics.get("tool_calls", 0) > 0 for t in trajectories])
        return {
            "num_tasks": len(tasks),
            "success_rate": float(success.mean()),
            "tool_use_rate": float(used_tool.mean()),
            "tool_path_accuracy": float(success[used_tool].mean()) if used_tool.any() else 0.0,
            "direct_accuracy": float(success[~used_tool].mean()) if (~used_tool).any() else 0.0,
            "statuses": dict(collections.Counter(t.status.value for t in trajectories)),
        }
