"""The main job on local Ray, end to end, with a tiny model: both environments train
(switched by one config key), and a run resumes from its checkpoint with the same step
counter, optimizer state and data position."""

import json
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402

from raytunix.config import ConfigError, load_config  # noqa: E402
from raytunix.driver.run_dir import removed_if_left_empty as _removed_if_left_empty  # noqa: E402
from raytunix.driver.heldout import unfinished_episodes as _unfinished_episodes  # noqa: E402
from raytunix.train import RunDir, RunError, load_run_config, train  # noqa: E402

TINY = [
    "model.d_model=32",
    "model.n_layers=1",
    "model.n_heads=2",
    "model.n_kv_heads=1",
    "model.d_ff=64",
    "model.max_seq_len=128",
    "model.tokenizer_vocab_size=300",
    "data.train_size=300",
    "data.heldout_size=16",
    "eval.heldout_size=16",
    "warmup.max_steps=20",
    "warmup.min_steps=20",
    "warmup.eval_every=20",
    "warmup.eval_size=8",
    "warmup.batch_size=8",
    "rollout.group_size=2",
    "rollout.groups_per_batch=2",
    "rollout.max_concurrent_episodes=8",
    "rollout.max_new_tokens=32",
    "engine.max_batch_size=8",
    "env.num_env_actors=1",
    "learner.checkpoint_every=1",
    # A run of a few steps meets a few engine shapes; building all it could reach ahead
    # takes a core from it (test_compile_ahead.py and the disaggregated run below keep it on).
    "engine.compile_ahead=false",
]


def _rl_records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["phase"] == "rl"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "env_name,max_turns,placement,replicas",
    [
        ("calculator_math", 3, "colocated", 1),
        ("math_verifier", 1, "colocated", 1),
        # engine and learner in separate actors, two engine replicas behind the router
        ("calculator_math", 3, "disaggregated", 2),
    ],
)
def test_short_training_run_on_local_ray(
    ray_session, tmp_path, env_name, max_turns, placement, replicas
):
    # math_verifier: 3 steps in two profiling windows, the first step's (it compiles) and
    # one the last two share (a window of 1000 s closes at the last step, no checkpoint
    # between); the others close a window at every step (a checkpoint every step).
    shared = env_name == "math_verifier"
    steps = [1, 2, 3] if shared else [1, 2]
    cfg = load_config(
        None,
        TINY
        + [
            f"run.output_dir={tmp_path}",
            f"env.name={env_name}",
            f"env.max_turns={max_turns}",
            f"learner.rl_steps={len(steps)}",
            f"engine.placement={placement}",
            f"engine.num_replicas={replicas}",
            "rollout.adaptive_interval_s=0.2",
            f"engine.compile_ahead={placement == 'disaggregated'}",
        ]
        + (["run.profile_window_s=1000", "learner.checkpoint_every=3"] if shared else []),
    )
    summary = train(cfg)
    run_dir = summary["run_dir"]
    for name in ("config.yaml", "tokenizer.json", "metrics.jsonl", "summary.json", "state.json"):
        assert os.path.exists(os.path.join(run_dir, name)), name
    assert not os.path.exists(os.path.join(run_dir, "reference"))  # kl_coef=0: no KL reference
    records = _rl_records(run_dir)
    assert [r["step"] for r in records] == steps
    assert [r["policy_version"] for r in records] == steps
    if shared:
        assert [r["window_steps"] for r in records] == [1, 2, 2]
        window = ("window_s", "engine_busy_fraction", "trajectories_per_s")
        assert [records[1][k] for k in window] == [records[2][k] for k in window]
        assert records[1]["time"] < records[2]["time"]  # each stamped when its step ended
    else:
        assert all(r["window_steps"] == 1 for r in records)
    assert all(r["num_trajectories"] == 4 for r in records)
    assert all(r["staleness_max"] <= cfg.rollout.max_staleness for r in records)
    # Adaptive concurrency reads every replica (or the colocated engine) and stays in its
    # bounds: one group, and what admission lets in ((1 + 1) x 2 groups x 2).
    assert all(2 <= r["max_concurrent_episodes"] <= 8 for r in records)
    assert all(
        0.0 <= r["engine_busy_fraction_last_window"] <= 1.0
        for r in records
        if "engine_busy_fraction_last_window" in r
    )
    assert summary["env"] == env_name and summary["heldout_tasks"] == 16
    assert summary["engine_policy_version"] == len(steps)  # it got every update's weights
    assert 0.0 <= summary["heldout_success_after_rl"] <= 1.0
    if env_name == "math_verifier":
        assert all(r["turns_mean"] == 1.0 for r in records)  # single turn, no tool
    _check_profile(run_dir, summary, records, placement, replicas)


