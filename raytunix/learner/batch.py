"""The learner's input: a padded batch of trajectories with named ``[B, T]`` arrays.

A ``Batch`` is what ``make_grpo_update``'s update takes; ``Batch.from_record_batch`` builds
it from the Arrow record batch the rollout side packs (``raytunix.rollout.batch``)::

    batch = Batch.from_record_batch(record_batch, pad_id=0, max_seq_len=128)
    state, metrics = update(state, ref_params, batch)

Shapes are ``[B, T]`` (B trajectories, T tokens) or ``[B]``. T is one of a few widths
(``padding_buckets``), so that a jitted update compiles once per width, not per length.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa

from raytunix.rollout.batch import record_batch_to_arrays

SMALLEST_WIDTH = 32  # tokens; the narrowest padded width


def padding_buckets(max_seq_len: int, smallest: int = SMALLEST_WIDTH) -> tuple[int, ...]:
    """The widths a batch is padded to: ``smallest``, then two per doubling (``2^k`` and
    ``1.5 * 2^k``) from ``2 * smallest`` up, and ``max_seq_len`` itself, e.g. 32, 64, 96,
    128 for 128 tokens and 14 widths for 4096. Padding wastes at most a third of a
    batch's tokens, and the update compiles for at most these shapes.

    Raises:
      ValueError: ``max_seq_len`` or ``smallest`` not positive.
    """
    if max_seq_len < 1 or smallest < 1:
        raise ValueError(f"padding_buckets needs max_seq_len={max_seq_len!r} and "
                         f"smallest={smallest!r} >= 1.")
    widths = {max_seq_len}
    width = smallest
    while width < max_seq_len:
        widths.add(width)
        if width >= 2 * smallest:
            widths.add(width * 3 // 2)
        width *= 2
    return tuple(sorted(w for w in widths if w <= max_seq_len))


def bucket_width(length: int, max_seq_len: int) -> int:
    """The narrowest of ``padding_buckets(max_seq_len)`` that holds ``length`` tokens;
    ``max_seq_len`` for a longer one (which is then cut to it)."""
    return next((w for w in padding_buckets(max_seq_len) if w >= length), max_seq_len)


class Batch(NamedTuple):
    """B trajectories right-padded to T tokens, as the learner's update reads them.

    Token ``t`` of a row is scored by the logits at position ``t - 1``, so position 0 is
    never trained. Padding has ``loss_mask`` 0 and is ignored by every loss.

    Attributes:
      tokens: int32[B, T], token ids; the pad id past each trajectory's end.
      loss_mask: float32[B, T], 1 on tokens the policy generated and is trained on; 0 on
        prompt, tool and environment tokens, padding, and tokens masked as stale.
      logprobs: float32[B, T], the behaviour (engine) policy's log-probability of each
        generated token under its sampling distribution (nats); 0 elsewhere.
      policy_versions: int32[B, T], the policy version that sampled each generated token
        (-1 elsewhere); read for staleness, not by the loss.
      rewards: float32[B], episode rewards (finite).
      group_ids: int32[B], dense group ids in ``[0, B)``: the trajectories of one task.
      valid: float32[B], 0 for a trajectory whose episode failed by infrastructure (env
        error, timeout, abort), left out of group statistics; 1 otherwise.
    """

    tokens: Any
    loss_mask: Any
    logprobs: Any
    policy_versions: Any
    rewards: Any
    group_ids: Any
    valid: Any

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray]) -> Batch:
        """From the dict of ``record_batch_to_arrays`` (its other keys are dropped).

        Raises:
          ValueError: a field is missing, naming it and the keys given.
        """
        missing = [name for name in cls._fields if name not in arrays]
        if missing:
            raise ValueError(f"a learner batch needs {missing}; got keys {sorted(arrays)}. "
                             "Build it with Batch.from_record_batch.")
        return cls(
            tokens=np.asarray(arrays["tokens"], np.int32),
            loss_mask=np.asarray(arrays["loss_mask"], np.float32),
            logprobs=np.asarray(arrays["logprobs"], np.float32),
            policy_versions=np.asarray(arrays["policy_versions"], np.int32),
            rewards=np.asarray(arrays["rewards"], np.float32),
            group_ids=np.asarray(arrays["group_ids"], np.int32),
            valid=np.asarray(arrays["valid"], np.float32),
        )

    @classmethod
    def from_record_batch(cls, batch: pa.RecordBatch | pa.Table, *, pad_id: int,
                          max_seq_len: int) -> Batch:
        """Pads a ``TRAJECTORY_SCHEMA`` batch to ``bucket_width`` of its longest
        trajectory; a trajectory longer than ``max_seq_len`` is cut to it (its tail is not
        trained on)."""
        if isinstance(batch, pa.Table):
            batch = batch.combine_chunks().to_batches()[0]
        lengths = np.diff(batch.column("token_ids").offsets.to_numpy())
        width = bucket_width(int(lengths.max()), max_seq_len)
        # Padded to a multiple of ``width``: exactly ``width`` unless a row is longer.
        arrays = record_batch_to_arrays(batch, pad_to_multiple=width, pad_id=pad_id)
        if arrays["tokens"].shape[1] > max_seq_len:
            for key in ("tokens", "loss_mask", "logprobs", "policy_versions"):
                arrays[key] = arrays[key][:, :max_seq_len]
        return cls.from_arrays(arrays)

    def pad_rows(self, multiple: int) -> Batch:
        """The batch with empty rows appended up to a multiple of ``multiple`` rows: no
        trained token, ``valid`` 0 (outside every statistic), group 0."""
        extra = -len(self.rewards) % multiple
        if not extra:
            return self

        def pad(x, fill):
            x = np.asarray(x)
            return np.concatenate([x, np.full((extra,) + x.shape[1:], fill, x.dtype)])

        return Batch(tokens=pad(self.tokens, 0), loss_mask=pad(self.loss_mask, 0),
                     logprobs=pad(self.logprobs, 0), policy_versions=pad(self.policy_versions, -1),
                     rewards=pad(self.rewards, 0), group_ids=pad(self.group_ids, 0),
                     valid=pad(self.valid, 0))
