"""Offboarding ends a tenant's admitted reservations in batches: every kind of live reservation
(queued, suspended, offloaded to the CPU tier, sharing blocks with another tenant or a pin of
its own) ends as ending it through its instance's owner would, and the books balance
afterwards."""

from __future__ import annotations

from dataclasses import replace

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from quota_service.api.server import HotPath
from quota_service.api.waiting import Waiters
from quota_service.core import catalog, geometry
from quota_service.core.admission import AdmitRequest
from quota_service.core.instance_machine import InstanceMachine
from quota_service.core.model import EndReason, ReservationState, TenantState
from quota_service.store.offboarding import OffboardingReport
from tests.integration.invariants import assert_invariants
from tests.integration.ledger_fixtures import (
    add_tenant,
    crash_after_batches,
    derived_counters,
    owned_offboarding,
    request,
    snapshot,
)

BS = 16
GEOMETRY = geometry.KvGeometry(2, 2, 64, geometry.KvDtype.FP16)  # 16 KiB a block
BLOCK_BYTES = 16384
PRIVATE = 9  # private requests of 3 blocks
BATCH = 4  # reservations a batch ends: the test's admitted ones take several

# What the usage events of each tenant add up to, per kind: block deltas by share ("blocks:k"),
# pinned blocks and CPU-tier bytes. They net out to what the tenant holds now.
_METERED = text(
    """
    SELECT tenant, 'blocks:' || k AS kind, sum(v::int) AS total
    FROM usage_events, jsonb_each_text(blocks) AS e(k, v) GROUP BY tenant, k
    UNION ALL SELECT tenant, 'pinned', sum(pinned) FROM usage_events GROUP BY tenant
    UNION ALL SELECT tenant, 'cpu_bytes', sum(cpu_bytes) FROM usage_events GROUP BY tenant
    """
)

# What each tenant holds, as the record derives it: its blocks by how many tenants hold each,
# its pinned blocks, and its sessions' bytes in the CPU tier.
_HELD = text(
    """
    WITH held AS (SELECT DISTINCT tenant, instance, block_id FROM journal_slot_references
                  WHERE tenant IS NOT NULL)
    SELECT h.tenant, 'blocks:' || (SELECT count(*) FROM held o
                                    WHERE o.instance = h.instance AND o.block_id = h.block_id)
           AS kind, count(*) AS total
    FROM held h GROUP BY 1, 2
    UNION ALL SELECT tenant, 'pinned', sum(pinned_blocks) FROM journal_tenant_holdings
              GROUP BY tenant
    UNION ALL SELECT tenant, 'cpu_bytes', coalesce(sum(offloaded_bytes), 0) FROM reservations
              WHERE state <> 'ENDED' GROUP BY tenant
    """
)


def tokens(seed: int, blocks: int, extra: int = 0) -> list[int]:
    return [seed * 1_000_000 + i for i in range(blocks * BS + extra)]


async def metered(engine: AsyncEngine) -> dict[tuple[str, str], int]:
    async with engine.connect() as conn:
        rows = (await conn.execute(_METERED)).all()
    return {(tenant, kind): int(total) for tenant, kind, total in rows if total}


async def held(engine: AsyncEngine) -> dict[tuple[str, str], int]:
    async with engine.connect() as conn:
        rows = (await conn.execute(_HELD)).all()
    return {(tenant, kind): int(total) for tenant, kind, total in rows if total}


async def end_reasons(engine: AsyncEngine, tenant: str) -> dict[str, str | None]:
    async with engine.connect() as conn:
        rows = await conn.execute(
            text("SELECT request_id, end_reason FROM reservations WHERE tenant = :tenant"),
            {"tenant": tenant},
        )
        return {request_id: reason for request_id, reason in rows.all()}


async def offboarded_tenant(engine: AsyncEngine, owned: HotPath) -> None:
    """'big' holds every kind of live reservation on gpu-0; 'other' shares a prefix with it."""
    ledger, pins, books = owned.ledger, owned.pins, owned.catalog
    spec = catalog.instance_spec("gpu-0", "m", GEOMETRY, BS, 8192, None, 80)
    await books.register_instance(spec)
    for tenant in ("big", "other", "filler"):
        await add_tenant(engine, tenant)
    await books.create_namespace("pub")
    for tenant in ("big", "other"):
        await books.update_tenant(tenant, {"namespace": "pub"})

    def prompt(request_id: str, ids: list[int], tenant: str = "big") -> AdmitRequest:
        # Two output tokens: the first gets a slot (vLLM never computes the last one's KV).
        return replace(request(request_id, len(ids), 2, tenant=tenant), prompt_token_ids=tuple(ids))

    # A pin of its own, and a request on top of the pinned prefix.
    await pins.pin("tenants/big", "system", "gpu-0", tokens(1, 3))
    await ledger.admit(prompt("on-pin", tokens(1, 3) + tokens(2, 1)))
    # Four blocks shared with 'other'.
    await ledger.admit(prompt("s", tokens(3, 4), tenant="other"))
    await ledger.admit(prompt("s", tokens(3, 4) + tokens(4, 1)))
    for i in range(PRIVATE):
        await ledger.admit(request(f"p{i}", 2 * BS, BS, tenant="big"))
    # Idle between turns: one still on the GPU, one offloaded to the CPU tier.
    for request_id in ("idle", "offloaded"):
        await ledger.admit(request(request_id, 2 * BS, BS, tenant="big"))
        await ledger.suspend("big", request_id, ())

    def offload(machine: InstanceMachine, now: float) -> int | None:
        return machine.offload("big", "offloaded", 3 * BLOCK_BYTES)

    assert await owned.owners.run("gpu-0", offload) == 3
    # The instance full: one more waits in the queue.
    pool = (await derived_counters(engine, owned))["instance:gpu-0"]
    room = pool["free_blocks"] + pool["cached_blocks"]
    await ledger.admit(request("fill", (room - 1) * BS, BS, tenant="filler"))
    waiting = replace(request("waiting", 2 * BS, BS, tenant="big"), wait_timeout_seconds=60.0)
    queued, _ = await ledger.admit(waiting)
    assert queued.state is ReservationState.QUEUED


