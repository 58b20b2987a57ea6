"""Whether a run has anything to learn from: the learning signal of its RL steps.

Group-relative advantages (GRPO: Shao et al. 2024, arXiv:2402.03300; RLOO) compare the
samples of one task: a group whose rewards are all equal gives every member advantage 0
and the update no policy gradient. A batch made (almost) only of such groups teaches
nothing however fast it runs, so a run like that is told so before it is told how to go
faster.

Each RL step's record in ``metrics.jsonl`` carries its batch's
``zero_variance_group_fraction``, ``format_error_fraction``, ``tool_error_fraction``,
``truncated_fraction`` and ``reward_mean`` (``raytunix.rollout.packer.
learning_signal_metrics``) and the learner's ``grad_norm``. The rules, one setting each:

* a step has **no learning signal** when its ``zero_variance_group_fraction`` is at least
  ``run.no_signal_fraction`` (0.9);
* the driver warns on the console, and logs a ``{"phase": "learning_signal"}`` record, once
  ``run.no_signal_steps`` (3) steps in a row had none (``SignalWatch``); the run goes on;
* the report's verdict (``judge_learning``) is "no learning signal" when the share of
  zero-variance groups over all RL steps is at least ``run.no_signal_fraction``; it then
  leads the report and the throughput advice is held back.

This holds for the episode-level estimators (``learner.advantage_estimator`` grpo, rloo,
reinforce_pp: each subtracts its group's mean). GAE's advantages come from a value
estimate, which equal rewards within a group do not zero; such runs get the numbers
without a verdict or a warning.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

ZERO_VARIANCE = "zero_variance_group_fraction"

MOSTLY = 0.5
"""A share of trajectories with format errors, or truncated, at least this large is named
first in the advice of a run without learning signal (it is the likelier cause)."""


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _setting(settings: dict[str, Any], key: str) -> Any:
    """``section.name`` of a run's config (``config.yaml`` as a nested dict), else the
    setting's default."""
    from raytunix.config import settings as settings_of_config

    section, name = key.split(".")
    value = (settings.get(section) or {}).get(name) if isinstance(settings, dict) else None
    return settings_of_config()[key].default if value is None else value


GROUP_RELATIVE = ("grpo", "rloo", "reinforce_pp")  # learner.advantage_estimator choices


def no_signal(record: dict[str, Any], threshold: float) -> bool | None:
    """Whether the RL step of ``record`` had no learning signal (its share of zero-variance
    groups >= ``threshold``); None when the record does not say (an older run)."""
    share = _finite(record.get(ZERO_VARIANCE))
    return None if share is None else share >= threshold


def _equal_rewards(shares: list[float], threshold: float) -> str:
    """ "every group's rewards were equal" or "at least 90% of groups had equal rewards"."""
    if all(share >= 1.0 for share in shares):
        return "every group's rewards were equal"
    return f"at least {threshold:.0%} of groups had equal rewards"


def _capital(text: str) -> str:
    return text[:1].upper() + text[1:]


def remedies(dynamic_sampling: bool) -> str:
    """The three ways out of a run without learning signal, as one sentence."""
    sampling = (
        "make dynamic sampling find more groups whose rewards differ (it is on: "
        "rollout.dynamic_sampling; raise rollout.dynamic_sampling_max_filtered)"
        if dynamic_sampling
        else "enable dynamic sampling (rollout.dynamic_sampling=true)"
    )
    return f"add a warm start, shape the reward, or {sampling}"


