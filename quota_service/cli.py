"""The `kvquota` command: serve, migrate, and operators' views over gRPC (tables, or --json)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import re
import sys
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import grpc
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message
from google.protobuf.timestamp_pb2 import Timestamp

from kvquota.v1 import admin_pb2, admin_pb2_grpc, billing_pb2, billing_pb2_grpc, resources_pb2
from quota_service import logs, usage_export
from quota_service.config import Settings, SettingsError, load_settings
from quota_service.core import capacity, geometry

log = logging.getLogger("kvquota")


def _database_url(settings: Settings) -> str:
    if settings.database_url:
        return settings.database_url
    from quota_service.store import embedded

    return embedded.start(settings.data_dir)


def _serve(settings: Settings, args: argparse.Namespace) -> int:
    from quota_service import demo
    from quota_service.api import server
    from quota_service.store import access, migrate

    url = _database_url(settings)
    if args.migrate:
        migrate.upgrade(url)

    async def run() -> None:
        host = None
        if args.demo:
            host, endpoints = await demo.start_simulated_host()
            await demo.seed(url, endpoints)
            if settings.auth_required:
                _, token = await access.create_bootstrap_key(url, "demo-admin")
                # Local development only: a production key is never printed by a server.
                print(f"kvquota demo admin key: export KVQUOTA_API_KEY={token}", flush=True)
        try:
            await server.serve(settings, url)
        finally:
            if host is not None:
                await host.close()

    asyncio.run(run())
    return 0


def _gateway_envoy(args: argparse.Namespace) -> int:
    # The gateways' dependencies (Envoy's protos, transformers) are an extra, not the server's.
    from kvquota.gateways import config
    from kvquota.gateways.ext_proc import processor

    try:
        gateway_config = config.load(args.config)
    except config.ConfigError as exc:
        print(f"kvquota: bad gateway configuration: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(processor.serve(gateway_config))
    except config.ConfigError as exc:
        print(f"kvquota: bad gateway configuration: {exc}", file=sys.stderr)
        return 2
    return 0


def _migrate(settings: Settings, args: argparse.Namespace) -> int:
    from quota_service.store import migrate

    migrate.upgrade(_database_url(settings))
    print("database is at the newest migration")
    return 0


def _as_dict(message: Message) -> dict[str, object]:
    """Proto JSON, zeros and empty fields included: a script reading `expectedBlocks` should
    find 0 there, not nothing."""
    return MessageToDict(message, always_print_fields_with_no_presence=True)


def _enum_name(message: Message, field: str) -> str:
    """`TENANT_STATE_ACTIVE` → `ACTIVE`: the value's name without its enum's prefix
    (the enum's name in upper snake case, as the proto style guide has it)."""
    descriptor = message.DESCRIPTOR.fields_by_name[field].enum_type
    assert descriptor is not None
    name = descriptor.values_by_number[getattr(message, field)].name
    prefix = re.sub(r"(?<!^)(?=[A-Z])", "_", descriptor.name).upper() + "_"
    return name.removeprefix(prefix)


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
        # Its LMCache L1 as last read ("-": no CPU tier, or not read yet).
        "cpu tier": (
            f"{format_size(i.cpu_used_bytes)}/{format_size(i.cpu_capacity_bytes)}"
            if i.HasField("cpu_check_time")
            else "-"
        ),
    }


def _list(args: argparse.Namespace) -> int:
    """Every page of tenants or instances, as a table or JSON."""
    messages: list[Message] = []
    rows: list[dict[str, object]] = []
    with _channel(args) as channel:
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
        print(json.dumps([_as_dict(m) for m in messages], indent=2))
    else:
        _print_rows(rows)
    return 0


def _top(args: argparse.Namespace) -> int:
    from quota_service import top  # it builds on this module's helpers

    return top.run(args)


def _register_instance(args: argparse.Namespace) -> int:
    """Register an instance from its live engine: the engine reports its real pool."""
    engine = resources_pb2.EngineEndpoints(
        url=args.vllm_url,
        kv_events_endpoint=args.kv_events or "",
        kv_replay_endpoint=args.kv_replay or "",
    )
    if args.lmcache_coordinator:
        engine.lmcache.CopyFrom(
            resources_pb2.LmcacheEndpoint(
                coordinator_url=args.lmcache_coordinator,
                instance_id=args.lmcache_instance_id or "",
                model_name=args.lmcache_model or "",
            )
        )
    request = admin_pb2.RegisterInstanceRequest(
        instance_id=args.name,
        model=args.model or "",
        max_model_len=args.max_model_len or 0,
        engine=engine,
    )
    with _channel(args) as channel:
        instance = admin_pb2_grpc.AdminServiceStub(channel).RegisterInstance(request, timeout=60)
    if args.json:
        print(json.dumps(_as_dict(instance), indent=2))
    else:
        _print_rows([_instance_row(instance)])
    return 0


