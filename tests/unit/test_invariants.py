"""The invariants' verdicts (core/invariants.py) and which of them the record's checks cover."""

from __future__ import annotations

from quota_service.core.invariants import (
    INVARIANTS,
    Offence,
    Verdict,
    judged,
    not_checked,
    violations,
)
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
