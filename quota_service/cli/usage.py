"""`kvquota usage export` and `kvquota usage summary`: usage of closed hours, for billing."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from datetime import UTC, datetime

from google.protobuf.timestamp_pb2 import Timestamp

from kvquota.v1 import billing_pb2, billing_pb2_grpc
from quota_service.cli import usage_export
from quota_service.cli.command import AddParser, add_json_option
from quota_service.cli.connection import add_server_options, channel
from quota_service.cli.formatting import as_dict, print_json, print_rows
from quota_service.config import Settings

EXPORT_BATCH_ROWS = 5000
PROGRESS_WIDTH = 30


def add_parsers(add_parser: AddParser) -> None:
    usage = add_parser("usage", help="usage of closed hours, for billing")
    usage_commands = usage.add_subparsers(dest="action", required=True)
    export = usage_commands.add_parser("export", help="FOCUS-style rows of a range of hours")
    summary = usage_commands.add_parser("summary", help="per-tenant totals of a range of hours")
    for command in (export, summary):
        command.add_argument(
            "--from", dest="start", required=True, type=_hour, help="e.g. 2026-11-29T00:00Z"
        )
        command.add_argument("--to", dest="end", required=True, type=_hour, help="exclusive")
        command.add_argument("--tenant", help="only this tenant")
        add_server_options(command)
    export.add_argument("--instance", help="only this instance")
    export.add_argument("--format", choices=usage_export.FORMATS, default="csv")
    export.add_argument("--output", help="a file (default: standard output)")
    export.set_defaults(run=run_export)
    add_json_option(summary)
    summary.set_defaults(run=run_summary)


def _hour(text: str) -> Timestamp:
    """An ISO 8601 time ('2026-11-29T10:00Z'; UTC unless it says otherwise)."""
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a time: {text!r} (e.g. 2026-11-29T10:00Z)") from None
    stamp = Timestamp()
    stamp.FromDatetime(when if when.tzinfo else when.replace(tzinfo=UTC))
    return stamp


def _tenant(args: argparse.Namespace) -> str:
    return f"tenants/{args.tenant}" if args.tenant else ""


def run_summary(args: argparse.Namespace, settings: Settings) -> int:
    request = billing_pb2.GetUsageSummaryRequest(
        start_time=args.start, end_time=args.end, tenant=_tenant(args)
    )
    with channel(args) as chan:
        summary = billing_pb2_grpc.BillingServiceStub(chan).GetUsageSummary(request)
    if args.json:
        print_json(as_dict(summary))
    else:
        print_rows([_summary_row(t) for t in summary.tenants])
    return 0


def run_export(args: argparse.Namespace, settings: Settings) -> int:
    request = billing_pb2.ExportUsageRequest(
        start_time=args.start,
        end_time=args.end,
        tenant=_tenant(args),
        instance=f"instances/{args.instance}" if args.instance else "",
    )
    with channel(args) as chan:
        stub = billing_pb2_grpc.BillingServiceStub(chan)
        out = open(args.output, "wb") if args.output else sys.stdout.buffer  # noqa: SIM115
        try:
            _export(stub.ExportUsage(request), usage_export.writer(args.format, out), args)
        finally:
            if args.output:
                out.close()
    return 0


def _export(
    records: Iterable[billing_pb2.UsageRecord],
    writer: usage_export.Writer,
    args: argparse.Namespace,
) -> None:
    """Write the rows as the records stream in, a batch at a time; progress on stderr."""
    start, end = args.start.ToMicroseconds(), args.end.ToMicroseconds()
    batch: list[tuple[str, ...]] = []
    exported = rows = 0
    for record in records:
        batch.extend(usage_export.focus_rows(record))
        exported += 1
        if len(batch) >= EXPORT_BATCH_ROWS:
            rows += len(batch)
            writer.write(batch)
            batch = []
            done = (record.hour_start.ToMicroseconds() - start) / (end - start)
            _progress(done, f"{exported:,} records, {rows:,} rows")
    rows += len(batch)
    writer.write(batch)
    writer.close()
    _progress(1.0, f"{exported:,} records, {rows:,} rows")
    print(file=sys.stderr)


def _progress(done: float, what: str) -> None:
    filled = int(done * PROGRESS_WIDTH)
    bar = "#" * filled + "." * (PROGRESS_WIDTH - filled)
    print(f"\r[{bar}] {done:4.0%} {what}", end="", file=sys.stderr, flush=True)


def _summary_row(t: billing_pb2.UsageRecord) -> dict[str, object]:
    return {
        "tenant": t.tenant,
        "GPU block-s": f"{t.gpu_block_seconds:.1f}",
        "fair share block-s": f"{t.fair_share_block_seconds:.1f}",
        "pinned block-s": f"{t.pinned_block_seconds:.1f}",
        "GPU GiB-h": f"{t.gpu_gib_hours:.4f}",
        "CPU GiB-h": f"{t.cpu_gib_hours:.4f}",
        "compressed GiB-h": f"{t.compressed_gib_hours:.4f}",
        "admitted": t.requests_admitted,
        "queued": t.requests_queued,
        "refused": sum(t.requests_refused.values()),
        "output tokens": t.output_tokens,
    }
