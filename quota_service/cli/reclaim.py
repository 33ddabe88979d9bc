"""`kvquota reclaim`: plan a reclaim job, print the plan, and follow it until it has finished."""

from __future__ import annotations

import argparse
import sys
import time
import uuid

from kvquota.v1 import admin_pb2, admin_pb2_grpc, resources_pb2
from quota_service.cli.command import AddParser, add_json_option
from quota_service.cli.connection import add_server_options, channel
from quota_service.cli.formatting import as_dict, enum_name, parse_size, print_json, print_rows
from quota_service.config import Settings

POLL_SECONDS = 0.5
TIERS = ["free", "offload", "compress", "evict"]
FINISHED = {
    resources_pb2.RECLAIM_JOB_STATE_SUCCEEDED,
    resources_pb2.RECLAIM_JOB_STATE_FAILED,
    resources_pb2.RECLAIM_JOB_STATE_CANCELLED,
}


def add_parsers(add_parser: AddParser) -> None:
    reclaim = add_parser("reclaim", help="take KV memory back, tier by tier")
    reclaim.add_argument("--instance", required=True, help="the instance id, e.g. gpu-0")
    reclaim.add_argument("--tenant", help="only what this tenant holds (default: everything)")
    target = reclaim.add_mutually_exclusive_group(required=True)
    target.add_argument("--target", type=parse_size, help="bytes to take back, e.g. 2GiB")
    target.add_argument("--blocks", type=int, help="blocks to take back")
    reclaim.add_argument(
        "--max-tier", default="free", choices=TIERS, help="the highest tier allowed (default: free)"
    )
    reclaim.add_argument(
        "--min-tier",
        default="free",
        choices=TIERS,
        help="the lowest tier to use (default: free; offload skips freeing cached blocks)",
    )
    reclaim.add_argument("--dry-run", action="store_true", help="plan only")
    reclaim.add_argument("--request-id", help="idempotency key (default: a new one)")
    add_server_options(reclaim)
    add_json_option(reclaim, "tables")
    reclaim.set_defaults(run=run_reclaim)


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
        "tier": enum_name(step, "tier"),
        "what": what,
        "expected": step.expected_blocks,
        "actual": "-" if step.actual_blocks < 0 else step.actual_blocks,
        "state": enum_name(step, "state"),
        "note": step.note,
    }


def run_reclaim(args: argparse.Namespace, settings: Settings) -> int:
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
    with channel(args) as chan:
        stub = admin_pb2_grpc.AdminServiceStub(chan)
        job = stub.CreateReclaimJob(request)
        if not args.json:
            print(f"{job.name}: {job.expected_blocks} blocks planned of {job.target_blocks}")
            print_rows([_step_row(s) for s in job.steps])
            for e in job.excluded:
                print(f"not reclaimable: {e.blocks} blocks, {e.reason} {e.reservation}".rstrip())
        while job.state not in FINISHED:
            time.sleep(POLL_SECONDS)
            job = stub.GetReclaimJob(admin_pb2.GetReclaimJobRequest(name=job.name))
            print(
                f"{finished_steps(job)}/{len(job.steps)} steps, {job.actual_blocks} blocks back",
                file=sys.stderr,
            )
    if args.json:
        print_json(as_dict(job))
    elif not job.dry_run:
        state = enum_name(job, "state")
        print(f"{state}: {job.actual_blocks} of {job.expected_blocks} expected blocks back")
        differences = [s for s in job.steps if 0 <= s.actual_blocks != s.expected_blocks]
        if differences:
            print_rows([_step_row(s) for s in differences])
    return 0
