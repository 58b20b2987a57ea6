"""Trajectories to Arrow record batches and back to padded arrays.

A batch is put once into the Ray object store and read zero-copy by the learner; the
schema below is the contract between the rollout side and the learner side.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pyarrow as pa

from raytunix.types import EpisodeStatus, Trajectory, is_infrastructure_failure

TRAJECTORY_SCHEMA = pa.schema(
    [
        ("task_id", pa.string()),
        ("group_id", pa.string()),
        ("token_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.int8())),
        ("logprobs", pa.list_(pa.float32())),
        ("policy_versions", pa.list_(pa.int32())),
        ("reward", pa.float32()),
        ("status", pa.string()),
        ("num_turns", pa.int32()),
    ]
)


def trajectories_to_record_batch(trajectories: Sequence[Trajectory]) -> pa.RecordBatch:
    """Packs trajectories (one or more whole groups) into one ``TRAJECTORY_SCHEMA`` batch.

    Raises:
      ValueError: if ``trajectories`` is empty.
    """
    if not trajectories:
        raise ValueError(
            "trajectories_to_record_batch got no trajectories; pack at least one group."
        )
    columns = {
        "task_id": [t.task_id for t in trajectories],
        "group_id": [t.group_id for t in trajectories],
        "token_ids": [t.token_ids for t in trajectories],
        "loss_mask": [t.loss_mask for t in trajectories],
        "logprobs": [t.logprobs for t in trajectories],
        "policy_versions": [t.policy_versions for t in trajectories],
        "reward": [float(t.reward) for t in trajectories],
        "status": [EpisodeStatus(t.status).value for t in trajectories],
        "num_turns": [t.num_turns for t in trajectories],
    }
    return pa.RecordBatch.from_pydict(columns, schema=TRAJECTORY_SCHEMA)


def record_batch_to_trajectories(batch: pa.RecordBatch) -> list[Trajectory]:
    """Inverse of ``trajectories_to_record_batch`` (metrics are not carried)."""
    rows = batch.to_pylist()
    return [
        Trajectory(
            task_id=r["task_id"],
            group_id=r["group_id"],
            token_ids=r["token_ids"],
            loss_mask=r["loss_mask"],
            logprobs=r["logprobs"],
            policy_versions=r["policy_versions"],
            reward=r["reward"],
            status=EpisodeStatus(r["status"]),
            num_turns=r["num_turns"],
        )
        for r in rows
    ]


def _padded(column: pa.ListArray, width: int, fill, dtype) -> np.ndarray:
    """[B] list column -> [B, width] array, right-padded with ``fill``."""
    # ``offsets`` index the whole child array, also for a slice of a batch (whose first
    # offset is not 0), so read ``values`` (all of it), not ``flatten()`` (the slice's part).
    offsets = column.offsets.to_numpy()
    values = column.values.to_numpy(zero_copy_only=False)
    out = np.full((len(column), width), fill, dtype=dtype)
    for i in range(len(column)):
        row = values[offsets[i] : offsets[i + 1]]
        out[i, : len(row)] = row
    return out


def record_batch_to_arrays(
    batch: pa.RecordBatch | pa.Table, pad_to_multiple: int = 32, pad_id: int = 0
) -> dict[str, np.ndarray]:
    """Right-pads a trajectory batch into dense arrays for a jitted update.

    The padded length T is the longest trajectory rounded up to ``pad_to_multiple``, so
    that a jitted function sees few distinct shapes (each new shape recompiles).

    Returns:
      ``tokens`` int32[B, T] (``pad_id`` past the end), ``loss_mask`` float32[B, T],
      ``logprobs`` float32[B, T], ``policy_versions`` int32[B, T] (-1 past the end),
      ``rewards`` float32[B], ``group_ids`` int32[B] (dense ids in order of first
      appearance), ``lengths`` int32[B], ``valid`` float32[B] (0 for trajectories whose
      episode failed by infrastructure — env error, timeout, abort — which group
      statistics leave out; see ``grpo_advantages``).
    """
    if isinstance(batch, pa.Table):
        batch = batch.combine_chunks().to_batches()[0]
    token_col = batch.column("token_ids")
    lengths = np.diff(token_col.offsets.to_numpy()).astype(np.int32)
    width = max(pad_to_multiple, int(-(-lengths.max() // pad_to_multiple) * pad_to_multiple))
    group_names = batch.column("group_id").to_pylist()
    dense: dict[str, int] = {}
    group_ids = np.array([dense.setdefault(g, len(dense)) for g in group_names], np.int32)
    return {
        "tokens": _padded(token_col, width, pad_id, np.int32),
        "loss_mask": _padded(batch.column("loss_mask"), width, 0, np.float32),
        "logprobs": _padded(batch.column("logprobs"), width, 0.0, np.float32),
        "policy_versions": _padded(batch.column("policy_versions"), width, -1, np.int32),
        "rewards": batch.column("reward").to_numpy().astype(np.float32),
        "group_ids": group_ids,
        "lengths": lengths,
        "valid": np.array(
            [
                0.0 if is_infrastructure_failure(s) else 1.0
                for s in batch.column("status").to_pylist()
            ],
            np.float32,
        ),
    }


def episode_rows(results: Sequence[Trajectory | list[Trajectory]]) -> list[Trajectory]:
    """The trajectories of a group's episodes, in order: a native episode is one, an agent
    program's is one per segment."""
    rows: list[Trajectory] = []
    for result in results:
        rows.extend(result if isinstance(result, list) else [result])
    return rows
