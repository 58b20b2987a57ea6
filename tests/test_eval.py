"""`raytunix eval`: pass@k by the unbiased estimator, the per-env table and summary, the
errors of a bad request, and one evaluation of a freshly trained tiny run."""

import json
import os
import shutil
import subprocess

import pytest

from raytunix import evaluation
from raytunix.cli import main
from raytunix.config import ConfigError, load_config
from raytunix.driver.evaluate_run import check_request, env_config
from raytunix.driver.run_dir import RunDir, RunError

# --- pass@k (Chen et al. 2021: 1 - C(n-c, k) / C(n, k)) -----------------------------------


@pytest.mark.parametrize(
    "n, c, k, expected",
    [
        (4, 1, 1, 0.25),  # pass@1 is the success rate
        (5, 2, 2, 1 - 3 / 10),  # C(3,2)=3, C(5,2)=10
        (10, 3, 5, 1 - 21 / 252),  # C(7,5)=21, C(10,5)=252
        (6, 6, 3, 1.0),  # n = c: every draw succeeds
        (6, 0, 3, 0.0),  # c = 0: none does
        (3, 1, 3, 1.0),  # k = n: the draw is every episode, one of them a success
        (3, 0, 3, 0.0),
    ],
)
def test_pass_at_k_matches_hand_computed_values(n, c, k, expected):
    assert evaluation.pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_refuses_k_above_n_and_k_below_one():
    with pytest.raises(ValueError, match=r"k=5 sampled episodes per task, got n=3"):
        evaluation.pass_at_k(3, 1, 5)
    with pytest.raises(ValueError, match=r"k >= 1, got k=0"):
        evaluation.pass_at_k(3, 1, 0)
    with pytest.raises(ValueError, match=r"c=4"):
        evaluation.pass_at_k(3, 4, 1)


def test_pass_at_k_stays_finite_for_many_samples():
    # C(1000, 500) overflows a float; the product form does not.
    assert 0.0 < evaluation.pass_at_k(1000, 1, 500) == pytest.approx(0.5)


# --- the table and summary ---------------------------------------------------------------


def test_env_summary_from_episode_outcomes():
    greedy = [1.0, 0.0, 0.5, 1.0]  # success: reward >= 1.0; 0.5 is partial credit
    sampled = [[1.0, 0.0], [0.0, 0.0], [0.5, 1.0], [1.0, 1.0]]
    row = evaluation.env_summary("arithmetic", greedy, sampled, k=2, temperature=0.7)
    assert set(row) == set(evaluation.SUMMARY_KEYS)
    assert row["num_tasks"] == 4
    assert row["greedy_success_rate"] == 0.5
    assert row["greedy_reward_mean"] == pytest.approx(2.5 / 4)
    assert row["sampled_success_rate"] == pytest.approx(4 / 8)
    assert row["sampled_reward_mean"] == pytest.approx(4.5 / 8)
    assert row["pass_at_k"] == pytest.approx((1 + 0 + 1 + 1) / 4)  # n = k = 2: any success
    assert row["success_rule"] == "arithmetic: an episode succeeds when its reward >= 1"
    text = evaluation.table([row])
    assert "arithmetic" in text and "50.0%" in text and "75.0% (k=2)" in text
    assert "an episode succeeds when its reward >= 1" in text
    assert "2 episodes per task at temperature 0.7" in text


def test_env_summary_refuses_ragged_or_empty_outcomes():
    with pytest.raises(ValueError, match="same number of sampled episodes"):
        evaluation.env_summary("e", [1.0, 0.0], [[1.0], [0.0, 1.0]], k=1, temperature=1.0)
    with pytest.raises(ValueError, match="0 greedy and 0 sampled"):
        evaluation.env_summary("e", [], [], k=1, temperature=1.0)


# --- a bad request ---------------------------------------------------------------------


def _run_dir(tmp_path, checkpoint=True):
    run = RunDir(str(tmp_path / "run"))
    run.write_config(load_config("default"))
    if checkpoint:
        os.makedirs(os.path.join(run.checkpoints, "1"))
    return run.path


