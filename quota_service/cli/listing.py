"""`kvquota tenants` and `kvquota instances`: every tenant or instance, as a table or JSON. Their
rows are also `kvquota top`'s and `kvquota instance register`'s."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from google.protobuf.message import Message

from kvquota.v1 import admin_pb2, admin_pb2_grpc, resources_pb2
from quota_service.cli.command import AddParser, add_json_option
from quota_service.cli.connection import add_server_options, channel, every_page
from quota_service.cli.formatting import as_dict, enum_name, format_size, print_json, print_rows
from quota_service.config import Settings


def add_parsers(add_parser: AddParser) -> None:
    for resource in ("tenants", "instances"):
        lister = add_parser(resource, help=f"list {resource}")
        add_server_options(lister)
        add_json_option(lister)
        lister.set_defaults(run=run_tenants if resource == "tenants" else run_instances)


def tenants(
    stub: admin_pb2_grpc.AdminServiceStub, timeout: float | None = None
) -> list[resources_pb2.Tenant]:
    """Every tenant, one page after another."""

    def page(token: str) -> tuple[Sequence[resources_pb2.Tenant], str]:
        found = stub.ListTenants(admin_pb2.ListTenantsRequest(page_token=token), timeout=timeout)
        return found.tenants, found.next_page_token

    return every_page(page)


def instances(
    stub: admin_pb2_grpc.AdminServiceStub, timeout: float | None = None
) -> list[resources_pb2.Instance]:
    """Every instance, one page after another."""

    def page(token: str) -> tuple[Sequence[resources_pb2.Instance], str]:
        request = admin_pb2.ListInstancesRequest(page_token=token)
        found = stub.ListInstances(request, timeout=timeout)
        return found.instances, found.next_page_token

    return every_page(page)


def tenant_row(t: resources_pb2.Tenant) -> dict[str, object]:
    return {
        "name": t.name,
        "state": enum_name(t, "state"),
        "blocks": f"{t.usage.blocks_in_use}/{t.quota.max_blocks}",
        "tokens in flight": f"{t.usage.tokens_in_flight}/{t.quota.max_tokens_in_flight}",
        "live": t.usage.live_reservations,
        "weight": t.weight,
    }


def instance_row(i: resources_pb2.Instance) -> dict[str, object]:
    return {
        "name": i.name,
        "state": enum_name(i, "state"),
        "model": i.model,
        "blocks used": f"{i.blocks_in_use}/{i.capacity_blocks}",
        "free": i.free_blocks,
        "block size": i.block_size,
        "context": i.max_model_len,
        "live": i.live_reservations,
        # What the engine itself says it runs ("-" until the follower has read its metrics).
        "engine running": "-" if i.engine_requests_running < 0 else i.engine_requests_running,
        # Its LMCache L1 as last read ("-": no CPU tier, or not read yet).
        "cpu tier": (
            f"{format_size(i.cpu_used_bytes)}/{format_size(i.cpu_capacity_bytes)}"
            if i.HasField("cpu_check_time")
            else "-"
        ),
    }


def run_tenants(args: argparse.Namespace, settings: Settings) -> int:
    with channel(args) as chan:
        found = tenants(admin_pb2_grpc.AdminServiceStub(chan))
    _show(found, [tenant_row(t) for t in found], args.json)
    return 0


def run_instances(args: argparse.Namespace, settings: Settings) -> int:
    with channel(args) as chan:
        found = instances(admin_pb2_grpc.AdminServiceStub(chan))
    _show(found, [instance_row(i) for i in found], args.json)
    return 0


def _show(messages: Sequence[Message], rows: list[dict[str, object]], as_json: bool) -> None:
    if as_json:
        print_json([as_dict(m) for m in messages])
    else:
        print_rows(rows)
