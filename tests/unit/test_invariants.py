"""The invariants' verdicts (core/invariants.py), counters judged against what they count, each
owner's memory judged beside the record, and which invariants the record's checks cover."""

from __future__ import annotations

from quota_service.core.invariants import (
    INVARIANTS,
    Offence,
    OwnerCheck,
    Tally,
    Verdict,
    judged,
    not_checked,
    pool_tally,
    tally_offences,
    violations,
    with_owners,
)
from quota_service.core.machine_comparison import Difference
from quota_service.store.invariants import CHECKED, NOT_CHECKED


def test_every_invariant_is_checked_or_says_why_not() -> None:
    assert sorted([*CHECKED, *NOT_CHECKED]) == sorted(INVARIANTS)


def test_a_check_that_found_rows_violates_its_invariant() -> None:
    found = Offence("refs match", ("block_id", "ref_count"), ((3, 2), (5, 1)), more=True)
    broken = judged(2, "every slot", [found])
    assert (broken.verdict, broken.statement) == (Verdict.VIOLATED, INVARIANTS[2])
    assert judged(1, "counters", []).verdict is Verdict.OK
    assert not_checked(8, "no owners yet").verdict is Verdict.NOT_CHECKED
    assert violations([broken, judged(1, "counters", [])]) == [
        "invariant 2: refs match: [(3, 2), (5, 1)] and more"
    ]


def test_counters_are_judged_field_by_field_and_a_pool_adds_up_to_its_capacity() -> None:
    healthy = pool_tally("gpu-0", 10, (4, 2, 3, 1), (4, 2, 3, 1))
    moved = pool_tally("gpu-1", 10, (4, 2, 3, 1), (4, 1, 4, 1))  # a slot counted elsewhere
    lost = pool_tally("gpu-2", 10, (4, 2, 3, 1), (3, 2, 3, 1))  # a slot in no state
    negative = Tally("acme", (0,), (-1,))
    assert healthy.consistent and not moved.consistent and not lost.consistent
    assert not negative.consistent
    (found,) = tally_offences(
        "counters",
        "instance",
        ("slots", "free", "cached", "in_use", "pinned"),
        [healthy, moved, lost],
        limit=1,
    )
    assert found.columns == ("instance", "slots", "free", "cached", "in_use", "pinned")
    assert found.rows == (("gpu-1", "10/10", "4/4", "2/1", "3/4", "1/1"),)
    assert found.more
    assert tally_offences("counters", "instance", ("slots",), [healthy], limit=10) == []


def test_owners_memory_is_judged_beside_the_record() -> None:
    record = judged(8, "batches fenced", [])
    same = OwnerCheck("gpu-0")
    differs = OwnerCheck("gpu-1", (Difference("slot 3", "references 2", "references 1"),))
    away = OwnerCheck("gpu-2", not_compared="not served from memory here")

    judged_8 = with_owners(record, [same, differs, away])
    assert judged_8.verdict is Verdict.VIOLATED
    assert [(o.check, o.rows) for o in judged_8.offences] == [
        (
            "instances/gpu-1: the owner's memory equals what the record rebuilds",
            (("slot 3", "references 2", "references 1"),),
        )
    ]
    assert "the owners' memory of instances/gpu-0, instances/gpu-1" in judged_8.scope
    assert "not compared: instances/gpu-2: not served from memory here" in judged_8.scope
    assert with_owners(record, [same]).verdict is Verdict.OK
    # Nothing compared, nothing journaled: still not checked, and why.
    unchecked = with_owners(not_checked(8, "no owners"), [away])
    assert unchecked.verdict is Verdict.NOT_CHECKED
    assert (
        unchecked.scope == "no owners; not compared: instances/gpu-2: not served from memory here"
    )