def test_a_missing_run_dir_is_named(tmp_path, capsys):
    missing = str(tmp_path / "nope")
    assert main(["eval", missing]) == 2
    assert f"run directory {missing!r} does not exist" in capsys.readouterr().err


def test_a_run_without_checkpoint_is_named(tmp_path):
    path = _run_dir(tmp_path, checkpoint=False)
    with pytest.raises(RunError, match="has no RL checkpoint to evaluate"):
        check_request(path, k=1, episodes=None)


def test_k_below_one_and_too_few_episodes_are_refused(tmp_path, capsys):
    path = _run_dir(tmp_path)
    assert main(["eval", path, "--k", "0"]) == 2
    assert "--k must be >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--episodes 2 is fewer than --k 3"):
        check_request(path, k=3, episodes=2)
    assert check_request(path, k=2, episodes=None) == 4


def test_an_unknown_env_is_named(tmp_path, capsys):
    path = _run_dir(tmp_path)
    with pytest.raises(ConfigError, match="--env 'no_such_env'"):
        env_config(path, "no_such_env")
    assert main(["eval", path, "--env", "no_such_env"]) == 2
    assert "no_such_env" in capsys.readouterr().err


# --- end to end ----------------------------------------------------------------------------


@pytest.mark.slow
def test_eval_of_a_trained_tiny_run(tiny_run, ray_session, tmp_path):
    """``raytunix eval`` as a user runs it, on (a copy of) the shared tiny run: ParityEnv,
    8 held-out tasks, 5 RL steps with a checkpoint after each."""
    from test_byo_env import REPO, TESTS_DIR

    run_dir = str(tmp_path / "run")
    shutil.copytree(tiny_run.path, run_dir)  # eval writes eval/ into it
    env = {
        **os.environ,
        "RAY_ADDRESS": ray_session.get_runtime_context().gcs_address,
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join(
            p for p in (REPO, TESTS_DIR, os.environ.get("PYTHONPATH")) if p
        ),
    }
    result = subprocess.run(
        ["python", "-m", "raytunix.cli", "eval", run_dir, "--k", "2", "--episodes", "3"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "pass@k" in result.stdout and "test_byo_env:ParityEnv" in result.stdout
    with open(os.path.join(run_dir, "eval", "summary.json")) as f:
        summary = json.load(f)
    assert summary["checkpoint_step"] == 5
    (row,) = summary["envs"]
    assert set(evaluation.SUMMARY_KEYS) <= set(row)
    assert row["num_tasks"] == 8 and row["sampled_episodes_per_task"] == 3 and row["k"] == 2
    for key in ("greedy_success_rate", "sampled_success_rate", "pass_at_k"):
        assert 0.0 <= row[key] <= 1.0
    assert row["pass_at_k"] >= row["sampled_success_rate"] - 1e-9  # pass@2 >= pass@1 per task
    assert sum(row["statuses"]["sampled"].values()) == 8 * 3


@pytest.mark.slow
def test_eval_every_logs_held_out_evaluations_at_the_named_steps(tiny_run):
    # The shared tiny run: learner.rl_steps=5, eval.every=2 (due after steps 2 and 4; step
    # 5's is the after_rl one), 8 held-out tasks.
    out = tiny_run.stdout
    with open(os.path.join(tiny_run.path, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    during = [r for r in records if r["phase"] == "eval" and r["when"] == "during_rl"]
    skipped = [r["step"] for r in records if r["phase"] == "eval_skipped"]
    # One runs at a time: the one due after step 4 is skipped if step 2's still runs.
    assert [r["step"] for r in during][:1] == [2]
    assert sorted([r["step"] for r in during] + skipped) == [2, 4]
    rl_versions = {r["step"]: r["policy_version"] for r in records if r["phase"] == "rl"}
    for r in during:
        assert r["policy_version"] == rl_versions[r["step"]]
        assert r["step"] <= r["finished_after_step"] <= 5
        assert r["num_tasks"] == 8 and 0.0 <= r["success_rate"] <= 1.0 and "reward_mean" in r
        assert f"held-out at RL step {r['step']} (policy version {r['policy_version']})" in out
    whens = [r["when"] for r in records if r["phase"] == "eval"]
    assert whens[0] == "before_rl" and whens[-1] == "after_rl"
