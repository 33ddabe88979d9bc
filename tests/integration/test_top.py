"""`kvquota top --once` and `--json` against a real server: an instance with a pin, cached
blocks, a running and a queued reservation, two tenants and a reclaim job; the figures shown are
the ledger's."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
from collections.abc import AsyncIterator

import grpc
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from kvquota.v1 import admin_pb2, admin_pb2_grpc, admission_pb2, admission_pb2_grpc, resources_pb2
from quota_service.api import server
from quota_service.cli import main as cli_main
from quota_service.cli.top import CLEAR
from quota_service.config import Settings
from quota_service.core.model import TenantQuota
from tests import processes
from tests.integration.grpc_helpers import admit, until_queued
from tests.integration.ledger_fixtures import add_instance, add_tenant, counters

QUOTA = TenantQuota(
    max_blocks=40,
    max_tokens_in_flight=10_000,
    max_queued_requests=5,
    max_pinned_blocks=8,
    max_cpu_tier_bytes=0,
)


def table(lines: list[str], title: str) -> list[dict[str, str]]:
    """The rows of the frame's table under `title`, by column: columns are two or more spaces
    apart, and a value (like a header) has single spaces at most."""
    start = lines.index(title) + 1
    header = lines[start]
    spans = [m.span() for m in re.finditer(r"\S+(?: \S+)*", header)]
    names = [header[a:b] for a, b in spans]
    rows = []
    for line in lines[start + 1 :]:
        if not line.strip():
            break
        starts = [a for a, _ in spans] + [len(line)]
        rows.append({n: line[starts[i] : starts[i + 1]].strip() for i, n in enumerate(names)})
    return rows


@pytest.fixture
async def address(engine: AsyncEngine, settings: Settings, database_url: str) -> AsyncIterator[str]:
    """A server seeded through its API (see the module's docstring)."""
    await add_instance(engine, blocks=16)
    await add_tenant(engine, "acme", QUOTA)
    await add_tenant(engine, "idle", QUOTA)
    running = await server.start(settings, database_url)
    address = f"127.0.0.1:{running.port}"
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            admin = admin_pb2_grpc.AdminServiceStub(channel)
            gateway = admission_pb2_grpc.AdmissionServiceStub(channel)
            await admin.PinPrefix(
                admin_pb2.PinPrefixRequest(
                    parent="tenants/acme",
                    pin_id="system",
                    instance="instances/gpu-0",
                    token_ids=range(1000, 1032),
                )
            )
            # Four full prompt blocks stay cached after the release.
            warm = await gateway.Admit(admit("warm", 64, 1, prompt_token_ids=range(64)))
            await gateway.Release(
                admission_pb2.ReleaseRequest(name=warm.reservation.name, output_tokens=1)
            )
            await gateway.Admit(admit("running", 4 * 16 - 1, 1))
            # Queued while the tests look: it needs 11 blocks, and 10 are free or cached.
            queued = admit("waiting", 11 * 16 - 1, 1)
            queued.wait_timeout.FromSeconds(600)
            waiting = gateway.Admit(queued)
            await until_queued(gateway, "tenants/acme/reservations/waiting")
            await admin.CreateReclaimJob(
                admin_pb2.CreateReclaimJobRequest(
                    instance="instances/gpu-0",
                    target_blocks=2,
                    max_tier=resources_pb2.RECLAIM_TIER_FREE,
                    dry_run=True,
                    request_id="plan-1",
                )
            )
            yield address
            waiting.cancel()
    finally:
        await running.stop(0)


async def test_top_once_shows_the_ledger(
    engine: AsyncEngine, address: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert await asyncio.to_thread(cli_main, ["top", "--once", "--server", address]) == 0
    lines = capsys.readouterr().out.splitlines()
    books = await counters(engine)
    pool = books["instance:gpu-0"]
    assert pool["pinned_blocks"] == 2 and pool["cached_blocks"] > 0  # the seeding did its part
    assert lines[0].startswith(f"kvquota top  {address}  ")
    assert lines[1] == (
        f"instances 1: 16 blocks, {pool['blocks_in_use']} in use, {pool['cached_blocks']} cached, "
        f"{pool['free_blocks']} free, 2 pinned; 1 live, 1 queued"
    )
    assert lines[2] == "tenants 2; reclaim jobs: 0 running, 0 planned, 1 finished"

    [instance] = table(lines, "INSTANCES")
    held = pool["blocks_in_use"] + 2
    assert instance == {
        "INSTANCE": "gpu-0",
        "STATE": "ACTIVE",
        "USED": f"[{'#' * int(held * 10 / 16 + 0.5):.<10}] {100 * held / 16:.0f}%",
        "CAPACITY": "16",
        "IN USE": str(pool["blocks_in_use"]),
        "CACHED": str(pool["cached_blocks"]),
        "FREE": str(pool["free_blocks"]),
        "PINNED": "2",
        "KV IN USE": "-",  # registered from a block count: no geometry, no bytes
        "LIVE": "1",
        "QUEUED": "1/1024",
        "ENGINE RUNNING": "-",
        "CPU TIER": "-",
        "COMPRESS": "-",
    }
    acme, idle = table(lines, "TENANTS")  # the bigger holder first
    tenant = books["tenant:acme"]
    assert acme == {
        "TENANT": "acme",
        "STATE": "ACTIVE",
        "BLOCKS": f"{tenant['blocks_in_use']}/40",
        "OF QUOTA": f"{100 * tenant['blocks_in_use'] / 40:.0f}%",
        "PINNED": "2/8",
        "TOKENS IN FLIGHT": f"{tenant['tokens_in_flight']}/10000",
        "LIVE": "1",
        "QUEUED": "1/5",
        "CPU TIER": "0B",
        "COMPRESSED": "0B",
        "WEIGHT": "1",
    }
    assert (idle["TENANT"], idle["BLOCKS"], idle["QUEUED"]) == ("idle", "0/40", "0/5")
    assert table(lines, "QUEUE") == [
        {"WAITING ON": "instances/gpu-0", "QUEUED": "1", "LIMIT": "1024", "PROMPT TOKENS": "175"},
        {"WAITING ON": "tenants/acme", "QUEUED": "1", "LIMIT": "5", "PROMPT TOKENS": "-"},
    ]
    [job] = table(lines, "RECLAIM JOBS")
    assert job["JOB"].startswith("reclaim-")
    assert {k: v for k, v in job.items() if k != "JOB"} == {
        "INSTANCE": "gpu-0",
        "TENANT": "-",
        "STATE": "SUCCEEDED (dry run)",
        "TIERS": "FREE",
        "TARGET": "2",
        "EXPECTED": "2",
        "BACK": "0",
        "STEPS": "0/1",
    }


async def test_top_json_is_one_snapshot(
    engine: AsyncEngine, address: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert await asyncio.to_thread(cli_main, ["top", "--json", "--server", address]) == 0
    snapshot = json.loads(capsys.readouterr().out)
    pool = (await counters(engine))["instance:gpu-0"]
    assert snapshot["server"] == address
    assert snapshot["totals"] == {
        "instances": 1,
        "capacityBlocks": 16,
        "blocksInUse": pool["blocks_in_use"],
        "cachedBlocks": pool["cached_blocks"],
        "freeBlocks": pool["free_blocks"],
        "pinnedBlocks": 2,
        "liveReservations": 1,
        "queuedRequests": 1,
        "tenants": 2,
        "reclaimJobsRunning": 0,
        "reclaimJobsPlanned": 0,
        "reclaimJobsFinished": 1,
    }
    [instance] = snapshot["instances"]
    # The resources as the API gives them (int64 as strings, in proto JSON).
    assert (instance["name"], instance["queuedRequests"], instance["queuedPromptTokens"]) == (
        "instances/gpu-0",
        "1",
        "175",
    )
    assert [t["name"] for t in snapshot["tenants"]] == ["tenants/acme", "tenants/idle"]
    [job] = snapshot["reclaimJobs"]
    assert (job["state"], job["expectedBlocks"], job["dryRun"]) == (
        "RECLAIM_JOB_STATE_SUCCEEDED",
        "2",
        True,
    )


async def test_top_redraws_until_ctrl_c(address: str) -> None:
    process = await processes.exec_async(
        sys.executable,
        *("-m", "quota_service.cli", "top", "--interval", "0.1", "--server", address),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "COLUMNS": "200", "LINES": "50"},
    )
    assert process.stdout is not None
    shown = b""
    async with asyncio.timeout(30):
        while shown.count(CLEAR.encode()) < 3:  # two whole frames
            shown += await process.stdout.read(65536)
    process.send_signal(signal.SIGINT)
    rest, errors = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 0, errors.decode()
    assert b"Traceback" not in errors
    frames = (shown + rest).decode().split(CLEAR)[1:3]
    for frame in frames:
        lines = frame.splitlines()
        assert lines[0].startswith(f"kvquota top  {address}  ")
        assert lines[0].endswith("  every 0.1s, Ctrl-C quits")
        assert lines[1].endswith("2 pinned; 1 live, 1 queued")
