"""Pins, shared namespaces and offboarding against the durable block pool."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from quota_service.config import Settings
from quota_service.core.admission import AdmitRequest
from quota_service.core.errors import KvQuotaError
from quota_service.core.model import (
    EndReason,
    PinState,
    ReservationState,
    TenantQuota,
    TenantState,
)
from quota_service.store.catalog import Catalog
from quota_service.store.inspection import Inspection
from quota_service.store.ledger import Ledger
from quota_service.store.offboarding import OffboardingReport
from quota_service.store.pins import Pins
from tests.integration.invariants import assert_invariants
from tests.integration.ledger_fixtures import (
    add_instance,
    add_tenant,
    counters,
    crash_after_batches,
    offboarding_service,
    request,
    snapshot,
)

BS = 16


def tokens(seed: int, blocks: int, extra: int = 0) -> list[int]:
    return [seed * 1_000_000 + i for i in range(blocks * BS + extra)]


# Two output tokens: the first gets a slot in the tail (vLLM never computes the last one's KV).
def with_tokens(
    request_id: str, ids: list[int], tenant: str = "acme", output: int = 2
) -> AdmitRequest:
    return replace(
        request(request_id, len(ids), output, tenant=tenant), prompt_token_ids=tuple(ids)
    )


@pytest.fixture
def stores(engine: AsyncEngine, settings: Settings) -> tuple[Ledger, Pins, Catalog]:
    limits = settings.admission_limits
    return Ledger(engine, limits), Pins(engine, limits), Catalog(engine)


async def states(engine: AsyncEngine, ids: list[int]) -> list[str]:
    async with engine.connect() as conn:
        rows = await conn.execute(
            text(
                "SELECT state FROM blocks WHERE instance = 'gpu-0' AND block_id = ANY(:ids) "
                "ORDER BY block_id"
            ),
            {"ids": ids},
        )
        return [r.state for r in rows]


async def test_pinned_blocks_survive_eviction_and_count_against_the_pin_budget(
    engine: AsyncEngine, stores: tuple[Ledger, Pins, Catalog]
) -> None:
    ledger, pins, _ = stores
    await add_instance(engine, blocks=20)
    await add_tenant(engine, "acme", TenantQuota(1000, 10**6, 1, 6, 1))
    pin = await pins.pin("tenants/acme", "system", "gpu-0", tokens(1, 4, extra=7))
    assert (pin.pinned_blocks, pin.state) == (4, PinState.ACTIVE)
    pinned_ids = [h.block_id for h in pin.blocks]
    assert await states(engine, pinned_ids) == ["PINNED"] * 4
    assert (await counters(engine))["tenant:acme"]["pinned_blocks"] == 4

    # A request on the pinned prompt hits it; afterwards the blocks are pinned again, not cached.
    hit, _ = await ledger.admit(with_tokens("r", tokens(1, 4, extra=7)))
    assert hit.prefix_hit_blocks == 4
    assert await states(engine, pinned_ids) == ["IN_USE"] * 4
    await ledger.end("acme", "r", EndReason.RELEASED, 1)
    assert await states(engine, pinned_ids) == ["PINNED"] * 4

    # Every other slot taken: pinned blocks are not evictable, so 17 blocks cannot fit.
    with pytest.raises(KvQuotaError) as full:
        await ledger.admit(request("big", 17 * BS - 1, 1))
    assert full.value.reason == "INSTANCE_OVERLOADED"
    await ledger.admit(request("fits", 16 * BS - 1, 1))
    assert await states(engine, pinned_ids) == ["PINNED"] * 4

    # The same pin again is the same pin; another prefix under its id is refused; over budget too.
    assert (await pins.pin("tenants/acme", "system", "gpu-0", tokens(1, 4, extra=7))) == pin
    before = await snapshot(engine)
    with pytest.raises(KvQuotaError) as reused:
        await pins.pin("tenants/acme", "system", "gpu-0", tokens(2, 4))
    assert reused.value.reason == "PIN_ID_REUSED"
    assert await snapshot(engine) == before
    await ledger.end("acme", "fits", EndReason.RELEASED, 1)
    before = await snapshot(engine)
    with pytest.raises(KvQuotaError) as over:
        await pins.pin("tenants/acme", "more", "gpu-0", tokens(3, 3))
    assert over.value.reason == "TENANT_QUOTA_EXCEEDED"
    assert await snapshot(engine) == before

    removed = await pins.unpin("tenants/acme", "system")
    assert (removed.state, removed.blocks) == (PinState.REMOVED, ())
    assert await pins.unpin("tenants/acme", "system") == removed
    assert await states(engine, pinned_ids) == ["CACHED"] * 4
    assert (await counters(engine))["tenant:acme"]["pinned_blocks"] == 0
    await assert_invariants(engine)


async def test_shared_namespace_shares_prefixes_and_not_usage(
    engine: AsyncEngine, stores: tuple[Ledger, Pins, Catalog]
) -> None:
    ledger, pins, catalog = stores
    await add_instance(engine, blocks=100)
    for tenant in ("a", "b", "c"):
        await add_tenant(engine, tenant)
    await catalog.create_namespace("public")
    for tenant in ("a", "b"):
        await catalog.update_tenant(tenant, {"namespace": "public"})
    system = tokens(7, 6)
    await pins.pin("namespaces/public", "system", "gpu-0", system)

    a, salt_a = await ledger.admit(with_tokens("q", [*system, 1, 2, 3], tenant="a"))
    usage_a = (await counters(engine))["tenant:a"]["blocks_in_use"]
    b, salt_b = await ledger.admit(with_tokens("q", [*system, 1, 2, 3], tenant="b"))
    c, salt_c = await ledger.admit(with_tokens("q", [*system, 1, 2, 3], tenant="c"))
    assert salt_a == salt_b != salt_c
    assert (a.prefix_hit_blocks, b.prefix_hit_blocks, c.prefix_hit_blocks) == (6, 6, 0)
    assert a.block_table[:6] == b.block_table[:6]
    # b joining the shared blocks, and then leaving them, never moves a's count.
    assert (await counters(engine))["tenant:a"]["blocks_in_use"] == usage_a == 7
    await ledger.end("b", "q", EndReason.RELEASED, 1)
    assert (await counters(engine))["tenant:a"]["blocks_in_use"] == usage_a
    await assert_invariants(engine)


async def test_offboarding_ten_thousand_blocks(
    engine: AsyncEngine, stores: tuple[Ledger, Pins, Catalog]
) -> None:
    ledger, pins, catalog = stores
    await add_instance(engine, blocks=10_200)
    await add_tenant(engine, "big")
    await add_tenant(engine, "other")
    # Under its own salt: a pin (5 blocks) and 100 private requests of 100 blocks.
    await pins.pin("tenants/big", "own", "gpu-0", tokens(1, 5))
    for i in range(100):
        await ledger.admit(request(f"p{i}", 99 * BS, BS, tenant="big"))
    # In a namespace with another tenant: 20 blocks shared with it, 1 block of its own hashed
    # under the namespace salt, and 3 blocks the namespace pins.
    await catalog.create_namespace("pub")
    for tenant in ("big", "other"):
        await catalog.update_tenant(tenant, {"namespace": "pub"})
    await pins.pin("namespaces/pub", "system", "gpu-0", tokens(2, 3))
    shared = tokens(3, 20)
    theirs, _ = await ledger.admit(with_tokens("s", shared, tenant="other"))
    await ledger.admit(with_tokens("s", shared + tokens(4, 1), tenant="big"))  # 20 + 1 + tail
    await ledger.admit(with_tokens("r", [*tokens(2, 3), 1], tenant="big"))  # 3 pinned + tail
    held = (await counters(engine))["tenant:big"]["blocks_in_use"]
    assert held == 5 + 10_000 + 22 + 4

    report = await offboarding_service(engine, ledger, pins).delete_tenant("big")
    # Freed: the pin, the private requests and the two tails. Kept: the 20 blocks "other" uses,
    # the namespace-hashed block (cached for the namespace), the 3 the namespace pins.
    assert report == OffboardingReport(
        freed_blocks=5 + 10_000 + 2,
        shared_blocks=24,
        pinned_by_others=3,
        awaiting_engine_aborts=0,
        finished=True,
    )
    assert report.freed_blocks + report.shared_blocks == held
    books = await counters(engine)
    assert (
        books["tenant:big"]["blocks_in_use"] == 0 and books["tenant:big"]["tokens_in_flight"] == 0
    )
    assert (await catalog.get_tenant("big")).state.value == "DELETED"
    still, _ = await ledger.admit(with_tokens("s", shared, tenant="other"))  # a replay
    assert still.state is ReservationState.ADMITTED and still.block_table == theirs.block_table
    assert await states(engine, [h.block_id for h in theirs.block_table[:20]]) == ["IN_USE"] * 20
    async with engine.connect() as conn:
        rows = await conn.execute(text("SELECT reason, count(*) FROM tombstones GROUP BY 1"))
        reasons: dict[str, int] = {reason: count for reason, count in rows.all()}
    assert reasons == {"FREED": 10_002, "OFFBOARDED": 5}
    # Calling it again changes nothing and gives the same report.
    before = await snapshot(engine)
    assert await offboarding_service(engine, ledger, pins).delete_tenant("big") == report
    assert await snapshot(engine) == before
    await assert_invariants(engine)


async def test_offboarding_resumes_after_a_crash(
    engine: AsyncEngine, stores: tuple[Ledger, Pins, Catalog], monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger, pins, _ = stores
    await add_instance(engine, blocks=200)
    await add_tenant(engine, "gone")
    for i in range(10):
        await ledger.admit(request(f"r{i}", 10 * BS, BS, tenant="gone"))
    offboarding = offboarding_service(engine, ledger, pins, reservation_batch=3)
    crash_after_batches(offboarding, monkeypatch, 2)
    with pytest.raises(RuntimeError):
        await offboarding.delete_tenant("gone")
    await assert_invariants(engine)  # every finished step committed whole
    with pytest.raises(KvQuotaError) as deleting:
        await ledger.admit(request("new", 10, 10, tenant="gone"))
    assert deleting.value.reason == "TENANT_SUSPENDED"
    monkeypatch.undo()
    finished = await offboarding_service(engine, ledger, pins).resume_all()
    assert finished == 1
    report = await offboarding_service(engine, ledger, pins).delete_tenant("gone")
    assert report == OffboardingReport(
        freed_blocks=110,
        shared_blocks=0,
        pinned_by_others=0,
        awaiting_engine_aborts=0,
        finished=True,
    )
    await assert_invariants(engine)


async def test_tombstones_are_purged_after_retention(
    engine: AsyncEngine, stores: tuple[Ledger, Pins, Catalog]
) -> None:
    ledger, _, _ = stores
    await add_instance(engine, blocks=20)
    await add_tenant(engine, "acme")
    await ledger.admit(request("r", 10, 10))
    await ledger.end("acme", "r", EndReason.RELEASED, 1)
    inspection = Inspection(engine)
    assert await inspection.purge_tombstones(3600, 100) == 0
    assert await inspection.purge_tombstones(0, 100) == 2


async def test_an_offboarded_tenant_cannot_come_back(
    engine: AsyncEngine, stores: tuple[Ledger, Pins, Catalog], monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger, pins, catalog = stores
    await add_instance(engine, blocks=50)
    await add_tenant(engine, "gone")
    await add_tenant(engine, "crashed")
    await offboarding_service(engine, ledger, pins).delete_tenant("gone")
    for change in (
        catalog.set_tenant_state("gone", TenantState.ACTIVE),
        catalog.update_tenant("gone", {"weight": 2}),
    ):
        with pytest.raises(KvQuotaError) as refused:
            await change
        assert refused.value.reason == "TENANT_OFFBOARDED"
    # An offboarding that crashed stays DELETING: suspending it cannot derail the resumption.
    await ledger.admit(request("r", 10, 10, tenant="crashed"))

    async def crash(*args: object, **kwargs: object) -> object:
        raise RuntimeError("process killed")

    crashing = offboarding_service(engine, ledger, pins)
    monkeypatch.setattr(crashing, "_end_batch", crash)
    with pytest.raises(RuntimeError):
        await crashing.delete_tenant("crashed")
    monkeypatch.undo()
    with pytest.raises(KvQuotaError):
        await catalog.set_tenant_state("crashed", TenantState.SUSPENDED)
    assert await offboarding_service(engine, ledger, pins).resume_all() == 1
    assert (await catalog.get_tenant("crashed")).state is TenantState.DELETED


async def test_racing_namespace_pins_with_one_id(
    engine: AsyncEngine, stores: tuple[Ledger, Pins, Catalog]
) -> None:
    _, pins, catalog = stores
    await add_instance(engine, blocks=20)
    await add_instance(engine, "gpu-1", blocks=20)
    await catalog.create_namespace("pub")
    results = await asyncio.gather(
        pins.pin("namespaces/pub", "system", "gpu-0", tokens(1, 2)),
        pins.pin("namespaces/pub", "system", "gpu-1", tokens(1, 2)),
        return_exceptions=True,
    )
    refused = [r for r in results if isinstance(r, BaseException)]
    assert len(refused) == 1
    assert isinstance(refused[0], KvQuotaError) and refused[0].reason == "PIN_ID_REUSED"
    await assert_invariants(engine)
