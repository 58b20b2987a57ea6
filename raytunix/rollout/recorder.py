"""The episode recorder: what happened to each episode, group and generated token, counted.

The rollout orchestrator (``raytunix.rollout.orchestrator``) hands every finished episode,
every group it gives up and every token kept from the loss to one ``EpisodeRecorder``; the
recorder's counters are what ``state()`` saves, ``stats()`` reports and each batch's info
carries, and its breaker is what stops a run whose episodes keep failing.
"""

from __future__ import annotations

import collections
from typing import Any, Sequence

from raytunix.envs.contract import EnvErrorTally
from raytunix.rollout.faults import FailureBreaker
from raytunix.types import (
    TOOL_ERRORS_KEY,
    EpisodeStatus,
    RolloutHalted,
    Trajectory,
    is_infrastructure_failure,
)

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


class EpisodeRecorder:
    """Counts episodes, groups and dropped tokens, tallies env errors, and holds the breaker.

    Owns:
      ``counters``: the run's counts, saved in the orchestrator's ``state()`` so they go on
        across a resume: ``episodes_<status>``, ``episodes_failed_infrastructure`` /
        ``_policy``, ``tool_errors`` (and ``tool_errors_<kind>``), ``engine_retries``,
        ``generated_tokens_dropped_<kind>``, and what the admission and the packer count
        in it (``groups_*``, ``episodes_restarted_*``, ``stale_tokens_*``).
      ``env_errors``: the ``EnvErrorTally`` (first report of each kind, counts by kind).
      the generated tokens kept from the loss since the last batch, by
        ``DROPPED_TOKEN_KINDS``.
      the breaker (``FailureBreaker``): ``max_consecutive_failures`` episodes in a row
        failed by infrastructure (engine down, env error, timeout) halt the run; 0 turns it
        off.

    Args:
      max_consecutive_failures: the breaker's threshold (see above).
      state: the orchestrator's ``state()`` to resume from (its ``counters`` and
        ``env_errors``), or None.

    Raises:
      ValueError: a negative ``max_consecutive_failures``.
    """

    def __init__(self, max_consecutive_failures: int, state: dict[str, Any] | None = None):
        state = state or {}
        self._breaker = FailureBreaker(max_consecutive_failures)
        self.counters: collections.Counter = collections.Counter(state.get("counters", {}))
        self.env_errors = EnvErrorTally(state.get("env_errors"))
        self._dropped: collections.Counter = collections.Counter()  # since the last batch

    def count_episode(self, t: Trajectory) -> RolloutHalted | None:
        """Counts one finished episode (status, tool errors, engine retries, its env error
        report) and records it with the breaker; returns the error to halt the run with
        when the breaker trips (see ``record_episode``)."""
        self.counters[f"episodes_{t.status.value}"] += 1
        if t.error_report is not None:
            self.env_errors.add(t.error_report)
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
        return self.record_episode(ok=not failed, failure=failure, env_raised=env_raised)

    def record_episode(
        self, ok: bool, failure: str, env_raised: bool = False
    ) -> RolloutHalted | None:
        """Records one episode with the breaker (``ok``: not failed by infrastructure;
        ``failure``: what went wrong, for the message; ``env_raised``: the environment's
        own exception rather than an outage). Returns the ``RolloutHalted`` to stop the run
        with once the breaker has tripped, else None."""
        if not self._breaker.record(ok, failure):
            return None
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
        return RolloutHalted(
            f"{what} The run stops here; checkpoints and the data ledger are kept. Resume "
            "once fixed, or raise the breaker's threshold (rollout.max_consecutive_failures;"
            " a resume may change it)."
        )

    def count_dropped(self, kind: str, trajectories: Sequence[Trajectory]) -> None:
        """Counts the generated tokens (loss mask 1) of ``trajectories`` as kept from the
        loss for ``kind`` (one of ``DROPPED_TOKEN_KINDS``)."""
        self.count_dropped_tokens(kind, sum(sum(t.loss_mask) for t in trajectories))

    def count_dropped_tokens(self, kind: str, tokens: int) -> None:
        """Counts ``tokens`` generated tokens as kept from the loss for ``kind``."""
        if tokens:
            self._dropped[kind] += int(tokens)
            self.counters[f"generated_tokens_dropped_{kind}"] += int(tokens)

    def take_batch_info(self) -> dict[str, Any]:
        """What a batch's info says of the time since the batch before, and resets it:
        ``env_error_reports`` and ``env_errors`` (``EnvErrorTally.take``), and
        ``generated_tokens_dropped_<kind>`` (tokens) for each of ``DROPPED_TOKEN_KINDS``."""
        info: dict[str, Any] = {}
        info["env_error_reports"], info["env_errors"] = self.env_errors.take()
        info.update(
            {
                f"generated_tokens_dropped_{kind}": self._dropped[kind]
                for kind in DROPPED_TOKEN_KINDS
            }
        )
        self._dropped.clear()
        return info

    def state(self) -> dict[str, Any]:
        """The JSON-able part of the resume state the recorder owns: ``counters`` and
        ``env_errors`` (counts by kind)."""
        return {"counters": dict(self.counters), "env_errors": dict(self.env_errors.counts)}
