"""The design's invariants, numbered as there, and what checking them found: a verdict per
invariant and the offending rows of each check that failed. Pure: the store gathers the rows
(store/invariants.py); `kvquota check`, the tests and the stress tool read the same reports."""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from quota_service.core.machine_comparison import Difference

INVARIANTS = {
    1: "every block slot of an instance is in exactly one state; the counts add up to capacity",
    2: "a block's references = live table entries naming its current handle + pins, never "
    "negative; a referenced block is never free",
    3: "a tenant's blocks in use and tokens in flight = what its live reservations and pins hold",
    4: "no live table names a tombstoned handle; no prefix lookup returns a freed block; salts "
    "never match across tenants",
    5: "a repeated Admit returns the same reservation; a repeated Release or Cancel changes "
    "nothing",
    6: "pinned blocks are never freed, offloaded, compressed or evicted by reclaim",
    7: "nothing acknowledged is lost in a crash: every reservation is live with a lease or ended "
    "with a reason",
    8: "one writer per instance, and the owner's memory equals what the record derives",
}

# Offending rows shown per check unless asked for more.
DEFAULT_ROWS = 10


class Verdict(enum.StrEnum):
    OK = "OK"
    VIOLATED = "VIOLATED"
    NOT_CHECKED = "NOT CHECKED"


@dataclass(frozen=True)
class Offence:
    """What one check found: the first offending rows (up to the limit asked for)."""

    check: str
    columns: tuple[str, ...]
    rows: tuple[tuple[object, ...], ...]
    # More rows offend than `rows` holds.
    more: bool


@dataclass(frozen=True)
class InvariantReport:
    number: int
    verdict: Verdict
    # What of the invariant the checks cover, or why it is not checked.
    scope: str
    offences: tuple[Offence, ...] = ()

    @property
    def statement(self) -> str:
        return INVARIANTS[self.number]


@dataclass(frozen=True)
class Tally:
    """What the record keeps of something (an instance, a tenant) beside what it holds, counted
    afresh from its rows: field by field, the same when the record is consistent."""

    key: str
    recorded: tuple[int, ...]
    counted: tuple[int, ...]

    @property
    def consistent(self) -> bool:
        return self.recorded == self.counted and min(self.counted, default=0) >= 0


def offence(
    check: str, columns: Sequence[str], rows: Sequence[tuple[object, ...]], limit: int
) -> list[Offence]:
    """The check's offending rows, the first `limit` of them shown; none when none offend."""
    if not rows:
        return []
    return [Offence(check, tuple(columns), tuple(rows[:limit]), len(rows) > limit)]


def tally_offences(
    check: str, key: str, fields: Sequence[str], tallies: Iterable[Tally], limit: int
) -> list[Offence]:
    """The tallies whose recorded and counted fields differ (or count below zero), each field
    shown as recorded/counted."""
    rows = [
        (t.key, *(f"{r}/{c}" for r, c in zip(t.recorded, t.counted, strict=True)))
        for t in tallies
        if not t.consistent
    ]
    return offence(check, (key, *fields), rows, limit)


def pool_tally(
    instance: str, capacity: int, recorded: Sequence[int], counted: Sequence[int]
) -> Tally:
    """An instance's slot counters (free, cached, in use, pinned only) as recorded and as
    counted from its slots, led by its capacity against the sum of the counted: every slot is
    in exactly one state, so they add up to it."""
    return Tally(instance, (capacity, *recorded), (sum(counted), *counted))


def judged(number: int, scope: str, offences: Sequence[Offence]) -> InvariantReport:
    """Violated when any check found an offending row."""
    verdict = Verdict.VIOLATED if offences else Verdict.OK
    return InvariantReport(number, verdict, scope, tuple(offences))


def not_checked(number: int, why: str) -> InvariantReport:
    return InvariantReport(number, Verdict.NOT_CHECKED, why)


@dataclass(frozen=True)
class OwnerCheck:
    """What an instance's owner answered when asked to compare its memory with the record: the
    differences it found, or why it could not compare."""

    instance: str
    differences: tuple[Difference, ...] = ()
    # More differences than `differences` holds.
    more: bool = False
    not_compared: str | None = None


def with_owners(report: InvariantReport, owners: Sequence[OwnerCheck]) -> InvariantReport:
    """Invariant 8's report from the record, with each owner's memory judged beside it: an
    owner that found differences violates it. Judged from what was compared, if anything was;
    instances that were not say why in the scope."""
    compared = [o for o in owners if o.not_compared is None]
    if compared:
        names = ", ".join(f"instances/{o.instance}" for o in compared)
        scope = f"{report.scope}; the owners' memory of {names}"
    else:
        scope = report.scope
    skipped = "; ".join(
        f"instances/{o.instance}: {o.not_compared}" for o in owners if o.not_compared
    )
    if skipped:
        scope = f"{scope}; not compared: {skipped}"
    if not compared and report.verdict is Verdict.NOT_CHECKED:
        return not_checked(report.number, scope)
    found = [
        Offence(
            f"instances/{o.instance}: the owner's memory equals what the record rebuilds",
            ("subject", "memory", "record"),
            tuple((d.subject, d.memory, d.record) for d in o.differences),
            o.more,
        )
        for o in compared
        if o.differences
    ]
    return judged(report.number, scope, [*report.offences, *found])


def violations(reports: Sequence[InvariantReport]) -> list[str]:
    """One line per check that found offending rows, for logs and assertions."""
    return [
        f"invariant {r.number}: {o.check}: {list(o.rows)}{' and more' if o.more else ''}"
        for r in reports
        for o in r.offences
    ]
