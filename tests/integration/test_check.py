"""`kvquota check` over a real record: it passes after traffic through
the API (a queue, shared prefixes, a pin, ended and shrunk reservations), and finds a violation
planted by direct SQL for each invariant it checks, naming that invariant alone. With --server,
each owner's memory is compared with the record, and a difference planted in memory is found."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import suppress
from typing import TYPE_CHECKING, Any

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from kvquota.v1 import admin_pb2, admin_pb2_grpc, admission_pb2, admission_pb2_grpc
from kvquota.v1 import resources_pb2 as pb
from quota_service.api import server
from quota_service.cli import main as cli_main
from quota_service.config import Settings
from quota_service.store.invariants import CHECKED
from tests.integration.grpc_helpers import admit, quota, refused

if TYPE_CHECKING:  # the async stubs exist only in the type stubs
    from kvquota.v1.admin_pb2_grpc import AdminServiceAsyncStub as Admin
    from kvquota.v1.admission_pb2_grpc import AdmissionServiceAsyncStub as Gateway

SYSTEM = list(range(100, 164))  # 4 blocks of 16
BLOCKS = 32

# The SQL that breaks one invariant the record shows, and nothing else.
PLANTS = {
    "1": (
        1,
        "UPDATE instance_owners SET blocks_in_use = blocks_in_use - 1, "
        "cached_blocks = cached_blocks + 1",
    ),
    "3": (3, "UPDATE tenants SET tokens_in_flight = tokens_in_flight + 1 WHERE tenant = 'acme'"),
    "4-shared-salt": (
        4,
        "UPDATE tenants SET cache_salt = (SELECT cache_salt FROM tenants WHERE tenant = 'acme')"
        " WHERE tenant = 'globex'",
    ),
    "6": (6, "UPDATE pins SET pinned_blocks = pinned_blocks + 1 WHERE state = 'ACTIVE'"),
    # An end without its reason passes the CHECK constraint `ended` (it asks for a time or a
    # reason), not the check.
    "7": (7, "UPDATE reservations SET end_reason = NULL WHERE state = 'ENDED'"),
    # b's first block is the pinned prefix's: shared, referenced and hashed already.
    "2-slot-twice-in-a-table": (
        2,
        "UPDATE reservations SET block_ids = block_ids || block_ids[1], "
        "block_generations = block_generations || block_generations[1] "
        "WHERE tenant = 'acme' AND request_id = 'b'",
    ),
    "4-stale-generation": (
        4,
        "UPDATE reservations SET block_generations[1] = block_generations[1] + 1 "
        "WHERE tenant = 'acme' AND request_id = 'b'",
    ),
    "8-unfenced-batch": (
        8,
        "UPDATE pool_deltas SET batch = batch + 1000 "
        "WHERE batch = (SELECT max(batch) FROM pool_deltas)",
    ),
}


def name(request_id: str, tenant: str = "acme") -> str:
    return f"tenants/{tenant}/reservations/{request_id}"


def waiting(request_id: str, blocks: int, seconds: float) -> admission_pb2.AdmitRequest:
    budget = Duration()
    budget.FromNanoseconds(int(seconds * 1e9))
    return admit(request_id, blocks * 16 - 1, 1, wait_timeout=budget)


async def some_traffic(
    admin: Admin, gateway: Gateway
) -> asyncio.Future[admission_pb2.AdmitResponse]:
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
    return queued


async def stop_waiting(queued: asyncio.Future[admission_pb2.AdmitResponse]) -> None:
    queued.cancel()
    with suppress(asyncio.CancelledError):
        await queued


@pytest.fixture
async def traffic(
    admin: Admin, gateway: Gateway
) -> AsyncIterator[asyncio.Future[admission_pb2.AdmitResponse]]:
    queued = await some_traffic(admin, gateway)
    yield queued
    await stop_waiting(queued)


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
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    database_url: str,
    *args: str,
) -> tuple[int, dict[int, dict[str, Any]]]:
    status, out = await check(monkeypatch, capsys, database_url, "--json", *args)
    return status, {r["invariant"]: r for r in json.loads(out)}


def expected_verdicts(checked: set[int]) -> dict[int, str]:
    return {n: "OK" if n in checked else "NOT CHECKED" for n in range(1, 9)}


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
    checked = len(CHECKED)
    assert lines[-1] == f"OK: {checked} invariants hold, {8 - checked} not checked"
    assert [line.split("  ")[:2] for line in lines if line.startswith("invariant")] == [
        [f"invariant {n}", verdict] for n, verdict in expected_verdicts(set(CHECKED)).items()
    ]
    assert "why: a property of repeated calls" in out

    # The queue drains into an admission; the record still holds.
    await gateway.Release(admission_pb2.ReleaseRequest(name=name("filler")))
    admitted = await asyncio.wait_for(traffic, 10)
    assert admitted.reservation.state == pb.RESERVATION_STATE_ADMITTED
    status, found = await verdicts(monkeypatch, capsys, database_url)
    assert status == 0
    assert {n: r["verdict"] for n, r in found.items()} == expected_verdicts(set(CHECKED))


@pytest.mark.parametrize(("number", "plant"), PLANTS.values(), ids=PLANTS.keys())
async def test_a_planted_violation_is_found(
    number: int,
    plant: str,
    traffic: asyncio.Future[admission_pb2.AdmitResponse],
    engine: AsyncEngine,
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    async with engine.begin() as conn:
        await conn.execute(text(plant))
    status, found = await verdicts(monkeypatch, capsys, database_url)
    assert status == 1
    assert [n for n, r in found.items() if r["verdict"] == "VIOLATED"] == [number]
    offences = found[number]["offences"]
    assert offences and all(o["rows"] for o in offences)

    status, out = await check(monkeypatch, capsys, database_url, "--limit", "1")
    assert status == 1
    assert f"invariant {number}  VIOLATED" in out
    checked = len(CHECKED)
    assert out.splitlines()[-1] == (
        f"VIOLATED: {number} (of {checked} checked, {8 - checked} not checked)"
    )


def test_a_plant_for_every_invariant_checked() -> None:
    assert {number for number, _ in PLANTS.values()} == set(CHECKED)


# Each owner's memory against the record (invariant 8).


@pytest.fixture
async def memory_server(
    database_url: str, settings: Settings
) -> AsyncIterator[server.RunningServer]:
    running = await server.start(settings, database_url)
    yield running
    await running.stop(0)


async def test_each_owner_s_memory_equals_the_record_until_it_is_changed(
    memory_server: server.RunningServer,
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    address = f"127.0.0.1:{memory_server.port}"
    async with grpc.aio.insecure_channel(address) as channel:
        admin = admin_pb2_grpc.AdminServiceStub(channel)
        queued = await some_traffic(admin, admission_pb2_grpc.AdmissionServiceStub(channel))
        try:
            answer = await admin.CheckInstance(
                admin_pb2.CheckInstanceRequest(name="instances/gpu-0")
            )
            assert (answer.name, list(answer.differences), answer.more_differences) == (
                "instances/gpu-0",
                [],
                False,
            )
            assert answer.epoch >= 1
            status, found = await verdicts(monkeypatch, capsys, database_url, "--server", address)
            assert status == 0
            assert {n: r["verdict"] for n, r in found.items()} == expected_verdicts(set(CHECKED))
            assert "the owners' memory of instances/gpu-0" in found[8]["scope"]

            # Memory changed behind the journal's back: a slot referenced once more, and a
            # lease that the record does not have.
            owners = memory_server.owners
            machine = owners.served()[0].machine
            record = machine.reservations[("acme", "b")]
            assert record.table is not None and record.lease_expires_at is not None
            slot = record.table.blocks[0]
            machine.pool.reference(slot, pinned=False)
            record.lease_expires_at += 60
            answer = await admin.CheckInstance(
                admin_pb2.CheckInstanceRequest(name="instances/gpu-0", max_differences=1)
            )
            assert [d.subject for d in answer.differences] == [f"slot {slot}"]
            assert answer.more_differences
            status, found = await verdicts(monkeypatch, capsys, database_url, "--server", address)
            assert status == 1
            assert [n for n, r in found.items() if r["verdict"] == "VIOLATED"] == [8]
            (offence,) = found[8]["offences"]
            assert [row["subject"] for row in offence["rows"]] == [
                f"slot {slot}",
                name("b") + ": lease_expires_at",
            ]
            referenced = offence["rows"][0]
            assert (referenced["memory"], referenced["record"]) == (
                f"references {machine.pool.ref_count(slot)}",
                f"references {machine.pool.ref_count(slot) - 1}",
            )

            missing = await refused(
                admin.CheckInstance(admin_pb2.CheckInstanceRequest(name="instances/gpu-9"))
            )
            assert (missing.code, missing.reason) == (
                grpc.StatusCode.NOT_FOUND,
                "INSTANCE_NOT_FOUND",
            )
            too_many = await refused(
                admin.CheckInstance(
                    admin_pb2.CheckInstanceRequest(name="instances/gpu-0", max_differences=1001)
                )
            )
            assert too_many.code is grpc.StatusCode.INVALID_ARGUMENT
        finally:
            await stop_waiting(queued)
