"""`kvquota audit`: the audit log of administrative actions, newest first, up to --limit."""

from __future__ import annotations

import argparse
from datetime import UTC

from kvquota.v1 import admin_pb2, admin_pb2_grpc, resources_pb2
from quota_service.cli.command import AddParser, add_json_option
from quota_service.cli.connection import add_server_options, channel
from quota_service.cli.formatting import as_dict, print_json, print_rows
from quota_service.config import Settings
from quota_service.core.pagination import MAX_PAGE_SIZE


def add_parsers(add_parser: AddParser) -> None:
    audit = add_parser("audit", help="the audit log of administrative actions")
    audit.add_argument("--principal", help="only this principal, e.g. apiKeys/0123456789abcdef")
    audit.add_argument("--method", help="only this method, e.g. DeleteTenant")
    audit.add_argument("--limit", type=int, default=100, help="at most this many (newest first)")
    add_server_options(audit)
    add_json_option(audit)
    audit.set_defaults(run=run_audit)


def _audit_row(e: resources_pb2.AuditEvent) -> dict[str, object]:
    return {
        "time": e.time.ToDatetime(UTC).isoformat(timespec="seconds"),
        "principal": e.principal,
        "method": e.method,
        "resource": e.resource or "-",
        "code": e.code,
        "request id": e.request_id,
    }


def run_audit(args: argparse.Namespace, settings: Settings) -> int:
    events: list[resources_pb2.AuditEvent] = []
    with channel(args) as chan:
        stub = admin_pb2_grpc.AdminServiceStub(chan)
        token = ""
        while len(events) < args.limit:
            page = stub.ListAuditEvents(
                admin_pb2.ListAuditEventsRequest(
                    page_size=min(args.limit - len(events), MAX_PAGE_SIZE),
                    page_token=token,
                    principal=args.principal or "",
                    method=args.method or "",
                )
            )
            events.extend(page.audit_events)
            token = page.next_page_token
            if not token:
                break
    if args.json:
        print_json([as_dict(e) for e in events])
    else:
        print_rows([_audit_row(e) for e in events])
    return 0