def _check_profile(run_dir, summary, records, placement, replicas):
    """Every run leaves its profile: a trace with a process per actor, the bottleneck
    report, the plots, TensorBoard scalars and per-step RL metrics."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for r in records:
        assert 0.0 <= r["engine_busy_fraction"] <= 1.0
        assert 0.0 <= r["learner_busy_fraction"] <= 1.0 and r["window_s"] > 0
        assert r["trajectories_per_s"] > 0 and r["spans_dropped"] == 0
    with open(os.path.join(run_dir, "trace.json")) as f:
        trace = json.load(f)
    names = {
        e["args"]["name"].split(" (host")[0]
        for e in trace["traceEvents"]
        if e.get("name") == "process_name"
    }
    expected = {"driver", "orchestrator", "env actor 0"}
    expected |= (
        {"policy (learner + engine)"}
        if placement == "colocated"
        else {"learner", *(f"engine {i}" for i in range(replicas))}
    )
    assert expected <= names, names
    report = open(os.path.join(run_dir, "report.txt")).read()
    assert summary["bottleneck"] in ("engine", "environment/tools", "learner", "orchestrator")
    assert f"Bounded by: {summary['bottleneck']}" in report
    assert os.path.getsize(os.path.join(run_dir, "profile.png")) > 0
    events = EventAccumulator(os.path.join(run_dir, "tensorboard", "rl"))  # a run per phase
    events.Reload()
    busy = events.Scalars("rl/engine_busy_fraction")
    assert [e.step for e in busy] == [r["step"] for r in records]


@pytest.mark.slow
def test_resume_continues_step_counter_optimizer_and_data_position(tiny_run, tmp_path):
    import shutil

    from raytunix.learner.checkpoint import Checkpointer

    run_dir = str(tmp_path / "run")
    shutil.copytree(tiny_run.path, run_dir)  # the shared run: 5 RL steps, a checkpoint each
    with open(os.path.join(run_dir, "state.json")) as f:
        state = json.load(f)
    assert state["checkpoint_step"] == 5
    ckpt = Checkpointer(os.path.join(run_dir, "checkpoints"))
    assert ckpt.latest_step() == 5
    ckpt.close()

    summary = train(None, resume=run_dir, resume_overrides=["learner.rl_steps=6"])
    records = _rl_records(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert [r["policy_version"] for r in records] == [1, 2, 3, 4, 5, 6]  # counter continued
    # Batches after the resume start where the checkpoint's data position left off.
    with open(os.path.join(run_dir, "state.json")) as f:
        resumed = json.load(f)
    assert resumed["checkpoint_step"] == 6
    assert resumed["data_position"] >= state["data_position"]
    assert summary["rl_steps"] == 6
    # Asking for fewer steps than the checkpoint holds is refused, not silently ignored.
    with pytest.raises(RunError, match="nothing left to train"):
        train(None, resume=run_dir, resume_overrides=["learner.rl_steps=5"])


# Rewards every reply by its share of digits: the tiny model never solves a task, but its
# samples differ in this, so every group has advantages and every update moves the weights.
DIGITS_ENV = '''
from raytunix.envs.base import BaseEnv
from raytunix.types import EpisodeStatus, StepResult


class DigitsEnv(BaseEnv):
    default_agent = "text"

    def _initial_observation(self, task):
        return task.question

    def _step_impl(self, action):
        text = action.text
        reward = sum(c.isdigit() for c in text) / max(len(text), 1)
        return StepResult("", reward, True, EpisodeStatus.COMPLETED)
'''

# Rollouts that replay exactly: one episode in flight at a time, on-policy
# (max_staleness=0), one engine that decodes one sequence at a time (a row's float sums then
# never depend on which other requests share its decode step), single-turn episodes. Two
# episodes in flight together reach the engine in an order that timing decides: under two
# test workers one run in three saw the optimizer state differ in its last bits.
DETERMINISTIC_ROLLOUTS = [
    "env.name=digits_env:DigitsEnv",
    "env.max_turns=1",
    "rollout.max_staleness=0",
    "rollout.adaptive_concurrency=false",
    "rollout.max_concurrent_episodes=1",
    "engine.max_batch_size=1",
    "engine.placement=colocated",
]


def _checkpoint_extras(run_dir, step):
    with open(os.path.join(run_dir, "checkpoints", str(step), "extras", "metadata")) as f:
        return json.load(f)


@pytest.mark.slow
def test_resume_is_bit_identical_to_an_uninterrupted_run(ray_session, tmp_path, monkeypatch):
    """A run stopped after its step-1 checkpoint and resumed ends with the same params,
    optimizer state, RNG and data ledger, bit for bit, as the run that went on."""
    import shutil

    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    (tmp_path / "digits_env.py").write_text(DIGITS_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_config(
        None,
        TINY
        + DETERMINISTIC_ROLLOUTS
        + [
            f"run.output_dir={tmp_path / 'runs'}",
            "learner.rl_steps=3",
            "learner.max_checkpoints=4",
        ],
    )
    uninterrupted = train(cfg)["run_dir"]

    # The run as it was when it stopped after step 1: its files, checkpoints up to step 1.
    stopped = str(tmp_path / "stopped")
    shutil.copytree(uninterrupted, stopped, ignore=shutil.ignore_patterns("2", "3"))
    with open(os.path.join(stopped, "state.json"), "w") as f:
        json.dump({"checkpoint_step": 1}, f)
    with open(os.path.join(uninterrupted, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    end = next(i for i, r in enumerate(records) if r["phase"] == "rl" and r["step"] == 1)
    with open(os.path.join(stopped, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records[: end + 1])
    train(cfg, resume=stopped)

    def saved(run_dir):
        path = os.path.join(run_dir, "checkpoints", "3", "state")
        with ocp.PyTreeCheckpointer() as checkpointer:
            return checkpointer.restore(path), _checkpoint_extras(run_dir, 3)

    (want, want_extras), (got, got_extras) = saved(uninterrupted), saved(stopped)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for path, a, b in zip(
        jax.tree_util.tree_flatten_with_path(want)[0], jax.tree.leaves(want), jax.tree.leaves(got)
    ):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=str(path[0]))
    got_orch, want_orch = got_extras["orchestrator"], want_extras["orchestrator"]
    for key in ("next_index", "ledger", "pending"):  # data position, ledger
        assert got_orch[key] == want_orch[key], key
    # The group that was in flight at step 1's checkpoint ran again after the resume: the
    # one count that tells the two runs apart.
    pending_at_stop = len(_checkpoint_extras(stopped, 1)["orchestrator"]["pending"])
    want_orch["counters"]["groups_started"] += pending_at_stop
    assert got_orch["counters"] == want_orch["counters"]
    steps = {r["step"]: r for r in _rl_records(stopped)}
    for r in _rl_records(uninterrupted)[1:]:  # steps 2 and 3, trained again after the resume
        assert r["grad_norm"] > 0  # the weights moved: equal params are not trivially equal
        for key in ("loss", "grad_norm", "reward_mean", "generated_tokens_mean", "policy_version"):
            assert steps[r["step"]][key] == r[key], (r["step"], key)


@pytest.mark.slow
def test_dataset_settings_reasoning_gym_refuses_stop_the_run_naming_the_keys(ray_session, tmp_path):
    # The config cannot know every dataset's rules: the dataset is built when the run
    # starts, and its refusal is the run's one error (the CLI prints it, exit 2).
    cfg = load_config(
        None, TINY + [f"run.output_dir={tmp_path}", "data.dataset_kwargs.min_terms=-1"]
    )
    with pytest.raises(RunError, match=r"min_terms must be positive; change data.dataset_kwargs"):
        train(cfg)
    assert os.listdir(tmp_path) == []  # stopped before training: no run directory is left


def test_resume_refuses_overrides_the_checkpoint_depends_on(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(load_config(None).to_yaml())
    d_model = load_config(None).model.d_model
    with pytest.raises(ConfigError, match="model.d_model cannot change when resuming") as e:
        load_run_config(str(run_dir), ["model.d_model=64"])
    assert f"the run has model.d_model={d_model}" in str(e.value)
    assert load_run_config(str(run_dir), ["learner.rl_steps=80"]).learner.rl_steps == 80
    # The run's own value repeated (a resume given the first command's overrides) is no change.
    assert load_run_config(str(run_dir), [f"model.d_model={d_model}"]).model.d_model == d_model
    (run_dir / "config.yaml").write_text("run: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_run_config(str(run_dir))


def test_an_evaluation_line_names_the_episodes_that_did_not_complete():
    broken = {
        "statuses": {"env_error": 8},
        "error": "step failed: RuntimeError('step always fails')",
    }
    assert _unfinished_episodes(broken) == (
        " (8 of 8 episodes ended env_error; first error: step failed: "
        "RuntimeError('step always fails'))"
    )
    assert (
        _unfinished_episodes({"statuses": {"completed": 6, "truncated": 2}, "error": ""})
        == " (2 of 8 episodes ended truncated)"
    )
    assert _unfinished_episodes({"statuses": {"completed": 8}, "error": ""}) == ""


def test_a_run_that_cannot_start_leaves_no_run_directory(tmp_path):
    output_dir = tmp_path / "runs"
    cfg = load_config(
        None,
        [
            "data.source=jsonl",
            f"data.path={tmp_path / 'nope.jsonl'}",
            f"run.output_dir={output_dir}",
        ],
    )
    with pytest.raises(ConfigError, match="nope.jsonl' does not exist"):
        train(cfg)
    assert not output_dir.exists() or not os.listdir(output_dir)

    # A later failure (env actors, prompts...) removes a new run's directory while it holds
    # only its config and tokenizer; one that got further, or a resumed run's, stays.
    def fail(run, new, extra=None):
        with pytest.raises(RuntimeError, match="env cannot be built"):
            with _removed_if_left_empty(run, new=new):
                for name in ("config.yaml", "tokenizer.json") + ((extra,) if extra else ()):
                    (tmp_path / os.path.basename(run.path) / name).write_text("x")
                raise RuntimeError("env cannot be built")
        return os.path.exists(run.path)

    assert not fail(RunDir(str(tmp_path / "new")), new=True)
    assert fail(RunDir(str(tmp_path / "warmed")), new=True, extra="metrics.jsonl")
    assert fail(RunDir(str(tmp_path / "resumed")), new=False)
    with _removed_if_left_empty(RunDir(str(tmp_path / "ok")), new=True):
        pass
    assert os.path.exists(tmp_path / "ok")
