"""The data ledger: every task index handed out is trained, filtered or pending, exactly
once; a saved ledger that does not add up is refused."""

from __future__ import annotations

import random

import pytest

from raytunix.rollout.ledger import IndexRanges, LedgerError, TaskLedger


def test_index_ranges_merge_neighbours_and_refuse_duplicates():
    ranges = IndexRanges()
    for index in [5, 3, 4, 0, 1, 9]:
        assert ranges.add(index)
    assert ranges.to_json() == [[0, 2], [3, 6], [9, 10]]
    assert ranges.add(2)  # fills the gap: two ranges become one
    assert ranges.to_json() == [[0, 6], [9, 10]]
    assert not ranges.add(4)  # already in: nothing changes
    assert len(ranges) == 7 and list(ranges) == [0, 1, 2, 3, 4, 5, 9]
    assert 5 in ranges and 6 not in ranges and 9 in ranges


def test_index_ranges_match_a_set_in_any_order():
    rng = random.Random(0)
    indices = rng.sample(range(500), 300)
    ranges, reference = IndexRanges(), set()
    for index in indices:
        assert ranges.add(index) == (index not in reference)
        reference.add(index)
    assert list(ranges) == sorted(reference)
    assert list(IndexRanges(ranges.to_json())) == sorted(reference)  # round trip
    assert all((i in ranges) == (i in reference) for i in range(510))


@pytest.mark.parametrize(
    "bad", [[[3, 3]], [[-1, 2]], [[0, 4], [2, 6]], [[0, 4], [4, 6]], [[5, 6], [0, 1]]]
)
def test_index_ranges_refuse_a_corrupt_saved_form(bad):
    with pytest.raises(ValueError, match="range"):
        IndexRanges(bad)


def test_a_task_settled_twice_is_a_loud_error():
    ledger = TaskLedger()
    ledger.record_trained(0)
    ledger.record_filtered(1, "stale")
    with pytest.raises(LedgerError, match="task index 0 is already trained"):
        ledger.record_trained(0)
    with pytest.raises(LedgerError, match="already filtered:stale and would now be trained"):
        ledger.record_trained(1)
    with pytest.raises(LedgerError, match="task index 0 is already trained"):
        ledger.record_filtered(0, "engine_error")
    assert ledger.outcome(0) == "trained" and ledger.outcome(1) == "filtered:stale"
    assert ledger.outcome(2) is None


def test_check_accepts_an_exact_partition_and_names_what_is_wrong_otherwise():
    ledger = TaskLedger()
    for index in [0, 1, 2, 5]:
        ledger.record_trained(index)
    ledger.record_filtered(3, "engine_error")
    ledger.check(next_index=7, pending=[4, 6])  # 0..6: trained, filtered or pending
    with pytest.raises(LedgerError, match=r"\[6, 7\) were handed out but are neither"):
        ledger.check(next_index=7, pending=[4])
    with pytest.raises(LedgerError, match="pending and trained"):
        ledger.check(next_index=7, pending=[4, 5, 6])
    with pytest.raises(LedgerError, match="outside"):
        ledger.check(next_index=7, pending=[4, 6, 7])
    with pytest.raises(LedgerError, match=r"\[7, 8\) were handed out"):
        ledger.check(next_index=8, pending=[4, 6])
    with pytest.raises(LedgerError, match="settled beyond the data position 5"):
        ledger.check(next_index=5, pending=[4])


def test_the_saved_form_round_trips_and_a_corrupt_one_is_refused():
    ledger = TaskLedger()
    for index in range(10):
        ledger.record_trained(index)
    ledger.record_filtered(10, "stale")
    ledger.record_filtered(12, "zero_variance")
    saved = ledger.to_json()
    assert saved == {
        "trained": [[0, 10]],
        "filtered": {"stale": [[10, 11]], "zero_variance": [[12, 13]]},
    }
    restored = TaskLedger.from_json(saved)
    assert restored.to_json() == saved
    assert restored.outcome(12) == "filtered:zero_variance" and restored.outcome(11) is None
    with pytest.raises(
        LedgerError, match="task index 9 is recorded as trained and as filtered:stale"
    ):
        TaskLedger.from_json({"trained": [[0, 10]], "filtered": {"stale": [[9, 11]]}})
