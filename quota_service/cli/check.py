"""`kvquota check`: the invariants checked over a deployment's record, each by its number with
its verdict (OK, VIOLATED, or NOT CHECKED and why) and the first rows that break it; with
--server, also each instance's owner's memory against the record (invariant 8), asked of that
replica. Exits 1 when one is violated, so a cron job or a CI step can run it."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

import grpc

from kvquota.v1 import admin_pb2, admin_pb2_grpc
from quota_service.api.admin_service import MAX_DIFFERENCES
from quota_service.cli.command import AddParser, add_json_option
from quota_service.cli.connection import add_server_options, channel, database_url, every_page
from quota_service.cli.formatting import print_json, table_lines
from quota_service.config import Settings
from quota_service.core.invariants import (
    DEFAULT_ROWS,
    InvariantReport,
    Offence,
    OwnerCheck,
    Verdict,
    with_owners,
)
from quota_service.core.machine_comparison import Difference
from quota_service.core.names import instance_id

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
    add_server_options(
        check,
        default=None,
        help="also ask the replica at this gRPC address to compare each instance's memory "
        "with the record",
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
    if args.server:
        try:
            owners = ask_owners(args)
        except grpc.RpcError as exc:
            print(
                f"kvquota check: {args.server}: {exc.code().name}: {exc.details()}", file=sys.stderr
            )
            return 2
        reports = [with_owners(r, owners) if r.number == 8 else r for r in reports]
    if args.json:
        print_json([_report_json(r) for r in reports])
    else:
        print("\n".join(report_lines(reports)))
    return 1 if any(r.verdict is Verdict.VIOLATED for r in reports) else 0


def ask_owners(args: argparse.Namespace) -> list[OwnerCheck]:
    """Every instance's owner at --server, asked to compare its memory with the record. An
    instance it does not hold in memory, or that stays too busy to compare, is not compared."""
    with channel(args) as transport:
        stub = admin_pb2_grpc.AdminServiceStub(transport)

        def page(token: str) -> tuple[list[str], str]:
            found = stub.ListInstances(admin_pb2.ListInstancesRequest(page_token=token))
            return [i.name for i in found.instances], found.next_page_token

        checks = []
        for name in every_page(page):
            instance = instance_id(name)
            request = admin_pb2.CheckInstanceRequest(
                name=name, max_differences=min(args.limit, MAX_DIFFERENCES)
            )
            try:
                answer = stub.CheckInstance(request)
            except grpc.RpcError as exc:
                if exc.code() not in (
                    grpc.StatusCode.FAILED_PRECONDITION,
                    grpc.StatusCode.UNAVAILABLE,
                ):
                    raise
                checks.append(OwnerCheck(instance, not_compared=exc.details()))
                continue
            differences = tuple(
                Difference(d.subject, d.memory, d.record) for d in answer.differences
            )
            checks.append(OwnerCheck(instance, differences, answer.more_differences))
        return checks


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
