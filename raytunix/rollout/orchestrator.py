"""The rollout orchestrator: many episodes in flight, finished groups out as Arrow batches.

Episodes run as asyncio coroutines, so while one waits for a tool the engine keeps
decoding the others. The G episodes of one task form a group; every ``groups_per_batch``
finished groups are packed into one Arrow record batch, put into the object store by this
process (so it owns the data) and queued for the learner in a bounded queue.

Staleness control (see ``RolloutOrchestrator`` for the exact rules): a group is only
started when the batch it will land in is consumed at most ``max_staleness`` policy versions
after the version running now; a group that still holds tokens too old when packed is
dropped, has those tokens masked out of the loss, or is kept (``stale_token_policy``),
counted each way. Episodes run on across weight updates (partial rollouts), or, with
``partial_rollout=False``, an episode that saw an update restarts from its prompt.

Exactly-once accounting: every task index handed out is either trained on (its batch was
consumed by an update), filtered with a counted reason, or still pending. ``state()``
records the ledger of trained and filtered indices (``raytunix.rollout.ledger``) and the
pending ones, so that a resumed run starts the pending ones again and never settles a
task twice. A batch holds its groups in task order, not in the order they finished, so
the same seed gives the same batches row for row.

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

Adaptive concurrency (``concurrency``): the episode budget ``max_concurrent_episodes`` is
not fixed; every ``concurrency_interval_s`` the engine's stats are read and a
``ConcurrencyController`` (``raytunix.rollout.concurrency``) moves the budget to hold the
engine's busy fraction near a target. The admission rules above still apply on top.

Dynamic sampling (``dynamic_sampling``, DAPO): a group whose valid members all got the
same reward is filtered (``groups_filtered_zero_variance``) and another task is started in
its place, so batches still fill with groups that carry a learning signal.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import random
import time
from typing import Any, Callable, Sequence, get_args

import numpy as np

from raytunix.config import StaleTokenPolicy
from raytunix import profiling
from raytunix.envs.contract import EnvErrorTally
from raytunix.rollout.batch import episode_rows, trajectories_to_record_batch
from raytunix.rollout.concurrency import ConcurrencyController, EngineLoadMeter
from raytunix.rollout.episode import run_episode
from raytunix.rollout.faults import Backoff, FailureBreaker, RateLimitedLog
from raytunix.rollout.ledger import TaskLedger
from raytunix.samples import batch_samples
from raytunix.types import (
    TOOL_ERRORS_KEY,
    EngineClient,
    EngineFailure,
    EnvClient,
    EpisodeStatus,
    RolloutHalted,
    SamplingParams,
    Task,
    ToolErrorKind,
    Trajectory,
    is_infrastructure_failure,
)

logger = logging.getLogger(__name__)

# (env client, release callback) for one episode of one group.
EnvProvider = Callable[[str], tuple[EnvClient, Callable[[], None]]]

STALE_TOKEN_POLICIES: tuple[str, ...] = get_args(StaleTokenPolicy)  # rollout.stale_token_policy

DROPPED_TOKEN_KINDS = (
    "failed_env_error",
    "failed_timeout",
    "failed_aborted",  # loss mask zeroed, by status
    "group_failed",  # a group whose every member failed, retried or filtered
    "failed_group_dropped",  # drop_failed_groups: a group with a failed member
    "zero_variance",  # dynamic sampling filtered the group
    "stale_group",  # stale_token_policy=drop
    "stale_masked",  # stale_token_policy=mask
    "restarted_env_failure",  # the episode's env actor died: it runs again
    "restarted_weight_update",  # partial_rollout=False: restarted from its prompt
)
"""Why generated tokens did not reach a batch's loss; each is the batch info's (and the
step's) ``generated_tokens_dropped_<kind>``, counted since the batch before."""


class WeightUpdated(Exception):
    """Raised inside an episode that must be generated by one policy version
    (``partial_rollout=False``) once the weights changed under it; the orchestrator
    restarts the episode from its prompt."""


class _OneVersionEngine:
    """The engine, for one episode whose generated tokens must share one policy version.

    ``generate`` raises ``WeightUpdated`` when a result holds a token of another version
    than the episode's first, or, before a request is sent, once the orchestrator knows
    of a newer version (no generation is spent on tokens that would be thrown away).
    Everything else (``end_session``...) is the wrapped engine's."""

    def __init__(self, engine: EngineClient, current_version: Callable[[], int]):
        self._engine = engine
        self._current_version = current_version
        self.version: int | None = None
        self.discarded_tokens = 0  # of the result that raised WeightUpdated

    async def generate(self, request):
        if self.version is not None and self._current_version() > self.version:
            raise WeightUpdated(
                f"policy version {self._current_version()} arrived while "
                f"{request.request_id} ran on version {self.version}"
            )
        result = await self._engine.generate(request)
        versions = set(result.policy_versions)
        if self.version is None and versions:
            self.version = min(versions)
        if versions - {self.version}:
            self.discarded_tokens = len(result.token_ids)
            raise WeightUpdated(
                f"{request.request_id} holds tokens of versions {sorted(versions | {self.version})}"
            )
        return result

    def __getattr__(self, name: str):
        return getattr(self._engine, name)


def _check_arguments(
    tasks: Sequence[Task], stale_token_policy: str, max_weight_update_restarts: int
) -> None:
    """Raises ValueError for no tasks, an unknown stale-token policy or a negative restart
    limit, naming the value."""
    if not tasks:
        raise ValueError("RolloutOrchestrator got no tasks; give it a non-empty dataset.")
    if stale_token_policy not in STALE_TOKEN_POLICIES:
        raise ValueError(
            f"stale_token_policy={stale_token_policy!r} is not one of "
            f"{', '.join(STALE_TOKEN_POLICIES)}."
        )
    if max_weight_update_restarts < 0:
        raise ValueError(f"max_weight_update_restarts={max_weight_update_restarts} must be >= 0.")


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
      stale_token_policy: what packing does with a group holding generated tokens older
        than ``consume_version - max_staleness``: ``"drop"`` the group
        (``groups_filtered_stale``), ``"mask"`` those tokens out of the loss
        (``stale_tokens_masked``; a group left with no token to train on is dropped), or
        ``"accept"`` them (``stale_tokens_accepted``).
      partial_rollout: True: an episode goes on across weight updates, its tokens stamped
        with the versions that made them. False: an episode whose generated tokens would
        span two versions restarts from its prompt on a fresh environment
        (``episodes_restarted_weight_update``); after ``max_weight_update_restarts``
        restarts it runs to the end whatever the versions, so a learner faster than an
        episode cannot livelock it (``episodes_accepted_mixed_versions``).
      concurrency: a controller that moves ``max_concurrent_episodes`` (the start value)
        during the run from the engine's busy fraction; None keeps it fixed. Needs an
        engine client with ``async engine_stats() -> list[dict]`` (one
        ``InferenceEngine.stats()`` per replica), as ``RayEngineClient`` has.
      concurrency_interval_s: seconds between two engine stats readings of the controller.
      dynamic_sampling: filter groups whose valid members' rewards are all equal (DAPO).
      dynamic_sampling_max_filtered: at most this many groups are filtered while one batch
        fills; past it a zero-variance group is kept (``groups_kept_zero_variance``, a
        warning), so a run whose every group is degenerate trains on instead of sampling
        forever. 0 means ``4 * groups_per_batch``.
      seed: base seed; sample j of task index i uses its own seed.
      samples_per_step: episodes of each batch put in its info's ``samples`` for the
        sample log (``raytunix.samples``; ``run.samples_per_step``); 0 = none.
      policy_version: the version the engine holds now.
      state: a dict from ``state()`` to resume from (data position, ledger, pending tasks).

    Admission rule: with ``v0`` the version at start and ``v`` now, a new group starts
    only if ``groups_started - groups_dropped < (v - v0 + max_staleness + 1) *
    groups_per_batch``, the episode budget has room and the batch queue is not full
    (backpressure: a stalled learner stops the producer). Packing rule: batch k (counted
    from 0 since start) is consumed at version ``v0 + k``; a group whose oldest generated
    token is older than ``v0 + k - max_staleness`` is dropped, masked or accepted
    (``stale_token_policy``). A resumed orchestrator starts with ``v0`` = the version it
    is given, so the rules hold across a checkpoint and restore.
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
        stale_token_policy: str = "drop",
        partial_rollout: bool = True,
        max_weight_update_restarts: int = 2,
        concurrency: ConcurrencyController | None = None,
        concurrency_interval_s: float = 2.0,
        dynamic_sampling: bool = False,
        dynamic_sampling_max_filtered: int = 0,
        seed: int = 0,
        policy_version: int = 0,
        state: dict[str, Any] | None = None,
        samples_per_step: int = 0,
    ):
        _check_arguments(tasks, stale_token_policy, max_weight_update_restarts)
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
        self.stale_token_policy = stale_token_policy
        self.partial_rollout = partial_rollout
        self.max_weight_update_restarts = max_weight_update_restarts
        self.seed = seed
        self.samples_per_step = samples_per_step
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
        self._concurrency = concurrency
        self.concurrency_interval_s = concurrency_interval_s
        self._budget_binding = False  # the budget alone held a group back since the last reading
        self._backlogged = False  # the batch queue was full since the last reading
        self._controller: asyncio.Task | None = None
        self.dynamic_sampling = dynamic_sampling
        self.dynamic_sampling_max_filtered = dynamic_sampling_max_filtered or 4 * groups_per_batch
        self._zero_variance_batch = 0  # the batch being filled when the count below began
        self._zero_variance_filtered = 0
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
        self._env_errors = EnvErrorTally(state.get("env_errors"))
        self._dropped: collections.Counter = collections.Counter()  # since the last batch
        self._ledger = TaskLedger.from_json(state.get("ledger"))
        if "ledger" in state:  # a state saved before the ledger existed has nothing to check
            self._ledger.check(self._next_index, self._retry)
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
            self._in_flight_episodes + self.group_size <= self.max_concurrent_episodes
        )
        allowed = (self._version - self._version0 + self.max_staleness + 1) * self.groups_per_batch
        backlog = self._queue is not None and self._queue.full()  # the learner is behind
        fresh = self._groups_started - self._groups_dropped < allowed
        # For the concurrency controller: raising the budget only helps when it alone holds
        # a group back; behind a full queue or the staleness rule it would only wind up.
        if backlog:
            self._backlogged = True
        elif not room and fresh:
            self._budget_binding = True
        return room and not backlog and fresh

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
                runs = [
                    episodes.create_task(
                        self._episode(
                            task,
                            group_id,
                            self.sampling,
                            seed=(self.seed * 1_000_003 + index * self.group_size + j) % 2**31,
                        )
                    )
                    for j in range(self.group_size)
                ]
            trajectories = episode_rows([run.result() for run in runs])
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
            self._count_dropped("group_failed", trajectories)
            await self._retry_or_filter(
                index,
                infra_failed[0].status.value,
                f"every episode ended as {infra_failed[0].status.value}",
            )
            return
        self._failures.pop(index, None)
        if self.dynamic_sampling and self._filter_zero_variance(index, trajectories):
            return
        if infra_failed and self.drop_failed_groups:
            self._count_dropped("failed_group_dropped", trajectories)
            self._drop(index, "failed_episode")
            return
        for t in infra_failed:  # keep the group's shape; the failed member teaches nothing
            self._count_dropped(f"failed_{t.status.value}", [t])
            t.loss_mask = [0] * len(t.loss_mask)
        self._finished.append((index, list(trajectories)))
        await self._pack_ready_batches()

    def _filter_zero_variance(self, index: int, trajectories: list[Trajectory]) -> bool:
        """Dynamic sampling (DAPO: Yu et al. 2025, arXiv:2503.14476, section 3.2): when the
        group's valid members all got the same reward, every advantage is 0 and the group
        teaches nothing; it is filtered (counted ``groups_filtered_zero_variance``) and
        admission starts another task in its place. Returns whether it was filtered.

        Bounded: past ``dynamic_sampling_max_filtered`` filtered groups while one batch
        fills, the group is kept and counted ``groups_kept_zero_variance``, with a warning."""
        rewards = [t.reward for t in trajectories if not is_infrastructure_failure(t.status)]
        if max(rewards) != min(rewards):
            return False
        if self._zero_variance_batch != self._batches_formed:  # a new batch is filling
            self._zero_variance_batch, self._zero_variance_filtered = self._batches_formed, 0
        if self._zero_variance_filtered >= self.dynamic_sampling_max_filtered:
            self.counters["groups_kept_zero_variance"] += 1
            self._log.log(
                logging.WARNING,
                "dynamic_sampling_cap",
                "dynamic sampling: %d groups filtered while batch %d fills, all with "
                "equal rewards (last: %r); past dynamic_sampling_max_filtered such "
                "groups are kept (zero advantage) until the batch forms. Rewards that "
                "never differ within a group mean the tasks are too easy or too hard "
                "for the policy, or the reward is broken.",
                self._zero_variance_filtered,
                self._batches_formed,
                rewards[0],
            )
            return False
        self._zero_variance_filtered += 1
        self._count_dropped("zero_variance", trajectories)
        self._drop(index, "zero_variance")
        return True

    def _count_dropped(self, kind: str, trajectories: Sequence[Trajectory]) -> None:
        """Counts the generated tokens (loss mask 1) of ``trajectories`` as kept from the
        loss for ``kind`` (one of ``DROPPED_TOKEN_KINDS``)."""
        self._count_dropped_tokens(kind, sum(sum(t.loss_mask) for t in trajectories))

    def _count_dropped_tokens(self, kind: str, tokens: int) -> None:
        if tokens:
            self._dropped[kind] += int(tokens)
            self.counters[f"generated_tokens_dropped_{kind}"] += int(tokens)

    def _release_group(self) -> None:
        self._in_flight_episodes -= self.group_size
        self._wake.set()

    def _count_episode(self, t: Trajectory) -> None:
        self.counters[f"episodes_{t.status.value}"] += 1
        if t.error_report is not None:
            self._env_errors.add(t.error_report)
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
        failure = f"episode ended as {t.status.value}"
        if t.error:
            failure += f": {t.error}"
        # An env_error whose host did not die is the environment's own exception (a bug in
        # it, or in what it calls), not an outage.
        env_raised = t.status == EpisodeStatus.ENV_ERROR and not t.metrics.get(
            "env_failure_retryable"
        )
        self._record_episode(ok=not failed, failure=failure, env_raised=env_raised)

    def _record_episode(self, ok: bool, failure: str, env_raised: bool = False) -> None:
        if self._breaker.record(ok, failure) and self._halt_error is None:
            if env_raised:
                what = (
                    f"{self._breaker.consecutive} episodes in a row failed: the environment "
                    f"raised (last: {failure}). Fix the environment (or what it calls)."
                )
            else:
                what = (
                    f"{self._breaker.consecutive} episodes in a row failed by infrastructure "
                    f"(last: {failure}); the engine or the environments look down for "
                    "good. Fix the cause."
                )
            self._halt(
                RolloutHalted(
                    f"{what} The run stops here; checkpoints and the data ledger are kept. Resume "
                    "once fixed, or raise the breaker's threshold (rollout.max_consecutive_failures;"
                    " a resume may change it)."
                )
            )

    async def _retry_or_filter(self, index: int, reason: str, cause: Any) -> None:
        """The group made no data: its task goes back in the queue after a backoff, or is
        filtered once it has failed ``max_group_retries + 1`` times."""
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
            self._drop(index, reason)
            return
        self.counters[f"groups_retried_{reason}"] += 1
        self._groups_dropped += 1  # this try is over; the retry is a new group
        self._wake.set()
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

    async def _episode(
        self,
        task: Task,
        group_id: str,
        sampling: SamplingParams,
        seed: int,
        one_version: bool | None = None,
    ) -> Trajectory:
        """One episode; re-run on a fresh environment (after a backoff) while its env actor
        died under it, up to ``max_episode_restarts`` times; with ``one_version`` (default:
        ``not partial_rollout``) restarted from its prompt when the weights change under
        it, up to ``max_weight_update_restarts`` times."""
        if one_version is None:
            one_version = not self.partial_rollout
        rng = random.Random(seed)
        env_restarts = version_restarts = 0
        while True:
            restartable = one_version and version_restarts < self.max_weight_update_restarts
            engine = (
                _OneVersionEngine(self._engine, lambda: self._version)
                if restartable
                else self._engine
            )
            profiling.current_flow.set(f"{group_id}/{seed}")  # run_episode's session id
            env, release = self._env_provider(group_id)
            agent = self._agent_factory()
            try:
                trajectory = await run_episode(
                    task,
                    group_id,
                    agent,
                    env,
                    engine,
                    sampling,
                    max_turns=self.max_turns,
                    max_context_tokens=self.max_context_tokens,
                    seed=seed,
                    timeout_s=self.episode_timeout_s,
                    engine_backoff=self.engine_backoff,
                )
            except WeightUpdated:
                version_restarts += 1
                self.counters["episodes_restarted_weight_update"] += 1
                if not group_id.startswith("eval"):
                    self._count_dropped_tokens(
                        "restarted_weight_update",
                        getattr(agent, "num_generated_tokens", 0) + engine.discarded_tokens,
                    )
                continue
            finally:
                release()
            if (
                trajectory.metrics.get("env_failure_retryable")
                and env_restarts < self.max_episode_restarts
            ):
                self.counters["episodes_restarted_env_error"] += 1
                if not group_id.startswith("eval"):
                    self._count_dropped("restarted_env_failure", [trajectory])
                await asyncio.sleep(self.retry_backoff.delay_s(env_restarts, rng))
                env_restarts += 1
                continue
            if (
                one_version
                and not restartable
                and len({v for v, m in zip(trajectory.policy_versions, trajectory.loss_mask) if m})
                > 1
            ):
                self.counters["episodes_accepted_mixed_versions"] += 1
            return trajectory

    async def _control_concurrency(self) -> None:
        """Every ``concurrency_interval_s``: reads the engine's stats and lets the
        controller move ``max_concurrent_episodes``. An engine that cannot answer leaves
        the budget as it is; a bug in the stats path halts the rollout like any bug."""
        meter = EngineLoadMeter()
        while True:
            await asyncio.sleep(self.concurrency_interval_s)
            try:
                replicas = await asyncio.wait_for(
                    self._engine.engine_stats(), timeout=10 * self.concurrency_interval_s
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
                self._halt(error)
                return
            load = meter.update(replicas)
            self._can_start_group()  # counts a budget that binds right now, too
            limit_reached, self._budget_binding = self._budget_binding, False
            backlog, self._backlogged = self._backlogged, False
            if load is None:
                continue
            self.max_concurrent_episodes = self._concurrency.update(
                load.busy_fraction,
                limit_reached=limit_reached,
                backpressure=load.saturated or backlog,
            )
            self._wake.set()

    def _drop(self, index: int, reason: str) -> None:
        self._ledger.record_filtered(index, reason)
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
            oldest_allowed = consume_version - self.max_staleness
            fresh = []
            for index, group in self._finished:
                if self._apply_stale_token_policy(group, oldest_allowed):
                    fresh.append((index, group))
                else:
                    self._count_dropped("stale_group", group)
                    self._drop(index, "stale")
            self._finished = fresh
            if len(fresh) < self.groups_per_batch:
                return
            chosen, self._finished = fresh[: self.groups_per_batch], fresh[self.groups_per_batch :]
            chosen.sort(key=lambda item: item[0])  # task order: timing must not reorder rows
            batch_id = self._batches_formed
            self._batches_formed += 1
            trajectories = [t for _, group in chosen for t in group]
            if self.stale_token_policy == "accept":
                for t in trajectories:  # counted once, in the batch that trains on them
                    t.metrics["stale_tokens_accepted"] = float(_count_stale(t, oldest_allowed))
                    self.counters["stale_tokens_accepted"] += int(
                        t.metrics["stale_tokens_accepted"]
                    )
            self._batch_members[batch_id] = [index for index, _ in chosen]
            with profiling.span(
                "batch_pack", "batches", {"batch_id": batch_id, "trajectories": len(trajectories)}
            ):
                record_batch = trajectories_to_record_batch(trajectories)
                info = batch_info(
                    batch_id,
                    consume_version,
                    [g for _, g in chosen],
                    self.samples_per_step,
                    self.seed,
                )
            with profiling.span(
                "object_store_put", "batches", {"batch_id": batch_id, "bytes": record_batch.nbytes}
            ):
                handle = self._put(record_batch)
            await self._queue.put((handle, info))

    def _apply_stale_token_policy(self, group: list[Trajectory], oldest_allowed: int) -> bool:
        """False if the group must be dropped as stale; under ``"mask"``, zeroes the loss
        mask of its tokens older than ``oldest_allowed`` first (a group left with nothing
        to train on is dropped too). ``"accept"`` keeps everything (counted when packed)."""
        stale = sum(_count_stale(t, oldest_allowed) for t in group)
        if not stale or self.stale_token_policy == "accept":
            return True
        if self.stale_token_policy == "drop":
            return False
        self._count_dropped_tokens("stale_masked", stale)
        for t in group:
            masked = _count_stale(t, oldest_allowed)
            if masked:
                t.loss_mask = [
                    0 if m and v < oldest_allowed else m
                    for v, m in zip(t.policy_versions, t.loss_mask)
                ]
                t.metrics["stale_tokens_masked"] = (
                    t.metrics.get("stale_tokens_masked", 0.0) + masked
                )
        self.counters["stale_tokens_masked"] += stale
        return any(any(t.loss_mask) for t in group)

    # ----------------------------------------------------------------- learner side
    def start(self) -> None:
        """Starts producing on the running event loop (idempotent)."""
        if self._producer is None:
            self._queue = asyncio.Queue(maxsize=self._queue_size)
            self._wake = asyncio.Event()
            self._halted = asyncio.Event()
            self._pack_lock = asyncio.Lock()
            self._producer = asyncio.create_task(self._produce())
            if self._concurrency is not None:
                if not callable(getattr(self._engine, "engine_stats", None)):
                    raise TypeError(
                        f"adaptive concurrency reads the engine's load, but the engine client "
                        f"{type(self._engine).__name__} has no engine_stats(); give it one "
                        "(see RayEngineClient) or turn it off (rollout.adaptive_concurrency=false)."
                    )
                self._controller = asyncio.create_task(self._control_concurrency())

    async def next_batch(self) -> tuple[list[Any], dict]:
        """Waits for the next batch; returns ``([handle], info)``.

        The handle is wrapped in a list so that Ray passes the object reference on instead
        of resolving it in this actor.

        ``info`` holds the batch's numbers; ``env_error_reports`` (the first report of
        each env error kind seen since the last batch, to be shown and kept) and
        ``env_errors`` (``{kind: env errors}`` since the last batch); and
        ``generated_tokens_dropped_<kind>`` for each of ``DROPPED_TOKEN_KINDS``: generated
        tokens kept from the loss since the last batch.

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
        info.update(self._concurrency_info())
        info["env_error_reports"], info["env_errors"] = self._env_errors.take()
        info.update(
            {
                f"generated_tokens_dropped_{kind}": self._dropped[kind]
                for kind in DROPPED_TOKEN_KINDS
            }
        )
        self._dropped.clear()
        if self.dynamic_sampling:
            info["groups_filtered_zero_variance"] = self.counters["groups_filtered_zero_variance"]
            info["groups_kept_zero_variance"] = self.counters["groups_kept_zero_variance"]
        return [handle], info

    def _concurrency_info(self) -> dict[str, Any]:
        """The episode budget now and the controller's last engine reading (absent until
        it has one: a -1 stand-in read as a busy fraction in every metrics sink)."""
        info: dict[str, Any] = {"max_concurrent_episodes": self.max_concurrent_episodes}
        if self._concurrency is not None:
            busy = self._concurrency.last_busy_fraction
            if busy is not None:
                info["engine_busy_fraction_last_window"] = busy
            info["concurrency_changes"] = self._concurrency.changes
        return info

    def mark_trained(self, batch_id: int, policy_version: int) -> None:
        """The learner finished the update on ``batch_id``; the engine now runs
        ``policy_version``. Its tasks leave the pending set; admission opens."""
        for index in self._batch_members.pop(batch_id, []):
            self._ledger.record_trained(index)
            self._pending.discard(index)
            self.counters["groups_trained"] += 1
        self.set_policy_version(policy_version)

    def set_policy_version(self, policy_version: int) -> None:
        self._version = policy_version
        if self._wake is not None:
            self._wake.set()

    def state(self) -> dict[str, Any]:
        """JSON-able resume state: data position, the ledger of trained and filtered task
        indices, tasks to redo (pending), counters."""
        return {
            "next_index": self._next_index,
            "ledger": self._ledger.to_json(),
            "pending": sorted(self._pending | set(self._retry)),
            "counters": dict(self.counters),
            "env_errors": dict(self._env_errors.counts),
        }

    def take_env_errors(self) -> tuple[list[dict[str, str]], dict[str, int]]:
        """``(first reports of env error kinds not reported before, as JSON; {kind: env
        errors})`` since the last take (``next_batch`` and ``evaluate`` take them too);
        see ``raytunix.envs.contract.EnvErrorTally``."""
        return self._env_errors.take()

    def stats(self) -> dict[str, Any]:
        return {
            "episodes_in_flight": self._in_flight_episodes,
            "groups_started": self._groups_started,
            "groups_dropped": self._groups_dropped,
            "batches_formed": self._batches_formed,
            "queue_depth": self._queue.qsize() if self._queue else 0,
            **self._concurrency_info(),
            "counters": dict(self.counters),
            "env_errors_by_kind": dict(self._env_errors.counts),
            "uptime_s": time.monotonic() - self._created,
        }

    async def stop(self) -> None:
        """Cancels the producer and every in-flight episode (their tasks stay pending)."""
        if self._producer is not None:
            self._producer.cancel()
        if self._controller is not None:
            self._controller.cancel()
            self._controller = None
        for task in list(self._group_tasks):
            task.cancel()
        await asyncio.gather(*self._group_tasks, return_exceptions=True)
        self._producer = None

    # ----------------------------------------------------------------- evaluation
    async def evaluate(
        self, tasks: Sequence[Task], max_new_tokens: int, temperature: float = 0.0, keep=False
    ) -> dict[str, Any]:
        """One episode per task, greedy unless ``temperature`` > 0 (each episode's seed is
        its index in ``tasks``); returns ``evaluation_result``'s numbers, with
        ``env_error_reports``, ``env_errors`` as in ``next_batch``'s info and, with ``keep``,
        ``successes`` (``successful_episodes``)."""
        stops: dict[str, Any] = {
            "stop_token_ids": self.sampling.stop_token_ids,
            "stop_strings": self.sampling.stop_strings,
        }
        sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, **stops)
        limit = asyncio.Semaphore(self.max_concurrent_episodes)

        async def one(i: int, task: Task) -> Trajectory:
            async with limit:  # no weight update during evaluation: nothing to restart
                return await self._episode(task, f"eval{i}", sampling, seed=i, one_version=False)

        trajectories = await asyncio.gather(*[one(i, t) for i, t in enumerate(tasks)])
        for t in trajectories:
            if t.error_report is not None:
                self._env_errors.add(t.error_report)
        reports, by_kind = self._env_errors.take()
        result = {**evaluation_result(trajectories), "env_error_reports": reports}
        result["env_errors"] = by_kind
        if keep:
            result["successes"] = successful_episodes(trajectories)
        return result


def batch_info(
    batch_id: int,
    consume_version: int,
    groups: list[list[Trajectory]],
    samples_per_step: int = 0,
    seed: int = 0,
) -> dict:
    """The numbers of one batch (``next_batch``'s info before the orchestrator adds its
    own), and under ``samples`` its ``samples_per_step`` episodes for the sample log
    (``raytunix.samples.batch_samples``, chosen by ``seed`` and ``consume_version``)."""
    trajectories = [t for group in groups for t in group]
    statuses = collections.Counter(t.status.value for t in trajectories)
    infra_failed = sum(is_infrastructure_failure(t.status) for t in trajectories)
    staleness = [
        consume_version - v
        for t in trajectories
        for v, m in zip(t.policy_versions, t.loss_mask)
        if m
    ]
    used_tool = [t.metrics.get("tool_calls", 0) > 0 for t in trajectories]
    return {
        "batch_id": batch_id,
        "consume_version": consume_version,
        "num_trajectories": len(trajectories),
        **learning_signal_metrics(groups),
        "tool_use_rate": float(np.mean(used_tool)),
        "turns_mean": float(np.mean([t.num_turns for t in trajectories])),
        "generated_tokens_mean": float(
            np.mean([t.metrics.get("generated_tokens", 0.0) for t in trajectories])
        ),
        "episode_generate_s_mean": float(
            np.mean([t.metrics.get("generate_s", 0.0) for t in trajectories])
        ),
        "episode_env_s_mean": float(np.mean([t.metrics.get("env_s", 0.0) for t in trajectories])),
        "staleness_min": int(min(staleness, default=0)),
        "staleness_max": int(max(staleness, default=0)),
        "staleness_mean": float(np.mean(staleness)) if staleness else 0.0,
        "stale_tokens_masked": int(
            sum(t.metrics.get("stale_tokens_masked", 0) for t in trajectories)
        ),
        "stale_tokens_accepted": int(
            sum(t.metrics.get("stale_tokens_accepted", 0) for t in trajectories)
        ),
        "valid_trajectories": len(trajectories) - infra_failed,
        "trainable_tokens": int(sum(sum(t.loss_mask) for t in trajectories)),  # loss mask 1
        "tool_errors_mean": float(
            np.mean([t.metrics.get(TOOL_ERRORS_KEY, 0.0) for t in trajectories])
        ),
        "statuses": dict(statuses),
        "samples": batch_samples(trajectories, samples_per_step, (seed << 32) + consume_version),
    }


SUCCESS_REWARD = 1.0
"""The held-out evaluation's success rule: an episode succeeds when its reward is at least
this (the shipped environments give 1.0 for a solved task; partial credit counts in the
mean reward only)."""


def successful_episodes(trajectories: Sequence[Trajectory]) -> list[tuple[list[int], list[int]]]:
    """``(token_ids, loss_mask)`` of each completed episode whose reward is at least
    ``SUCCESS_REWARD``: exactly the tokens the engine saw and produced, the mask 1 on the
    generated ones (the warm start's ``warmup.source=rejection`` trains on them)."""
    return [
        (list(t.token_ids), list(t.loss_mask))
        for t in trajectories
        if t.status == EpisodeStatus.COMPLETED and t.reward >= SUCCESS_REWARD
    ]


def evaluation_result(trajectories: Sequence[Trajectory]) -> dict[str, Any]:
    """The numbers of a held-out evaluation, one greedy episode per task.

    Returns:
      ``num_tasks``; ``success_rate`` (share of episodes with reward >= ``SUCCESS_REWARD``);
      ``reward_mean`` (mean episode reward, in the environment's units); ``tool_use_rate``
      (share that called a tool); ``tool_path_accuracy`` / ``direct_accuracy`` (success
      rate among the episodes that did / did not call one, 0.0 when there are none);
      ``statuses`` (``{EpisodeStatus value: episodes}``); ``error`` (the first failed
      episode's ``Trajectory.error``, "" when none); ``rewards`` (``[len(trajectories)]``,
      each episode's reward, in order).
    """
    rewards = np.array([t.reward for t in trajectories], np.float64)
    success = rewards >= SUCCESS_REWARD
    used_tool = np.array([t.metrics.get("tool_calls", 0) > 0 for t in trajectories], bool)
    return {
        "num_tasks": len(trajectories),
        "success_rate": float(success.mean()) if len(rewards) else 0.0,
        "reward_mean": float(rewards.mean()) if len(rewards) else 0.0,
        "tool_use_rate": float(used_tool.mean()) if len(rewards) else 0.0,
        "tool_path_accuracy": float(success[used_tool].mean()) if used_tool.any() else 0.0,
        "direct_accuracy": float(success[~used_tool].mean()) if (~used_tool).any() else 0.0,
        "statuses": dict(collections.Counter(t.status.value for t in trajectories)),
        "error": next((t.error for t in trajectories if t.error), ""),
        "rewards": rewards.tolist(),
    }


def rewards_all_equal(group: Sequence[Trajectory]) -> bool:
    """Whether the valid members of ``group`` (those not ended by an infrastructure
    failure) all got the same reward: then every group-relative advantage is 0 (GRPO,
    RLOO) and the group gives no policy gradient. True for a group with no valid member."""
    rewards = [t.reward for t in group if not is_infrastructure_failure(t.status)]
    return not rewards or max(rewards) == min(rewards)


def learning_signal_metrics(groups: Sequence[Sequence[Trajectory]]) -> dict[str, float]:
    """The learning signal of one batch (``raytunix.profiling.learning`` judges it).

    Returns (floats; shares in [0, 1], 0.0 for an empty batch):
      ``reward_mean``: mean episode reward over the batch's trajectories.
      ``zero_variance_group_fraction``: share of groups whose rewards were all equal
        (``rewards_all_equal``).
      ``format_error_fraction``: share of trajectories with at least one
        ``ToolErrorKind.FORMAT`` error (a turn with no call and no answer, both, or several).
      ``tool_error_fraction``: share with at least one tool error of any kind (format,
        malformed or failing tool calls: ``TOOL_ERRORS_KEY``).
      ``truncated_fraction``: share that ended ``truncated`` (turns, tokens or context ran out).
    """
    trajectories = [t for group in groups for t in group]
    n = max(len(trajectories), 1)
    format_key = f"{TOOL_ERRORS_KEY}/{ToolErrorKind.FORMAT.value}"
    return {
        "reward_mean": sum(t.reward for t in trajectories) / n,
        "zero_variance_group_fraction": (
            sum(map(rewards_all_equal, groups)) / len(groups) if groups else 0.0
        ),
        "format_error_fraction": sum(t.metrics.get(format_key, 0) > 0 for t in trajectories) / n,
        "tool_error_fraction": sum(t.metrics.get(TOOL_ERRORS_KEY, 0) > 0 for t in trajectories) / n,
        "truncated_fraction": sum(t.status == EpisodeStatus.TRUNCATED for t in trajectories) / n,
    }


def _count_stale(t: Trajectory, oldest_allowed: int) -> int:
    """Loss-mask tokens of ``t`` generated by a version older than ``oldest_allowed``."""
    return sum(1 for v, m in zip(t.policy_versions, t.loss_mask) if m and v < oldest_allowed)
