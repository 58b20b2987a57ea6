"""A non-finite update is never applied: when the loss, the gradients or the new
parameters of an update are not finite, the learner keeps its parameters, optimizer state
and step bit for bit, counts the update, and a run of
``learner.max_consecutive_nonfinite_updates`` such updates stops the run with one error
saying what was not finite and what to change."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from raytunix.config import ConfigError, LearnerConfig, load_config  # noqa: E402
from raytunix.driver.run_dir import RunDir, RunError, load_run_config  # noqa: E402
from raytunix.driver.steps import check_nonfinite_update  # noqa: E402
from raytunix.learner.batch import Batch  # noqa: E402
from raytunix.learner.learner import Learner  # noqa: E402
from raytunix.learner.train_state import (  # noqa: E402
    RLHyperparams,
    create_train_state,
    make_optimizer,
    make_policy_update,
)
from raytunix.models.llama import ModelConfig, init_model  # noqa: E402
from raytunix.rollout.batch import (  # noqa: E402
    record_batch_to_arrays,
    trajectories_to_record_batch,
)
from raytunix.types import EpisodeStatus, Trajectory  # noqa: E402

CONFIG = ModelConfig(
    vocab_size=16, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64, max_seq_len=32
)
SAMPLING = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}


def _trajectories(behaviour_logprob=-1.0, reward_scale=1.0):
    rows = []
    for i, (group, reward) in enumerate([("a", 1.0), ("a", 0.0), ("b", 0.0), ("b", 1.0)]):
        prompt, completion = [1 + i, 2], [3 + i, 5, 7]
        rows.append(
            Trajectory(
                task_id=group,
                group_id=group,
                token_ids=prompt + completion,
                loss_mask=[0, 0, 1, 1, 1],
                logprobs=[0.0, 0.0] + [behaviour_logprob] * 3,
                policy_versions=[-1, -1, 0, 0, 0],
                reward=reward * reward_scale,
                status=EpisodeStatus.COMPLETED,
                num_turns=1,
            )
        )
    return trajectories_to_record_batch(rows)


def _batch(**kw):
    return Batch.from_arrays(record_batch_to_arrays(_trajectories(**kw), pad_to_multiple=8))


def _assert_trees_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def model():
    return init_model(CONFIG, seed=0)


def _state_and_update(model, optimizer, **settings):
    graphdef, params = model
    state = create_train_state(graphdef, params, optimizer, seed=0)
    hp = RLHyperparams(**SAMPLING, **settings)
    return state, make_policy_update(graphdef, optimizer, hp, max_seq_len=CONFIG.max_seq_len)


def test_nan_behaviour_logprobs_leave_params_moments_and_step_bit_identical(model):
    optimizer = make_optimizer(1e-2, weight_decay=0.1)
    state, update = _state_and_update(model, optimizer)
    warm, _ = update(state, None, _batch())  # AdamW moments that are not all zero
    before = jax.device_get(warm)
    after, metrics = update(warm, None, _batch(behaviour_logprob=float("nan")))
    _assert_trees_equal(jax.device_get(after), before)
    assert float(metrics["update_skipped"]) == 1.0 and float(metrics["update_nonfinite"]) == 1.0
    assert float(metrics["nonfinite_loss"]) == 1.0 and not np.isfinite(float(metrics["loss"]))
    # The same batch with finite logprobs is applied.
    applied, metrics = update(warm, None, _batch())
    assert float(metrics["update_nonfinite"]) == 0.0 and float(metrics["update_skipped"]) == 0.0
    assert int(applied.step) == int(warm.step) + 1


@pytest.mark.parametrize("num_iterations", [1, 2])
def test_an_update_whose_new_parameters_overflow_is_not_applied(model, num_iterations):
    # Finite loss and gradients, but an SGD step of inf x the gradient is not finite.
    optimizer = make_optimizer(float("inf"), optimizer="sgd", max_grad_norm=None)
    state, update = _state_and_update(model, optimizer, num_iterations=num_iterations)
    before = jax.device_get(state)
    after, metrics = update(state, None, _batch())
    _assert_trees_equal(jax.device_get(after), before)
    assert float(metrics["nonfinite_new_state"]) == 1.0 and float(metrics["update_skipped"]) == 1.0
    assert np.isfinite(float(metrics["loss"])) and np.isfinite(float(metrics["grad_norm"]))
    # With a second iteration, it starts from the first's non-finite parameters.
    assert float(metrics["nonfinite_loss"]) == float(num_iterations > 1)


def test_the_learner_counts_them_and_an_applied_update_ends_the_run_of_them():
    learner = Learner(CONFIG, seed=0)
    learner.start_rl(RLHyperparams(**SAMPLING, learning_rate=1e-2))
    before = jax.device_get(learner.params)
    bad = _trajectories(behaviour_logprob=float("nan"))
    for n in (1, 2):
        metrics = learner.train_step(bad)
        assert metrics["nonfinite_updates_in_a_row"] == n
        assert metrics["updates_skipped_nonfinite"] == n and metrics["updates_skipped"] == n
        assert metrics["policy_version"] == 0
    _assert_trees_equal(jax.device_get(learner.params), before)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(learner.weights_numpy()))
    metrics = learner.train_step(_trajectories())
    assert metrics["nonfinite_updates_in_a_row"] == 0 and metrics["policy_version"] == 1
    assert metrics["updates_skipped_nonfinite"] == 2


def test_n_in_a_row_stop_the_run_with_one_error_naming_the_cause_and_the_key(tmp_path, capsys):
    limit = LearnerConfig().max_consecutive_nonfinite_updates
    assert limit == 3
    run = RunDir(str(tmp_path / "run"))
    learner = Learner(CONFIG, seed=0)
    learner.start_rl(RLHyperparams(**SAMPLING, learning_rate=1e-2))
    bad = _trajectories(behaviour_logprob=float("nan"))
    for step in range(1, limit):
        check_nonfinite_update(learner.train_step(bad), limit, step, run)  # said, not raised
    said = capsys.readouterr().out
    assert (
        "RL step 2: the update was not applied: the loss, the gradients and the new "
        "parameters or optimizer state were not finite (loss nan" in said
    )
    assert "(2 in a row; the run stops at learner.max_consecutive_nonfinite_updates=3)" in said
    with pytest.raises(RunError) as e:
        check_nonfinite_update(learner.train_step(bad), limit, limit, run)
    message = str(e.value)
    assert message.startswith("3 updates in a row were not applied because they were not finite")
    assert "the loss" in message and "learner.max_consecutive_nonfinite_updates=3" in message
    assert "learner.learning_rate" in message and run.checkpoints in message
    # 0 never stops; an applied update says nothing.
    check_nonfinite_update(learner.train_step(bad), 0, limit + 1, run)
    check_nonfinite_update(learner.train_step(_trajectories()), limit, limit + 2, run)
    assert "RL step 6" not in capsys.readouterr().out


def test_the_key_is_a_non_negative_int_a_resume_may_change(tmp_path):
    assert (
        load_config(
            None, ["learner.max_consecutive_nonfinite_updates=0"]
        ).learner.max_consecutive_nonfinite_updates
        == 0
    )
    with pytest.raises(ConfigError, match="learner.max_consecutive_nonfinite_updates=-1"):
        load_config(None, ["learner.max_consecutive_nonfinite_updates=-1"])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(load_config(None, []).to_yaml())
    resumed = load_run_config(str(run_dir), ["learner.max_consecutive_nonfinite_updates=10"])
    assert resumed.learner.max_consecutive_nonfinite_updates == 10


def _demonstrations():
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, CONFIG.vocab_size, size=(8, 12)).astype(np.int32)
    mask = np.ones_like(tokens, dtype=np.float32)
    mask[:, 0] = 0.0
    return tokens, mask


@pytest.mark.slow
def test_a_warm_start_step_that_is_not_finite_is_not_applied_and_is_counted():
    from raytunix.learner.learner import SFTHyperparams

    learner = Learner(CONFIG, seed=0)
    learner.start_warmup(SFTHyperparams(learning_rate=float("inf"), warmup_steps=0))
    before = jax.device_get(learner.params)
    tokens, mask = _demonstrations()
    metrics = learner.sft_steps(tokens, mask, num_steps=3, batch_size=4)
    assert metrics["updates_skipped_nonfinite"] == 3 and metrics["nonfinite_updates_in_a_row"] == 3
    _assert_trees_equal(jax.device_get(learner.params), before)
    # A finite learning rate trains, and a finite step ends the run of skipped ones.
    learner.start_warmup(SFTHyperparams(learning_rate=1e-2, warmup_steps=0))
    metrics = learner.sft_steps(tokens, mask, num_steps=2, batch_size=4)
    assert metrics["updates_skipped_nonfinite"] == 0 and metrics["nonfinite_updates_in_a_row"] == 0
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(learner.weights_numpy()))


def test_a_run_of_them_in_the_warm_start_stops_the_run_naming_the_learning_rate(tmp_path, capsys):
    from raytunix.driver.steps import check_nonfinite_warmup

    run = RunDir(str(tmp_path / "run"))
    check_nonfinite_warmup({"loss": 1.0}, 3, 100, run)  # nothing skipped: silent
    assert capsys.readouterr().out == ""
    check_nonfinite_warmup(
        {"loss": float("nan"), "updates_skipped_nonfinite": 2, "nonfinite_updates_in_a_row": 2},
        3,
        100,
        run,
    )
    assert "2 step(s) up to step 100 were not applied" in capsys.readouterr().out
    with pytest.raises(RunError, match=r"warmup.learning_rate"):
        check_nonfinite_warmup(
            {
                "loss": float("nan"),
                "updates_skipped_nonfinite": 100,
                "nonfinite_updates_in_a_row": 100,
            },
            3,
            200,
            run,
        )
