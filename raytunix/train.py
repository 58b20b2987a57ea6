"""The main job: warm start, then asynchronous GRPO on Ray, then a summary.

    driver ─► PolicyActor (learner + engine, colocated) or LearnerActor + EngineActor
          ─► EnvActor pool (environments, no JAX)
          ─► OrchestratorActor (episodes as coroutines, Arrow batches in the object store)

``train`` reads top to bottom: open (or reopen) the run directory, start the actors,
then either restore the newest RL checkpoint or warm start, evaluate and begin RL; the RL
loop; the evaluation after it; the summary. The steps live in ``raytunix.driver``, each
testable on its own. ``train(cfg)`` starts local Ray itself when no cluster is connected.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Sequence
from typing import Any

import ray

from raytunix.config import Config
from raytunix.driver import steps
from raytunix.driver.job import Job, started_job
from raytunix.driver.prepare import connect_ray
from raytunix.driver.run_dir import (
    RESUME_OVERRIDABLE,
    RunDir,
    RunError,
    load_run_config,
    removed_if_left_empty,
)

__all__ = [
    "RESUME_OVERRIDABLE",
    "Job",
    "RunDir",
    "RunError",
    "load_run_config",
    "main_train",
    "train",
]


def train(
    cfg: Config | None, resume: str | None = None, resume_overrides: Sequence[str] = ()
) -> dict[str, Any]:
    """Runs the main job; returns the summary (also saved as ``summary.json``).

    Args:
      cfg: the run config (None or ignored when resuming: the run's own config is used).
      resume: a run directory to continue from its newest RL checkpoint, else from its
        warm start's progress, else from the beginning.
      resume_overrides: ``section.key=value`` changes to the resumed run's config, e.g.
        ``learner.rl_steps=80`` to train further; saved back to its config.yaml.

    Raises:
      FileNotFoundError: ``resume`` is not a run directory.
      ConfigError: a bad override or dataset.
      RunError: the run cannot go on (the message says why and what to do).
    """
    wall0 = time.monotonic()
    cfg, run, dataset = steps.open_run(cfg, resume, resume_overrides)
    try:
        with contextlib.closing(run), removed_if_left_empty(run, new=not resume):
            connect_ray()
            with (
                started_job(cfg, run, dataset) as (job, tasks),
                steps.profiled(cfg, job, run) as collector,
            ):
                if run.has_rl_checkpoint():
                    start = steps.restore_rl(cfg, job, run)
                else:
                    job.start_orchestrator(state={}, policy_version=0)  # RL data from the start
                    warm = steps.warm_start(cfg, job, run, tasks, collector)
                    before = steps.evaluate(job, run, tasks.heldout, collector, "before_rl", step=0)
                    start = steps.begin_rl(cfg, job, run, before, warm)
                rl_s = steps.rl_loop(cfg, job, run, start, collector, tasks.heldout)
                engine_stats = job.engine_stats()  # before the evaluation adds its own decoding
                after = steps.evaluate(
                    job, run, tasks.heldout, collector, "after_rl", step=cfg.learner.rl_steps
                )
                steps.export_policy(cfg, job, run)
                return steps.summarise(
                    cfg, job, run, start, after, engine_stats, rl_s, wall0, tasks.dropped
                )
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (driver.prepare turns it into this)
        # The CLI's message names the directory to resume, or none when it was removed.
        e.run_dir = run.path if os.path.isdir(run.path) else None
        raise


def main_train(
    cfg: Config | None, resume: str | None = None, resume_overrides: Sequence[str] = ()
) -> int:
    """``train``, then Ray shut down whatever happened; 0 once the run has its summary."""
    try:
        summary = train(cfg, resume, resume_overrides)
    finally:
        if ray.is_initialized():
            ray.shutdown()
    return 0 if summary else 1
