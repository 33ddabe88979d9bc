"""`kvquota check`: the invariants checked over a deployment's record, each by its number with
its verdict (OK, VIOLATED, or NOT CHECKED and why) and the first rows that break it. Exits 1
when one is violated, so a cron job or a CI step can run it."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

from quota_service.cli.command import AddParser, add_json_option
from quota_service.cli.connection import database_url
from quota_service.cli.formatting import print_json, table_lines
from quota_service.config import Settings
from quota_service.core.invariants import DEFAULT_ROWS, InvariantReport, Offence, Verdict

INDENT = " " * 13


def add_parsers(add_parser: AddParser) -> None:
    check = add_parser(
        "check", help="check the invariants over the database's record (exit 1: violated)"
    )
    check.add_argument(
        "--limit",
        type=int,
        default=DEFAULT_ROWS,
        help="offending rows shown per check (default: %(default)s)",
    )
    add_json_option(check, "text")
    check.set_defaults(run=run_check)


def run_check(args: argparse.Namespace, settings: Settings) -> int:
    from quota_service.store.database import connect
    from quota_service.store.invariants import check_record

    if args.limit < 1:
        print("kvquota check: --limit must be positive", file=sys.stderr)
        return 2

    async def check() -> list[InvariantReport]:
        engine = connect(database_url(settings), pool_size=1)
        try:
            return await check_record(engine, args.limit)
        finally:
            await engine.dispose()

    reports = asyncio.run(check())
    if args.json:
        print_json([_report_json(r) for r in reports])
    else:
        print("\n".join(report_lines(reports)))
    return 1 if any(r.verdict is Verdict.VIOLATED for r in reports) else 0


def report_lines(reports: Sequence[InvariantReport]) -> list[str]:
    """Each invariant: its number, verdict and statement, what was checked (or why not), and
    the rows each failed check found; then a summary line."""
    width = max(len(v) for v in Verdict)
    lines = []
    for r in reports:
        lines.append(f"invariant {r.number}  {r.verdict:<{width}}  {r.statement}")
        label = "why:" if r.verdict is Verdict.NOT_CHECKED else "checked:"
        lines.append(f"{INDENT}{label} {r.scope}")
        for offence in r.offences:
            lines.append(f"{INDENT}{offence.check}:")
            lines.extend(f"{INDENT}  {line}" for line in table_lines(_rows(offence)))
            if offence.more:
                lines.append(f"{INDENT}  ... and more (--limit shows more)")
    violated = [r.number for r in reports if r.verdict is Verdict.VIOLATED]
    unchecked = sum(r.verdict is Verdict.NOT_CHECKED for r in reports)
    checked = len(reports) - unchecked
    if violated:
        numbers = ", ".join(map(str, violated))
        lines.append(f"VIOLATED: {numbers} (of {checked} checked, {unchecked} not checked)")
    else:
        lines.append(f"OK: {checked} invariants hold, {unchecked} not checked")
    return lines


def _rows(offence: Offence) -> list[dict[str, object]]:
    return [dict(zip(offence.columns, row, strict=True)) for row in offence.rows]


def _report_json(report: InvariantReport) -> dict[str, object]:
    return {
        "invariant": report.number,
        "statement": report.statement,
        "verdict": report.verdict.value,
        "scope": report.scope,
        "offences": [
            {
                "check": o.check,
                # Times and the like as text: JSON has no type for them.
                "rows": [
                    {
                        k: v if isinstance(v, int | str) or v is None else str(v)
                        for k, v in row.items()
                    }
                    for row in _rows(o)
                ],
                "more": o.more,
            }
            for o in report.offences
        ],
    }
