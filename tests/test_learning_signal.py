"""A run that says when it is not learning: the batch's learning-signal metrics, the
report's "Learning signal" verdict and its precedence over throughput advice, the
driver's console warning, the held-out mean reward, and one end-to-end run whose
environment never rewards."""

import json
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402
import yaml  # noqa: E402

from raytunix.config import load_config  # noqa: E402
from raytunix.driver import steps  # noqa: E402
from raytunix.driver.run_dir import RunDir  # noqa: E402
from raytunix.profiling.learning import SignalWatch, judge_learning  # noqa: E402
from raytunix.profiling.report import render_report  # noqa: E402
from raytunix.rollout.orchestrator import evaluation_result  # noqa: E402
from raytunix.rollout.packer import learning_signal_metrics  # noqa: E402
from raytunix.types import EpisodeStatus, Trajectory  # noqa: E402

LEARNER_ADVICE = "fewer trajectories per batch"  # what a learner-bound run is told


def _trajectory(reward, status=EpisodeStatus.COMPLETED, group="g", **metrics):
    return Trajectory(
        "t", group, [1, 2], [0, 1], [0.0, -0.5], [-1, 0], reward, status, 1, dict(metrics)
    )


def _step(n, zero_variance, reward=0.0, **extra):
    """An RL step record of a learner-bound run (the learner busy 90%, never waiting)."""
    return {
        "phase": "rl",
        "step": n,
        "window_s": 1.0,
        "learner_busy_fraction": 0.9,
        "learner_wait_fraction": 0.05,
        "zero_variance_group_fraction": zero_variance,
        "reward_mean": reward,
        "format_error_fraction": 0.0,
        "tool_error_fraction": 0.0,
        "truncated_fraction": 0.0,
        "grad_norm": 0.0,
        **extra,
    }


