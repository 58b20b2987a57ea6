"""The driver's steps (``raytunix.driver``) one at a time, and the promises a resume keeps:
``--resume`` with ``--config`` is refused, an unknown key on resume is reported as
unknown, and a run stopped during its warm start goes on from there."""

import json
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np
import pytest
import ray
from test_train import TINY  # the tiny run of tests/test_train.py

from raytunix.config import ConfigError, load_config
from raytunix.driver import prepare, steps
from raytunix.driver.run_dir import RunDir, RunError, load_run_config, new_run_dir


def _run_dir_with_config(tmp_path, overrides=()):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(load_config(None, list(overrides)).to_yaml())
    return run_dir


# -- resume's promises, before anything starts ---------------------------------------------


def test_resume_with_config_is_refused_before_anything_runs(tmp_path, capsys):
    from raytunix.cli import main

    run_dir = _run_dir_with_config(tmp_path)
    assert main(["train", "--resume", str(run_dir), "--config", "default"]) == 2
    err = capsys.readouterr().err
    assert "--config default cannot be combined with --resume" in err
    assert str(run_dir / "config.yaml") in err  # which config a resume keeps
    assert "learner.rl_steps=80" in err  # and what to pass instead
    assert sorted(os.listdir(run_dir)) == ["config.yaml"]  # nothing ran


def test_an_unknown_key_on_resume_is_reported_as_unknown(tmp_path):
    run_dir = _run_dir_with_config(tmp_path)
    with pytest.raises(ConfigError) as e:
        load_run_config(str(run_dir), ["learner.no_such_key=1"])
    message = str(e.value)
    assert "unknown key 'learner.no_such_key'" in message
    assert "valid keys in 'learner'" in message and "rl_steps" in message
    assert "cannot change when resuming" not in message
    with pytest.raises(ConfigError, match="unknown section 'nope'"):
        load_run_config(str(run_dir), ["nope.rl_steps=1"])
    with pytest.raises(ConfigError, match="is not an integer"):  # checked as for a new run
        load_run_config(str(run_dir), ["learner.rl_steps=many"])
    # A known key the checkpoint depends on is still refused for that reason.
    with pytest.raises(ConfigError, match="model.d_model cannot change when resuming"):
        load_run_config(str(run_dir), ["model.d_model=64"])
    with pytest.raises(ConfigError, match="env.kwargs cannot change when resuming"):
        load_run_config(str(run_dir), ["env.kwargs.turns=2"])
    resumed = load_run_config(str(run_dir), ["learner.rl_steps=80", "learner.checkpoint_every=5"])
    assert (resumed.learner.rl_steps, resumed.learner.checkpoint_every) == (80, 5)


# -- start or restore: the run directory -----------------------------------------------------


def test_open_run_makes_a_new_directory_or_reopens_a_stopped_run(tmp_path):
    cfg = load_config(None, TINY + [f"run.output_dir={tmp_path / 'runs'}", "learner.rl_steps=3"])
    cfg, run, dataset = steps.open_run(cfg, None)
    assert os.path.dirname(run.path) == str(tmp_path / "runs")
    assert sorted(os.listdir(run.path)) == ["config.yaml", "driver.lock"]
    assert dataset is None  # the calculator env brings its own tasks, made in an env actor
    assert not run.has_rl_checkpoint()
    run.unlock()  # as train() does when it ends

    # Stopped before any checkpoint (e.g. in its warm start): it reopens, with its own
    # config and the overrides saved back.
    again, reopened, _ = steps.open_run(None, run.path, ["learner.rl_steps=5"])
    reopened.unlock()
    assert reopened.path == run.path and again.learner.rl_steps == 5
    assert load_run_config(run.path).learner.rl_steps == 5
    assert again.model == cfg.model  # everything else is the run's own

    # With an RL checkpoint: too few steps left stops before Ray starts.
    reopened.write_state({"checkpoint_step": 5, "data_position": 40})
    assert reopened.has_rl_checkpoint()
    with pytest.raises(RunError, match="nothing left to train"):
        steps.open_run(None, run.path)
    with pytest.raises(FileNotFoundError, match="not a raytunix run directory"):
        steps.open_run(None, str(tmp_path / "runs"))


def test_a_committed_checkpoint_directory_counts_even_before_state_json(tmp_path):
    run = RunDir(str(tmp_path / "run"))
    os.makedirs(os.path.join(run.checkpoints, "0.orbax-checkpoint-tmp-12"))
    assert not run.has_rl_checkpoint()  # a save that never committed
    os.makedirs(os.path.join(run.checkpoints, "0"))
    assert run.has_rl_checkpoint()  # committed; the run stopped before writing state.json


