"""Reading a checkpoint back tells a transient failure from a damaged checkpoint: a
storage blink (stale NFS handle, timeout, device memory short) is retried and never rolls
the run back nor moves the checkpoint aside; a persistent one raises; only a checkpoint
whose files are really damaged (truncated, garbled, missing) is moved aside, with the
reason written beside it, and the older one restored; a checkpoint that does not fit the
learner is a config mismatch, raised with nothing moved."""

import errno
import json
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from raytunix.learner.checkpoint import (  # noqa: E402
    CheckpointCorrupt,
    CheckpointMismatch,
    CheckpointUnavailable,
    Checkpointer,
    is_corruption,
    is_transient,
)
from raytunix.learner.train_state import TrainState  # noqa: E402
from raytunix.rollout.faults import Backoff  # noqa: E402

FAST = Backoff(initial_delay_s=0.001, max_delay_s=0.002, max_attempts=4, jitter=0.0)


def _state(value: float, size: int = 4) -> TrainState:
    return TrainState(
        params={"w": jnp.full((size,), value, jnp.float32)},
        opt_state={"count": jnp.asarray(int(value), jnp.int32)},
        step=jnp.asarray(int(value), jnp.int32),
        rng=jax.random.key_data(jax.random.key(0)),
    )


@pytest.fixture
def two_checkpoints(tmp_path):
    directory = str(tmp_path / "checkpoints")
    ck = Checkpointer(directory, read_backoff=FAST)
    ck.save(10, _state(10.0), {"step": 10})
    ck.save(20, _state(20.0), {"step": 20})
    ck.wait_until_finished()
    yield ck, directory
    ck.close()


def _fail_reads_of(ck, step, errors):
    """The next ``len(errors)`` reads of ``step`` raise those errors; returns the list of
    reads of ``step`` made."""
    real, seen = ck._manager.restore, []

    def flaky(s, *args, **kwargs):
        if int(s) == step:
            seen.append(s)
            if errors:
                raise errors.pop(0)
        return real(s, *args, **kwargs)

    ck._manager.restore = flaky
    return seen


def _moved(directory):
    aside = directory + "-corrupt"
    return sorted(os.listdir(aside)) if os.path.isdir(aside) else []


class _TensorstoreError(ValueError):
    pass


TRANSIENT = {
    "nfs_estale": lambda: OSError(errno.ESTALE, "Stale file handle"),
    "eio": lambda: OSError(errno.EIO, "Input/output error"),
    "storage_timeout": lambda: TimeoutError("GCS read timed out (503 Service Unavailable)"),
    "connection_reset": lambda: ConnectionResetError(errno.ECONNRESET, "Connection reset"),
    "device_oom": lambda: MemoryError("RESOURCE_EXHAUSTED: out of memory while restoring"),
    "tensorstore_unavailable": lambda: _TensorstoreError(
        'UNAVAILABLE: Error reading "params.w/.zarray" in OCDBT database at gs://b/c/20/state'
    ),
    "tensorstore_deadline": lambda: _TensorstoreError("DEADLINE_EXCEEDED: CURL error"),
}


@pytest.mark.parametrize("name", sorted(TRANSIENT))
def test_transient_read_errors_are_retried_without_rollback_or_quarantine(two_checkpoints, name):
    ck, directory = two_checkpoints
    seen = _fail_reads_of(ck, 20, [TRANSIENT[name](), TRANSIENT[name]()])
    state, extras = ck.restore(None, _state(0.0))
    assert len(seen) == 3  # two failures, then the read that worked
    assert int(state.step) == 20 and extras == {"step": 20}
    assert _moved(directory) == [] and ck.all_steps() == [10, 20]


def test_a_transient_error_that_persists_raises_and_moves_nothing(two_checkpoints):
    ck, directory = two_checkpoints
    _fail_reads_of(ck, 20, [OSError(errno.ESTALE, "Stale file handle")] * 10)
    with pytest.raises(
        CheckpointUnavailable, match=r"step 20 .* 4 attempts .*Stale file handle.*left in place"
    ):
        ck.restore(None, _state(0.0))
    assert _moved(directory) == [] and ck.all_steps() == [10, 20]


def _damage(directory, step, how):
    files = [
        os.path.join(root, f)
        for root, _, names in os.walk(os.path.join(directory, str(step)))
        for f in names
    ]
    assert files
    for path in files:
        if how == "truncate":
            open(path, "wb").close()
        elif how == "garble":
            with open(path, "wb") as f:
                f.write(b"\x9d\xff garbage \x00" * 8)
        elif how == "truncate_arrays" and f"{os.sep}d{os.sep}" in path:
            with open(path, "r+b") as f:
                f.truncate(3)
        elif how == "remove_extras" and f"{os.sep}extras{os.sep}" in path:
            os.remove(path)