def _server_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--server", default="127.0.0.1:50051", help="kvquota gRPC address")
    parser.add_argument("--tls-ca", help="PEM of the CA the server's certificate is signed by")
    parser.add_argument("--tls-cert", help="this client's certificate (mutual TLS)")
    parser.add_argument("--tls-key", help="its private key")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("KVQUOTA_API_KEY", ""),
        help="the API key to call with (default: $KVQUOTA_API_KEY)",
    )


class _BearerKey(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds `authorization: Bearer <key>` to every call."""

    def __init__(self, key: str) -> None:
        self._metadata = (("authorization", f"Bearer {key}"),)

    def _with_key(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return details._replace(metadata=(*(details.metadata or ()), *self._metadata))  # type: ignore[attr-defined,no-any-return]

    def intercept_unary_unary(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return continuation(self._with_key(details), request)

    def intercept_unary_stream(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return continuation(self._with_key(details), request)


def _channel(args: argparse.Namespace) -> grpc.Channel:
    """A channel to --server: TLS when a CA is given (with a client certificate for mTLS), and
    the API key on every call."""
    if not args.tls_ca:
        channel = grpc.insecure_channel(args.server)
    else:
        key = Path(args.tls_key).read_bytes() if args.tls_key else None
        cert = Path(args.tls_cert).read_bytes() if args.tls_cert else None
        credentials = grpc.ssl_channel_credentials(Path(args.tls_ca).read_bytes(), key, cert)
        channel = grpc.secure_channel(args.server, credentials)
    if not args.api_key:
        return channel
    return grpc.intercept_channel(channel, _BearerKey(args.api_key))


def _hour(text: str) -> Timestamp:
    """An ISO 8601 time ('2026-11-29T10:00Z'; UTC unless it says otherwise)."""
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a time: {text!r} (e.g. 2026-11-29T10:00Z)") from None
    stamp = Timestamp()
    stamp.FromDatetime(when if when.tzinfo else when.replace(tzinfo=UTC))
    return stamp


def _plan(args: argparse.Namespace) -> int:
    """The capacity plan for one engine (core/capacity.py), as tables or JSON."""
    try:
        config = json.loads(Path(args.config).read_text())
        dtype = geometry.parse_dtype(args.dtype) if args.dtype else None
        kv = geometry.geometry_from_hf_config(config, dtype)
        budget: geometry.KvBudget
        if args.kv_cache_memory is not None:
            budget = geometry.KvCacheBytes(args.kv_cache_memory)
        elif args.gpu_memory is None or args.weights is None:
            raise geometry.GeometryError("give --gpu-memory and --weights, or --kv-cache-memory")
        else:
            budget = geometry.MemoryBudget(
                args.gpu_memory, args.weights, args.overhead, args.utilization
            )
        plan = capacity.plan_capacity(
            kv,
            budget,
            args.block_size,
            args.context,
            args.arrival_rate,
            args.request_seconds,
            args.ttft,
            args.prefill_rate,
            dtype,
        )
    except (OSError, ValueError) as exc:  # GeometryError and bad JSON are ValueErrors
        print(f"kvquota plan: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(dataclasses.asdict(plan), indent=2))
        return 0
    _print_rows(
        [
            {"figure": "KV bytes per token", "value": format_size(plan.bytes_per_token)},
            {"figure": "KV bytes per block", "value": format_size(plan.bytes_per_block)},
            {"figure": "KV cache", "value": format_size(plan.kv_bytes)},
            {"figure": "tokens", "value": plan.tokens},
            {"figure": "blocks (vLLM's num_gpu_blocks)", "value": plan.blocks},
            {"figure": "blocks for requests (less the null block)", "value": plan.usable_blocks},
            {
                "figure": "concurrency needed (Little's law)",
                "value": "-" if plan.needed_concurrency is None else plan.needed_concurrency,
            },
        ]
    )
    print()
    _print_rows(
        [
            {
                "context": f.context_tokens,
                "blocks per request": f.blocks_per_request,
                "requests at once": f.max_concurrency,
            }
            for f in plan.fits
        ]
    )
    print()
    print(f"vLLM: vllm serve MODEL {' '.join(plan.vllm_args)}")
    if plan.max_num_queued_tokens is not None:
        print(f"kvquota instance: max_num_queued_tokens {plan.max_num_queued_tokens}")
    return 0


def _usage(args: argparse.Namespace) -> int:
    with _channel(args) as channel:
        stub = billing_pb2_grpc.BillingServiceStub(channel)
        tenant = f"tenants/{args.tenant}" if args.tenant else ""
        if args.action == "summary":
            summary = stub.GetUsageSummary(
                billing_pb2.GetUsageSummaryRequest(
                    start_time=args.start, end_time=args.end, tenant=tenant
                )
            )
            if args.json:
                print(json.dumps(_as_dict(summary), indent=2))
            else:
                _print_rows([_summary_row(t) for t in summary.tenants])
            return 0
        request = billing_pb2.ExportUsageRequest(
            start_time=args.start,
            end_time=args.end,
            tenant=tenant,
            instance=f"instances/{args.instance}" if args.instance else "",
        )
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


EXPORT_BATCH_ROWS = 5000
PROGRESS_WIDTH = 30
SIZE_UNITS = {"": 1, "B": 1, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}
POLL_SECONDS = 0.5


def parse_size(text: str) -> int:
    """'2GiB', '512MiB', '4096' (bytes) → bytes."""
    match = re.fullmatch(r"(\d+)\s*([KMGT]iB|B)?", text.strip(), re.IGNORECASE)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 2GiB, 512MiB, 4096)")
    return int(match.group(1)) * SIZE_UNITS[(match.group(2) or "").upper()]


def format_size(size: int) -> str:
    """Bytes in the largest binary unit that keeps a whole number above 1, e.g. 1.5GiB."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        scale = SIZE_UNITS[unit.upper()]
        if size >= scale:
            return f"{size / scale:.3g}{unit}"
    return f"{size}B"


def finished_steps(job: resources_pb2.ReclaimJob) -> int:
    """Steps applied, skipped or failed (a FREE step part way through has blocks back but is
    still planned)."""
    return sum(s.state != resources_pb2.RECLAIM_STEP_STATE_PLANNED for s in job.steps)


def _step_row(step: resources_pb2.ReclaimStep) -> dict[str, object]:
    if step.reservation:
        what = step.reservation
    elif step.HasField("block"):  # a FREE step of a job planned block by block
        what = f"block {step.block.block_id}@{step.block.generation}"
    elif step.tier == resources_pb2.RECLAIM_TIER_FREE:
        what = "cached blocks, least recently used first"
    else:
        what = "-"
    return {
        "step": step.seq,
        "tier": _enum_name(step, "tier"),
        "what": what,
        "expected": step.expected_blocks,
        "actual": "-" if step.actual_blocks < 0 else step.actual_blocks,
        "state": _enum_name(step, "state"),
        "note": step.note,
    }


def _reclaim(args: argparse.Namespace) -> int:
    """Plan a reclaim job, print the plan, and follow it until it has finished."""
    request = admin_pb2.CreateReclaimJobRequest(
        instance=f"instances/{args.instance}",
        tenant=f"tenants/{args.tenant}" if args.tenant else "",
        target_blocks=args.blocks or 0,
        target_bytes=args.target or 0,
        max_tier=resources_pb2.ReclaimTier.Value(f"RECLAIM_TIER_{args.max_tier.upper()}"),
        min_tier=resources_pb2.ReclaimTier.Value(f"RECLAIM_TIER_{args.min_tier.upper()}"),
        dry_run=args.dry_run,
        request_id=args.request_id or f"cli-{uuid.uuid4().hex}",
    )
    with _channel(args) as channel:
        stub = admin_pb2_grpc.AdminServiceStub(channel)
        job = stub.CreateReclaimJob(request)
        if not args.json:
            print(f"{job.name}: {job.expected_blocks} blocks planned of {job.target_blocks}")
            _print_rows([_step_row(s) for s in job.steps])
            for e in job.excluded:
                print(f"not reclaimable: {e.blocks} blocks, {e.reason} {e.reservation}".rstrip())
        finished = {
            resources_pb2.RECLAIM_JOB_STATE_SUCCEEDED,
            resources_pb2.RECLAIM_JOB_STATE_FAILED,
            resources_pb2.RECLAIM_JOB_STATE_CANCELLED,
        }
        while job.state not in finished:
            time.sleep(POLL_SECONDS)
            job = stub.GetReclaimJob(admin_pb2.GetReclaimJobRequest(name=job.name))
            print(
                f"{finished_steps(job)}/{len(job.steps)} steps, {job.actual_blocks} blocks back",
                file=sys.stderr,
            )
    if args.json:
        print(json.dumps(_as_dict(job), indent=2))
    elif not job.dry_run:
        state = _enum_name(job, "state")
        print(f"{state}: {job.actual_blocks} of {job.expected_blocks} expected blocks back")
        differences = [s for s in job.steps if 0 <= s.actual_blocks != s.expected_blocks]
        if differences:
            _print_rows([_step_row(s) for s in differences])
    return 0


def _key_row(k: resources_pb2.ApiKey) -> dict[str, object]:
    return {
        "name": k.name,
        "display name": k.display_name,
        "role": _enum_name(k, "role"),
        "tenants": ",".join(t.removeprefix("tenants/") for t in k.tenants) or "-",
        "created": k.create_time.ToDatetime(UTC).isoformat(timespec="seconds"),
        "revoked": (
            k.revoke_time.ToDatetime(UTC).isoformat(timespec="seconds")
            if k.HasField("revoke_time")
            else "-"
        ),
        "creator": k.creator,
    }


def _show_new_key(response: admin_pb2.CreateApiKeyResponse, as_json: bool) -> None:
    if as_json:
        print(json.dumps(_as_dict(response), indent=2))
        return
    _print_rows([_key_row(response.api_key)])
    print("the key (shown only this once; store it as a secret):", file=sys.stderr)
    print(response.secret)


def _keys(args: argparse.Namespace) -> int:
    """Create, list and revoke API keys over gRPC (needs an admin key)."""
    with _channel(args) as channel:
        stub = admin_pb2_grpc.AdminServiceStub(channel)
        if args.action == "create":
            request = admin_pb2.CreateApiKeyRequest(
                display_name=args.name,
                role=resources_pb2.Role.Value(f"ROLE_{args.role.upper()}"),
                tenants=[f"tenants/{t}" for t in args.tenant],
            )
            _show_new_key(stub.CreateApiKey(request), args.json)
            return 0
        if args.action == "revoke":
            name = args.key if args.key.startswith("apiKeys/") else f"apiKeys/{args.key}"
            revoked = stub.RevokeApiKey(admin_pb2.RevokeApiKeyRequest(name=name))
            messages: list[Message] = [revoked]
        else:
            messages = []
            token = ""
            while True:
                page = stub.ListApiKeys(
                    admin_pb2.ListApiKeysRequest(page_token=token, show_revoked=args.all)
                )
                messages.extend(page.api_keys)
                token = page.next_page_token
                if not token:
                    break
    if args.json:
        print(json.dumps([_as_dict(m) for m in messages], indent=2))
    else:
        _print_rows([_key_row(m) for m in messages])  # type: ignore[arg-type]
    return 0


def _bootstrap_key(settings: Settings, args: argparse.Namespace) -> int:
    """The first admin key, written straight into the database: whoever can reach the
    database is already trusted with everything."""
    from quota_service.store import access

    url = _database_url(settings)
    key, token = asyncio.run(access.create_bootstrap_key(url, args.name))
    print(f"created apiKeys/{key.key_id} ({key.display_name}, ADMIN)", file=sys.stderr)
    print("the key (shown only this once; store it as a secret):", file=sys.stderr)
    print(token)
    return 0


def _audit_row(e: resources_pb2.AuditEvent) -> dict[str, object]:
    return {
        "time": e.time.ToDatetime(UTC).isoformat(timespec="seconds"),
        "principal": e.principal,
        "method": e.method,
        "resource": e.resource or "-",
        "code": e.code,
        "request id": e.request_id,
    }


def _audit(args: argparse.Namespace) -> int:
    """The newest administrative actions first, up to --limit."""
    events: list[resources_pb2.AuditEvent] = []
    with _channel(args) as channel:
        stub = admin_pb2_grpc.AdminServiceStub(channel)
        token = ""
        while len(events) < args.limit:
            page = stub.ListAuditEvents(
                admin_pb2.ListAuditEventsRequest(
                    page_size=min(args.limit - len(events), 1000),
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
        print(json.dumps([_as_dict(e) for e in events], indent=2))
    else:
        _print_rows([_audit_row(e) for e in events])
    return 0


def table_lines(rows: list[dict[str, object]]) -> list[str]:
    """Rows as aligned columns under a header of their keys in upper case."""
    columns = list(rows[0]) if rows else ["name"]
    widths = {c: max([len(c), *(len(str(r[c])) for r in rows)]) for c in columns}
    header = "  ".join(c.upper().ljust(widths[c]) for c in columns)
    return [header, *("  ".join(str(r[c]).ljust(widths[c]) for c in columns) for r in rows)]


def _print_rows(rows: list[dict[str, object]]) -> None:
    print("\n".join(table_lines(rows)))


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
        _server_options(lister)
        lister.add_argument("--json", action="store_true", help="print JSON instead of a table")
        lister.set_defaults(resource=resource)
    top = commands.add_parser(
        "top", help="a live view of instances, tenants, the queue and reclaim jobs"
    )
    top.add_argument("--interval", type=float, default=2.0, help="seconds between frames")
    one_shot = top.add_mutually_exclusive_group()
    one_shot.add_argument("--once", action="store_true", help="print one frame and exit")
    one_shot.add_argument("--json", action="store_true", help="print one JSON snapshot and exit")
    _server_options(top)
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
    register.add_argument(
        "--lmcache-coordinator",
        help="the LMCache MP coordinator of its CPU tier, e.g. http://host:9300",
    )
    register.add_argument("--lmcache-instance-id", help="its MP server's --instance-id")
    register.add_argument("--lmcache-model", help="the model name its KV is stored under")
    register.add_argument("--max-model-len", type=int, help="default: the engine's")
    _server_options(register)
    register.add_argument("--json", action="store_true", help="print JSON instead of a table")
    reclaim = commands.add_parser("reclaim", help="take KV memory back, tier by tier")
    reclaim.add_argument("--instance", required=True, help="the instance id, e.g. gpu-0")
    reclaim.add_argument("--tenant", help="only what this tenant holds (default: everything)")
    target = reclaim.add_mutually_exclusive_group(required=True)
    target.add_argument("--target", type=parse_size, help="bytes to take back, e.g. 2GiB")
    target.add_argument("--blocks", type=int, help="blocks to take back")
    tiers = ["free", "offload", "compress", "evict"]
    reclaim.add_argument(
        "--max-tier", default="free", choices=tiers, help="the highest tier allowed (default: free)"
    )
    reclaim.add_argument(
        "--min-tier",
        default="free",
        choices=tiers,
        help="the lowest tier to use (default: free; offload skips freeing cached blocks)",
    )
    reclaim.add_argument("--dry-run", action="store_true", help="plan only")
    reclaim.add_argument("--request-id", help="idempotency key (default: a new one)")
    _server_options(reclaim)
    reclaim.add_argument("--json", action="store_true", help="print JSON instead of tables")
    plan = commands.add_parser("plan", help="plan an engine's KV capacity from a model config")
    plan.add_argument("--config", required=True, help="the model's Hugging Face config.json")
    plan.add_argument("--gpu-memory", type=parse_size, help="e.g. 24GiB")
    plan.add_argument("--weights", type=parse_size, help="model weights, e.g. 16GiB")
    plan.add_argument("--overhead", type=parse_size, default=0, help="activations etc., e.g. 2GiB")
    plan.add_argument(
        "--utilization",
        type=float,
        default=geometry.VLLM_GPU_MEMORY_UTILIZATION,
        help="gpu_memory_utilization (default: vLLM's, %(default)s)",
    )
    plan.add_argument(
        "--kv-cache-memory",
        type=parse_size,
        help="the KV cache's size outright, as vLLM's --kv-cache-memory-bytes (instead of "
        "--gpu-memory, --weights, --overhead and --utilization)",
    )
    plan.add_argument("--dtype", help="KV dtype (default: what vLLM's auto makes of the config's)")
    plan.add_argument(
        "--block-size",
        type=int,
        default=geometry.VLLM_BLOCK_SIZE,
        help="tokens per block (default: vLLM's on a GPU, %(default)s)",
    )
    plan.add_argument(
        "--context", type=int, nargs="+", default=[2048, 8192, 32768], help="context lengths"
    )
    plan.add_argument("--arrival-rate", type=float, help="requests per second to serve")
    plan.add_argument("--request-seconds", type=float, help="mean time a request is held")
    plan.add_argument("--ttft", type=float, help="target time to first token, seconds")
    plan.add_argument("--prefill-rate", type=float, help="prefill tokens per second")
    plan.add_argument("--json", action="store_true", help="print JSON instead of tables")
    usage = commands.add_parser("usage", help="usage of closed hours, for billing")
    usage_commands = usage.add_subparsers(dest="action", required=True)
    export = usage_commands.add_parser("export", help="FOCUS-style rows of a range of hours")
    summary = usage_commands.add_parser("summary", help="per-tenant totals of a range of hours")
    for command in (export, summary):
        command.add_argument(
            "--from", dest="start", required=True, type=_hour, help="e.g. 2026-11-29T00:00Z"
        )
        command.add_argument("--to", dest="end", required=True, type=_hour, help="exclusive")
        command.add_argument("--tenant", help="only this tenant")
        _server_options(command)
    export.add_argument("--instance", help="only this instance")
    export.add_argument("--format", choices=usage_export.FORMATS, default="csv")
    export.add_argument("--output", help="a file (default: standard output)")
    summary.add_argument("--json", action="store_true", help="print JSON instead of a table")
    keys = commands.add_parser("keys", help="API keys: create, list, revoke, bootstrap")
    key_commands = keys.add_subparsers(dest="action", required=True)
    create_key = key_commands.add_parser("create", help="a new key (its secret is shown once)")
    create_key.add_argument("name", help="a label, e.g. gateway-eu-1")
    create_key.add_argument("--role", required=True, choices=["admin", "gateway", "tenant"])
    create_key.add_argument(
        "--tenant",
        action="append",
        default=[],
        help="a tenant the key acts for (repeat for a gateway of several tenants)",
    )
    list_keys = key_commands.add_parser("list", help="the keys that work (--all: revoked too)")
    list_keys.add_argument("--all", action="store_true", help="also revoked keys")
    revoke_key = key_commands.add_parser("revoke", help="stop a key working")
    revoke_key.add_argument("key", help="apiKeys/{id} or the id")
    for command in (create_key, list_keys, revoke_key):
        _server_options(command)
        command.add_argument("--json", action="store_true", help="print JSON instead of a table")
    bootstrap = key_commands.add_parser(
        "bootstrap", help="the first admin key, written straight into the database"
    )
    bootstrap.add_argument("name", nargs="?", default="bootstrap-admin", help="a label")
    gateway = commands.add_parser("gateway", help="run kvquota inside a gateway")
    gateway_commands = gateway.add_subparsers(dest="action", required=True)
    envoy = gateway_commands.add_parser(
        "envoy", help="an Envoy external processor (needs the `gateways` extra)"
    )
    envoy.add_argument(
        "--config", help="the gateway's TOML file (default: $KVQUOTA_GATEWAY_CONFIG)"
    )
    audit = commands.add_parser("audit", help="the audit log of administrative actions")
    audit.add_argument("--principal", help="only this principal, e.g. apiKeys/0123456789abcdef")
    audit.add_argument("--method", help="only this method, e.g. DeleteTenant")
    audit.add_argument("--limit", type=int, default=100, help="at most this many (newest first)")
    _server_options(audit)
    audit.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    try:
        settings = load_settings()
        if getattr(args, "listen", None):
            settings = replace(settings, grpc_listen=args.listen)
    except SettingsError as exc:
        print(f"kvquota: bad settings: {exc}", file=sys.stderr)
        return 2
    logs.configure(settings.log_level.upper(), settings.log_format)
    if args.command == "keys" and args.action == "bootstrap":
        return _bootstrap_key(settings, args)
    if args.command == "serve":
        return _serve(settings, args)
    if args.command == "migrate":
        return _migrate(settings, args)
    if args.command == "plan":
        return _plan(args)
    if args.command == "gateway":
        return _gateway_envoy(args)
    commands_over_grpc = {
        "instance": _register_instance,
        "reclaim": _reclaim,
        "top": _top,
        "usage": _usage,
        "keys": _keys,
        "audit": _audit,
    }
    try:
        return commands_over_grpc.get(args.command, _list)(args)
    except grpc.RpcError as exc:
        print(f"kvquota: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