def test_new_run_dir_names_do_not_collide_and_a_bad_output_dir_is_named(tmp_path):
    cfg = load_config(None, [f"run.output_dir={tmp_path}", "run.name=x"])
    first, second = new_run_dir(cfg), new_run_dir(cfg)
    assert first.path != second.path and os.path.basename(second.path).startswith("x-")
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="run.output_dir=.*cannot be created"):
        new_run_dir(load_config(None, [f"run.output_dir={tmp_path / 'file' / 'runs'}"]))


# -- warm start: the learner's part of resuming it -----------------------------------------


@pytest.mark.slow
def test_a_warm_start_restored_after_k_steps_trains_on_bit_identically(tmp_path):
    """k SFT steps, a warm-start checkpoint, k more: a learner restored from it (another
    init, another seed) ends where the uninterrupted one does, rows drawn included."""
    import jax

    from raytunix.learner.checkpoint import Checkpointer
    from raytunix.learner.learner import Learner, SFTHyperparams
    from raytunix.models.llama import ModelConfig

    config = ModelConfig(
        vocab_size=16, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64, max_seq_len=16
    )
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 16, size=(12, 16)).astype(np.int32)
    mask = (rng.random((12, 16)) > 0.3).astype(np.float32)
    hp = SFTHyperparams(learning_rate=1e-2, warmup_steps=2)

    ckpt = Checkpointer(str(tmp_path / "warmup"), max_to_keep=1)
    uninterrupted = Learner(config, seed=3)
    uninterrupted.start_warmup(hp)
    uninterrupted.sft_steps(tokens, mask, 3, 4)
    uninterrupted.save_warmup(ckpt, 3, {"warmup_steps": 3, "warmup_s": 1.5, "done": False})
    want = uninterrupted.sft_steps(tokens, mask, 3, 4)  # trains on while step 3 is written
    ckpt.close()

    resumed = Learner(config, seed=11)
    resumed.start_warmup(hp)
    assert resumed.restore_warmup(Checkpointer(str(tmp_path / "empty"))) is None
    ckpt = Checkpointer(str(tmp_path / "warmup"), max_to_keep=1)
    assert resumed.restore_warmup(ckpt) == {"warmup_steps": 3, "warmup_s": 1.5, "done": False}
    got = resumed.sft_steps(tokens, mask, 3, 4)
    assert (got["loss"], got["loss_last"]) == (want["loss"], want["loss_last"])
    assert jax.tree.structure(resumed._state) == jax.tree.structure(uninterrupted._state)
    for a, b in zip(jax.tree.leaves(uninterrupted._state), jax.tree.leaves(resumed._state)):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a))  # params, moments, rng
    resumed.start_rl(_grpo_hp())
    with pytest.raises(RuntimeError, match="for the warm start"):
        resumed.save_warmup(ckpt, 6, {})


def _grpo_hp():
    from raytunix.learner.learner import RLHyperparams

    return RLHyperparams(temperature=1.0, top_k=0, top_p=1.0, rl_steps=1)


# -- the steps on Ray: a run stopped in its warm start ---------------------------------------

# Two warm-start checks of 10 steps, single-turn episodes, few and short evaluations, and
# no RL step (checkpoint 0 only): the cheapest run that has a warm start to stop in.
WARM = TINY + [
    "env.name=math_verifier",
    "env.max_turns=1",
    "warmup.max_steps=20",
    "warmup.min_steps=20",
    "warmup.eval_every=10",
    "warmup.eval_size=4",
    "eval.heldout_size=4",
    "eval.max_new_tokens=16",
    "learner.rl_steps=0",
]


def _records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
def test_a_run_stopped_in_its_warm_start_resumes_from_it(ray_session, tmp_path, monkeypatch):
    from raytunix.cli import interrupted_message
    from raytunix.train import train

    runs = tmp_path / "runs"
    cfg = load_config(None, WARM + [f"run.output_dir={runs}"])

    # Ctrl-C right after the warm start's first check (step 10) is logged: raised in the
    # driver's main thread at that point, as SIGINT would be. (A watcher thread polling for
    # the checkpoint directory missed it when the 20 steps took one second.)
    log = RunDir.log

    def log_then_interrupt(self, record):
        log(self, record)
        if record.get("phase") == "warmup" and record.get("step") == 10:
            raise KeyboardInterrupt

    monkeypatch.setattr(RunDir, "log", log_then_interrupt)
    with pytest.raises(KeyboardInterrupt) as interrupted:
        train(cfg)
    monkeypatch.undo()
    (run_dir,) = [str(p) for p in runs.iterdir()]
    # the CLI's message names this directory to resume
    assert interrupted.value.run_dir == run_dir
    assert f"raytunix train --resume {run_dir}`" in interrupted_message(run_dir)
    assert f"kept: the warm start's progress in {run_dir}" in interrupted_message(run_dir)
    run = RunDir(run_dir)
    assert not run.has_rl_checkpoint()  # stopped before RL: no RL checkpoint to resume from
    saved = sorted(int(n) for n in os.listdir(run.warmup) if n.isdigit())
    assert saved and saved[-1] == 10  # the check before the Ctrl-C, committed on the way out
    stopped_at = saved[-1]

    summary = train(None, resume=run_dir)
    records = _records(run_dir)
    (resume,) = [i for i, r in enumerate(records) if r["phase"] == "warmup_resume"]
    assert records[resume]["step"] == stopped_at
    after = [r["step"] for r in records[resume:] if r["phase"] == "warmup"]
    assert after == [s for s in (10, 20) if s > stopped_at]  # on from there, nothing redone
    assert summary["warm_start_steps"] == 20 and summary["warm_start_s"] > 0
    assert [r["when"] for r in records if r["phase"] == "eval"] == ["before_rl", "after_rl"]
    assert summary["heldout_tasks"] == 4
    assert RunDir(run_dir).read_state()["checkpoint_step"] == 0  # RL began
    assert not os.path.exists(run.warmup)  # and the warm start's checkpoint went