@dataclasses.dataclass
class SignalWatch:
    """Watches the RL steps as they end and says, once, when ``steps`` in a row had no
    learning signal (``no_signal`` at ``threshold``); again only after a step with signal
    cleared it.

    Attributes:
      threshold: ``run.no_signal_fraction``.
      steps: ``run.no_signal_steps``; 0 turns the watch off.
      dynamic_sampling: ``rollout.dynamic_sampling``, for the advice.
    """

    threshold: float
    steps: int
    dynamic_sampling: bool = False
    in_a_row: int = dataclasses.field(default=0, init=False)
    warned: bool = dataclasses.field(default=False, init=False)
    # (zero-variance share, mean reward) of the steps in a row without signal, newest last
    _recent: list[tuple[float, float]] = dataclasses.field(
        default_factory=list, init=False, repr=False
    )

    @classmethod
    def from_config(cls, cfg: Any) -> SignalWatch:
        """The watch of a run's ``Config``; off (``steps`` 0) for a GAE run."""
        group_relative = cfg.learner.advantage_estimator in GROUP_RELATIVE
        return cls(
            cfg.run.no_signal_fraction,
            cfg.run.no_signal_steps if group_relative else 0,
            cfg.rollout.dynamic_sampling,
        )

    def observe(self, step: int, record: dict[str, Any]) -> dict[str, Any] | None:
        """Takes RL step ``step``'s record; returns a ``{"phase": "learning_signal"}``
        record when the state changes — ``signal`` False when the warning starts, True
        when the signal came back after one — with a ``message`` for the console; else
        None (a record that does not say counts neither way)."""
        none = no_signal(record, self.threshold)
        if self.steps <= 0 or none is None:
            return None
        share = float(record[ZERO_VARIANCE])
        if none:
            self.in_a_row += 1
            reward = _finite(record.get("reward_mean"))
            self._recent = (self._recent + [(share, math.nan if reward is None else reward)])[
                -self.steps :
            ]
            if self.warned or self.in_a_row < self.steps:
                return None
            self.warned = True
            shares, rewards = zip(*self._recent)
            message = (
                f"NO LEARNING SIGNAL: {_equal_rewards(list(shares), self.threshold)} on the "
                f"last {self.in_a_row} RL steps (steps {step - self.in_a_row + 1}-{step}; "
                f"mean reward {sum(rewards) / len(rewards):.3f}): every "
                f"advantage in those groups is 0, so the updates learn nothing. "
                f"{_capital(remedies(self.dynamic_sampling))}. The run goes on; report.txt "
                f"says more (run.no_signal_fraction={self.threshold:g}, "
                f"run.no_signal_steps={self.steps})."
            )
            return self._record(step, False, share, message)
        self.in_a_row, self._recent = 0, []
        if not self.warned:
            return None
        self.warned = False
        message = (
            f"learning signal back at RL step {step}: {share:.0%} of its groups had "
            f"equal rewards (below run.no_signal_fraction={self.threshold:g})."
        )
        return self._record(step, True, share, message)

    def _record(self, step: int, signal: bool, share: float, message: str) -> dict[str, Any]:
        return {
            "phase": "learning_signal",
            "step": step,
            "signal": signal,
            "steps_in_a_row": self.in_a_row,
            ZERO_VARIANCE: share,
            "no_signal_fraction": self.threshold,
            "no_signal_steps": self.steps,
            "message": message,
        }


@dataclasses.dataclass
class LearningVerdict:
    """Whether the run had anything to learn from.

    Attributes:
      signal: ``"none"`` (no learning signal), ``"ok"``, or ``"unknown"`` (no RL step
        record says: none logged, or a run from before these metrics; or a GAE run, whose
        advantages equal rewards within a group do not zero).
      summary: one sentence: the verdict, the deciding numbers, what to change.
      evidence: ``{name: value}``: shares in [0, 1] (means over the RL steps), rewards,
        the gradient norm, step counts.
      advice: what to change, most useful first (empty unless ``signal == "none"``).
    """

    signal: str
    summary: str
    evidence: dict[str, float]
    advice: list[str]


_MEANS = (
    "zero_variance_group_fraction",
    "format_error_fraction",
    "tool_error_fraction",
    "truncated_fraction",
    "reward_mean",
    "grad_norm",
)


def _means(steps: list[dict[str, Any]]) -> dict[str, float]:
    """Plain means over the steps that have each of ``_MEANS`` (every group counts alike:
    a batch holds ``rollout.groups_per_batch`` of them, whatever the step's length)."""
    out = {}
    for key in _MEANS:
        values = [v for v in (_finite(s.get(key)) for s in steps) if v is not None]
        if values:
            out[key] = sum(values) / len(values)
    return out


def judge_learning(
    steps: list[dict[str, Any]], settings: dict[str, Any] | None = None, warm_started: bool = False
) -> LearningVerdict:
    """The learning verdict from a run's RL step records (``collect.rl_steps``).

    Args:
      steps: the RL step records of ``metrics.jsonl``, oldest first.
      settings: the run's config as a nested dict (``config.yaml``): the thresholds
        (``run.no_signal_fraction``) and the settings the advice names.
      warm_started: the run had a warm start (``{"phase": "warmup"}`` records).
    """
    settings = settings if isinstance(settings, dict) else {}
    threshold = float(_setting(settings, "run.no_signal_fraction"))
    judged = [s for s in steps if no_signal(s, threshold) is not None]
    if not judged:
        return LearningVerdict(
            "unknown",
            "no RL step record has zero_variance_group_fraction "
            "(none logged yet, or a run from before it was logged).",
            {},
            [],
        )
    means = _means(judged)
    without = [s for s in judged if no_signal(s, threshold)]
    evidence = {
        **means,
        "steps_without_signal": float(len(without)),
        "steps_judged": float(len(judged)),
    }
    rewards = [_finite(s.get("reward_mean")) for s in judged]
    if rewards[0] is not None and rewards[-1] is not None:
        evidence.update(reward_mean_first=rewards[0], reward_mean_last=rewards[-1])
    estimator = _setting(settings, "learner.advantage_estimator")
    if estimator not in GROUP_RELATIVE:
        return LearningVerdict(
            "unknown",
            (
                f"learner.advantage_estimator={estimator}: its advantages come from a value "
                "estimate, which equal rewards within a group do not zero; read the numbers "
                "below."
            ),
            evidence,
            [],
        )
    if means[ZERO_VARIANCE] < threshold:
        return LearningVerdict(
            "ok",
            (
                f"learning signal: {means[ZERO_VARIANCE]:.0%} of groups had equal rewards "
                f"(below run.no_signal_fraction={threshold:g}); {len(without)} of {len(judged)} "
                f"RL steps had none."
            ),
            evidence,
            [],
        )
    never = all(r == 0.0 for r in rewards)
    advice = _no_signal_advice(means, settings, warm_started)
    # A mean at or over the threshold has at least one step at or over it.
    equal = _equal_rewards([float(s[ZERO_VARIANCE]) for s in without], threshold)
    summary = (
        f"no learning signal: {equal} on {len(without)} of {len(judged)} RL steps (mean reward "
        f"{means.get('reward_mean', float('nan')):.3f}"
        f"{', no trajectory earned any reward' if never else ''}): every advantage in "
        f"those groups is 0, so the updates learned nothing; "
        f"{remedies(bool(_setting(settings, 'rollout.dynamic_sampling')))}."
    )
    return LearningVerdict("none", summary, evidence, advice)


