"""``model.init_from=RUN_DIR``: a new run starts from an earlier run's policy, tokenizer and
model shape, on any env, and says clearly when the earlier run cannot be started from."""

import dataclasses
import filecmp
import os
import shutil

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402

from raytunix.config import ConfigError, load_config  # noqa: E402
from raytunix.driver.init_from import adopt_init_from, initial_checkpoints  # noqa: E402
from raytunix.driver.run_dir import RunDir  # noqa: E402
from raytunix.learner.actor import _load  # noqa: E402
from raytunix.learner.checkpoint import Checkpointer  # noqa: E402
from raytunix.learner.train_state import create_train_state  # noqa: E402
from raytunix.models.llama import ModelConfig, init_model  # noqa: E402

CONFIG = ModelConfig(
    vocab_size=16, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64, max_seq_len=32
)


def _leaves(params):
    return [np.asarray(x) for x in jax.tree.leaves(params)]


def _earlier_run(tmp_path, *overrides, checkpoint=True, tokenizer=True):
    """A run directory as a finished run leaves it: config.yaml, tokenizer.json and an RL
    checkpoint of ``init_model(CONFIG, seed=1)``'s weights under an Adam state."""
    cfg = load_config("default", overrides=["model.d_model=32", "model.n_layers=1", *overrides])
    run = RunDir(str(tmp_path / "earlier"))
    run.write_config(cfg)
    if tokenizer:
        with open(run.tokenizer, "w") as f:
            f.write('{"stand-in": "the copy is checked byte for byte"}')
    graphdef, params = init_model(CONFIG, seed=1)
    if checkpoint:
        ck = Checkpointer(run.checkpoints)
        ck.save(7, create_train_state(graphdef, params, optax.adam(1e-3), 0), {"rl_step": 7})
        ck.wait_until_finished()
        ck.close()
    return run, params


def test_the_learner_starts_from_the_earlier_runs_newest_policy(tmp_path):
    run, params = _earlier_run(tmp_path)
    _, loaded = _load("", CONFIG, run.checkpoints, seed=2)
    _, fresh = init_model(CONFIG, seed=2)
    for got, want, other in zip(_leaves(loaded), _leaves(params), _leaves(fresh), strict=True):
        assert got.dtype == want.dtype and np.array_equal(got, want)
        assert got.shape == other.shape
    assert not all(np.array_equal(a, b) for a, b in zip(_leaves(loaded), _leaves(fresh)))


def test_a_new_run_takes_the_shape_of_the_run_it_starts_from(tmp_path, capsys):
    run, _ = _earlier_run(tmp_path)
    cfg = load_config("default", overrides=[f"model.init_from={run.path}", "env.max_turns=1"])
    adopted = adopt_init_from(cfg)
    assert (adopted.model.d_model, adopted.model.n_layers) == (32, 1)
    assert adopted.model.init_from == run.path and adopted.env.max_turns == 1
    assert "model.d_model=32" in capsys.readouterr().out  # said, not silently replaced
    assert adopt_init_from(load_config("default")) == load_config("default")


def test_a_size_set_against_the_earlier_run_is_refused_by_name(tmp_path):
    run, _ = _earlier_run(tmp_path)
    cfg = load_config("default", overrides=[f"model.init_from={run.path}", "model.d_model=64"])
    with pytest.raises(ConfigError, match=r"model.d_model=64, but .* model.d_model=32"):
        adopt_init_from(cfg)
    same = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, d_model=32))
    assert adopt_init_from(same).model.d_model == 32


@pytest.mark.parametrize(
    "what, match",
    [
        ("not_a_run", "no config.yaml"),
        ("no_checkpoint", "has no checkpoint"),
        ("no_tokenizer", "no tokenizer.json"),
    ],
)
def test_a_run_that_cannot_be_started_from_is_named_with_what_to_do(tmp_path, what, match):
    if what == "not_a_run":
        path = str(tmp_path / "nothing here")
    else:
        run, _ = _earlier_run(
            tmp_path, checkpoint=what != "no_checkpoint", tokenizer=what != "no_tokenizer"
        )
        path = run.path
    cfg = load_config("default", overrides=[f"model.init_from={path}"])
    with pytest.raises(ConfigError, match=match):
        adopt_init_from(cfg)


def test_the_tokenizer_is_copied_and_a_resumed_run_keeps_its_own_checkpoints(tmp_path):
    from raytunix.driver.init_from import copy_tokenizer

    earlier, _ = _earlier_run(tmp_path)
    cfg = adopt_init_from(load_config("default", overrides=[f"model.init_from={earlier.path}"]))
    run = RunDir(str(tmp_path / "new"))
    copy_tokenizer(cfg, run)
    assert filecmp.cmp(run.tokenizer, earlier.tokenizer, shallow=False)
    assert initial_checkpoints(cfg, run) == earlier.checkpoints
    os.makedirs(os.path.join(run.checkpoints, "3"))  # the new run saved a step of its own
    assert initial_checkpoints(cfg, run) == ""


@pytest.mark.slow
def test_a_run_on_another_env_continues_from_an_earlier_runs_checkpoint(tiny_run, tmp_path):
    """The earlier run is the shared tiny run (ParityEnv, a 20-step warm start that moves
    the weights far from their init, 5 RL steps); the new one trains math_verifier."""
    from test_train import TINY

    from raytunix.train import train

    earlier = str(tmp_path / "earlier")
    shutil.copytree(tiny_run.path, earlier)  # the new run only reads it; others share it
    cfg = load_config(
        None,
        TINY
        + [
            f"run.output_dir={tmp_path / 'second'}",
            f"model.init_from={earlier}",
            "model.d_model=32",  # the TINY size, which is also the earlier run's: accepted
            "env.name=math_verifier",
            "env.max_turns=1",
            "warmup.enabled=false",
            "data.heldout_size=4",
            "eval.heldout_size=4",
            "eval.max_new_tokens=16",
            "learner.rl_steps=1",
        ],
    )
    later = train(cfg)["run_dir"]
    assert filecmp.cmp(
        os.path.join(later, "tokenizer.json"), os.path.join(earlier, "tokenizer.json")
    )
    # One RL step from the earlier run's policy stays near it; a fresh model is far away.
    template = init_model(_model_config(later), seed=0)[1]
    start = _leaves(Checkpointer(os.path.join(earlier, "checkpoints")).restore_params(template)[0])
    end = _leaves(Checkpointer(os.path.join(later, "checkpoints")).restore_params(template)[0])
    fresh = _leaves(init_model(_model_config(later), seed=0)[1])
    moved = sum(float(np.sum((a - b) ** 2)) for a, b in zip(end, start))
    from_fresh = sum(float(np.sum((a - b) ** 2)) for a, b in zip(start, fresh))
    assert moved < 0.01 * from_fresh, (moved, from_fresh)


def _model_config(run_dir):
    from raytunix.driver.prepare import model_config
    from raytunix.driver.run_dir import load_run_config
    from raytunix.models.tokenizer import Tokenizer

    cfg = load_run_config(run_dir)
    return model_config(cfg, Tokenizer.load(os.path.join(run_dir, "tokenizer.json")))
