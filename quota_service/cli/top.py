"""`kvquota top`: a live view of the fleet, redrawn every few seconds like `top`.

Instances (blocks in use, cached, free and pinned; live reservations; the queue), tenants
(blocks held against their quota), what waits in the queue, and reclaim jobs — all read over
gRPC from AdminService. `snapshot` reads; `frame` and `snapshot_json` are pure, for tests.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

import grpc

from kvquota.v1 import admin_pb2, admin_pb2_grpc, resources_pb2
from quota_service.cli import listing
from quota_service.cli.command import AddParser
from quota_service.cli.connection import add_server_options, channel, every_page
from quota_service.cli.formatting import (
    as_dict,
    enum_name,
    format_size,
    print_json,
    table_lines,
)
from quota_service.cli.reclaim import finished_steps
from quota_service.config import Settings

CLEAR = "\x1b[H\x1b[2J"
RPC_TIMEOUT_SECONDS = 10.0
BAR_WIDTH = 10
# Reclaim jobs shown at most (running and planned ones first); the rest are counted.
MAX_JOB_ROWS = 10
ACTIVE_JOB_STATES = (
    resources_pb2.RECLAIM_JOB_STATE_RUNNING,
    resources_pb2.RECLAIM_JOB_STATE_PLANNED,
)


@dataclass(frozen=True)
class Snapshot:
    """What one frame shows, as read from the server at `time`."""

    server: str
    time: datetime
    instances: Sequence[resources_pb2.Instance]
    tenants: Sequence[resources_pb2.Tenant]
    reclaim_jobs: Sequence[resources_pb2.ReclaimJob]


def add_parsers(add_parser: AddParser) -> None:
    top = add_parser("top", help="a live view of instances, tenants, the queue and reclaim jobs")
    top.add_argument("--interval", type=float, default=2.0, help="seconds between frames")
    one_shot = top.add_mutually_exclusive_group()
    one_shot.add_argument("--once", action="store_true", help="print one frame and exit")
    one_shot.add_argument("--json", action="store_true", help="print one JSON snapshot and exit")
    add_server_options(top)
    top.set_defaults(run=run_top)


def snapshot(stub: admin_pb2_grpc.AdminServiceStub, server: str) -> Snapshot:
    """Every instance, tenant and reclaim job, one page after another."""
    timeout = RPC_TIMEOUT_SECONDS

    def jobs(token: str) -> tuple[Sequence[resources_pb2.ReclaimJob], str]:
        request = admin_pb2.ListReclaimJobsRequest(page_token=token)
        page = stub.ListReclaimJobs(request, timeout=timeout)
        return page.reclaim_jobs, page.next_page_token

    return Snapshot(
        server,
        datetime.now(UTC),
        listing.instances(stub, timeout),
        listing.tenants(stub, timeout),
        every_page(jobs),
    )


def totals(snap: Snapshot) -> dict[str, int]:
    """The fleet's sums, for the summary lines."""
    instances, tenants = snap.instances, snap.tenants
    jobs = Counter(enum_name(j, "state") for j in snap.reclaim_jobs)
    return {
        "instances": len(instances),
        "capacityBlocks": sum(i.capacity_blocks for i in instances),
        "blocksInUse": sum(i.blocks_in_use for i in instances),
        "cachedBlocks": sum(i.cached_blocks for i in instances),
        "freeBlocks": sum(i.free_blocks for i in instances),
        "pinnedBlocks": sum(i.pinned_blocks for i in instances),
        "liveReservations": sum(i.live_reservations for i in instances),
        "queuedRequests": sum(i.queued_requests for i in instances),
        "tenants": len(tenants),
        "reclaimJobsRunning": jobs["RUNNING"],
        "reclaimJobsPlanned": jobs["PLANNED"],
        "reclaimJobsFinished": sum(jobs[s] for s in ("SUCCEEDED", "FAILED", "CANCELLED")),
    }


def _short(name: str) -> str:
    """`instances/gpu-0` → `gpu-0`: the column says what it is."""
    return name.rsplit("/", 1)[-1]