@pytest.mark.slow
def test_a_run_interrupted_in_rl_leaves_state_json_at_its_newest_checkpoint(
    ray_session, tmp_path, monkeypatch
):
    """Ctrl-C as RL step 4's record is about to be written, with checkpoints every 2
    steps: checkpoint 2 may still be being written (saves are asynchronous); the shutdown
    finishes it and state.json names it (it said 0 before); step 4's record is written on
    the way out, once; the interrupt carries the run directory for the CLI's message."""
    from raytunix.train import train

    runs = tmp_path / "runs"
    cfg = load_config(
        None,
        TINY
        + [
            "env.name=math_verifier",
            "env.max_turns=1",
            "warmup.enabled=false",
            "eval.heldout_size=4",
            "eval.max_new_tokens=16",
            "learner.rl_steps=6",
            "learner.checkpoint_every=2",
            "run.profile_window_s=0",
            f"run.output_dir={runs}",
        ],
    )
    log = RunDir.log

    def interrupt_before_step_4(self, record):
        if record.get("phase") == "rl" and record.get("step") == 4:
            monkeypatch.undo()  # once: the window's closing on the way out logs it
            raise KeyboardInterrupt
        log(self, record)

    monkeypatch.setattr(RunDir, "log", interrupt_before_step_4)
    with pytest.raises(KeyboardInterrupt) as interrupted:
        train(cfg)
    (run_dir,) = [str(p) for p in runs.iterdir()]
    assert interrupted.value.run_dir == run_dir
    assert RunDir(run_dir).read_state()["checkpoint_step"] == 2
    assert {int(n) for n in os.listdir(os.path.join(run_dir, "checkpoints"))} == {0, 2}
    assert [r["step"] for r in _records(run_dir) if r["phase"] == "rl"] == [1, 2, 3, 4]


@pytest.mark.slow
def test_a_finished_warm_start_is_not_redone(ray_session, tmp_path):
    """A run stopped after its warm start, before RL's first checkpoint: the warm start
    step restores the finished state and trains nothing; the learner holds its weights."""
    import jax

    from raytunix.driver.job import started_job
    from raytunix.learner.checkpoint import Checkpointer
    from raytunix.learner.learner import Learner, SFTHyperparams

    cfg = load_config(None, WARM + [f"run.output_dir={tmp_path / 'runs'}"])
    cfg, run, dataset = steps.open_run(cfg, None)
    with started_job(cfg, run, dataset) as (job, tasks):
        # The warm start's end as a stopped run left it: a finished checkpoint at step 20
        # of a learner like the run's (same model and seed), its weights moved off the init.
        learner = Learner(
            prepare.model_config(cfg, job.tokenizer), seed=cfg.run.seed, pad_id=job.tokenizer.pad_id
        )
        learner.start_warmup(SFTHyperparams.from_config(cfg))
        learner._state = learner._state.replace(
            params=jax.tree.map(lambda x: x + 0.5, learner._state.params)
        )
        ckpt = Checkpointer(run.warmup, max_to_keep=1)
        learner.save_warmup(ckpt, 20, {"warmup_steps": 20, "warmup_s": 12.5, "done": True})
        ckpt.close()
        job.start_orchestrator({}, 0)
        with steps.profiled(cfg, job, run) as collector:
            warm = steps.warm_start(cfg, job, run, tasks, collector)
        assert warm == {"warmup_steps": 20, "warmup_s": 12.5}
        records = _records(run.path)
        assert [r["phase"] for r in records] == ["warmup_resume"]  # no SFT step, no dev check
        params = ray.get(job.learner.weights.remote())[0]
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(learner.params)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
