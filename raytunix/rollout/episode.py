"""One episode, top to bottom: one agent, one environment, one task.

The loop never re-tokenizes the conversation: the agent appends the engine's tokens and the
environment's text (tokenized once) to one token list, which becomes the trajectory.
Every way an episode can go wrong ends this episode with a status, never the run.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

from raytunix.types import (
    Action,
    EpisodeStatus,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    StepResult,
    Task,
    Trajectory,
)


MAX_TURN_SEEDS = 1 << 16  # seeds reserved per episode, one per turn (max_turns must stay below)


class EngineClient(Protocol):
    """Anything that generates: a local ``InferenceEngine`` or a Ray actor handle wrapper."""

    async def generate(self, request: GenerationRequest) -> GenerationResult: ...


class EnvClient(Protocol):
    """One environment instance for one episode, local or hosted by an env actor."""

    async def reset(self, task: Task) -> str: ...

    async def step(self, action: Action) -> StepResult: ...

    async def close(self) -> None: ...


class EnvFailure(Exception):
    """The environment (or the actor hosting it) failed; the episode ends as ENV_ERROR."""


async def run_episode(
    task: Task,
    group_id: str,
    agent,
    env: EnvClient,
    engine: EngineClient,
    sampling: SamplingParams,
    *,
    max_turns: int,
    max_context_tokens: int,
    seed: int,
    timeout_s: float,
) -> Trajectory:
    """Runs one agent–environment episode and returns its trajectory.

    Args:
      agent: a fresh ``ConversationAgentBase`` (holds the episode's tokens).
      sampling: per-turn sampling; ``max_new_tokens`` is cut so the conversation never
        exceeds ``max_context_tokens``.
      seed: the episode's PRNG seed; turn i samples with ``seed * MAX_TURN_SEEDS + i``, so
        no two (episode, turn) pairs share a seed (``seed + i`` would give episode j's
        second turn the noise of episode j + 1's first).
      timeout_s: wall-clock budget for the whole episode (seconds).

    Returns:
      The trajectory; ``metrics`` holds ``generate_s``, ``env_s`` (seconds),
      ``tool_calls``, ``tool_errors`` and ``generated_tokens``. Never raises for environment or parsing
      failures (they set ``status``); cancellation propagates.
    """
    start = time.monotonic()
    timings = {"generate_s": 0.0, "env_s": 0.0, "tool_errors": 0.0, "tool_calls": 0.0}
    reward, status = 0.0, EpisodeStatus.TRUNCATED

    async def env_call(coro):
        t0 = time.monotonic()
        try:
            return await coro
        finally:
            timings["env_s"] += time.monotonic() - t0

    try:
        async with asyncio.timeout(timeout_s):
            agent.reset(task, await env_call(env.reset(task)))
            for turn in range(max_turns):
                room = max_context_tokens - len(agent.token_ids) - 1
                if room <= 0:
                    break  # context full: TRUNCATED
                turn_sampling = SamplingParams(
                    max_new_tokens=min(sampling.max_new_tokens, room),
                    temperature=sampling.temperature,
                    stop_token_ids=sampling.stop_token_ids,
                    stop_strings=sampling.stop_strings,
                )
                request = agent.next_request(f"{group_id}/{seed}/{turn}", turn_sampling,
                                             seed * MAX_TURN_SEEDS + turn)
                t0 = time.monotonic()
                result = await engine.generate(request)
                timings["generate_s"] += time.monotonic() - t0
                action = agent.on_generation(result)
                if result.finish_reason == FinishReason.ABORT:
                    status = EpisodeStatus.ABORTED
                    break
                if result.finish_reason == FinishReason.LENGTH and not agent.turn_finished:
                    break  # the turn did not end (an agent may close a cut reply): TRUNCATED
                timings["tool_calls"] += len(action.tool_calls)
                step = await env_call(env.step(action))
                reward += step.reward
                if step.info.get("tool_error"):
                    timings["tool_errors"] += 1
                if step.done:
                    status = step.status or EpisodeStatus.COMPLETED
                    break
                if turn + 1 < max_turns:
                    agent.on_observation(step.observation)
    except TimeoutError:
        status = EpisodeStatus.TIMEOUT
    except EnvFailure:
        status = EpisodeStatus.ENV_ERROR
    finally:
        try:
            await env.close()
        except Exception:  # closing a dead env must not hide the episode's outcome
            pass
    if status not in (EpisodeStatus.COMPLETED, EpisodeStatus.TRUNCATED):
        reward = 0.0
    timings["generated_tokens"] = float(agent.num_generated_tokens)
    timings["wall_s"] = time.monotonic() - start
    return agent.to_trajectory(task.task_id, group_id, reward, status, metrics=timings)
