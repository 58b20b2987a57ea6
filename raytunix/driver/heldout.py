"""Held-out evaluations of a run: the line each prints, and the periodic one that runs while
RL trains (``eval.every``).

A periodic evaluation is started after an RL step and collected after a later one, never
waited for inside the loop: the orchestrator plays its greedy episodes beside the training
episodes, on the same engines, while the learner goes on updating. Its episodes may so run
on policy versions newer than the one it started at (each record names that one and the
step it was collected after). One runs at a time; a due one is skipped while the last still
runs, and said so.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import ray

from raytunix.driver.run_dir import RunDir, say
from raytunix.types import EpisodeStatus, Task


def unfinished_episodes(result: dict[str, Any]) -> str:
    """For an evaluation's log line: " (8 of 8 episodes ended env_error; first error:
    <error>)" when some episodes did not complete (``result`` is
    ``RolloutOrchestrator.evaluate``'s), else "". A 0% success from a broken environment
    must not read as a policy that cannot solve anything."""
    statuses = result.get("statuses") or {}
    total = sum(statuses.values())
    other = {s: n for s, n in sorted(statuses.items()) if s != EpisodeStatus.COMPLETED.value}
    if not other:
        return ""
    ended = ", ".join(f"{n} of {total} episodes ended {s}" for s, n in other.items())
    error = result.get("error")
    return f" ({ended}" + (f"; first error: {error}" if error else "") + ")"


def heldout_line(label: str, result: dict[str, Any]) -> str:
    """The console line of one held-out evaluation, e.g. "held-out before RL: success
    61.0%, mean reward 0.610 (tool use 0.0%) on 200 tasks"."""
    return (
        f"held-out {label}: success {result['success_rate']:.1%}"
        f"{unfinished_episodes(result)}, mean reward {result['reward_mean']:.3f} (tool use "
        f"{result['tool_use_rate']:.1%}) on {result['num_tasks']} tasks"
    )


class PeriodicEval:
    """The held-out evaluation every ``every`` RL steps (``eval.every``; 0 = none), started
    after steps ``every``, ``2 * every``, ... before ``last_step`` (whose evaluation is the
    run's ``after_rl`` one) and logged when it is done as ``{"phase": "eval", "when":
    "during_rl", "step": started after, "policy_version": the version then,
    "finished_after_step", "eval_s", ...RolloutOrchestrator.evaluate's numbers}``."""

    def __init__(self, job, run: RunDir, heldout: Sequence[Task], every: int, last_step: int):
        self.job, self.run = job, run
        self.heldout = list(heldout)
        self.every = every if self.heldout else 0
        self.last_step = last_step
        self._pending: tuple[int, int, float, Any] | None = None  # step, version, t0, ref

    def after_step(self, step: int, policy_version: int) -> None:
        """After RL step ``step`` (the engines hold ``policy_version``): logs the running
        evaluation if it is done, then starts one if it is due. Never waits."""
        if self._pending is not None and ray.wait([self._pending[3]], timeout=0)[0]:
            self._log(step)
        if not self.every or step % self.every or step >= self.last_step:
            return
        if self._pending is not None:
            say(
                f"held-out at RL step {step}: skipped, the one started after step "
                f"{self._pending[0]} still runs (eval.every={self.every})"
            )
            self.run.log({"phase": "eval_skipped", "step": step, "running": self._pending[0]})
            return
        ref = self.job.start_evaluation(self.heldout)
        self._pending = (step, policy_version, time.monotonic(), ref)

    def finish(self, step: int, timeout_s: float) -> None:
        """At the end of the RL steps (``step`` the last): waits at most ``timeout_s``
        seconds for the running evaluation and logs it; one not done by then is said and
        dropped."""
        if self._pending is None:
            return
        if ray.wait([self._pending[3]], timeout=timeout_s)[0]:
            self._log(step)
            return
        say(f"held-out at RL step {self._pending[0]}: not done within {timeout_s:g} s; dropped")
        self._pending = None

    def _log(self, step: int) -> None:
        started, version, t0, ref = self._pending  # type: ignore[misc]
        self._pending = None
        try:
            result = ray.get(ref)
        except ray.exceptions.RayError as e:  # the run goes on; its after_rl one still runs
            say(f"held-out at RL step {started}: failed ({str(e)[:300]}); training goes on")
            return
        result.pop("rewards", None)
        self.run.record_env_errors(result.pop("env_error_reports", ()))
        self.run.log(
            {
                "phase": "eval",
                "when": "during_rl",
                "step": started,
                "policy_version": version,
                "finished_after_step": step,
                "eval_s": time.monotonic() - t0,
                **result,
            }
        )
        say(heldout_line(f"at RL step {started} (policy version {version})", result))
