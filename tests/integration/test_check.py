"""`kvquota check` over a real record: it passes after traffic through the API (a queue, shared
prefixes, a pin, ended and shrunk reservations), and finds a violation planted by direct SQL for
each invariant it checks, naming that invariant alone."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import suppress
from typing import TYPE_CHECKING

import pytest
from google.protobuf.duration_pb2 import Duration
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from kvquota.v1 import admin_pb2, admission_pb2
from kvquota.v1 import resources_pb2 as pb
from quota_service.cli import main as cli_main
from quota_service.store.invariants import CHECKED
from tests.integration.grpc_helpers import admit, quota

if TYPE_CHECKING:  # the async stubs exist only in the type stubs
    from kvquota.v1.admin_pb2_grpc import AdminServiceAsyncStub as Admin
    from kvquota.v1.admission_pb2_grpc import AdmissionServiceAsyncStub as Gateway

SYSTEM = list(range(100, 164))  # 4 blocks of 16
BLOCKS = 32

# The SQL that breaks one invariant the record shows, and nothing else.
PLANTS = [
    (
        1,
        [
            "UPDATE instances SET blocks_in_use = blocks_in_use - 1, "
            "cached_blocks = cached_blocks + 1"
        ],
    ),
    (
        2,
        [
            "UPDATE blocks SET ref_count = ref_count + 1 "
            "WHERE block_id = (SELECT min(block_id) FROM blocks WHERE state = 'IN_USE')"
        ],
    ),
    (3, ["UPDATE tenants SET tokens_in_flight = tokens_in_flight + 1 WHERE tenant = 'acme'"]),
    (
        4,
        [
            "INSERT INTO tombstones (instance, block_id, generation, content_hash, reason, "
            "tenant, freed_at) SELECT instance, block_id, generation, content_hash, 'FREED', "
            "'acme', now() FROM blocks WHERE state = 'IN_USE' ORDER BY block_id LIMIT 1"
        ],
    ),
    (
        4,
        [
            "UPDATE tenants SET cache_salt = (SELECT cache_salt FROM tenants WHERE tenant = 'acme')"
            " WHERE tenant = 'globex'"
        ],
    ),
    (6, ["UPDATE pins SET pinned_blocks = pinned_blocks + 1 WHERE state = 'ACTIVE'"]),
    # An end without its reason passes the CHECK constraint `ended` (it asks for a time or a
    # reason), not the check.
    (7, ["UPDATE reservations SET end_reason = NULL WHERE state = 'ENDED'"]),
]
PLANT_IDS = ["1", "2", "3", "4-stale-handle", "4-shared-salt", "6", "7"]


def name(request_id: str, tenant: str = "acme") -> str:
    return f"tenants/{tenant}/reservations/{request_id}"


def waiting(request_id: str, blocks: int, seconds: float) -> admission_pb2.AdmitRequest:
    budget = Duration()
    budget.FromNanoseconds(int(seconds * 1e9))
    return admit(request_id, blocks * 16 - 1, 1, wait_timeout=budget)


@pytest.fixture
async def traffic(
    admin: Admin, gateway: Gateway
) -> AsyncIterator[asyncio.Future[admission_pb2.AdmitResponse]]:
    """Two tenants on one instance: a pin, requests sharing it, one ended, one cancelled, one
    shrunk, and one left waiting in the queue (the future of its Admit)."""
    await admin.RegisterInstance(
        admin_pb2.RegisterInstanceRequest(
            instance_id="gpu-0", block_size=16, max_model_len=4096, num_gpu_blocks=BLOCKS
        )
    )
    for tenant in ("acme", "globex"):
        await admin.CreateTenant(
            admin_pb2.CreateTenantRequest(tenant_id=tenant, tenant=pb.Tenant(quota=quota()))
        )
    await admin.PinPrefix(
        admin_pb2.PinPrefixRequest(
            parent="tenants/acme", pin_id="system", instance="instances/gpu-0", token_ids=SYSTEM
        )
    )
    for request_id, tenant in (("a", "acme"), ("b", "acme"), ("c", "globex"), ("d", "globex")):
        ids = [*SYSTEM, *range(len(request_id))]
        await gateway.Admit(admit(request_id, len(ids), 8, tenant=tenant, prompt_token_ids=ids))
    await gateway.Release(admission_pb2.ReleaseRequest(name=name("a"), output_tokens=5))
    await gateway.Cancel(admission_pb2.CancelRequest(name=name("c", "globex")))
    shrunk = await gateway.GetReservation(admission_pb2.GetReservationRequest(name=name("b")))
    await gateway.ReleaseBlocks(
        admission_pb2.ReleaseBlocksRequest(name=name("b"), handles=shrunk.block_table[-1:])
    )
    instance = await admin.GetInstance(admin_pb2.GetInstanceRequest(name="instances/gpu-0"))
    # Every block not held (free, or cached and reusable), so that the next request waits.
    await gateway.Admit(waiting("filler", instance.free_blocks + instance.cached_blocks, 0))
    queued = asyncio.ensure_future(gateway.Admit(waiting("waiter", 2, 30)))
    while instance.queued_requests == 0:
        await asyncio.sleep(0.05)
        instance = await admin.GetInstance(admin_pb2.GetInstanceRequest(name="instances/gpu-0"))
    yield queued
    queued.cancel()
    with suppress(asyncio.CancelledError):
        await queued


async def check(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    database_url: str,
    *args: str,
) -> tuple[int, str]:
    monkeypatch.setenv("KVQUOTA_DATABASE_URL", database_url)
    status = await asyncio.to_thread(cli_main, ["check", *args])
    return status, capsys.readouterr().out


async def verdicts(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], database_url: str
) -> tuple[int, dict[int, dict[str, object]]]:
    status, out = await check(monkeypatch, capsys, database_url, "--json")
    return status, {r["invariant"]: r for r in json.loads(out)}


async def test_a_healthy_record_passes(
    traffic: asyncio.Future[admission_pb2.AdmitResponse],
    gateway: Gateway,
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    status, out = await check(monkeypatch, capsys, database_url)
    assert status == 0, out
    lines = out.splitlines()
    assert lines[-1] == "OK: 6 invariants hold, 2 not checked"
    assert [line.split("  ")[:2] for line in lines if line.startswith("invariant")] == [
        [f"invariant {n}", "OK" if n in CHECKED else "NOT CHECKED"] for n in range(1, 9)
    ]
    assert "why: a property of repeated calls" in out

    # The queue drains into an admission; the record still holds.
    await gateway.Release(admission_pb2.ReleaseRequest(name=name("filler")))
    admitted = await asyncio.wait_for(traffic, 10)
    assert admitted.reservation.state == pb.RESERVATION_STATE_ADMITTED
    status, found = await verdicts(monkeypatch, capsys, database_url)
    assert status == 0
    assert {n: r["verdict"] for n, r in found.items()} == {
        n: "OK" if n in CHECKED else "NOT CHECKED" for n in range(1, 9)
    }


@pytest.mark.parametrize(("number", "plant"), PLANTS, ids=PLANT_IDS)
async def test_a_planted_violation_is_found(
    number: int,
    plant: list[str],
    traffic: asyncio.Future[admission_pb2.AdmitResponse],
    engine: AsyncEngine,
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    async with engine.begin() as conn:
        for statement in plant:
            await conn.execute(text(statement))
    status, found = await verdicts(monkeypatch, capsys, database_url)
    assert status == 1
    assert [n for n, r in found.items() if r["verdict"] == "VIOLATED"] == [number]
    offences = found[number]["offences"]
    assert isinstance(offences, list) and offences and all(o["rows"] for o in offences)

    status, out = await check(monkeypatch, capsys, database_url, "--limit", "1")
    assert status == 1
    assert f"invariant {number}  VIOLATED" in out
    assert out.splitlines()[-1] == f"VIOLATED: {number} (of 6 checked, 2 not checked)"


def test_a_plant_for_every_invariant_checked() -> None:
    assert {number for number, _ in PLANTS} == set(CHECKED)
