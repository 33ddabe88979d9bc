"""The design's invariants, numbered as there, and what checking them found: a verdict per
invariant and the offending rows of each check that failed. Pure: the store gathers the rows
(store/invariants.py); `kvquota check`, the tests and the stress tool read the same reports."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

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


def judged(number: int, scope: str, offences: Sequence[Offence]) -> InvariantReport:
    """Violated when any check found an offending row."""
    verdict = Verdict.VIOLATED if offences else Verdict.OK
    return InvariantReport(number, verdict, scope, tuple(offences))


def not_checked(number: int, why: str) -> InvariantReport:
    return InvariantReport(number, Verdict.NOT_CHECKED, why)


def violations(reports: Sequence[InvariantReport]) -> list[str]:
    """One line per check that found offending rows, for logs and assertions."""
    return [
        f"invariant {r.number}: {o.check}: {list(o.rows)}{' and more' if o.more else ''}"
        for r in reports
        for o in r.offences
    ]
