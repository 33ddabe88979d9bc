"""`kvquota top`'s frames, built from snapshots made by hand (no server)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from kvquota.v1 import resources_pb2 as pb
from quota_service.cli import main as cli_main
from quota_service.cli import top

WHEN = datetime(2026, 11, 29, 10, 0, 5, tzinfo=UTC)


def instance(name: str, **fields: int) -> pb.Instance:
    made = pb.Instance(
        name=f"instances/{name}",
        state=pb.INSTANCE_STATE_ACTIVE,
        engine_requests_running=-1,
        max_queued_requests=64,
    )
    for field, value in fields.items():
        setattr(made, field, value)
    return made


def tenant(name: str, blocks: int, queued: int = 0) -> pb.Tenant:
    return pb.Tenant(
        name=f"tenants/{name}",
        state=pb.TENANT_STATE_ACTIVE,
        weight=1,
        quota=pb.TenantQuota(max_blocks=100, max_queued_requests=4, max_pinned_blocks=10),
        usage=pb.TenantUsage(blocks_in_use=blocks, queued_requests=queued),
    )


def job(name: str, state: pb.ReclaimJobState.ValueType, steps: int = 0) -> pb.ReclaimJob:
    return pb.ReclaimJob(
        name=f"reclaimJobs/{name}",
        instance="instances/gpu-0",
        state=state,
        min_tier=pb.RECLAIM_TIER_FREE,
        max_tier=pb.RECLAIM_TIER_EVICT,
        target_blocks=8,
        expected_blocks=6,
        actual_blocks=2,
        steps=[
            pb.ReclaimStep(seq=i, actual_blocks=1, state=pb.RECLAIM_STEP_STATE_APPLIED)
            if i < 2
            else pb.ReclaimStep(seq=i, actual_blocks=-1, state=pb.RECLAIM_STEP_STATE_PLANNED)
            for i in range(steps)
        ],
    )


SNAPSHOT = top.Snapshot(
    server="kvq:50051",
    time=WHEN,
    instances=[
        instance(
            "gpu-1",
            capacity_blocks=100,
            blocks_in_use=40,
            cached_blocks=10,
            free_blocks=45,
            pinned_blocks=5,
            live_reservations=3,
            queued_requests=2,
            queued_prompt_tokens=900,
            bytes_per_block=2 << 20,
        ),
        instance("gpu-0", capacity_blocks=50, free_blocks=50),
    ],
    tenants=[tenant("small", 5), tenant("big", 40, queued=2), tenant("none", 0)],
    reclaim_jobs=[
        job("done", pb.RECLAIM_JOB_STATE_SUCCEEDED),
        job("busy", pb.RECLAIM_JOB_STATE_RUNNING, steps=4),
    ],
)


def test_a_frame_has_the_summary_and_every_section() -> None:
    lines = top.frame(SNAPSHOT).splitlines()
    assert lines[:3] == [
        "kvquota top  kvq:50051  2026-11-29 10:00:05Z",
        "instances 2: 150 blocks, 40 in use, 10 cached, 95 free, 5 pinned; 3 live, 2 queued",
        "tenants 3; reclaim jobs: 1 running, 0 planned, 1 finished",
    ]
    assert [line.split()[0] for line in lines[6:8]] == ["gpu-0", "gpu-1"]  # by name
    gpu1 = lines[7]
    assert "[#####.....] 45%" in gpu1  # in use and pinned, of the capacity
    assert "90MiB/200MiB" in gpu1  # with a geometry, in bytes too
    # queued/limit; engine and CPU tier unread, and nothing to compress with
    assert gpu1.split()[-4:] == ["2/64", "-", "-", "-"]
    tenants = lines[lines.index("TENANTS") + 2 : lines.index("TENANTS") + 5]
    assert [t.split()[:4] for t in tenants] == [  # the biggest holders first
        ["big", "ACTIVE", "40/100", "40%"],
        ["small", "ACTIVE", "5/100", "5%"],
        ["none", "ACTIVE", "0/100", "0%"],
    ]
    queue = lines[lines.index("QUEUE") + 1 :]
    assert [q.split() for q in queue[:3]] == [
        ["WAITING", "ON", "QUEUED", "LIMIT", "PROMPT", "TOKENS"],
        ["instances/gpu-1", "2", "64", "900"],
        ["tenants/big", "2", "4", "-"],
    ]
    jobs = lines[lines.index("RECLAIM JOBS") + 2 :]
    # Running jobs first; steps applied of planned; the tiers it may use.
    assert [j.split() for j in jobs] == [
        ["busy", "gpu-0", "-", "RUNNING", "FREE..EVICT", "8", "6", "2", "2/4"],
        ["done", "gpu-0", "-", "SUCCEEDED", "FREE..EVICT", "8", "6", "2", "0/0"],
    ]
    assert all(line == line.rstrip() for line in lines)


def test_empty_sections_say_so() -> None:
    empty = top.Snapshot("kvq:50051", WHEN, [], [], [])
    assert top.frame(empty, interval=2).splitlines() == [
        "kvquota top  kvq:50051  2026-11-29 10:00:05Z  every 2s, Ctrl-C quits",
        "instances 0: 0 blocks, 0 in use, 0 cached, 0 free, 0 pinned; 0 live, 0 queued",
        "tenants 0; reclaim jobs: 0 running, 0 planned, 0 finished",
        "",
        "INSTANCES: none registered",
        "",
        "TENANTS: none",
        "",
        "QUEUE: empty",
        "",
        "RECLAIM JOBS: none",
    ]


def test_a_terminal_cuts_lines_and_the_screen() -> None:
    many = top.Snapshot(
        "kvq:50051",
        WHEN,
        [],
        [tenant(f"t{i:02}", i) for i in range(40)],
        [job(f"j{i:02}", pb.RECLAIM_JOB_STATE_SUCCEEDED) for i in range(top.MAX_JOB_ROWS + 3)],
    )
    full = top.frame(many).splitlines()
    assert full[-1] == "... and 3 more"  # jobs beyond the limit are counted
    screen = top.frame(many, width=30, height=20).splitlines()
    assert len(screen) == 20 and screen[-1] == "..."
    assert max(len(line) for line in screen) <= 30
    assert screen[:19] == [line[:30].rstrip() for line in full[:19]]


def test_the_json_snapshot_has_the_resources_and_the_sums() -> None:
    snapshot = top.snapshot_json(SNAPSHOT)
    assert snapshot["time"] == "2026-11-29T10:00:05+00:00"
    assert snapshot["totals"] == top.totals(SNAPSHOT)
    instances = snapshot["instances"]
    assert isinstance(instances, list)
    assert [(i["name"], i["freeBlocks"]) for i in instances] == [
        ("instances/gpu-1", "45"),
        ("instances/gpu-0", "50"),
    ]


def test_the_interval_must_be_positive(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["top", "--interval", "0", "--server", "127.0.0.1:1"]) == 2
    assert "--interval must be positive" in capsys.readouterr().err
