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
    session_id = f"{group_id}/{seed}"
    timings = {
        "generate_s": 0.0,
        "env_s": 0.0,
        TOOL_ERRORS_KEY: 0.0,
        "tool_calls": 0.0,
        "engine_retries": 0.0,
    }
    reward, status = 0.0, EpisodeStatus.TRUNCATED
    error = ""  # an ENV_ERROR's message, kept on the trajectory for the user to see
    report = None  # and its EnvErrorReport, when the environment's code failed
    rng = random.Random(seed)

    def on_engine_retry(attempt: int, error: BaseException, delay_s: float) -> None:
        timings["engine_retries"] += 1
        _rate_limited.log(
            logging.WARNING,
            "engine_retry",
            "engine call of %s failed (%r); retry %d in %.2f s",
            group_id,
            error,
            attempt + 1,
            delay_s,
        )

    async def env_call(coro, record):
        """Awaits an env call, adds its seconds to ``env_s`` and calls ``record(start,
        seconds)``, also when it raised."""
        t0 = time.perf_counter()
        try:
            return await coro
        finally:
            seconds = time.perf_counter() - t0
            timings["env_s"] += seconds
            record(t0, seconds)

    def record_turn(turn: int, t0: float, t1: float, tokens: int, env_s: float | None) -> None:
        # One span per turn, its generation and its env step in its args: the trace draws
        # them as the turn's two children (``profiling.trace``). Three spans a turn would
        # triple what the orchestrator, the busiest recorder, holds and ships per step.
        args = {"turn": turn, "tokens": tokens, "generate_s": t1 - t0}
        if env_s is not None:
            args["env_s"] = env_s
        profiling.add("turn", t0, time.perf_counter(), "episodes", args, session_id)

    try:
        async with asyncio.timeout(timeout_s):
            agent.reset(
                task,
                await env_call(
                    env.reset(task),
                    lambda t0, seconds: profiling.add(
                        "env_reset", t0, t0 + seconds, "episodes", None, session_id
                    ),
                ),
            )
            for turn in range(max_turns):
                room = max_context_tokens - len(agent.token_ids) - 1
                if room <= 0:
                    break  # context full: TRUNCATED
                # replace, not a new SamplingParams: every other setting (temperature,
                # top-k, top-p, stops) reaches the engine as the caller gave it.
                turn_sampling = dataclasses.replace(
                    sampling, max_new_tokens=min(sampling.max_new_tokens, room)
                )
                request = dataclasses.replace(
                    agent.next_request(
                        f"{group_id}/{seed}/{turn}", turn_sampling, seed * MAX_TURN_SEEDS + turn
                    ),
                    session_id=session_id,
                )
                t0 = time.perf_counter()
                try:
                    result = await retry_async(
                        lambda: engine.generate(request),
                        engine_backoff,
                        retry_on=ENGINE_OUTAGE_ERRORS,
                        rng=rng,
                        on_retry=on_engine_retry,
                    )
                except ENGINE_OUTAGE_ERRORS as e:
                    if isinstance(e, EngineFailure):
                        raise
                    raise EngineFailure(f"engine call {request.request_id} failed: {e!r}") from e
                t1 = time.perf_counter()
                timings["generate_s"] += t1 - t0
                tokens = len(result.token_ids)
                action = agent.on_generation(result)
                if result.finish_reason == FinishReason.ABORT:
                    record_turn(turn, t0, t1, tokens, None)
                    status = EpisodeStatus.ABORTED
                    break
                if result.finish_reason == FinishReason.LENGTH and not agent.turn_finished:
                    record_turn(turn, t0, t1, tokens, None)
                    break  # the turn did not end (an agent may close a cut reply): TRUNCATED
                timings["tool_calls"] += len(action.tool_calls)
                step = await env_call(
                    env.step(action), lambda _, seconds: record_turn(turn, t0, t1, tokens, seconds)
                )
                step = _check_step(step, env, task)
                reward = _add_reward(reward, step.reward, env, task)
                for kind, count in (step.info.get(TOOL_ERRORS_KEY) or {}).items():
                    timings[TOOL_ERRORS_KEY] += count
                    key = f"{TOOL_ERRORS_KEY}/{kind}"
                    timings[key] = timings.get(key, 0.0) + count
                if step.done:
                    status = step.status or EpisodeStatus.COMPLETED
                    if status == EpisodeStatus.ENV_ERROR:  # BaseEnv.step caught the raise
                        error = str(step.info.get("error") or "the environment reported env_error")[
                            :MAX_ERROR_CHARS
                        ]
                        report = step.info.get("env_error_report")
                    break
                if turn + 1 < max_turns:
                    agent.on_observation(step.observation)
    except TimeoutError:
        status = EpisodeStatus.TIMEOUT
    except EnvFailure as e:
        status = EpisodeStatus.ENV_ERROR
        error = str(e)[:MAX_ERROR_CHARS]
        report = e.report
        if e.retryable:  # the host failed, not the environment: the caller may re-run it
            timings["env_failure_retryable"] = 1.0
        _rate_limited.log(
            logging.WARNING, "env_failure", "episode of %s ended as env_error: %s", group_id, e
        )
    finally:
        end_session = getattr(engine, "end_session", None)
        if end_session is not None:
            end_session(session_id)
        try:
            async with asyncio.timeout(ENV_CLOSE_TIMEOUT_S):
                await env.close()
        except EnvFailure as e:
            # The environment's own close raised: this episode ends as env_error (an earlier
            # failure's status and report are kept); a host failure only warns.
            if e.report is not None and not is_infrastructure_failure(status):
                status, error, report = EpisodeStatus.ENV_ERROR, str(e)[:MAX_ERROR_CHARS], e.report
            _rate_limited.log(
                logging.WARNING, "env_close", "closing the env of %s failed: %s", group_id, e
            )
        except TimeoutError as e:  # a hung close must not hide the episode's outcome
            _rate_limited.log(
                logging.WARNING, "env_close", "closing the env of %s failed: %r", group_id, e
            )
    if is_infrastructure_failure(status):
        reward = 0.0
    timings["generated_tokens"] = float(agent.num_generated_tokens)
    end = time.perf_counter()
    timings["wall_s"] = end - start
    trajectory = agent.to_trajectory(task.task_id, group_id, reward, status, metrics=timings)
    profiling.add(
        "episode",
        start,
        end,
        "episodes",
        {
            "task_id": task.task_id,
            "status": status.value,
            "turns": trajectory.num_turns,
            "reward": reward,
            "generate_s": timings["generate_s"],
            "env_s": timings["env_s"],
        },
        session_id,
    )
    trajectory.error = error
    trajectory.error_report = report
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
