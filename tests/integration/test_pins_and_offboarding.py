"""Pins, shared namespaces and offboarding on instances served from their owners' memory."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from quota_service.api.server import HotPath
from quota_service.core.admission import AdmitRequest
from quota_service.core.errors import KvQuotaError
from quota_service.core.model import (
    EndReason,
    PinState,
    ReservationState,
    TenantQuota,
    TenantState,
)
from quota_service.store.offboarding import OffboardingReport
from tests.integration.invariants import assert_invariants
from tests.integration.ledger_fixtures import (
    add_instance,
    add_tenant,
    crash_after_batches,
    derived_counters,
    owned_offboarding,
    request,
    slots,
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


async def states(engine: AsyncEngine, owned: HotPath, ids: list[int]) -> list[str]:
    held = await slots(engine, owned)
    return [held[block][0] for block in sorted(ids)]


async def tenant_counters(engine: AsyncEngine, owned: HotPath, name: str) -> dict[str, int]:
    return (await derived_counters(engine, owned))[f"tenant:{name}"]


async def test_pinned_blocks_survive_eviction_and_count_against_the_pin_budget(
    engine: AsyncEngine, owned: HotPath
) -> None:
    ledger, pins = owned.ledger, owned.pins
    await add_instance(engine, blocks=20)
    await add_tenant(engine, "acme", TenantQuota(1000, 10**6, 1, 6, 1))
    pin = await pins.pin("tenants/acme", "system", "gpu-0", tokens(1, 4, extra=7))
    assert (pin.pinned_blocks, pin.state) == (4, PinState.ACTIVE)
    pinned_ids = [h.block_id for h in pin.blocks]
    assert await states(engine, owned, pinned_ids) == ["PINNED"] * 4
    assert (await tenant_counters(engine, owned, "acme"))["pinned_blocks"] == 4

    # A request on the pinned prompt hits it; afterwards the blocks are pinned again, not cached.
    hit, _ = await ledger.admit(with_tokens("r", tokens(1, 4, extra=7)))
    assert hit.prefix_hit_blocks == 4
    assert await states(engine, owned, pinned_ids) == ["IN_USE"] * 4
    await ledger.end("acme", "r", EndReason.RELEASED, 1)
    assert await states(engine, owned, pinned_ids) == ["PINNED"] * 4

    # Every other slot taken: pinned blocks are not evictable, so 17 blocks cannot fit.
    with pytest.raises(KvQuotaError) as full:
        await ledger.admit(request("big", 17 * BS - 1, 1))
    assert full.value.reason == "INSTANCE_OVERLOADED"
    await ledger.admit(request("fits", 16 * BS - 1, 1))
    assert await states(engine, owned, pinned_ids) == ["PINNED"] * 4

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
    assert await states(engine, owned, pinned_ids) == ["CACHED"] * 4
    assert (await tenant_counters(engine, owned, "acme"))["pinned_blocks"] == 0
    await assert_invariants(engine)


async def test_shared_namespace_shares_prefixes_and_not_usage(
    engine: AsyncEngine, owned: HotPath
) -> None:
    ledger, pins, catalog = owned.ledger, owned.pins, owned.catalog
    await add_instance(engine, blocks=100)
    for tenant in ("a", "b", "c"):
        await add_tenant(engine, tenant)
    await catalog.create_namespace("public")
    for tenant in ("a", "b"):
        await catalog.update_tenant(tenant, {"namespace": "public"})
    system = tokens(7, 6)
    await pins.pin("namespaces/public", "system", "gpu-0", system)

    a, salt_a = await ledger.admit(with_tokens("q", [*system, 1, 2, 3], tenant="a"))
    usage_a = (await tenant_counters(engine, owned, "a"))["blocks_in_use"]
    b, salt_b = await ledger.admit(with_tokens("q", [*system, 1, 2, 3], tenant="b"))
    c, salt_c = await ledger.admit(with_tokens("q", [*system, 1, 2, 3], tenant="c"))
    assert salt_a == salt_b != salt_c
    assert (a.prefix_hit_blocks, b.prefix_hit_blocks, c.prefix_hit_blocks) == (6, 6, 0)
    assert a.block_table[:6] == b.block_table[:6]
    # b joining the shared blocks, and then leaving them, never moves a's count.
    assert (await tenant_counters(engine, owned, "a"))["blocks_in_use"] == usage_a == 7
    await ledger.end("b", "q", EndReason.RELEASED, 1)
    assert (await tenant_counters(engine, owned, "a"))["blocks_in_use"] == usage_a
    await assert_invariants(engine)


async def test_offboarding_ten_thousand_blocks(engine: AsyncEngine, owned: HotPath) -> None:
    ledger, pins, catalog = owned.ledger, owned.pins, owned.catalog
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
    held = (await tenant_counters(engine, owned, "big"))["blocks_in_use"]
    assert held == 5 + 10_000 + 22 + 4

    report = await owned_offboarding(engine, owned).delete_tenant("big")
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
    books = await derived_counters(engine, owned)
    assert (
        books["tenant:big"]["blocks_in_use"] == 0 and books["tenant:big"]["tokens_in_flight"] == 0
    )
    assert (await catalog.get_tenant("big")).state.value == "DELETED"
    still, _ = await ledger.admit(with_tokens("s", shared, tenant="other"))  # a replay
    assert still.state is ReservationState.ADMITTED and still.block_table == theirs.block_table
    assert (
        await states(engine, owned, [h.block_id for h in theirs.block_table[:20]])
        == ["IN_USE"] * 20
    )
    # Left: what "other" uses (20 shared, its tail), the 3 the namespace pins, the block cached
    # under the namespace salt; the 10,007 freed slots, the 5 cached under big's salt
    # among them, are free.
    pool = books["instance:gpu-0"]
    assert (pool["blocks_in_use"], pool["pinned_blocks"], pool["cached_blocks"]) == (21, 3, 1)
    assert pool["free_blocks"] == 10_200 - 25
    # Calling it again changes nothing and gives the same report.
    before = await snapshot(engine)
    assert await owned_offboarding(engine, owned).delete_tenant("big") == report
    assert await snapshot(engine) == before
    await assert_invariants(engine)


async def test_offboarding_resumes_after_a_crash(
    engine: AsyncEngine, owned: HotPath, monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger = owned.ledger
    await add_instance(engine, blocks=200)
    await add_tenant(engine, "gone")
    for i in range(10):
        await ledger.admit(request(f"r{i}", 10 * BS, BS, tenant="gone"))
    offboarding = owned_offboarding(engine, owned, reservation_batch=3)
    crash_after_batches(offboarding, monkeypatch, 2)
    with pytest.raises(RuntimeError):
        await offboarding.delete_tenant("gone")
    await assert_invariants(engine)  # every finished step committed whole
    with pytest.raises(KvQuotaError) as deleting:
        await ledger.admit(request("new", 10, 10, tenant="gone"))
    assert deleting.value.reason == "TENANT_SUSPENDED"
    monkeypatch.undo()
    finished = await owned_offboarding(engine, owned).resume_all()
    assert finished == 1
    report = await owned_offboarding(engine, owned).delete_tenant("gone")
    assert report == OffboardingReport(
        freed_blocks=110,
        shared_blocks=0,
        pinned_by_others=0,
        awaiting_engine_aborts=0,
        finished=True,
    )
    await assert_invariants(engine)


async def test_an_offboarded_tenant_cannot_come_back(
    engine: AsyncEngine, owned: HotPath, monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger, catalog = owned.ledger, owned.catalog
    await add_instance(engine, blocks=50)
    await add_tenant(engine, "gone")
    await add_tenant(engine, "crashed")
    await owned_offboarding(engine, owned).delete_tenant("gone")
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

    crashing = owned_offboarding(engine, owned)
    monkeypatch.setattr(crashing, "_end_batch", crash)
    with pytest.raises(RuntimeError):
        await crashing.delete_tenant("crashed")
    monkeypatch.undo()
    with pytest.raises(KvQuotaError):
        await catalog.set_tenant_state("crashed", TenantState.SUSPENDED)
    assert await owned_offboarding(engine, owned).resume_all() == 1
    assert (await catalog.get_tenant("crashed")).state is TenantState.DELETED


async def test_racing_namespace_pins_with_one_id(engine: AsyncEngine, owned: HotPath) -> None:
    pins, catalog = owned.pins, owned.catalog
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
