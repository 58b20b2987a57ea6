"""The numbers of ``raytunix eval``: success rate, mean reward and pass@k per environment,
greedy and sampled, and the table and summary a user reads. Pure functions of episode
rewards; the run that produces them is ``raytunix.driver.evaluate_run``.

Success rule (every environment, today): an episode succeeds when its reward is at least
``SUCCESS_REWARD`` (1.0), the reward the shipped environments and hub adapters give a solved
task; partial credit counts in the mean reward only. The rule is written, per environment,
into the table and ``RUN_DIR/eval/summary.json``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from raytunix.rollout.orchestrator import SUCCESS_REWARD

SUMMARY_KEYS = (
    "env",
    "success_rule",
    "num_tasks",
    "greedy_success_rate",
    "greedy_reward_mean",
    "sampled_episodes_per_task",
    "sampled_temperature",
    "sampled_success_rate",
    "sampled_reward_mean",
    "k",
    "pass_at_k",
)
"""The keys of one environment's row in the summary (``env_summary``)."""


def success_rule(env: str) -> str:
    """The success rule applied to ``env``'s episodes, in words (the same for every env)."""
    return f"{env}: an episode succeeds when its reward >= {SUCCESS_REWARD:g}"


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimate for one task: the chance that at least one of ``k``
    samples drawn without replacement from ``n`` sampled episodes, ``c`` of them
    successful, succeeds: ``1 - C(n-c, k) / C(n, k)`` (Chen et al. 2021, "Evaluating Large
    Language Models Trained on Code", eq. 1), computed as the product
    ``prod_{i=n-c+1..n} (1 - k / i)``, which neither overflows nor loses precision.

    Raises:
      ValueError: ``k < 1``, ``n < k`` (too few episodes for pass@k; sample more), or
        ``c`` outside ``0..n``.
    """
    if k < 1:
        raise ValueError(f"pass@k needs k >= 1, got k={k}.")
    if n < k:
        raise ValueError(
            f"pass@{k} needs at least k={k} sampled episodes per task, got n={n}; raise "
            "--episodes to at least --k."
        )
    if not 0 <= c <= n:
        raise ValueError(f"successes c={c} must lie in 0..n={n}.")
    if n - c < k:  # every draw of k holds a success
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def env_summary(
    env: str,
    greedy_rewards: Sequence[float],
    sampled_rewards: Sequence[Sequence[float]],
    k: int,
    temperature: float,
) -> dict[str, Any]:
    """One environment's row of the evaluation (keys ``SUMMARY_KEYS``).

    Args:
      env: the environment's name (``env.name``).
      greedy_rewards: ``[num_tasks]`` the reward of each task's greedy episode.
      sampled_rewards: ``[num_tasks][n]`` the rewards of each task's ``n`` sampled episodes
        (the same ``n`` for every task).
      k: pass@k's k (``pass_at_k``, averaged over the tasks).
      temperature: the sampling temperature of the sampled episodes.

    Raises:
      ValueError: no task, tasks with different numbers of sampled episodes, or a bad
        ``k`` (``pass_at_k``).
    """
    greedy = np.asarray(greedy_rewards, np.float64)
    if greedy.size == 0 or len(sampled_rewards) != greedy.size:
        raise ValueError(
            f"{env}: {greedy.size} greedy and {len(sampled_rewards)} sampled tasks; both "
            "must be the same, non-zero number."
        )
    if len({len(row) for row in sampled_rewards}) != 1:
        raise ValueError(f"{env}: every task needs the same number of sampled episodes.")
    sampled = np.asarray(sampled_rewards, np.float64)  # [num_tasks, n]
    n = sampled.shape[1]
    successes = (sampled >= SUCCESS_REWARD).sum(axis=1)
    return {
        "env": env,
        "success_rule": success_rule(env),
        "num_tasks": int(greedy.size),
        "greedy_success_rate": float((greedy >= SUCCESS_REWARD).mean()),
        "greedy_reward_mean": float(greedy.mean()),
        "sampled_episodes_per_task": int(n),
        "sampled_temperature": float(temperature),
        "sampled_success_rate": float((sampled >= SUCCESS_REWARD).mean()),
        "sampled_reward_mean": float(sampled.mean()),
        "k": int(k),
        "pass_at_k": float(np.mean([pass_at_k(n, int(c), k) for c in successes])),
    }


def table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The per-env table a user reads (one line per ``env_summary`` row), then each env's
    success rule."""
    head = (
        f"{'env':<24} {'tasks':>5} {'greedy ok':>9} {'greedy R':>9} "
        f"{'sampled ok':>10} {'sampled R':>9} {'pass@k':>12}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        pass_k = f"{r['pass_at_k']:.1%} (k={r['k']})"
        lines.append(
            f"{r['env']:<24} {r['num_tasks']:>5} {r['greedy_success_rate']:>9.1%} "
            f"{r['greedy_reward_mean']:>9.3f} {r['sampled_success_rate']:>10.1%} "
            f"{r['sampled_reward_mean']:>9.3f} {pass_k:>12}"
        )
    lines.append("")
    lines += [
        f"success rule, {r['success_rule']}; sampled: {r['sampled_episodes_per_task']} "
        f"episodes per task at temperature {r['sampled_temperature']:g}"
        for r in rows
    ]
    return "\n".join(lines)