async def test_offboarding_ends_every_kind_of_reservation_in_batches(
    engine: AsyncEngine, owned: HotPath, monkeypatch: pytest.MonkeyPatch
) -> None:
    await offboarded_tenant(engine, owned)
    other_before = (await derived_counters(engine, owned))["tenant:other"]
    big = (await derived_counters(engine, owned))["tenant:big"]
    # The pin's 3 blocks and 2 more on top of them, 6 with 4 of them shared, the private and
    # idle requests' blocks; the offloaded one holds none.
    assert big["blocks_in_use"] == 3 + 2 + 6 + 3 * PRIVATE + 3
    assert (big["pinned_blocks"], big["queued_requests"]) == (3, 1)
    await assert_invariants(engine)

    # Each ending is announced to this replica's waiters (queued Admits and watches, which
    # other replicas forward here), as a committed batch tells them.
    notified: list[str] = []
    hear = Waiters.on_notification

    def heard(waiters: Waiters, kind: str, subject: str) -> None:
        notified.append(f"{kind}:{subject}")
        hear(waiters, kind, subject)

    monkeypatch.setattr(Waiters, "on_notification", heard)
    offboarding = owned_offboarding(engine, owned, reservation_batch=BATCH)
    report = await offboarding.delete_tenant("big")
    live = {f"changed:big/{r}" for r in await end_reasons(engine, "big")}
    assert live <= set(notified)

    # Freed: the two tails, the private and idle blocks; kept: the 4 shared blocks and the
    # ones hashed under the namespace's salt (cached for it: the pin's 3 and 2 full blocks).
    assert report == OffboardingReport(
        freed_blocks=2 + 3 * PRIVATE + 3,
        shared_blocks=4 + 3 + 2,
        pinned_by_others=0,
        awaiting_engine_aborts=0,
        finished=True,
    )
    reasons = await end_reasons(engine, "big")
    assert set(reasons.values()) == {EndReason.TENANT_DELETED.value}
    assert len(reasons) == PRIVATE + 5
    books = await derived_counters(engine, owned)
    assert {k: v for k, v in books["tenant:big"].items() if k != "tenant"} == {
        "blocks_in_use": 0,
        "tokens_in_flight": 0,
        "pinned_blocks": 0,
        "queued_requests": 0,
    }
    assert books["tenant:other"] == other_before  # its usage never moves with big's
    assert books["instance:gpu-0"]["queued_requests"] == 0
    assert (await owned.catalog.get_tenant("big")).state is TenantState.DELETED
    # Metering: the shares, pins and CPU-tier bytes of every tenant net out to what it holds.
    assert await metered(engine) == await held(engine)
    await assert_invariants(engine)

    # Finished: calling it again changes nothing.
    before = await snapshot(engine)
    assert await offboarding.delete_tenant("big") == report
    assert await snapshot(engine) == before


async def test_a_crash_between_batches_resumes_where_it_stopped(
    engine: AsyncEngine, owned: HotPath, monkeypatch: pytest.MonkeyPatch
) -> None:
    await offboarded_tenant(engine, owned)
    offboarding = owned_offboarding(engine, owned, reservation_batch=BATCH)
    crash_after_batches(offboarding, monkeypatch, 2)
    with pytest.raises(RuntimeError):
        await offboarding.delete_tenant("big")
    reasons = await end_reasons(engine, "big")
    # The queued one left first, then two whole batches committed.
    assert list(reasons.values()).count(EndReason.TENANT_DELETED.value) == 1 + 2 * BATCH
    await assert_invariants(engine)

    monkeypatch.undo()
    assert await owned_offboarding(engine, owned).resume_all() == 1
    assert set((await end_reasons(engine, "big")).values()) == {EndReason.TENANT_DELETED.value}
    assert (await owned.catalog.get_tenant("big")).state is TenantState.DELETED
    assert await metered(engine) == await held(engine)
    await assert_invariants(engine)