def _share(part: int, whole: int) -> str:
    return f"{100 * part / whole:.0f}%" if whole > 0 else "-"


def _bar(part: int, whole: int) -> str:
    filled = min(BAR_WIDTH, int(BAR_WIDTH * part / whole + 0.5)) if whole > 0 else 0
    return "[" + "#" * filled + "." * (BAR_WIDTH - filled) + "]"


def instance_row(i: resources_pb2.Instance) -> dict[str, object]:
    """Its block pool (the four states add up to its capacity), what runs and what waits."""
    shared = listing.instance_row(i)
    held = i.blocks_in_use + i.pinned_blocks
    return {
        "instance": _short(i.name),
        "state": shared["state"],
        "used": f"{_bar(held, i.capacity_blocks)} {_share(held, i.capacity_blocks)}",
        "capacity": i.capacity_blocks,
        "in use": i.blocks_in_use,
        "cached": i.cached_blocks,
        "free": i.free_blocks,
        "pinned": i.pinned_blocks,
        "kv in use": (
            f"{format_size(held * i.bytes_per_block)}/"
            f"{format_size(i.capacity_blocks * i.bytes_per_block)}"
            if i.bytes_per_block > 0
            else "-"
        ),
        "live": i.live_reservations,
        "queued": f"{i.queued_requests}/{i.max_queued_requests}",
        "engine running": shared["engine running"],
        "cpu tier": shared["cpu tier"],
        # What its CPU tier's compressing L2 gives, as last measured ("-": cannot compress).
        "compress": f"{i.cpu_compression_ratio:.2f}x" if i.cpu_compression_ratio else "-",
    }


def tenant_row(t: resources_pb2.Tenant) -> dict[str, object]:
    """What it holds against its quota."""
    shared = listing.tenant_row(t)
    return {
        "tenant": _short(t.name),
        "state": shared["state"],
        "blocks": shared["blocks"],
        "of quota": _share(t.usage.blocks_in_use, t.quota.max_blocks),
        "pinned": f"{t.usage.pinned_blocks}/{t.quota.max_pinned_blocks}",
        "tokens in flight": shared["tokens in flight"],
        "live": shared["live"],
        "queued": f"{t.usage.queued_requests}/{t.quota.max_queued_requests}",
        # Its offloaded sessions in the CPU tier: as they are, and compressed.
        "cpu tier": format_size(t.usage.cpu_tier_bytes),
        "compressed": format_size(t.usage.compressed_bytes),
        "weight": shared["weight"],
    }


def queue_rows(snap: Snapshot) -> list[dict[str, object]]:
    """Where requests wait: each instance with a queue, then each tenant with requests in one."""
    rows: list[dict[str, object]] = [
        {
            "waiting on": i.name,
            "queued": i.queued_requests,
            "limit": i.max_queued_requests,
            "prompt tokens": i.queued_prompt_tokens,
        }
        for i in snap.instances
        if i.queued_requests > 0
    ]
    rows.extend(
        {
            "waiting on": t.name,
            "queued": t.usage.queued_requests,
            "limit": t.quota.max_queued_requests,
            "prompt tokens": "-",
        }
        for t in snap.tenants
        if t.usage.queued_requests > 0
    )
    return rows


def job_row(j: resources_pb2.ReclaimJob) -> dict[str, object]:
    low = enum_name(j, "min_tier") if j.min_tier else "FREE"  # unset: FREE
    high = enum_name(j, "max_tier")
    return {
        "job": _short(j.name),
        "instance": _short(j.instance),
        "tenant": _short(j.tenant) if j.tenant else "-",
        "state": enum_name(j, "state") + (" (dry run)" if j.dry_run else ""),
        "tiers": low if low == high else f"{low}..{high}",
        "target": j.target_blocks,
        "expected": j.expected_blocks,
        "back": j.actual_blocks,
        "steps": f"{finished_steps(j)}/{len(j.steps)}",
    }


def _section(title: str, rows: list[dict[str, object]], empty: str) -> list[str]:
    if not rows:
        return [f"{title}: {empty}"]
    return [title, *table_lines(rows)]


