"""`kvquota reclaim`: the plan as a table, progress while it runs, the result."""

from __future__ import annotations

import argparse
import asyncio
import json

import grpc
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from kvquota.v1 import admission_pb2, admission_pb2_grpc
from quota_service.api import server
from quota_service.cli import main as cli_main
from quota_service.cli.formatting import format_size, parse_size
from quota_service.config import Settings
from tests.integration.grpc_helpers import admit
from tests.integration.ledger_fixtures import add_instance, add_tenant


def test_sizes() -> None:
    assert [parse_size(s) for s in ("2GiB", "512 MiB", "4096", "1kib", "7B")] == [
        2 << 30,
        512 << 20,
        4096,
        1024,
        7,
    ]
    with pytest.raises(argparse.ArgumentTypeError):
        parse_size("2GB")  # decimal units are ambiguous next to GiB: refused
    sizes = [0, 1023, 64 << 10, 64 << 20, 3 << 29, 5 << 40]
    assert [format_size(n) for n in sizes] == ["0B", "1023B", "64KiB", "64MiB", "1.5GiB", "5TiB"]


async def test_reclaim_prints_the_plan_and_the_result(
    engine: AsyncEngine,
    settings: Settings,
    database_url: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    await add_instance(engine, blocks=32)
    await add_tenant(engine, "acme")
    running = await server.start(settings, database_url)
    address = f"127.0.0.1:{running.port}"
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            # Four full prompt blocks stay cached after the release.
            gateway = admission_pb2_grpc.AdmissionServiceStub(channel)
            done = await gateway.Admit(admit("r", 64, 1, prompt_token_ids=range(64)))
            await gateway.Release(admission_pb2.ReleaseRequest(name=done.reservation.name))
        plan_only = ["reclaim", "--instance", "gpu-0", "--blocks", "3", "--server", address]
        assert await asyncio.to_thread(cli_main, [*plan_only, "--dry-run"]) == 0
        out = capsys.readouterr().out.splitlines()
        assert out[0].endswith(": 3 blocks planned of 3")
        assert out[1].split() == ["STEP", "TIER", "WHAT", "EXPECTED", "ACTUAL", "STATE", "NOTE"]
        assert out[2].split()[:3] == ["0", "FREE", "cached"] and len(out) == 3
        run = ["reclaim", "--instance", "gpu-0", "--blocks", "10", "--server", address]
        assert await asyncio.to_thread(cli_main, run) == 0
        captured = capsys.readouterr()
        assert "not reclaimable" not in captured.out  # only cached blocks here, all taken
        assert captured.out.splitlines()[-1] == "SUCCEEDED: 4 of 4 expected blocks back"
        assert "1/1 steps, 4 blocks back" in captured.err  # progress while it ran
        tenant_scope = [*run, "--tenant", "acme", "--json", "--max-tier", "evict", "--dry-run"]
        assert await asyncio.to_thread(cli_main, tenant_scope) == 0
        job = json.loads(capsys.readouterr().out)
        # acme has nothing cached any more and nothing running: an empty plan.
        assert (job["state"], job["expectedBlocks"], job["steps"]) == (
            "RECLAIM_JOB_STATE_SUCCEEDED",
            "0",
            [],
        )
        bad = ["reclaim", "--instance", "gpu-0", "--blocks", "1", "--tenant", "nobody"]
        assert await asyncio.to_thread(cli_main, [*bad, "--server", address]) == 1
        assert "NOT_FOUND: " in capsys.readouterr().err
    finally:
        await running.stop(0)
