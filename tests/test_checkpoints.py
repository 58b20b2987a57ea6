"""Checkpoints (issue 9 item 7): asynchronous orbax saves that a crash mid-save cannot
corrupt, keep-last-N beside keep-best, and a learner that resumes bit-identically to an
uninterrupted one."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from raytunix.learner.checkpoint import Checkpointer  # noqa: E402
from raytunix.learner.train_state import TrainState  # noqa: E402


def _state(value: float, size: int = 4) -> TrainState:
    """A small TrainState whose every number is ``value`` (enough to tell saves apart)."""
    return TrainState(
        params={"w": jnp.full((size,), value, jnp.float32)},
        opt_state={"count": jnp.asarray(int(value), jnp.int32)},
        step=jnp.asarray(int(value), jnp.int32),
        rng=jax.random.key_data(jax.random.key(0)),
    )


def _assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# -- async saves and crashes mid-save ------------------------------------------------------------

CRASH_MID_SAVE = textwrap.dedent('''
    import os, signal, sys, time
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax, jax.numpy as jnp
    from raytunix.learner.checkpoint import Checkpointer
    from raytunix.learner.train_state import TrainState

    def state(value):
        return TrainState(params={"w": jnp.full((8_000_000,), value, jnp.float32)},
                          opt_state={"count": jnp.asarray(int(value), jnp.int32)},
                          step=jnp.asarray(int(value), jnp.int32),
                          rng=jax.random.key_data(jax.random.key(0)))

    directory = sys.argv[1]
    ckpt = Checkpointer(directory)
    ckpt.save(1, state(1.0), {"step": 1})
    ckpt.wait_until_finished()
    ckpt.save(2, state(2.0), {"step": 2})
    # save returned: the arrays are copied, the files are still being written. Orbax may
    # make its temporary directory from its writer thread, after save returned (a loaded
    # machine saw neither it nor step 2 at that moment): wait for one of the two.
    def seen():
        names = os.listdir(directory)
        return "2.orbax-checkpoint-tmp" in names, "2" in names
    deadline = time.monotonic() + 60
    while not any(seen()) and time.monotonic() < deadline:
        time.sleep(0.001)
    in_flight, committed = seen()
    print(f"in_flight={in_flight} committed={committed}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer or a preemption would
''')


def test_a_process_killed_mid_save_leaves_the_previous_checkpoint_usable(tmp_path):
    directory = str(tmp_path / "checkpoints")
    proc = subprocess.run(
        [sys.executable, "-c", CRASH_MID_SAVE, directory],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -9, proc.stderr[-2000:]
    # The save had returned while its files were still in orbax's temporary directory:
    # the learner trains on while a checkpoint is written.
    assert "in_flight=True committed=False" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert any(name.startswith("2.") for name in os.listdir(directory))  # the partial save

    ckpt = Checkpointer(directory)
    assert ckpt.all_steps() == [1]  # the partial step is never listed...
    restored, extras = ckpt.restore(None, _state(0.0, 8_000_000))
    assert extras == {"step": 1}  # ...nor restored: the previous checkpoint is
    assert float(restored.params["w"][0]) == 1.0 and int(restored.step) == 1
    ckpt.save(2, _state(2.0, 8_000_000), {"step": 2})  # and the resumed run saves step 2 again
    assert ckpt.all_steps() == [1, 2]
    assert ckpt.read_extras() == {"step": 2}
    ckpt.close()


def test_an_async_save_holds_the_state_of_its_step_while_training_goes_on(tmp_path):
    ckpt = Checkpointer(str(tmp_path))
    state = _state(1.0)
    ckpt.save(1, state, {"data_position": 4})
    state = state.replace(params={"w": state.params["w"] + 1.0}, step=state.step + 1)  # trains on
    ckpt.save(2, state, {"data_position": 8})  # finishes step 1 first
    restored, extras = ckpt.restore(1, _state(0.0))
    _assert_trees_equal(restored, _state(1.0))
    assert extras == {"data_position": 4}
    assert ckpt.read_extras(2) == {"data_position": 8}
    ckpt.close()


# -- which checkpoints stay ----------------------------------------------------------------------


def test_keep_last_n_never_deletes_the_best_checkpoint(tmp_path):
    ckpt = Checkpointer(str(tmp_path), max_to_keep=2, keep_best_by="reward_mean")
    ckpt.save(0, _state(0.0), {})  # before RL: no metrics
    for step, reward in [(1, 0.9), (2, 0.1), (3, 0.4), (4, 0.2)]:
        ckpt.save(step, _state(float(step)), {}, metrics={"reward_mean": reward, "loss": 1.0})
    assert ckpt.all_steps() == [1, 3, 4]  # the newest two and the best
    assert ckpt.best_step() == 1
    ckpt.close()

    # A resumed run reads the metrics back: the best one still outlives newer ones.
    ckpt = Checkpointer(str(tmp_path), max_to_keep=2, keep_best_by="reward_mean")
    assert ckpt.best_step() == 1
    ckpt.save(5, _state(5.0), {}, metrics={"reward_mean": 0.3})
    assert ckpt.all_steps() == [1, 4, 5]
    ckpt.save(6, _state(6.0), {}, metrics={"reward_mean": 1.5})  # a new best replaces it
    assert ckpt.all_steps() == [5, 6]
    assert ckpt.best_step() == 6
    with pytest.raises(ValueError, match="'reward_mean'.*no such key.*'loss'"):
        ckpt.save(7, _state(7.0), {}, metrics={"loss": 0.5})
    ckpt.close()


def test_keep_best_by_a_metric_to_minimise_and_plain_keep_last_n(tmp_path):
    ckpt = Checkpointer(
        str(tmp_path / "min"), max_to_keep=1, keep_best_by="loss", keep_best_mode="min"
    )
    for step, loss in [(1, 0.5), (2, 0.2), (3, 0.7), (4, 0.9)]:
        ckpt.save(step, _state(float(step)), {}, metrics={"loss": loss})
    assert ckpt.all_steps() == [2, 4] and ckpt.best_step() == 2
    ckpt.close()

    ckpt = Checkpointer(str(tmp_path / "last"), max_to_keep=2)
    for step in range(1, 5):
        ckpt.save(step, _state(float(step)), {}, metrics={"loss": 0.1})  # not kept for
    assert ckpt.all_steps() == [3, 4]  # anything without keep_best_by
    ckpt.close()
    with pytest.raises(ValueError, match="'max' or 'min'.*'lowest'"):
        Checkpointer(str(tmp_path / "bad"), keep_best_mode="lowest")


# -- a resumed learner trains on bit-identically -------------------------------------------------


def _record_batch(step: int):
    """A batch of two groups of two with rewards that differ within each group, so every
    update moves the weights; tokens differ from step to step."""
    from raytunix.rollout.batch import trajectories_to_record_batch
    from raytunix.types import EpisodeStatus, Trajectory

    rows = []
    for i, (group, reward) in enumerate([("a", 1.0), ("a", 0.0), ("b", 0.0), ("b", 1.0)]):
        prompt = [1 + (step + i) % 5, 2]
        completion = [(3 + step * 3 + i * 5 + t) % 14 + 1 for t in range(3 + i % 2)]
        rows.append(
            Trajectory(
                task_id=group,
                group_id=f"{group}{step}",
                token_ids=prompt + completion,
                loss_mask=[0] * len(prompt) + [1] * len(completion),
                logprobs=[0.0] * len(prompt) + [-1.5] * len(completion),
                policy_versions=[-1] * len(prompt) + [step] * len(completion),
                reward=reward,
                status=EpisodeStatus.COMPLETED,
                num_turns=1,
            )
        )
    return trajectories_to_record_batch(rows)


@pytest.mark.slow
def test_a_learner_resumed_from_an_async_checkpoint_trains_on_bit_identically(tmp_path):
    from raytunix.learner.learner import Learner, RLHyperparams
    from raytunix.models.llama import ModelConfig

    config = ModelConfig(
        vocab_size=16, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64, max_seq_len=32
    )
    # A decaying schedule, AdamW moments, weight decay and two optimizer steps per batch:
    # every piece of optimizer state must come back for the updates to match.
    hp = RLHyperparams(
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        rl_steps=4,
        learning_rate=1e-2,
        lr_schedule="cosine",
        weight_decay=0.01,
        num_iterations=2,
    )
    batches = [_record_batch(step) for step in range(4)]

    uninterrupted = Learner(config, seed=3)
    uninterrupted.start_rl(hp)
    expected = [uninterrupted.train_step(batch) for batch in batches]

    ckpt = Checkpointer(str(tmp_path))
    first = Learner(config, seed=3)
    first.start_rl(hp)
    for batch in batches[:2]:
        first.train_step(batch)
    first.save(ckpt, {"orchestrator": {"next_index": 4}})
    first.train_step(batches[2])  # trains on while step 2 is written, then the run dies
    ckpt.close()

    resumed = Learner(config, seed=11)  # another init: everything must come from the checkpoint
    resumed.start_rl(hp)
    extras = resumed.restore(Checkpointer(str(tmp_path)))
    assert extras["orchestrator"] == {"next_index": 4}
    assert (resumed.rl_step, resumed.version) == (2, 2)
    got = [resumed.train_step(batch) for batch in batches[2:]]
    _assert_trees_equal(resumed._state, uninterrupted._state)  # params, moments, count, rng
    for step, (a, b) in enumerate(zip(got, expected[2:]), start=3):
        assert {k: v for k, v in a.items() if k != "update_s"} == {
            k: v for k, v in b.items() if k != "update_s"
        }, f"step {step}"


def test_keep_best_by_names_a_number_of_the_rl_step_metrics():
    from raytunix.config import ConfigError, load_config
    from raytunix.driver.steps import best_metric as _best_metric
    from raytunix.train import RunError

    record = {
        "phase": "rl",
        "step": 3,
        "reward_mean": 0.25,
        "loss": -0.1,
        "update_skipped": 0.0,
        "statuses": {"completed": 4},
    }
    assert _best_metric(load_config(None), record) is None  # off by default
    cfg = load_config(None, ["learner.keep_best_by=reward_mean", "learner.keep_best_mode=max"])
    assert _best_metric(cfg, record) == {"reward_mean": 0.25}
    with pytest.raises(RunError, match=r"keep_best_by='reward'.*'loss', 'reward_mean'"):
        _best_metric(load_config(None, ["learner.keep_best_by=reward"]), record)
    with pytest.raises(ConfigError, match="keep_best_mode"):
        load_config(None, ["learner.keep_best_mode=lowest"])