def frame(
    snap: Snapshot,
    interval: float | None = None,
    width: int | None = None,
    height: int | None = None,
) -> str:
    """One screen: the summary, then instances, tenants, the queue and reclaim jobs. Lines are
    cut at `width` and the screen at `height` when given (a terminal); `interval` is said in the
    header of a live view."""
    sums = totals(snap)
    when = snap.time.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ")
    live = f"  every {interval:g}s, Ctrl-C quits" if interval is not None else ""
    lines = [
        f"kvquota top  {snap.server}  {when}{live}",
        f"instances {sums['instances']}: {sums['capacityBlocks']} blocks, "
        f"{sums['blocksInUse']} in use, {sums['cachedBlocks']} cached, "
        f"{sums['freeBlocks']} free, {sums['pinnedBlocks']} pinned; "
        f"{sums['liveReservations']} live, {sums['queuedRequests']} queued",
        f"tenants {sums['tenants']}; reclaim jobs: {sums['reclaimJobsRunning']} running, "
        f"{sums['reclaimJobsPlanned']} planned, {sums['reclaimJobsFinished']} finished",
        "",
    ]
    instances = sorted(snap.instances, key=lambda i: i.name)
    lines += _section("INSTANCES", [instance_row(i) for i in instances], "none registered")
    lines.append("")
    # The biggest holders first, as top puts the busiest processes first.
    tenants = sorted(snap.tenants, key=lambda t: (-t.usage.blocks_in_use, t.name))
    lines += _section("TENANTS", [tenant_row(t) for t in tenants], "none")
    lines.append("")
    lines += _section("QUEUE", queue_rows(snap), "empty")
    lines.append("")
    jobs = sorted(
        snap.reclaim_jobs, key=lambda j: (j.state not in ACTIVE_JOB_STATES, j.instance, j.name)
    )
    lines += _section("RECLAIM JOBS", [job_row(j) for j in jobs[:MAX_JOB_ROWS]], "none")
    if len(jobs) > MAX_JOB_ROWS:
        lines.append(f"... and {len(jobs) - MAX_JOB_ROWS} more")
    lines = [line[:width].rstrip() for line in lines]
    if height is not None and len(lines) > height:
        lines = [*lines[: height - 1], "..."]
    return "\n".join(lines)


def snapshot_json(snap: Snapshot) -> dict[str, object]:
    """The snapshot for scripts: the resources as the API gives them, and the sums."""
    return {
        "server": snap.server,
        "time": snap.time.astimezone(UTC).isoformat(),
        "totals": totals(snap),
        "instances": [as_dict(i) for i in snap.instances],
        "tenants": [as_dict(t) for t in snap.tenants],
        "reclaimJobs": [as_dict(j) for j in snap.reclaim_jobs],
    }


def run_top(args: argparse.Namespace, settings: Settings) -> int:
    """`--json` or `--once`: one snapshot and exit; otherwise redraw every --interval seconds
    until Ctrl-C (exit 0). While the server cannot be reached, the screen says so and the view
    keeps trying."""
    if args.interval <= 0:
        print("kvquota top: --interval must be positive", file=sys.stderr)
        return 2
    with channel(args) as chan:
        stub = admin_pb2_grpc.AdminServiceStub(chan)
        if args.json:
            print_json(snapshot_json(snapshot(stub, args.server)))
            return 0
        if args.once:
            print(frame(snapshot(stub, args.server)))
            return 0
        try:
            while True:
                size = shutil.get_terminal_size()
                try:
                    snap = snapshot(stub, args.server)
                    screen = frame(snap, args.interval, size.columns, size.lines - 1)
                except grpc.RpcError as exc:
                    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%SZ")
                    screen = (
                        f"kvquota top  {args.server}  {when}\n"
                        f"cannot read the server: {exc.code().name}: {exc.details()}"
                    )
                sys.stdout.write(CLEAR + screen + "\n")
                sys.stdout.flush()
                time.sleep(args.interval)
        except KeyboardInterrupt:
            return 0
