"""``raytunix eval RUN_DIR``: a trained run's newest RL checkpoint on held-out tasks.

For each environment (the run's own, or each ``--env``; same tokenizer and model), the
run's actors are started as ``raytunix train`` starts them, the learner restores the
newest RL checkpoint and the engines take its weights; then one greedy episode per
held-out task and ``episodes`` sampled ones at ``temperature``. The numbers
(``raytunix.evaluation``) are printed as a table and written to
``RUN_DIR/eval/summary.json``: ``{"run_dir", "checkpoint_step", "policy_version",
"envs": [env_summary rows]}``. The run's checkpoints and metrics are left as they are.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from raytunix import evaluation
from raytunix.config import Config, ConfigError, apply_override, validate
from raytunix.driver.run_dir import RunDir, RunError, load_run_config, say


def check_request(run_dir: str, k: int, episodes: int | None) -> int:
    """The sampled episodes per task (``episodes``, default ``max(k, 4)``), once the
    request is checked, before Ray starts.

    Raises:
      FileNotFoundError: ``run_dir`` is missing or not a run directory.
      RunError: the run has no RL checkpoint yet.
      ValueError: ``k < 1`` or ``episodes < k``.
    """
    if not os.path.isdir(run_dir):
        raise FileNotFoundError(
            f"run directory {run_dir!r} does not exist; pass the directory `raytunix train` "
            "printed at start."
        )
    if not os.path.exists(os.path.join(run_dir, "config.yaml")):
        raise FileNotFoundError(f"{run_dir!r} has no config.yaml: it is not a run directory.")
    if not RunDir(run_dir).has_rl_checkpoint():
        raise RunError(
            f"{run_dir!r} has no RL checkpoint to evaluate (none in "
            f"{os.path.join(run_dir, 'checkpoints')}); train it first, or --resume it."
        )
    if k < 1:
        raise ValueError(f"--k must be >= 1, got {k}.")
    n = max(k, 4) if episodes is None else episodes
    if n < k:
        raise ValueError(f"--episodes {n} is fewer than --k {k}: pass@k needs n >= k samples.")
    return n


def env_config(run_dir: str, env: str | None) -> Config:
    """The run's config, with ``env.name=env`` (and the env's own default kwargs) when
    ``env`` names another environment.

    Raises:
      ConfigError: ``env`` is not a known environment (the message lists them).
    """
    cfg = load_run_config(run_dir)
    if env is None or env == cfg.env.name:
        return cfg
    apply_override(cfg, f"env.name={env}")
    apply_override(cfg, "env.kwargs={}")
    try:
        return validate(cfg)
    except ConfigError as e:
        raise ConfigError(f"--env {env!r}: {e}") from None


def evaluate_run(
    run_dir: str,
    envs: Sequence[str] = (),
    k: int = 1,
    episodes: int | None = None,
    temperature: float = 1.0,
) -> dict[str, Any]:
    """Evaluates ``run_dir``'s newest RL checkpoint (see the module docstring); prints the
    table and returns the summary written to ``RUN_DIR/eval/summary.json``.

    Args:
      envs: environments to evaluate on (default: the run's own).
      k: pass@k's k (>= 1).
      episodes: sampled episodes per held-out task (>= k; default ``max(k, 4)``).
      temperature: the sampled episodes' temperature (> 0).

    Raises:
      FileNotFoundError, RunError, ValueError: as ``check_request``; ConfigError: as
        ``env_config``; RunError: the checkpoint does not restore.
    """
    n = check_request(run_dir, k, episodes)
    if temperature <= 0:
        raise ValueError(f"--temperature must be > 0 for the sampled episodes, got {temperature}.")
    configs = [env_config(run_dir, env) for env in envs] or [env_config(run_dir, None)]
    from raytunix.driver.prepare import connect_ray

    connect_ray()
    rows: list[dict[str, Any]] = []
    restored: dict[str, int] = {}
    for cfg in configs:
        row, restored = _evaluate_env(cfg, RunDir(run_dir), k, n, temperature)
        rows.append(row)
    summary = {"run_dir": os.path.abspath(run_dir), **restored, "envs": rows}
    out = os.path.join(run_dir, "eval")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    say(
        f"evaluation of checkpoint step {restored['checkpoint_step']}:\n"
        f"{evaluation.table(rows)}\nwritten to {os.path.join(out, 'summary.json')}"
    )
    return summary


def _evaluate_env(
    cfg: Config, run: RunDir, k: int, n: int, temperature: float
) -> tuple[dict[str, Any], dict[str, int]]:
    """One environment's ``env_summary`` row and ``{"checkpoint_step", "policy_version"}``."""
    from raytunix.data.datasets import DatasetError
    from raytunix.data.tasks import dataset_splits
    from raytunix.driver.job import started_job
    from raytunix.learner.learner import RLHyperparams

    try:
        dataset = dataset_splits(cfg.data)
    except DatasetError as e:
        raise ConfigError(str(e)) from None
    with started_job(cfg, run, dataset) as (job, tasks):
        learner: Any = job.learner  # a Ray actor handle
        job.learner_get(
            learner.start_rl.remote(RLHyperparams.from_config(cfg)), "start_rl", slow=True
        )
        extras = job.learner_get(
            learner.restore.remote(
                run.checkpoints,
                cfg.learner.max_checkpoints,
                run.reference if cfg.learner.kl_coef > 0 else None,
                cfg.learner.keep_best_by,
                cfg.learner.keep_best_mode,
            ),
            "restore",
            slow=True,
        )
        job.publish_weights()
        version = int(extras["policy_version"])
        job.start_orchestrator(state={}, policy_version=version)
        heldout = list(tasks.heldout)
        say(f"{cfg.env.name}: {len(heldout)} held-out tasks, greedy and {n} sampled each")
        greedy = job.evaluate(heldout)
        run.record_env_errors(greedy.pop("env_error_reports", ()))
        sampled = job.evaluate([t for t in heldout for _ in range(n)], temperature)
        run.record_env_errors(sampled.pop("env_error_reports", ()))
    per_task = [sampled["rewards"][i * n : (i + 1) * n] for i in range(len(heldout))]
    row = evaluation.env_summary(cfg.env.name, greedy["rewards"], per_task, k, temperature)
    row["statuses"] = {"greedy": greedy["statuses"], "sampled": sampled["statuses"]}
    restored = {"checkpoint_step": int(extras["rl_step"]), "policy_version": version}
    return row, restored
