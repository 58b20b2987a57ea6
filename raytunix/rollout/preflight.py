"""Fail loudly instead of training on nothing.

Before training (``raytunix.train`` runs these before the warm start):

* ``check_env_actors``: every env actor has built the environment and answers; an
  environment that cannot be built (bad kwargs, a module the actor cannot import) is one
  ``PreflightError`` with the actor's reason.
* ``measure_prompts``: a sample of tasks is reset in the env actors and rendered by the
  run's agent; a prompt that leaves no room in the context for a reply is a
  ``PreflightError`` with the numbers.

During training, ``check_batch`` refuses a batch with nothing to learn from (no valid
trajectory, or no token with loss mask 1).
"""

from __future__ import annotations

import statistics
from typing import Any, Callable, Sequence

import ray

from raytunix.rollout.env_pool import EnvBuildError, EnvPool
from raytunix.types import Task


class PreflightError(RuntimeError):
    """The run would train on nothing; the message says why, with numbers, and the fix."""


def check_env_actors(pool: EnvPool, timeout_s: float) -> None:
    """Waits until every env actor of ``pool`` has built its environment.

    Raises:
      PreflightError: an actor could not build the environment, or the actors did not
        start within ``timeout_s`` seconds.
    """
    try:
        pool.wait_ready(timeout_s=timeout_s)
    except (EnvBuildError, TimeoutError) as e:
        raise PreflightError(f"the env actors are not ready, so nothing can be trained: {e}") from None


def sample_tasks(tasks: Sequence[Task], n: int) -> list[Task]:
    """Up to ``n`` tasks spread evenly over ``tasks`` (first and last included)."""
    if n <= 0 or not tasks:
        return []
    if len(tasks) <= n:
        return list(tasks)
    step = (len(tasks) - 1) / (n - 1) if n > 1 else 0
    return [tasks[round(i * step)] for i in range(n)]


def measure_prompts(pool: EnvPool, tasks: Sequence[Task], new_agent: Callable[[], Any],
                    max_context_tokens: int, timeout_s: float = 120.0) -> dict[str, Any]:
    """Resets each task in the env actors and renders its first prompt with a fresh agent.

    A prompt fits when it leaves at least one token for the reply, as the episode loop
    requires (``max_context_tokens - prompt_tokens - 1 > 0``); an episode on a task whose
    prompt does not fit ends before its first generation, with nothing to train on.

    Args:
      pool: the run's env actors (already ready).
      tasks: the tasks to measure (e.g. ``sample_tasks`` of train and held-out).
      new_agent: builds the run's agent (``make_agent`` with the run's tokenizer).
      max_context_tokens: ``model.max_seq_len``, tokens.
      timeout_s: for all resets together, seconds.

    Returns:
      ``{"num_prompts", "prompt_tokens_min", "prompt_tokens_median",
      "prompt_tokens_max"}`` (tokens).

    Raises:
      PreflightError: the agent cannot be built (e.g. its chat template does not fit the
        tokenizer), a reset raised in the env actor (the task id and the environment's
        error are named), or a prompt does not fit (counts and lengths given).
    """
    if not tasks:
        return {"num_prompts": 0}
    try:
        new_agent()
    except Exception as e:  # noqa: BLE001 - a template or argument the agent refuses, reported whole
        raise PreflightError(f"the agent cannot be built: {type(e).__name__}: {e}") from None
    actors = pool.actors
    refs = [actors[i % len(actors)].first_observation.remote(task) for i, task in enumerate(tasks)]
    lengths = []
    for task, ref in zip(tasks, refs):
        try:
            observation = ray.get(ref, timeout=timeout_s)
        except ray.exceptions.RayTaskError as e:
            cause = e.cause if isinstance(e.cause, BaseException) else e
            raise PreflightError(
                f"environment {pool.env_name!r} raised on reset of task {task.task_id!r} in "
                f"an env actor: {type(cause).__name__}: {cause}") from None
        except ray.exceptions.GetTimeoutError:
            raise PreflightError(
                f"resetting {len(tasks)} sample tasks in the env actors took over {timeout_s} s; "
                f"environment {pool.env_name!r} hangs in reset.") from None
        agent = new_agent()
        agent.reset(task, observation)
        lengths.append((len(agent.token_ids), task))
    too_long = [(n, task) for n, task in lengths if max_context_tokens - n - 1 <= 0]
    sizes = sorted(n for n, _ in lengths)
    stats = {"num_prompts": len(sizes), "prompt_tokens_min": sizes[0],
             "prompt_tokens_median": statistics.median(sizes), "prompt_tokens_max": sizes[-1]}
    if too_long:
        worst, worst_task = max(too_long, key=lambda x: x[0])
        raise PreflightError(
            f"{len(too_long)} of {len(sizes)} sampled prompts leave no room for a reply in "
            f"model.max_seq_len={max_context_tokens} tokens: prompts are {sizes[0]}-{sizes[-1]} "
            f"tokens (median {stats['prompt_tokens_median']:g}; the longest, task "
            f"{worst_task.task_id!r}, has {worst}). Raise model.max_seq_len above "
            f"{sizes[-1]} plus the reply length (rollout.max_new_tokens), or shorten the "
            "prompts (the task text, the environment's first observation, the system prompt).")
    return stats


def check_batch(info: dict[str, Any], step: int) -> None:
    """Refuses a batch the learner cannot learn from.

    Args:
      info: the orchestrator's batch info (``valid_trajectories``, ``trainable_tokens``,
        ``num_trajectories``, ``statuses``).
      step: the RL step it would be (1-based), for the message.

    Raises:
      PreflightError: no trajectory is valid (every episode failed by infrastructure), or
        no token has loss mask 1 (every episode ended before the model generated).
    """
    statuses = info.get("statuses", {})
    if info.get("valid_trajectories", 1) == 0:
        raise PreflightError(
            f"RL step {step}: every one of the batch's {info.get('num_trajectories')} episodes "
            f"failed (statuses {statuses}); nothing to train on. Check the env actors' logs "
            "(`ray logs`) for the environment's errors.")
    if info.get("trainable_tokens", 1) == 0:
        raise PreflightError(
            f"RL step {step}: the batch's {info.get('num_trajectories')} trajectories hold no "
            f"generated token (statuses {statuses}); episodes end before the model replies, "
            "usually because prompts fill model.max_seq_len. Raise model.max_seq_len or "
            "shorten the prompts.")
