"""One episode, top to bottom: one agent, one environment, one task (the loop is shown,
step by step, in ``raytunix.types``, beside the protocols it calls).

The loop never re-tokenizes the conversation: the agent appends the engine's tokens and the
environment's text (tokenized once) to one token list, which becomes the trajectory.
Every way an episode can go wrong ends this episode with a status, never the run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from raytunix import profiling
from raytunix.envs.contract import MAX_REWARD, EnvContractError, check_step_result
from raytunix.rollout.faults import Backoff, RateLimitedLog, retry_async
from raytunix.types import (
    TOOL_ERRORS_KEY,
    Agent,
    EngineClient,
    EngineFailure,
    EnvClient,
    EnvFailure,
    EpisodeStatus,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    StepResult,
    Task,
    Trajectory,
    is_infrastructure_failure,
)

logger = logging.getLogger(__name__)
_rate_limited = RateLimitedLog(logger)

# What an engine client may raise for an outage: these are retried with backoff. Anything
# else from ``generate`` (a ValueError for a bad request...) is a bug and propagates.
ENGINE_OUTAGE_ERRORS = (EngineFailure, ConnectionError, TimeoutError)
ENV_CLOSE_TIMEOUT_S = 10.0  # closing an env on a hung actor must not hold the episode forever


MAX_ERROR_CHARS = 500  # of an env failure's message kept on its trajectory (``error``)
MAX_TURN_SEEDS = 1 << 16  # seeds reserved per episode, one per turn (max_turns must stay below)

T = TypeVar("T")


def _add_reward(total: float, reward: float, env, task) -> float:
    """``total + reward``, the episode's return so far.

    Raises:
      EnvFailure: the sum is more than ``MAX_REWARD`` in size (batches hold rewards as
        float32, where it would be inf).
    """
    total += reward
    if not abs(total) <= MAX_REWARD:
        raise EnvFailure(
            f"{type(env).__qualname__}: the episode's rewards sum to {total!r}, more than "
            f"{MAX_REWARD:g} in size (batches hold rewards as float32, where that is inf); "
            f"scale the rewards down (task {task.task_id!r})"
        )
    return total


async def run_episode(
    task: Task,
    group_id: str,
    agent: Agent,
    env: EnvClient,
    engine: EngineClient,
    sampling: SamplingParams,
    *,
    max_turns: int,
    max_context_tokens: int,
    seed: int,
    timeout_s: float,
    engine_backoff: Backoff = Backoff(),
) -> Trajectory:
    """Runs one agent–environment episode and returns its trajectory.

    Args:
      agent: a fresh ``ConversationAgentBase`` (holds the episode's tokens).
      sampling: per-turn sampling; ``max_new_tokens`` is cut so the conversation never
        exceeds ``max_context_tokens``.
      seed: the episode's PRNG seed; turn i samples with ``seed * MAX_TURN_SEEDS + i``, so
        no two (episode, turn) pairs share a seed (``seed + i`` would give episode j's
        second turn the noise of episode j + 1's first).
      timeout_s: wall-clock budget for the whole episode (seconds), retries included.
      engine_backoff: an engine outage is retried on this schedule; a short one costs
        time, not the episode.

    Returns:
      The trajectory; ``metrics`` holds ``generate_s``, ``env_s`` (seconds),
      ``tool_calls``, ``tool_errors`` (total) and ``tool_errors/<kind>`` (see
      ``ToolErrorKind``), ``engine_retries``, ``generated_tokens``, and
      ``env_failure_retryable`` (1.0) when its env's host died under it. Environment
      failures (``EnvFailure`` from reset, step or close, a step result of the wrong
      kind, a non-finite reward) end it as ``ENV_ERROR`` with the failure's message in
      ``error`` and its ``EnvErrorReport`` in ``error_report``, the budget
      as ``TIMEOUT``; parse errors are the environment's to answer.

    Raises:
      EngineFailure: the engine stayed down through every retry (the caller retries the
        group or filters the task).
      Exception: anything else raised by the agent, the parser or an engine/env client
        is a bug and propagates unchanged, never counted as an engine failure.
    """
    start = time.perf_counter()
    # The episode's turns share one engine session: each turn prefills only its new tokens.
    log = _EpisodeLog(group_id, session_id=f"{group_id}/{seed}")
    try:
        async with asyncio.timeout(timeout_s):
            agent.reset(task, await log.env_call(env.reset(task), log.record_reset))
            await _play_turns(
                task,
                agent,
                env,
                engine,
                sampling,
                log,
                max_turns=max_turns,
                max_context_tokens=max_context_tokens,
                seed=seed,
                engine_backoff=engine_backoff,
            )
    except TimeoutError:
        log.status = EpisodeStatus.TIMEOUT
    except EnvFailure as e:
        log.end_by_env_failure(e)
    finally:
        await _close_episode(engine, env, log)
    return _assemble_trajectory(agent, task, log, start)


def _fresh_metrics() -> dict[str, float]:
    """The counters every trajectory's ``metrics`` starts from (seconds and counts)."""
    return {
        "generate_s": 0.0,
        "env_s": 0.0,
        TOOL_ERRORS_KEY: 0.0,
        "tool_calls": 0.0,
        "engine_retries": 0.0,
    }


@dataclasses.dataclass
class _EpisodeLog:
    """One episode's running record: its metrics, its return so far and how it ended.

    ``status`` starts as ``TRUNCATED`` (what a loop that runs out of turns or context ends
    as); ``error`` and ``report`` are an ``ENV_ERROR``'s message and ``EnvErrorReport``,
    kept on the trajectory for the user to see.
    """

    group_id: str
    session_id: str
    metrics: dict[str, float] = dataclasses.field(default_factory=_fresh_metrics)
    reward: float = 0.0
    status: EpisodeStatus = EpisodeStatus.TRUNCATED
    error: str = ""
    report: Any = None

    def on_engine_retry(self, attempt: int, error: BaseException, delay_s: float) -> None:
        """Counts one engine retry in ``engine_retries`` and warns (rate-limited)."""
        self.metrics["engine_retries"] += 1
        _rate_limited.log(
            logging.WARNING,
            "engine_retry",
            "engine call of %s failed (%r); retry %d in %.2f s",
            self.group_id,
            error,
            attempt + 1,
            delay_s,
        )

    async def env_call(self, coro: Awaitable[T], record: Callable[[float, float], None]) -> T:
        """Awaits an env call, adds its seconds to ``env_s`` and calls ``record(start,
        seconds)``, also when it raised."""
        t0 = time.perf_counter()
        try:
            return await coro
        finally:
            seconds = time.perf_counter() - t0
            self.metrics["env_s"] += seconds
            record(t0, seconds)

    def record_reset(self, t0: float, seconds: float) -> None:
        """The trace span of the env's reset (``t0`` and ``seconds`` from ``env_call``)."""
        profiling.add("env_reset", t0, t0 + seconds, "episodes", None, self.session_id)

    def record_turn(
        self, turn: int, t0: float, t1: float, tokens: int, env_s: float | None
    ) -> None:
        """The trace span of one turn: generation from ``t0`` to ``t1`` (``tokens`` new
        tokens), then its env step of ``env_s`` seconds, ``None`` when it took none."""
        # One span per turn, its generation and its env step in its args: the trace draws
        # them as the turn's two children (``profiling.trace``). Three spans a turn would
        # triple what the orchestrator, the busiest recorder, holds and ships per step.
        args: dict[str, Any] = {"turn": turn, "tokens": tokens, "generate_s": t1 - t0}
        if env_s is not None:
            args["env_s"] = env_s
        profiling.add("turn", t0, time.perf_counter(), "episodes", args, self.session_id)

    def count_tool_errors(self, info: dict[str, Any]) -> None:
        """Adds a step's ``info[TOOL_ERRORS_KEY]`` (``{kind: count}``) to the total and to
        ``tool_errors/<kind>``."""
        for kind, count in (info.get(TOOL_ERRORS_KEY) or {}).items():
            self.metrics[TOOL_ERRORS_KEY] += count
            key = f"{TOOL_ERRORS_KEY}/{kind}"
            self.metrics[key] = self.metrics.get(key, 0.0) + count

    def end_by_env_failure(self, e: EnvFailure) -> None:
        """Ends the episode as ``ENV_ERROR`` for an ``EnvFailure`` from reset or a step,
        marking it ``env_failure_retryable`` when the host failed, not the environment."""
        self.status = EpisodeStatus.ENV_ERROR
        self.error = str(e)[:MAX_ERROR_CHARS]
        self.report = e.report
        if e.retryable:  # the host failed, not the environment: the caller may re-run it
            self.metrics["env_failure_retryable"] = 1.0
        _rate_limited.log(
            logging.WARNING, "env_failure", "episode of %s ended as env_error: %s", self.group_id, e
        )


async def _play_turns(
    task: Task,
    agent: Agent,
    env: EnvClient,
    engine: EngineClient,
    sampling: SamplingParams,
    log: _EpisodeLog,
    *,
    max_turns: int,
    max_context_tokens: int,
    seed: int,
    engine_backoff: Backoff,
) -> None:
    """The turn loop: generate, step the env, stop when the episode ends; into ``log``.

    Leaves ``log.status`` as ``TRUNCATED`` when turns, context or a cut reply end it.

    Raises:
      EnvFailure: from a step, or a step result the loop cannot use.
      EngineFailure: the engine stayed down through every retry.
    """
    rng = random.Random(seed)
    for turn in range(max_turns):
        room = max_context_tokens - len(agent.token_ids) - 1
        if room <= 0:
            break  # context full: TRUNCATED
        request = _turn_request(
            agent, sampling, room, f"{log.session_id}/{turn}", seed * MAX_TURN_SEEDS + turn
        )
        request = dataclasses.replace(request, session_id=log.session_id)
        t0 = time.perf_counter()
        result = await _generate(engine, request, engine_backoff, rng, log)
        t1 = time.perf_counter()
        log.metrics["generate_s"] += t1 - t0
        tokens = len(result.token_ids)
        action = agent.on_generation(result)
        if _reply_ends_episode(result, agent, log):
            log.record_turn(turn, t0, t1, tokens, None)
            break
        log.metrics["tool_calls"] += len(action.tool_calls)
        step = await log.env_call(
            env.step(action),
            lambda _, seconds: log.record_turn(turn, t0, t1, tokens, seconds),
        )
        step = _check_step(step, env, task)
        if _take_step(step, env, task, log):
            break
        if turn + 1 < max_turns:
            agent.on_observation(step.observation)


def _turn_request(
    agent: Agent, sampling: SamplingParams, room: int, request_id: str, seed: int
) -> GenerationRequest:
    """The agent's next request, its ``max_new_tokens`` cut to the ``room`` left in the
    context (tokens)."""
    # replace, not a new SamplingParams: every other setting (temperature, top-k, top-p,
    # stops) reaches the engine as the caller gave it.
    turn_sampling = dataclasses.replace(sampling, max_new_tokens=min(sampling.max_new_tokens, room))
    return agent.next_request(request_id, turn_sampling, seed)


async def _generate(
    engine: EngineClient,
    request: GenerationRequest,
    backoff: Backoff,
    rng: random.Random,
    log: _EpisodeLog,
) -> GenerationResult:
    """``engine.generate(request)``, an outage retried on ``backoff`` (jitter from ``rng``).

    Raises:
      EngineFailure: the engine stayed down through every retry (a ``ConnectionError`` or
        ``TimeoutError`` from the client is wrapped in one).
    """
    try:
        return await retry_async(
            lambda: engine.generate(request),
            backoff,
            retry_on=ENGINE_OUTAGE_ERRORS,
            rng=rng,
            on_retry=log.on_engine_retry,
        )
    except ENGINE_OUTAGE_ERRORS as e:
        if isinstance(e, EngineFailure):
            raise
        raise EngineFailure(f"engine call {request.request_id} failed: {e!r}") from e


def _reply_ends_episode(result: GenerationResult, agent: Agent, log: _EpisodeLog) -> bool:
    """Whether the reply ends the episode before any env step: an aborted generation
    (``ABORTED``, set on ``log``) or one cut at ``max_new_tokens`` whose turn did not end
    (``TRUNCATED``; an agent may close a cut reply and so let it go on)."""
    if result.finish_reason == FinishReason.ABORT:
        log.status = EpisodeStatus.ABORTED
        return True
    return result.finish_reason == FinishReason.LENGTH and not agent.turn_finished


def _take_step(step: StepResult, env: EnvClient, task: Task, log: _EpisodeLog) -> bool:
    """Adds a checked step's reward and tool errors to ``log``; whether the step ended the
    episode (then ``log.status`` is the step's status, ``COMPLETED`` when it gives none).

    Raises:
      EnvFailure: the rewards sum past ``MAX_REWARD`` (see ``_add_reward``).
    """
    log.reward = _add_reward(log.reward, step.reward, env, task)
    log.count_tool_errors(step.info)
    if not step.done:
        return False
    log.status = step.status or EpisodeStatus.COMPLETED
    if log.status == EpisodeStatus.ENV_ERROR:  # BaseEnv.step caught the raise
        message = step.info.get("error") or "the environment reported env_error"
        log.error = str(message)[:MAX_ERROR_CHARS]
        log.report = step.info.get("env_error_report")
    return True


async def _close_episode(engine: EngineClient, env: EnvClient, log: _EpisodeLog) -> None:
    """Ends the engine session and closes the env, whatever happened before.

    A close that raises an ``EnvFailure`` with a report (the environment's own code failed)
    ends the episode as ``ENV_ERROR`` unless it already ended as an infrastructure failure
    (whose status and report are kept); a host failure or a close hung for
    ``ENV_CLOSE_TIMEOUT_S`` seconds only warns.
    """
    end_session = getattr(engine, "end_session", None)
    if end_session is not None:
        end_session(log.session_id)
    try:
        async with asyncio.timeout(ENV_CLOSE_TIMEOUT_S):
            await env.close()
    except EnvFailure as e:
        if e.report is not None and not is_infrastructure_failure(log.status):
            log.status, log.error = EpisodeStatus.ENV_ERROR, str(e)[:MAX_ERROR_CHARS]
            log.report = e.report
        _rate_limited.log(
            logging.WARNING, "env_close", "closing the env of %s failed: %s", log.group_id, e
        )
    except TimeoutError as e:  # a hung close must not hide the episode's outcome
        _rate_limited.log(
            logging.WARNING, "env_close", "closing the env of %s failed: %r", log.group_id, e
        )


def _assemble_trajectory(agent: Agent, task: Task, log: _EpisodeLog, start: float) -> Trajectory:
    """The episode's trajectory from the agent's tokens and ``log``, and its trace span
    from ``start`` (``time.perf_counter()`` seconds); an infrastructure failure's reward
    is 0."""
    reward = 0.0 if is_infrastructure_failure(log.status) else log.reward
    metrics = log.metrics
    metrics["generated_tokens"] = float(agent.num_generated_tokens)
    end = time.perf_counter()
    metrics["wall_s"] = end - start
    trajectory = agent.to_trajectory(
        task.task_id, log.group_id, reward, log.status, metrics=metrics
    )
    profiling.add(
        "episode",
        start,
        end,
        "episodes",
        {
            "task_id": task.task_id,
            "status": log.status.value,
            "turns": trajectory.num_turns,
            "reward": reward,
            "generate_s": metrics["generate_s"],
            "env_s": metrics["env_s"],
        },
        log.session_id,
    )
    trajectory.error = log.error
    trajectory.error_report = log.report
    return trajectory


def _check_step(step, env, task: Task) -> StepResult:
    """``step`` checked by the env contract (``raytunix.envs.contract``), for an
    ``EnvClient`` that does not check where the value is made.

    Raises:
      EnvFailure: a step result the loop cannot use, naming the task.
    """
    try:
        return check_step_result(step, env)
    except EnvContractError as e:
        raise EnvFailure(f"{e} (task {task.task_id!r})") from e