@pytest.mark.parametrize("how", ["truncate", "garble", "truncate_arrays", "remove_extras"])
def test_a_damaged_newest_checkpoint_is_moved_aside_with_its_reason(two_checkpoints, how, caplog):
    ck, directory = two_checkpoints
    _damage(directory, 20, how)
    with caplog.at_level("ERROR"):
        state, extras = ck.restore(None, _state(0.0))
    assert int(state.step) == 10 and extras == {"step": 10}
    assert ck.all_steps() == [10]
    moved = _moved(directory)
    reasons = [name for name in moved if name.endswith(".reason.json")]
    assert len(reasons) == 1 and reasons[0].startswith("20-"), moved
    with open(os.path.join(directory + "-corrupt", reasons[0])) as f:
        record = json.load(f)
    assert record["step"] == 20 and record["reason"] and os.path.isdir(record["moved_to"])
    assert "CHECKPOINT DAMAGED: step 20" in caplog.text
    ck.save(20, _state(21.0), {"step": 20})  # the resumed run saves that step again
    assert int(ck.restore(None, _state(0.0))[0].step) == 21


def test_evidence_of_damage_seen_once_is_read_again_not_quarantined(two_checkpoints):
    ck, directory = two_checkpoints
    seen = _fail_reads_of(ck, 20, [FileNotFoundError(errno.ENOENT, "not yet visible")])
    state, _ = ck.restore(None, _state(0.0))
    assert int(state.step) == 20 and len(seen) == 2 and _moved(directory) == []


def test_a_checkpoint_that_does_not_fit_the_learner_is_a_mismatch_not_damage(two_checkpoints):
    ck, directory = two_checkpoints
    with pytest.raises(CheckpointMismatch, match=r"step 20 .*config.yaml"):
        ck.restore(None, _state(0.0, size=5))  # another model shape
    assert _moved(directory) == [] and ck.all_steps() == [10, 20]


def test_an_explicit_damaged_step_raises_without_moving_it(two_checkpoints):
    ck, directory = two_checkpoints
    _damage(directory, 20, "truncate")
    with pytest.raises(CheckpointCorrupt, match="step 20"):
        ck.restore(20, _state(0.0))
    assert ck.all_steps() == [10, 20]


def test_among_limits_the_candidates_to_the_steps_every_host_reads(two_checkpoints):
    ck, _ = two_checkpoints
    state, _ = ck.restore(None, _state(0.0), among=[5, 10])  # 20 not on every host yet
    assert int(state.step) == 10
    with pytest.raises(FileNotFoundError, match=r"among the steps \[5\]"):
        ck.restore(None, _state(0.0), among=[5])


def test_the_error_classes():
    wrapped = RuntimeError("orbax restore failed")
    wrapped.__cause__ = OSError(errno.ETIMEDOUT, "Connection timed out")
    assert is_transient(wrapped) and not is_corruption(wrapped)
    assert is_corruption(_TensorstoreError("DATA_LOSS: checksum mismatch in chunk"))
    assert is_corruption(json.JSONDecodeError("Expecting value", "", 0))
    structure = ValueError(
        "User-provided restore item and on-disk value metadata tree structures do not match"
    )
    assert not is_corruption(structure) and not is_transient(structure)
    assert not is_corruption(PermissionError(errno.EACCES, "Permission denied"))


# -- the policy alone, from another run's directory (model.init_from) -------------------------


def test_restore_params_reads_the_newest_policy_whatever_the_optimizer_state(two_checkpoints):
    ck, _ = two_checkpoints
    params, step = ck.restore_params({"w": jax.ShapeDtypeStruct((4,), jnp.float32)})
    assert step == 20 and np.asarray(params["w"]).tolist() == [20.0] * 4


def test_restore_params_skips_a_damaged_step_and_leaves_it_in_place(two_checkpoints):
    ck, directory = two_checkpoints
    _damage(directory, 20, "truncate_arrays")
    params, step = ck.restore_params({"w": jax.ShapeDtypeStruct((4,), jnp.float32)})
    assert step == 10 and np.asarray(params["w"]).tolist() == [10.0] * 4
    assert _moved(directory) == [] and ck.all_steps() == [10, 20]  # not this run's to move


def test_restore_params_of_another_shape_or_of_nothing_says_so(two_checkpoints, tmp_path):
    ck, _ = two_checkpoints
    with pytest.raises(CheckpointMismatch, match="step 20"):
        ck.restore_params({"w": jax.ShapeDtypeStruct((8,), jnp.float32)})
    empty = Checkpointer(str(tmp_path / "empty"), read_backoff=FAST)
    with pytest.raises(FileNotFoundError, match="No checkpoint"):
        empty.restore_params({"w": jax.ShapeDtypeStruct((4,), jnp.float32)})
    empty.close()
