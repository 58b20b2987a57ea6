"""Fail loudly instead of training on nothing.

Before training (``raytunix.train`` runs these before the warm start):

* ``check_env_actors``: every env actor has built the environment and answers; an
  environment that cannot be built (bad kwargs, a module the actor cannot import) is one
  ``PreflightError`` with the actor's reason.
* ``check_prompt_lengths``: every task's first prompt is length-checked in tokens: a few
  samples exactly through the env actors and the run's agent, every question against a
  bound from the samples (its bytes, else its tokens, in one tokenizer batch), the tasks
  the bound flags exactly again; it returns the tasks whose prompt leaves no room in the
  context for a reply.

During training, ``check_batch`` refuses a batch with nothing to learn from (no valid
trajectory, or no token with loss mask 1).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import ray

from raytunix.rollout.env_pool import EnvBuildError, EnvPool
from raytunix.types import Task

# Resets in flight at once while prompts are measured through the env actors.
PROMPT_CHUNK = 256
# Tokens the question-token bound adds for BPE merges across the question's edges.
BOUND_SLACK_TOKENS = 16


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
        raise PreflightError(
            f"the env actors are not ready, so nothing can be trained: {e}"
        ) from None


def sample_tasks(tasks: Sequence[Task], n: int) -> list[Task]:
    """Up to ``n`` tasks spread evenly over ``tasks`` (first and last included)."""
    if n <= 0 or not tasks:
        return []
    if len(tasks) <= n:
        return list(tasks)
    step = (len(tasks) - 1) / (n - 1) if n > 1 else 0
    return [tasks[round(i * step)] for i in range(n)]


def prompt_lengths(
    pool: EnvPool, tasks: Sequence[Task], new_agent: Callable[[], Any], timeout_s: float = 120.0
) -> list[tuple[int, str]]:
    """Resets each task in the env actors and renders its first prompt with a fresh agent,
    exactly as an episode starts.

    Args:
      pool: the run's env actors (already ready).
      tasks: the tasks to measure.
      new_agent: builds the run's agent (``make_agent`` with the run's tokenizer).
      timeout_s: for the resets of each chunk of ``PROMPT_CHUNK`` tasks, seconds.

    Returns:
      ``(prompt tokens, first observation)`` per task, in order.

    Raises:
      PreflightError: the agent cannot be built (e.g. its chat template does not fit the
        tokenizer), a reset raised in the env actor (the task id and the environment's
        error are named), or the resets took over ``timeout_s``.
    """
    if not tasks:
        return []
    try:
        new_agent()
    except Exception as e:  # noqa: BLE001 - a template or argument the agent refuses, reported whole
        raise PreflightError(f"the agent cannot be built: {type(e).__name__}: {e}") from None
    actors = pool.actors
    measured = []
    for start in range(0, len(tasks), PROMPT_CHUNK):
        chunk = tasks[start : start + PROMPT_CHUNK]
        refs = [
            actors[(start + i) % len(actors)].first_observation.remote(task)
            for i, task in enumerate(chunk)
        ]
        for task, ref in zip(chunk, refs):
            try:
                observation = ray.get(ref, timeout=timeout_s)
            except ray.exceptions.RayTaskError as e:
                cause = e.cause if isinstance(e.cause, BaseException) else e
                raise PreflightError(
                    f"environment {pool.env_name!r} raised on reset of task {task.task_id!r} "
                    f"in an env actor: {type(cause).__name__}: {cause}"
                ) from None
            except ray.exceptions.GetTimeoutError:
                raise PreflightError(
                    f"resetting {len(chunk)} tasks in the env actors took over {timeout_s} s; "
                    f"environment {pool.env_name!r} hangs in reset."
                ) from None
            agent = new_agent()
            agent.reset(task, observation)
            measured.append((len(agent.token_ids), observation))
    return measured


def fits(prompt_tokens: int, max_context_tokens: int) -> bool:
    """Whether a first prompt leaves at least one token of ``max_context_tokens`` for the
    reply, as the episode loop requires (``max_context_tokens - prompt_tokens - 1 > 0``);
    an episode whose prompt does not fit ends before its first generation."""
    return max_context_tokens - prompt_tokens - 1 > 0


@dataclasses.dataclass
class PromptCheck:
    """What ``check_prompt_lengths`` found (token counts).

    Attributes:
      too_long: ``(task, exact prompt tokens)`` of every task whose first prompt does not
        fit, in the order given.
      sample_tokens: exact prompt tokens of the sampled tasks (sorted).
      measured_exactly: tasks reset and rendered through the env actors (the samples, the
        tasks the bound flagged, or all of them when the bound does not apply).
      bound_applies: whether the question-token bound was used (the environment's first
        observations held their task's question), else every task was measured exactly.
      max_extra_tokens: the largest prompt tokens minus question tokens on the samples.
      tokenized: questions tokenized (those the byte bound did not clear).
    """

    too_long: list[tuple[Task, int]]
    sample_tokens: list[int]
    measured_exactly: int
    bound_applies: bool
    max_extra_tokens: int
    tokenized: int = 0


def check_prompt_lengths(
    pool: EnvPool,
    tasks: Sequence[Task],
    samples: Sequence[Task],
    new_agent: Callable[[], Any],
    tokenizer: Any,
    max_context_tokens: int,
    timeout_s: float = 120.0,
) -> PromptCheck:
    """Finds every task of ``tasks`` whose first prompt does not ``fit``, without building
    an environment per task.

    The first prompt is the agent's template text (system prompt, tools, headers) around
    the environment's first observation, whose content is tokenized on its own
    (``raytunix.agents.encoding``). So: the ``samples`` are measured exactly
    (``prompt_lengths``); a margin is the samples' largest extra (prompt minus question
    tokens) plus ``BOUND_SLACK_TOKENS`` plus the spread of that extra over the samples;
    every task whose question's byte bound on tokens (``tokenizer.token_count_bounds``)
    plus the margin leaves no room for a reply has its question tokenized, all in one
    batch (``tokenizer.count_tokens``), and is flagged when its question tokens plus the
    margin leave no room; flagged tasks are measured exactly, and only those that really
    do not fit are returned. The
    bound holds for an environment whose first observation is the task's question with
    text around it that varies across tasks about as much as across the samples (every
    shipped environment); when a sampled observation does not hold its question, every
    task is measured exactly instead.

    Args:
      pool: the run's env actors (already ready).
      tasks: every task to check (train and held-out).
      samples: tasks measured exactly first (e.g. ``sample_tasks`` of each split).
      new_agent: builds the run's agent.
      tokenizer: the run's tokenizer (``count_tokens``, ``token_count_bounds``).
      max_context_tokens: ``model.max_seq_len``, tokens.
      timeout_s: per chunk of resets, seconds (``prompt_lengths``).

    Raises:
      PreflightError: see ``prompt_lengths``.
    """
    if not tasks:
        return PromptCheck([], [], 0, True, 0)
    exact: dict[int, int] = {}  # id(task) -> prompt tokens
    measured = prompt_lengths(pool, samples, new_agent, timeout_s)
    for task, (n, _) in zip(samples, measured):
        exact[id(task)] = n
    bound_applies = all(
        task.question in observation for task, (_, observation) in zip(samples, measured)
    )
    extra = tokenized = 0
    if bound_applies and samples:
        flagged, extra, tokenized = _flagged_by_bound(
            tasks, samples, [n for n, _ in measured], exact, tokenizer, max_context_tokens
        )
    else:
        flagged = [t for t in tasks if id(t) not in exact]
    for task, (n, _) in zip(flagged, prompt_lengths(pool, flagged, new_agent, timeout_s)):
        exact[id(task)] = n
    too_long = [
        (t, exact[id(t)])
        for t in tasks
        if id(t) in exact and not fits(exact[id(t)], max_context_tokens)
    ]
    return PromptCheck(
        too_long=too_long,
        sample_tokens=sorted(n for n, _ in measured),
        measured_exactly=len(exact),
        bound_applies=bound_applies,
        max_extra_tokens=extra,
        tokenized=tokenized,
    )


def _flagged_by_bound(
    tasks: Sequence[Task],
    samples: Sequence[Task],
    sample_tokens: Sequence[int],
    exact: dict[int, int],
    tokenizer: Any,
    max_context_tokens: int,
) -> tuple[list[Task], int, int]:
    """The tasks of ``tasks`` whose question tokens plus the samples' margin leave no room
    for a reply, less those already measured (``exact``, keyed by ``id(task)``).

    ``sample_tokens`` are the samples' exact prompt tokens, in ``samples``' order; the
    margin is their largest extra over the question tokens plus ``BOUND_SLACK_TOKENS``
    plus the spread of that extra. Returns ``(flagged tasks, largest extra in tokens,
    questions tokenized)``.
    """
    question_tokens = tokenizer.count_tokens([t.question for t in samples])
    extras = [n - q for n, q in zip(sample_tokens, question_tokens)]
    extra = max(extras)
    margin = extra + BOUND_SLACK_TOKENS + (extra - min(extras))
    # Bytes bound tokens for most tokenizers; only rows that bound does not clear are
    # tokenized, so a dataset of short questions costs one pass over its bytes.
    bounds = tokenizer.token_count_bounds([t.question for t in tasks])
    candidates = (
        tasks
        if bounds is None
        else [t for t, b in zip(tasks, bounds) if not fits(b + margin, max_context_tokens)]
    )
    counts = tokenizer.count_tokens([t.question for t in candidates])
    flagged = [
        t
        for t, q in zip(candidates, counts)
        if not fits(q + margin, max_context_tokens) and id(t) not in exact
    ]
    return flagged, extra, len(candidates)


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
            "(`ray logs`) for the environment's errors."
        )
    if info.get("trainable_tokens", 1) == 0:
        raise PreflightError(
            f"RL step {step}: the batch's {info.get('num_trajectories')} trajectories hold no "
            f"generated token (statuses {statuses}); episodes end before the model replies, "
            "usually because prompts fill model.max_seq_len. Raise model.max_seq_len or "
            "shorten the prompts."
        )
