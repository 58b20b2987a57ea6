"""The data ledger: where every task index the orchestrator handed out stands.

Each index below the data position (``next_index``) is in exactly one of three places:

* **trained**: its group was in a batch the learner consumed (``mark_trained``);
* **filtered**: given up with a reason (``stale``, ``engine_error``, ``env_error``,
  ``failed_episode``, ``zero_variance``, ...);
* **pending**: handed out and not yet settled (in flight, packed but not trained, or
  waiting for a retry). A resumed run starts these again.

The ledger keeps the first two; the orchestrator keeps the pending set. Both travel in the
orchestrator's ``state()``, which the driver saves with every checkpoint, so after a crash
and a resume the restored ledger says which tasks the restored weights were trained on.
Settling an index twice raises ``LedgerError``: that is the exactly-once contract broken.

Settled indices are stored as sorted half-open ranges ``[start, end)``: groups finish
nearly in order, so a run of N steps costs a handful of ranges, not N x groups_per_batch
integers, in every checkpoint. Nothing here imports Ray or JAX.
"""

from __future__ import annotations

import bisect
from typing import Any, Iterable, Iterator


class LedgerError(RuntimeError):
    """A task index would be settled twice, or a saved ledger does not add up."""


class IndexRanges:
    """A set of non-negative ints stored as sorted, disjoint, non-adjacent ``[start, end)``
    ranges.

    Args:
      ranges: ``[[start, end], ...]`` as ``to_json`` writes them.

    Raises:
      ValueError: a range is empty, negative, or overlaps or touches another.
    """

    def __init__(self, ranges: Iterable[Iterable[int]] = ()):
        self._starts: list[int] = []
        self._ends: list[int] = []
        for pair in ranges:
            start, end = (int(x) for x in pair)
            if not 0 <= start < end:
                raise ValueError(f"range [{start}, {end}) must be non-empty and non-negative")
            if self._ends and start <= self._ends[-1]:
                raise ValueError(
                    f"range [{start}, {end}) overlaps or touches the one before "
                    f"([{self._starts[-1]}, {self._ends[-1]})); ranges must be "
                    "sorted and disjoint"
                )
            self._starts.append(start)
            self._ends.append(end)

    def __contains__(self, index: int) -> bool:
        k = bisect.bisect_right(self._starts, index) - 1
        return k >= 0 and index < self._ends[k]

    def add(self, index: int) -> bool:
        """Adds ``index``; returns False (and changes nothing) if it was already in."""
        if index < 0:
            raise ValueError(f"task index must be >= 0, got {index}")
        k = bisect.bisect_right(self._starts, index) - 1  # the range starting at or before
        if k >= 0 and index < self._ends[k]:
            return False
        joins_left = k >= 0 and self._ends[k] == index
        joins_right = k + 1 < len(self._starts) and self._starts[k + 1] == index + 1
        if joins_left and joins_right:  # fills the gap between two ranges
            self._ends[k] = self._ends.pop(k + 1)
            self._starts.pop(k + 1)
        elif joins_left:
            self._ends[k] = index + 1
        elif joins_right:
            self._starts[k + 1] = index
        else:
            self._starts.insert(k + 1, index)
            self._ends.insert(k + 1, index + 1)
        return True

    def __len__(self) -> int:
        return sum(e - s for s, e in zip(self._starts, self._ends))

    def __iter__(self) -> Iterator[int]:
        for start, end in zip(self._starts, self._ends):
            yield from range(start, end)

    def ranges(self) -> list[tuple[int, int]]:
        return list(zip(self._starts, self._ends))

    def to_json(self) -> list[list[int]]:
        return [[s, e] for s, e in zip(self._starts, self._ends)]


class TaskLedger:
    """Trained and filtered task indices (see the module docstring).

    Args:
      trained: ranges of trained indices (``to_json()["trained"]``).
      filtered: ``{reason: ranges}`` (``to_json()["filtered"]``).

    Raises:
      LedgerError: an index is both trained and filtered, or filtered for two reasons.
    """

    def __init__(
        self,
        trained: Iterable[Iterable[int]] = (),
        filtered: dict[str, Iterable[Iterable[int]]] | None = None,
    ):
        self.trained = IndexRanges(trained)
        self.filtered = {reason: IndexRanges(r) for reason, r in (filtered or {}).items()}
        tagged = sorted(
            (start, end, name) for name, indices in self._sets() for start, end in indices.ranges()
        )
        for (s0, e0, n0), (s1, _, n1) in zip(tagged, tagged[1:]):
            if s1 < e0:  # each set is disjoint in itself, so this is two sets
                raise LedgerError(
                    f"task index {s1} is recorded as {n0} and as {n1}; the saved ledger is corrupt"
                )

    def _sets(self) -> list[tuple[str, IndexRanges]]:
        return [
            ("trained", self.trained),
            *((f"filtered:{reason}", r) for reason, r in self.filtered.items()),
        ]

    @classmethod
    def from_json(cls, tree: dict[str, Any] | None) -> TaskLedger:
        """The ledger ``to_json`` wrote (an empty one for None)."""
        tree = tree or {}
        return cls(tree.get("trained", ()), tree.get("filtered", {}))

    def to_json(self) -> dict[str, Any]:
        return {
            "trained": self.trained.to_json(),
            "filtered": {reason: r.to_json() for reason, r in sorted(self.filtered.items())},
        }

    def outcome(self, index: int) -> str | None:
        """``"trained"``, ``"filtered:<reason>"``, or None while unsettled."""
        return next((name for name, indices in self._sets() if index in indices), None)

    def record_trained(self, index: int) -> None:
        """Records that ``index`` was in a batch the learner consumed.

        Raises:
          LedgerError: ``index`` was already trained or filtered.
        """
        self._check_unsettled(index, "trained")
        self.trained.add(index)

    def record_filtered(self, index: int, reason: str) -> None:
        """Records that ``index`` was given up for ``reason``.

        Raises:
          LedgerError: ``index`` was already trained or filtered.
        """
        self._check_unsettled(index, f"filtered:{reason}")
        self.filtered.setdefault(reason, IndexRanges()).add(index)

    def _check_unsettled(self, index: int, new: str) -> None:
        old = self.outcome(index)
        if old is not None:
            raise LedgerError(
                f"task index {index} is already {old} and would now be {new}: a task must be "
                "settled exactly once. This is a bug in the orchestrator; please report it "
                "with the run's metrics.jsonl."
            )

    def check(self, next_index: int, pending: Iterable[int]) -> None:
        """Checks the exactly-once invariant: every index in ``[0, next_index)`` is
        trained, filtered or pending, exactly one of them, and none is beyond.

        Raises:
          LedgerError: an index is missing, pending and settled, or beyond ``next_index``.
        """
        pending = sorted(set(int(i) for i in pending))
        for index in pending:
            if not 0 <= index < next_index:
                raise LedgerError(f"pending task index {index} is outside [0, {next_index})")
            settled = self.outcome(index)
            if settled is not None:
                raise LedgerError(f"task index {index} is pending and {settled}")
        ranges = sorted(
            [*(r for _, rs in self._sets() for r in rs.ranges()), *((i, i + 1) for i in pending)]
        )
        covered = 0
        for start, end in [*ranges, (next_index, next_index)]:  # must chain up to next_index
            if start < covered:
                raise LedgerError(
                    f"task index {start} is recorded twice, or settled beyond "
                    f"the data position {next_index}"
                )
            if start > covered:
                raise LedgerError(
                    f"task indices [{covered}, {start}) were handed out but are "
                    "neither trained, filtered nor pending"
                )
            covered = end