def _run_dir(path, records, overrides=()):
    path.mkdir(parents=True, exist_ok=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (path / "config.yaml").write_text(load_config(None, list(overrides)).to_yaml())
    return str(path)


# -- the batch's metrics -------------------------------------------------------------------


def test_a_batch_counts_groups_with_equal_rewards_and_trajectories_with_errors():
    solved = [_trajectory(1.0), _trajectory(1.0)]  # equal: no advantage
    mixed = [_trajectory(1.0), _trajectory(0.0, EpisodeStatus.TRUNCATED)]
    # the failed member is left out of the group's statistics: the other two are equal
    failed = [
        _trajectory(0.0, **{"tool_errors": 2.0, "tool_errors/format": 2.0}),
        _trajectory(0.0, **{"tool_errors": 1.0, "tool_errors/bad_json": 1.0}),
        _trajectory(0.0, EpisodeStatus.ENV_ERROR),
    ]
    metrics = learning_signal_metrics([solved, mixed, failed])
    assert metrics["zero_variance_group_fraction"] == pytest.approx(2 / 3)
    assert metrics["reward_mean"] == pytest.approx(3 / 7)
    assert metrics["format_error_fraction"] == pytest.approx(1 / 7)
    assert metrics["tool_error_fraction"] == pytest.approx(2 / 7)  # format or tool call
    assert metrics["truncated_fraction"] == pytest.approx(1 / 7)
    assert learning_signal_metrics([])["zero_variance_group_fraction"] == 0.0


def test_held_out_evaluation_reports_mean_reward_beside_success_at_reward_one():
    rewards = [1.0, 0.5, 0.0, 0.25, 1.5]  # partial credit counts in the mean only
    result = evaluation_result([_trajectory(r) for r in rewards])
    assert result["success_rate"] == pytest.approx(2 / 5)  # reward >= 1
    assert result["reward_mean"] == pytest.approx(3.25 / 5)
    assert result["num_tasks"] == 5 and result["statuses"] == {"completed": 5}


# -- the report's verdict ------------------------------------------------------------------


def test_equal_rewards_on_every_step_lead_the_report_and_hold_back_the_learner_advice(tmp_path):
    run = _run_dir(tmp_path / "run", [_step(n, 1.0) for n in (1, 2, 3, 4)])
    text, verdict = render_report(run)
    assert verdict.resource == "learner"  # still what bounded throughput
    assert verdict.learning.signal == "none" and verdict.advice == []
    assert LEARNER_ADVICE not in text and LEARNER_ADVICE not in verdict.summary
    assert text.index("Learning signal: none") < text.index("Bounded by: learner")
    assert (
        "no learning signal: every group's rewards were equal on 4 of 4 RL steps (mean "
        "reward 0.000, no trajectory earned any reward)"
    ) in text
    assert (
        "add a warm start, shape the reward, or enable dynamic sampling "
        "(rollout.dynamic_sampling=true)" in text
    )
    assert "groups with equal rewards (no advantage)   100.0%" in text
    assert "RL steps without signal                    4 of 4" in text


def test_a_learning_run_keeps_its_throughput_advice_and_reads_ok(tmp_path):
    records = [
        _step(n, share, reward=0.1 * n, grad_norm=0.5)
        for n, share in zip((1, 2, 3, 4), (0.25, 0.5, 1.0, 0.0))
    ]
    text, verdict = render_report(_run_dir(tmp_path / "run", records))
    assert verdict.learning.signal == "ok"
    assert LEARNER_ADVICE in verdict.advice[0]
    assert text.index("Bounded by: learner") < text.index("Learning signal: ok")
    assert (
        "44% of groups had equal rewards (below run.no_signal_fraction=0.9); 1 of 4 RL "
        "steps had none" in text
    )
    assert "mean reward, first step -> last            0.1 -> 0.4" in text
    assert "gradient norm (before clipping)            0.5" in text


def test_the_threshold_is_the_runs_setting_and_the_advice_names_the_likely_cause(tmp_path):
    records = [_step(n, 0.75, format_error_fraction=0.8) for n in (1, 2, 3)]
    assert judge_learning(records).signal == "ok"  # 75% < the default 0.9
    settings = yaml.safe_load(
        load_config(
            None,
            ["run.no_signal_fraction=0.7", "rollout.dynamic_sampling=true", "rollout.group_size=4"],
        ).to_yaml()
    )
    verdict = judge_learning(records, settings, warm_started=True)
    assert verdict.signal == "none"
    assert "at least 70% of groups had equal rewards on 3 of 3 RL steps" in verdict.summary
    assert verdict.advice[0].startswith("80% of trajectories had format errors")
    assert any("a longer warm start (warmup.max_steps 1400 -> more)" in a for a in verdict.advice)
    assert any(
        "dynamic sampling is on" in a and "rollout.dynamic_sampling_max_filtered" in a
        for a in verdict.advice
    )
    assert any("rollout.group_size 4 -> 8" in a for a in verdict.advice)


def test_a_run_from_before_these_metrics_gets_no_learning_verdict(tmp_path):
    records = [
        {k: v for k, v in _step(n, 1.0).items() if k != "zero_variance_group_fraction"}
        for n in (1, 2)
    ]
    text, verdict = render_report(_run_dir(tmp_path / "run", records))
    assert verdict.learning.signal == "unknown"
    assert LEARNER_ADVICE in verdict.advice[0]  # judged on throughput as before


def test_a_gae_run_gets_the_numbers_but_no_group_verdict_and_no_warning(tmp_path):
    cfg = load_config(None, ["learner.advantage_estimator=gae"])
    records = [_step(n, 1.0) for n in (1, 2, 3, 4)]
    verdict = judge_learning(records, yaml.safe_load(cfg.to_yaml()))
    assert verdict.signal == "unknown" and "learner.advantage_estimator=gae" in verdict.summary
    assert verdict.evidence["zero_variance_group_fraction"] == 1.0
    watch = SignalWatch.from_config(cfg)
    assert [watch.observe(n, r) for n, r in enumerate(records, start=1)] == [None] * 4


# -- the console warning -------------------------------------------------------------------


def test_the_driver_warns_once_after_k_steps_without_signal_and_again_after_it_came_back(
    tmp_path, capsys
):
    cfg = load_config(None, ["run.no_signal_steps=2"])
    watch, run = SignalWatch.from_config(cfg), RunDir(str(tmp_path / "run"))
    shares = [1.0, 0.95, 1.0, 1.0, 0.5, 1.0, 1.0]  # warned at 2, cleared at 5, warned at 7
    for n, share in enumerate(shares, start=1):
        steps.watch_learning_signal(watch, run, n, _step(n, share, reward=0.1 * (n % 2)))
    out = capsys.readouterr().out.splitlines()
    warnings = [line for line in out if "NO LEARNING SIGNAL" in line]
    assert len(warnings) == 2 and len(out) == 3
    assert (
        "at least 90% of groups had equal rewards on the last 2 RL steps (steps 1-2; "
        "mean reward 0.050)"
    ) in warnings[0]  # over those steps
    assert "every group's rewards were equal on the last 2 RL steps (steps 6-7" in warnings[1]
    assert "enable dynamic sampling (rollout.dynamic_sampling=true)" in warnings[0]
    assert "The run goes on" in warnings[0]
    assert "learning signal back at RL step 5: 50% of its groups" in out[1]
    with open(run.metrics) as f:
        logged = [json.loads(line) for line in f]
    assert [(r["phase"], r["step"], r["signal"]) for r in logged] == [
        ("learning_signal", 2, False),
        ("learning_signal", 5, True),
        ("learning_signal", 7, False),
    ]


def test_no_signal_steps_zero_turns_the_warning_off(tmp_path, capsys):
    watch = SignalWatch.from_config(load_config(None, ["run.no_signal_steps=0"]))
    run = RunDir(str(tmp_path / "run"))
    for n in range(1, 6):
        steps.watch_learning_signal(watch, run, n, _step(n, 1.0))
    assert capsys.readouterr().out == "" and not os.path.exists(run.metrics)


# -- end to end ----------------------------------------------------------------------------

NEVER_ENV = '''
from raytunix.envs.base import BaseEnv
from raytunix.types import EpisodeStatus, StepResult


class NeverRewardEnv(BaseEnv):
    default_agent = "text"

    def _initial_observation(self, task):
        return task.question

    def _step_impl(self, action):
        return StepResult("", 0.0, True, EpisodeStatus.COMPLETED)
'''


@pytest.mark.slow
def test_a_run_whose_environment_never_rewards_says_it_is_not_learning(
    ray_session, tmp_path, monkeypatch, capsys
):
    from test_train import TINY  # the tiny run of tests/test_train.py

    from raytunix.train import train

    (tmp_path / "never_env.py").write_text(NEVER_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_config(
        None,
        TINY
        + [
            f"run.output_dir={tmp_path / 'runs'}",
            "env.name=never_env:NeverRewardEnv",
            "env.max_turns=1",
            "warmup.enabled=false",
            "learner.rl_steps=3",
            "run.no_signal_steps=2",
            # Few tasks and one checkpoint: the verdict needs three steps, nothing more.
            "data.train_size=32",
            "data.heldout_size=2",
            "eval.heldout_size=2",
            "learner.checkpoint_every=3",
        ],
    )
    summary = train(cfg)
    out = capsys.readouterr().out
    assert out.count("NO LEARNING SIGNAL") == 1, out
    assert "on the last 2 RL steps (steps 1-2" in out
    with open(os.path.join(summary["run_dir"], "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    rl = [r for r in records if r["phase"] == "rl"]
    assert [r["zero_variance_group_fraction"] for r in rl] == [1.0, 1.0, 1.0]
    assert all(r["reward_mean"] == 0.0 and "grad_norm" in r for r in rl)
    signal = [r for r in records if r["phase"] == "learning_signal"]
    assert [(r["step"], r["signal"]) for r in signal] == [(2, False)]
    report = open(os.path.join(summary["run_dir"], "report.txt")).read()
    assert "Learning signal: none" in report
    assert "every group's rewards were equal on 3 of 3 RL steps" in report
    assert LEARNER_ADVICE not in report and "\nWhat to change:\n" not in report  # held back
    assert summary["learning_signal"] == "none"
    assert LEARNER_ADVICE not in summary["bottleneck_summary"]
    assert summary["heldout_reward_mean_before_rl"] == 0.0
    assert summary["heldout_reward_mean_after_rl"] == 0.0
    assert "mean reward 0.000" in out  # the held-out lines