def _no_signal_advice(
    means: dict[str, float], settings: dict[str, Any], warm_started: bool
) -> list[str]:
    """What to change in a run without learning signal, likeliest cause first."""
    advice = []
    formats = means.get("format_error_fraction", 0.0)
    if formats >= MOSTLY:
        advice.append(
            f"{formats:.0%} of trajectories had format errors (a turn with no "
            "answer or tool call, or several): the policy has not learned the reply "
            "format, which a warm start on demonstrations teaches"
        )
    truncated = means.get("truncated_fraction", 0.0)
    if truncated >= MOSTLY:
        advice.append(
            f"{truncated:.0%} of trajectories were truncated: raise "
            f"rollout.max_new_tokens ({_setting(settings, 'rollout.max_new_tokens')}) "
            f"or env.max_turns ({_setting(settings, 'env.max_turns')})"
        )
    if warm_started:
        advice.append(
            f"a longer warm start (warmup.max_steps "
            f"{_setting(settings, 'warmup.max_steps')} -> more): the policy it "
            "left earns too little reward for its samples to differ"
        )
    else:
        advice.append(
            "add a warm start: supervised steps on demonstrations of the task "
            "before RL, so that some samples earn reward (warmup.demonstrations=FILE, "
            "an environment expert's demonstrate(task), or arithmetic tasks)"
        )
    advice.append(
        "shape the reward: partial credit (for the format, for progress, for "
        "being close) makes the samples of a group differ"
    )
    if _setting(settings, "rollout.dynamic_sampling"):
        advice.append(
            "dynamic sampling is on (rollout.dynamic_sampling) and still found too "
            "few groups whose rewards differ: raise "
            "rollout.dynamic_sampling_max_filtered, or fix the causes above first"
        )
    else:
        advice.append(
            "enable dynamic sampling (rollout.dynamic_sampling=true): groups whose "
            "rewards are all equal are filtered and other tasks sampled in their "
            "place (at most rollout.dynamic_sampling_max_filtered per batch)"
        )
    size = _setting(settings, "rollout.group_size")
    advice.append(
        f"more samples per task (rollout.group_size {size} -> {2 * int(size)}): more "
        "chances that one of them earns a different reward"
    )
    return advice


_ROWS = (
    (ZERO_VARIANCE, "groups with equal rewards (no advantage)", "pct"),
    ("format_error_fraction", "trajectories with format errors", "pct"),
    ("tool_error_fraction", "  with format or tool-call errors", "pct"),
    ("truncated_fraction", "trajectories truncated", "pct"),
    ("reward_mean", "mean reward", "num"),
    ("grad_norm", "gradient norm (before clipping)", "num"),
)


def learning_lines(verdict: LearningVerdict) -> list[str]:
    """The report's "Learning signal" section: the verdict, its advice when there is no
    signal, and the per-step means."""
    if not verdict.evidence:
        return ["Learning signal: unknown", f"  {verdict.summary}", ""]
    lines = [f"Learning signal: {verdict.signal}", f"  {verdict.summary}", ""]
    if verdict.advice:
        lines += ["What to change first (before any throughput advice):"]
        lines += [f"  - {a}" for a in verdict.advice] + [""]
    e = verdict.evidence
    lines.append(f"Learning signal, means over {e['steps_judged']:.0f} RL step(s):")
    lines += [
        f"  {label:<42} {e[key]:.1%}" if fmt == "pct" else f"  {label:<42} {e[key]:.4g}"
        for key, label, fmt in _ROWS
        if key in e
    ]
    lines.append(
        f"  {'RL steps without signal':<42} {e['steps_without_signal']:.0f} of "
        f"{e['steps_judged']:.0f}"
    )
    if "reward_mean_first" in e:
        lines.append(
            f"  {'mean reward, first step -> last':<42} {e['reward_mean_first']:.4g} "
            f"-> {e['reward_mean_last']:.4g}"
        )
    return lines + [""]
