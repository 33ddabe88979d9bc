"""The `kvquota` command: serve, migrate, and operators' views over gRPC (tables, or --json)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import replace

import grpc
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

from kvquota.v1 import admin_pb2, admin_pb2_grpc, resources_pb2
from quota_service.config import Settings, SettingsError, load_settings

log = logging.getLogger("kvquota")


def _database_url(settings: Settings) -> str:
    if settings.database_url:
        return settings.database_url
    from quota_service.store import embedded

    return embedded.start(settings.data_dir)


def _serve(settings: Settings, args: argparse.Namespace) -> int:
    from quota_service import demo
    from quota_service.api import server
    from quota_service.store import migrate

    url = _database_url(settings)
    if args.migrate:
        migrate.upgrade(url)

    async def run() -> None:
        host = None
        if args.demo:
            host, endpoints = await demo.start_simulated_host()
            await demo.seed(url, endpoints)
        try:
            await server.serve(settings, url)
        finally:
            if host is not None:
                await host.close()

    asyncio.run(run())
    return 0


def _migrate(settings: Settings, args: argparse.Namespace) -> int:
    from quota_service.store import migrate

    migrate.upgrade(_database_url(settings))
    print("database is at the newest migration")
    return 0


def _enum_name(message: Message, field: str) -> str:
    """`TENANT_STATE_ACTIVE` → `ACTIVE`: the value's name without its enum's prefix."""
    descriptor = message.DESCRIPTOR.fields_by_name[field].enum_type
    assert descriptor is not None
    name = descriptor.values_by_number[getattr(message, field)].name
    return name.split("_STATE_", 1)[-1]


def _tenant_row(t: resources_pb2.Tenant) -> dict[str, object]:
    return {
        "name": t.name,
        "state": _enum_name(t, "state"),
        "blocks": f"{t.usage.blocks_in_use}/{t.quota.max_blocks}",
        "tokens in flight": f"{t.usage.tokens_in_flight}/{t.quota.max_tokens_in_flight}",
        "live": t.usage.live_reservations,
        "weight": t.weight,
    }


def _instance_row(i: resources_pb2.Instance) -> dict[str, object]:
    return {
        "name": i.name,
        "state": _enum_name(i, "state"),
        "model": i.model,
        "blocks used": f"{i.blocks_in_use}/{i.capacity_blocks}",
        "free": i.free_blocks,
        "block size": i.block_size,
        "context": i.max_model_len,
        "live": i.live_reservations,
        # What the engine itself says it runs ("-" until the follower has read its metrics).
        "engine running": "-" if i.engine_requests_running < 0 else i.engine_requests_running,
    }


def _list(args: argparse.Namespace) -> int:
    """Every page of tenants or instances, as a table or JSON."""
    messages: list[Message] = []
    rows: list[dict[str, object]] = []
    with grpc.insecure_channel(args.server) as channel:
        stub = admin_pb2_grpc.AdminServiceStub(channel)
        token = ""
        while True:
            if args.resource == "tenants":
                tenants = stub.ListTenants(admin_pb2.ListTenantsRequest(page_token=token))
                messages.extend(tenants.tenants)
                rows.extend(_tenant_row(t) for t in tenants.tenants)
                token = tenants.next_page_token
            else:
                instances = stub.ListInstances(admin_pb2.ListInstancesRequest(page_token=token))
                messages.extend(instances.instances)
                rows.extend(_instance_row(i) for i in instances.instances)
                token = instances.next_page_token
            if not token:
                break
    if args.json:
        print(json.dumps([MessageToDict(m) for m in messages], indent=2))
    else:
        _print_rows(rows)
    return 0


def _register_instance(args: argparse.Namespace) -> int:
    """Register an instance from its live engine: the engine reports its real pool."""
    engine = resources_pb2.EngineEndpoints(
        url=args.vllm_url,
        kv_events_endpoint=args.kv_events or "",
        kv_replay_endpoint=args.kv_replay or "",
    )
    request = admin_pb2.RegisterInstanceRequest(
        instance_id=args.name,
        model=args.model or "",
        max_model_len=args.max_model_len or 0,
        engine=engine,
    )
    with grpc.insecure_channel(args.server) as channel:
        instance = admin_pb2_grpc.AdminServiceStub(channel).RegisterInstance(request, timeout=60)
    if args.json:
        print(json.dumps(MessageToDict(instance), indent=2))
    else:
        _print_rows([_instance_row(instance)])
    return 0


def _print_rows(rows: list[dict[str, object]]) -> None:
    columns = list(rows[0]) if rows else ["name"]
    widths = {c: max([len(c), *(len(str(r[c])) for r in rows)]) for c in columns}
    print("  ".join(c.upper().ljust(widths[c]) for c in columns))
    for row in rows:
        print("  ".join(str(row[c]).ljust(widths[c]) for c in columns))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvquota", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve gRPC (embedded PostgreSQL when no URL set)")
    serve.add_argument("--listen", help="host:port, overrides KVQUOTA_GRPC_LISTEN")
    serve.add_argument("--migrate", action="store_true", help="apply migrations first")
    serve.add_argument("--demo", action="store_true", help="seed a demo instance and tenants")
    commands.add_parser("migrate", help="apply database migrations")
    for resource in ("tenants", "instances"):
        lister = commands.add_parser(resource, help=f"list {resource}")
        lister.add_argument("--server", default="127.0.0.1:50051", help="kvquota gRPC address")
        lister.add_argument("--json", action="store_true", help="print JSON instead of a table")
        lister.set_defaults(resource=resource)
    instance = commands.add_parser("instance", help="manage one instance")
    instance_commands = instance.add_subparsers(dest="action", required=True)
    register = instance_commands.add_parser(
        "register", help="register an instance from its live vLLM engine"
    )
    register.add_argument("name", help="the instance id, e.g. gpu-0")
    register.add_argument("--vllm-url", required=True, help="vLLM's HTTP server")
    register.add_argument("--kv-events", help="vLLM's KV-event publisher, e.g. tcp://host:5557")
    register.add_argument("--kv-replay", help="its replay socket, e.g. tcp://host:5558")
    register.add_argument("--model", help="the model name (default: what the engine serves)")
    register.add_argument("--max-model-len", type=int, help="default: the engine's")
    register.add_argument("--server", default="127.0.0.1:50051", help="kvquota gRPC address")
    register.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    logging.getLogger("alembic").setLevel(logging.WARNING)
    try:
        settings = load_settings()
        if getattr(args, "listen", None):
            settings = replace(settings, grpc_listen=args.listen)
    except SettingsError as exc:
        print(f"kvquota: bad settings: {exc}", file=sys.stderr)
        return 2
    if args.command == "serve":
        return _serve(settings, args)
    if args.command == "migrate":
        return _migrate(settings, args)
    try:
        return _register_instance(args) if args.command == "instance" else _list(args)
    except grpc.RpcError as exc:
        print(f"kvquota: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
