"""The learner's input: a padded batch of trajectories with named ``[B, T]`` arrays.

A ``Batch`` is what ``make_policy_update``'s update takes; ``Batch.from_record_batch`` builds
it from the Arrow record batch the rollout side packs (``raytunix.rollout.batch``)::

    batch = Batch.from_record_batch(record_batch, pad_id=0, max_seq_len=128)
    state, metrics = update(state, ref_params, batch)

Shapes are ``[B, T]`` (B trajectories, T tokens) or ``[B]``. T is one of a few widths
(``padding_buckets``), so that a jitted update compiles once per width, not per length.

A ``PackedBatch`` (sequence packing) holds the same trajectories several to a row of L
tokens, with segment ids, restarting positions and a per-token trajectory index, so that
a batch of short trajectories is not padded to its longest; ``pack_batch`` builds it.
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
        raise ValueError(
            f"padding_buckets needs max_seq_len={max_seq_len!r} and smallest={smallest!r} >= 1."
        )
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
            raise ValueError(
                f"a learner batch needs {missing}; got keys {sorted(arrays)}. "
                "Build it with Batch.from_record_batch."
            )
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
    def from_record_batch(
        cls, batch: pa.RecordBatch | pa.Table, *, pad_id: int, max_seq_len: int
    ) -> Batch:
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

        return Batch(
            tokens=pad(self.tokens, 0),
            loss_mask=pad(self.loss_mask, 0),
            logprobs=pad(self.logprobs, 0),
            policy_versions=pad(self.policy_versions, -1),
            rewards=pad(self.rewards, 0),
            group_ids=pad(self.group_ids, 0),
            valid=pad(self.valid, 0),
        )


ROW_MULTIPLE = 8  # packed rows are padded to a multiple of this, so few row counts compile


class PackedBatch(NamedTuple):
    """Trajectories packed several to a row of L tokens (sequence packing), so that short
    trajectories do not each pay for the longest one's padding.

    A row holds segments 1..k, one trajectory each, back to back from column 0, then
    padding (segment 0). The model attends only within a segment (``segment_ids``) and
    each segment's ``positions`` restart at 0, so a trajectory is scored exactly as in
    its own row of a ``Batch``. A segment's first token has ``loss_mask`` 0 (like column
    0 of a ``Batch``): the shifted logprobs never score a token from its neighbour's
    last token. Per-trajectory numbers stay ``[N]`` and reach their tokens through
    ``trajectory_index``. Build with ``pack_batch`` or ``PackedBatch.from_record_batch``.

    Attributes:
      tokens, loss_mask, logprobs, policy_versions: ``[R, L]``, as in ``Batch`` (pad id,
        0, 0 and -1 on padding).
      segment_ids: int32[R, L], 0 on padding, 1..k for the k-th trajectory of the row.
      positions: int32[R, L], the token's position in its trajectory (0 on padding).
      trajectory_index: int32[R, L], the trajectory (row of ``rewards``) each token
        belongs to; 0 on padding (whose ``loss_mask`` is 0).
      rewards, group_ids, valid: ``[N]``, as in ``Batch``, one per trajectory.
    """

    tokens: Any
    loss_mask: Any
    logprobs: Any
    policy_versions: Any
    segment_ids: Any
    positions: Any
    trajectory_index: Any
    rewards: Any
    group_ids: Any
    valid: Any

    @classmethod
    def from_record_batch(
        cls,
        batch: pa.RecordBatch | pa.Table,
        *,
        pad_id: int,
        max_seq_len: int,
        pack_width: int = 0,
        row_multiple: int = ROW_MULTIPLE,
    ) -> PackedBatch:
        """Packs a ``TRAJECTORY_SCHEMA`` batch into rows of at most ``pack_width`` tokens
        (0: ``max_seq_len``); a trajectory longer than ``min(pack_width, max_seq_len)`` is
        cut to it, as ``Batch.from_record_batch`` cuts. The row width is the one of
        ``packed_width`` (the fewest tokens in all). See ``pack_batch``."""
        if isinstance(batch, pa.Table):
            batch = batch.combine_chunks().to_batches()[0]
        lengths = np.diff(batch.column("token_ids").offsets.to_numpy())
        padded = Batch.from_record_batch(batch, pad_id=pad_id, max_seq_len=max_seq_len)
        widest = widest_packed_row(pack_width, max_seq_len)
        width = packed_width(np.minimum(lengths, widest), widest, row_multiple=row_multiple)
        return pack_batch(padded, lengths, width, pad_id=pad_id, row_multiple=row_multiple)


def widest_packed_row(pack_width: int, max_seq_len: int) -> int:
    """The most tokens a packed row holds: ``learner.pack_width`` (0: the model's context
    ``max_seq_len``), never more than ``max_seq_len``. A trajectory longer than this is
    cut to it.

    Raises:
      ValueError: a negative ``pack_width`` or a ``max_seq_len`` below 1.
    """
    if pack_width < 0 or max_seq_len < 1:
        raise ValueError(
            f"pack_width={pack_width!r} must be >= 0 (0: the context) and "
            f"max_seq_len={max_seq_len!r} >= 1."
        )
    return min(pack_width or max_seq_len, max_seq_len)


def packed_width(lengths: np.ndarray, widest: int, *, row_multiple: int = ROW_MULTIPLE) -> int:
    """The row width to pack trajectories of ``lengths`` (each <= ``widest``) at: among
    ``padding_buckets(widest)`` that hold the longest, the one whose packed batch (rows
    rounded up to ``row_multiple``) has the fewest tokens, the narrowest on a tie, since
    attention costs more per token in a wider row. Trajectories that already fill a
    narrow bucket (e.g. all 40-64 tokens in a 128 context) are packed at it rather than
    paired in twice-as-wide rows of as many tokens. So the update compiles once per
    (width, row count) seen: at most the padding widths times ``N / row_multiple``, in
    practice a few."""
    lengths = np.asarray(lengths)
    longest = int(lengths.max()) if lengths.size else 0
    best = None
    for width in padding_buckets(widest):
        if width < max(longest, 2):
            continue
        rows = -(-max(len(pack_rows(lengths, width)), 1) // row_multiple) * row_multiple
        if best is None or rows * width < best[0]:
            best = (rows * width, width)
    return best[1] if best else widest


def pack_rows(lengths: np.ndarray, width: int) -> list[list[int]]:
    """First-fit decreasing bin packing: the trajectories (by index) of each row, their
    ``lengths`` (tokens, each <= ``width``) summing to at most ``width`` per row. Longest
    first, each into the first row with room (Johnson 1973: at most 11/9 of the optimal
    row count plus a few). O(N x rows), fine for the learner's few hundred trajectories.

    Raises:
      ValueError: a length outside ``[0, width]``.
    """
    lengths = np.asarray(lengths, np.int64)
    if lengths.size and (lengths.min() < 0 or lengths.max() > width):
        raise ValueError(
            f"trajectory lengths must be in [0, width={width}]; got "
            f"{lengths.min()}..{lengths.max()}. Cut them to the width first."
        )
    rows: list[list[int]] = []
    room: list[int] = []
    for i in np.argsort(-lengths, kind="stable"):
        n = int(lengths[i])
        for r, free in enumerate(room):
            if n <= free:
                rows[r].append(int(i))
                room[r] -= n
                break
        else:
            rows.append([int(i)])
            room.append(width - n)
    return rows


def generated_tokens_cut(batch: pa.RecordBatch | pa.Table, width: int) -> dict[str, int]:
    """Generated tokens (loss mask 1) of a ``TRAJECTORY_SCHEMA`` batch that the learner
    cannot train on once its rows are ``width`` tokens wide, by why: ``seq_len`` (past
    ``width``: ``Batch.from_record_batch`` and ``pack_batch`` cut a longer trajectory)
    and ``first_position`` (a trajectory's token 0 is scored from nothing). Each is the
    step metric ``generated_tokens_dropped_<kind>``; a trajectory starts with its prompt,
    so both are 0 unless something upstream is wrong (a context longer than the model's).
    """
    if isinstance(batch, pa.Table):
        batch = batch.combine_chunks().to_batches()[0]
    column = batch.column("loss_mask")
    offsets = column.offsets.to_numpy()
    mask = column.values.to_numpy(zero_copy_only=False)
    cut = first = 0
    for i in range(len(column)):
        row = mask[offsets[i] : offsets[i + 1]]
        if len(row):
            first += int(row[0] != 0)
            cut += int(np.count_nonzero(row[width:]))
    return {"seq_len": cut, "first_position": first}


def pack_batch(
    batch: Batch,
    lengths: np.ndarray,
    width: int,
    *,
    pad_id: int = 0,
    row_multiple: int = ROW_MULTIPLE,
) -> PackedBatch:
    """Packs the trajectories of a padded ``batch`` into rows of ``width`` tokens.

    Rows are filled by ``pack_rows`` (first-fit decreasing); their number R is rounded up
    to a multiple of ``row_multiple`` with empty rows (all padding), so the update
    compiles once per multiple: with N trajectories at most ``ceil(N / row_multiple)``
    programs, in practice two or three, since a run's packed row count varies little.
    A segment's first token gets ``loss_mask`` 0 (``Batch``'s column 0 is never trained
    either), so packing changes no trained token.

    Args:
      batch: N trajectories, ``[N, T]`` / ``[N]`` (``Batch.from_record_batch``).
      lengths: int[N], each trajectory's token count (padding excluded); cut to
        ``min(width, T)``.
      width: L, tokens per packed row (>= 2).
      pad_id: token id of padding.
      row_multiple: R is a multiple of this (>= 1): lcm of 8, the micro-batch size and
        the mesh's batch shards, so that micro-batches and devices split the rows evenly.

    Raises:
      ValueError: ``width < 2``, ``row_multiple < 1``, or ``lengths`` not one per row.
    """
    if width < 2 or row_multiple < 1:
        raise ValueError(
            f"pack_batch needs width={width!r} >= 2 and row_multiple={row_multiple!r} >= 1."
        )
    tokens = np.asarray(batch.tokens)
    num, cols = tokens.shape
    lengths = np.asarray(lengths, np.int64)
    if lengths.shape != (num,):
        raise ValueError(
            f"pack_batch needs one length per trajectory: lengths {lengths.shape}, batch of {num}."
        )
    lengths = np.clip(lengths, 0, min(width, cols))
    out = _packed_arrays(
        {
            "tokens": (tokens.astype(np.int32), pad_id),
            "loss_mask": (np.asarray(batch.loss_mask, np.float32), 0),
            "logprobs": (np.asarray(batch.logprobs, np.float32), 0),
            "policy_versions": (np.asarray(batch.policy_versions, np.int32), -1),
        },
        lengths,
        width,
        row_multiple,
    )
    return PackedBatch(
        **out,
        rewards=np.asarray(batch.rewards, np.float32),
        group_ids=np.asarray(batch.group_ids, np.int32),
        valid=np.asarray(batch.valid, np.float32),
    )


def _packed_arrays(
    fields: dict[str, tuple[np.ndarray, Any]], lengths: np.ndarray, width: int, row_multiple: int
) -> dict[str, np.ndarray]:
    """Each ``[N, T]`` array of ``fields`` (name -> (array, padding value)) packed into
    ``[R, width]`` rows by ``pack_rows``, with ``segment_ids``, ``positions`` and
    ``trajectory_index`` (see ``PackedBatch``); R rounded up to ``row_multiple``. A
    segment's first token gets ``loss_mask`` 0 where ``fields`` has one. ``lengths`` must
    already be cut to ``min(width, T)``."""
    rows = pack_rows(lengths, width)
    num_rows = -(-max(len(rows), 1) // row_multiple) * row_multiple
    shape = (num_rows, width)
    out = {key: np.full(shape, pad, array.dtype) for key, (array, pad) in fields.items()}
    out.update(
        {key: np.zeros(shape, np.int32) for key in ("segment_ids", "positions", "trajectory_index")}
    )
    for r, members in enumerate(rows):
        start = 0
        for k, i in enumerate(members, start=1):
            n = int(lengths[i])
            span = slice(start, start + n)
            for key, (array, _) in fields.items():
                out[key][r, span] = array[i, :n]
            if n and "loss_mask" in out:  # the segment's first token is scored from nothing
                out["loss_mask"][r, start] = 0
            out["segment_ids"][r, span] = k
            out["positions"][r, span] = np.arange(n)
            out["trajectory_index"][r, span] = i
            start += n
    return out


def pack_demonstrations(
    tokens: np.ndarray, loss_mask: np.ndarray, *, pad_id: int = 0, row_multiple: int = ROW_MULTIPLE
) -> dict[str, np.ndarray]:
    """Supervised rows packed several to a row of the same width (sequence packing): a
    warm start's demonstrations average under half of the widest one's tokens, so packed
    they take about half the rows, and the step about half the compute.

    Each row is cut after its last target (``loss_mask`` > 0): later tokens (padding) are
    never predicted from, so the loss, its gradient and every metric are those of the
    unpacked rows (up to float rounding). Rows of ``tokens`` must start at column 0
    (right padding).

    Args:
      tokens: int32[N, T]. loss_mask: float32[N, T] (column 0 is never a target).
      pad_id: token id of padding. row_multiple: the packed row count is a multiple of it.

    Returns:
      ``tokens``, ``loss_mask``, ``positions`` and ``segment_ids`` ([R, T]; R <= N rounded
      up to ``row_multiple``), for ``make_sft_update``'s update.

    Raises:
      ValueError: ``tokens`` and ``loss_mask`` differ in shape, or ``row_multiple < 1``.
    """
    tokens, loss_mask = np.asarray(tokens), np.asarray(loss_mask)
    if tokens.shape != loss_mask.shape or tokens.ndim != 2 or row_multiple < 1:
        raise ValueError(
            f"pack_demonstrations needs tokens and loss_mask of one [N, T] shape "
            f"(got {tokens.shape} and {loss_mask.shape}) and row_multiple="
            f"{row_multiple!r} >= 1."
        )
    if tokens.size and (tokens.min() < 0 or tokens.max() > np.iinfo(np.int32).max):
        raise ValueError(
            f"pack_demonstrations needs token ids in [0, 2^31): got "
            f"{tokens.min()}..{tokens.max()} (the model takes int32 ids)."
        )
    width = max(tokens.shape[1], 2)
    on = loss_mask > 0
    lengths = np.where(on.any(axis=1), tokens.shape[1] - np.argmax(on[:, ::-1], axis=1), 0)
    out = _packed_arrays(
        {
            "tokens": (tokens.astype(np.int32), pad_id),
            "loss_mask": (loss_mask.astype(np.float32), 0),
        },
        lengths,
        width,
        row_multiple,
    )
    return {key: out[key] for key in ("tokens", "loss_mask", "positions", "segment_ids")}
