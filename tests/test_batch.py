import numpy as np
import pyarrow as pa
import pytest

from raytunix.rollout.batch import (
    TRAJECTORY_SCHEMA,
    record_batch_to_arrays,
    record_batch_to_trajectories,
    trajectories_to_record_batch,
)
from raytunix.types import EpisodeStatus, Trajectory


def trajectory(
    group_id,
    n_prompt,
    n_generated,
    reward=1.0,
    status=EpisodeStatus.COMPLETED,
    version=3,
    first_token=20,
):
    n = n_prompt + n_generated
    return Trajectory(
        task_id=f"task-{group_id}",
        group_id=group_id,
        token_ids=list(range(first_token, first_token + n)),
        loss_mask=[0] * n_prompt + [1] * n_generated,
        logprobs=[0.0] * n_prompt + [-0.5] * n_generated,
        policy_versions=[-1] * n_prompt + [version] * n_generated,
        reward=reward,
        status=status,
        num_turns=2,
        metrics={"generate_s": 0.1},
    )


def sample():
    return [
        trajectory("g7", 5, 3, reward=1.0),
        trajectory("g7", 5, 30, reward=0.0, status=EpisodeStatus.TRUNCATED, version=2),
        trajectory("g2", 4, 2, reward=0.0, status=EpisodeStatus.ENV_ERROR, first_token=40),
        trajectory("g2", 4, 1, reward=0.5, status=EpisodeStatus.TIMEOUT),
    ]


def test_round_trip_keeps_everything_but_metrics():
    trajectories = sample()
    batch = trajectories_to_record_batch(trajectories)
    assert batch.schema == TRAJECTORY_SCHEMA
    assert batch.num_rows == 4
    back = record_batch_to_trajectories(batch)
    for before, after in zip(trajectories, back):
        assert after.metrics == {}
        before.metrics = {}
        assert after == before
        assert isinstance(after.status, EpisodeStatus)


def test_round_trip_through_ipc_bytes():
    batch = trajectories_to_record_batch(sample())
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    read = pa.ipc.open_stream(sink.getvalue()).read_next_batch()
    assert record_batch_to_trajectories(read) == record_batch_to_trajectories(batch)


def test_empty_list_is_an_error():
    with pytest.raises(ValueError, match="no trajectories"):
        trajectories_to_record_batch([])


def test_arrays_are_right_padded_to_a_multiple():
    trajectories = sample()
    arrays = record_batch_to_arrays(
        trajectories_to_record_batch(trajectories), pad_to_multiple=16, pad_id=9
    )
    assert arrays["tokens"].shape == (4, 48)  # longest is 35 tokens -> 48
    assert arrays["tokens"].dtype == np.int32
    assert arrays["loss_mask"].dtype == np.float32
    assert arrays["policy_versions"].dtype == np.int32
    np.testing.assert_array_equal(arrays["lengths"], [8, 35, 6, 5])
    for i, t in enumerate(trajectories):
        n = len(t.token_ids)
        np.testing.assert_array_equal(arrays["tokens"][i, :n], t.token_ids)
        assert (arrays["tokens"][i, n:] == 9).all()
        np.testing.assert_array_equal(arrays["loss_mask"][i, :n], t.loss_mask)
        assert (arrays["loss_mask"][i, n:] == 0).all()
        np.testing.assert_allclose(arrays["logprobs"][i, :n], t.logprobs)
        assert (arrays["logprobs"][i, n:] == 0).all()
        np.testing.assert_array_equal(arrays["policy_versions"][i, :n], t.policy_versions)
        assert (arrays["policy_versions"][i, n:] == -1).all()
    np.testing.assert_allclose(arrays["rewards"], [1.0, 0.0, 0.0, 0.5])
    assert arrays["rewards"].dtype == np.float32


def test_short_batches_pad_to_at_least_one_multiple():
    arrays = record_batch_to_arrays(
        trajectories_to_record_batch([trajectory("a", 1, 1)]), pad_to_multiple=32
    )
    assert arrays["tokens"].shape == (1, 32)


def test_group_ids_are_dense_in_order_of_first_appearance():
    trajectories = [trajectory(g, 2, 2) for g in ["g9", "g3", "g9", "g100", "g3"]]
    arrays = record_batch_to_arrays(trajectories_to_record_batch(trajectories))
    np.testing.assert_array_equal(arrays["group_ids"], [0, 1, 0, 2, 1])
    assert arrays["group_ids"].dtype == np.int32


def test_a_table_of_several_chunks_reads_like_one_batch():
    trajectories = sample()
    table = pa.Table.from_batches(
        [
            trajectories_to_record_batch(trajectories[:2]),
            trajectories_to_record_batch(trajectories[2:]),
        ]
    )
    from_table = record_batch_to_arrays(table)
    from_batch = record_batch_to_arrays(trajectories_to_record_batch(trajectories))
    for key in from_batch:
        np.testing.assert_array_equal(from_table[key], from_batch[key])


def test_a_sliced_batch_reads_its_own_rows():
    """A learner may split a batch into minibatches with ``slice``; list offsets of a slice
    do not start at 0."""
    trajectories = sample()
    batch = trajectories_to_record_batch(trajectories)
    arrays = record_batch_to_arrays(batch.slice(2, 2), pad_to_multiple=8)
    np.testing.assert_array_equal(arrays["lengths"], [6, 5])
    for row, t in enumerate(trajectories[2:]):
        n = len(t.token_ids)
        np.testing.assert_array_equal(arrays["tokens"][row, :n], t.token_ids)
        np.testing.assert_array_equal(arrays["loss_mask"][row, :n], t.loss_mask)
        np.testing.assert_array_equal(arrays["policy_versions"][row, :n], t.policy_versions)


def test_arrays_from_read_only_buffers_are_writable_copies():
    batch = trajectories_to_record_batch(sample())
    arrays = record_batch_to_arrays(batch)
    arrays["tokens"][0, 0] = -5  # the learner may mutate its arrays; the batch is untouched
    assert record_batch_to_trajectories(batch)[0].token_ids[0] == 20


@pytest.mark.parametrize("field", ["loss_mask", "logprobs", "policy_versions"])
def test_trajectory_rejects_per_token_lists_of_another_length(field):
    kwargs = dict(
        task_id="t",
        group_id="g",
        token_ids=[1, 2, 3],
        loss_mask=[0, 1, 1],
        logprobs=[0.0, -1.0, -1.0],
        policy_versions=[-1, 0, 0],
        reward=0.0,
        status=EpisodeStatus.COMPLETED,
        num_turns=1,
    )
    kwargs[field] = kwargs[field][:2]
    with pytest.raises(ValueError) as e:
        Trajectory(**kwargs)
    assert field in str(e.value) and "2 entries" in str(e.value) and "has 3" in str(e.value)
