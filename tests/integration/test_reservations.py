"""Reservations on an instance's owner, journaled to a real PostgreSQL: the reference scenario,
idempotency, leases, refusals."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from quota_service.api.server import HotPath
from quota_service.core.admission import AdmitRequest
from quota_service.core.errors import KvQuotaError
from quota_service.core.model import EndReason, ReservationState, TenantQuota, TenantState
from quota_service.owner.owners import OwnedLedger
from tests.integration.invariants import assert_invariants
from tests.integration.ledger_fixtures import (
    add_instance,
    add_tenant,
    derived_counters,
    request,
    snapshot,
)


@pytest.fixture
async def ledger(engine: AsyncEngine, owned: HotPath) -> OwnedLedger:
    await add_instance(engine)
    await add_tenant(engine, "acme")
    return owned.ledger


async def free_blocks(engine: AsyncEngine, owned: HotPath) -> int:
    return (await derived_counters(engine, owned))["instance:gpu-0"]["free_blocks"]


async def test_reference_scenario(ledger: OwnedLedger, engine: AsyncEngine, owned: HotPath) -> None:
    a, _ = await ledger.admit(request("a", 4096, 2048))
    assert a.reserved_blocks == 384
    assert await free_blocks(engine, owned) == 128

    with pytest.raises(KvQuotaError) as refused:
        await ledger.admit(request("b", 2048, 1024))
    assert refused.value.reason == "INSTANCE_OVERLOADED"
    assert refused.value.metadata["requestedBlocks"] == "192"

    with pytest.raises(KvQuotaError) as too_long:
        await ledger.admit(request("c", 8000, 512))
    assert too_long.value.reason == "CONTEXT_LENGTH_EXCEEDED"

    await ledger.end("acme", "a", EndReason.RELEASED, 2000)
    assert await free_blocks(engine, owned) == 512

    b, _ = await ledger.admit(request("b", 2048, 1024))
    assert b.reserved_blocks == 192
    assert await free_blocks(engine, owned) == 320

    again, _ = await ledger.admit(request("b", 2048, 1024))
    assert again == b
    assert await free_blocks(engine, owned) == 320

    first = await ledger.end("acme", "b", EndReason.RELEASED, 10)
    second = await ledger.end("acme", "b", EndReason.RELEASED, 99)
    assert second == first
    assert second.output_tokens == 10
    assert await free_blocks(engine, owned) == 512
    await assert_invariants(engine)


async def test_ended_reservation_keeps_its_record(ledger: OwnedLedger) -> None:
    await ledger.admit(request("r", 100, 50, n=2))
    ended = await ledger.end("acme", "r", EndReason.RELEASED, 42)
    got = await ledger.get("acme", "r")
    assert got == ended
    assert got.state is ReservationState.ENDED
    assert got.end_reason is EndReason.RELEASED
    assert (got.prompt_tokens, got.max_output_tokens, got.n, got.output_tokens) == (100, 50, 2, 42)
    assert got.reserved_tokens == 300
    assert got.ended_at is not None and got.admitted_at is not None
    assert got.ended_at >= got.admitted_at


async def test_same_request_id_with_other_parameters_is_refused(
    ledger: OwnedLedger, engine: AsyncEngine
) -> None:
    await ledger.admit(request("dup", 100, 50))
    before = await snapshot(engine)
    with pytest.raises(KvQuotaError) as reused:
        await ledger.admit(request("dup", 100, 51))
    assert reused.value.reason == "REQUEST_ID_REUSED"
    assert await snapshot(engine) == before


async def test_same_request_id_with_another_prompt_is_refused(
    ledger: OwnedLedger, engine: AsyncEngine
) -> None:
    """As many tokens is not the same prompt: the first reservation's block table holds the
    first prompt's blocks. The same prompt again is answered with the same reservation."""
    prompt = tuple(range(1, 101))

    def with_prompt(request_id: str, tokens: tuple[int, ...]) -> AdmitRequest:
        return replace(request(request_id, 100, 50), prompt_token_ids=tokens)

    first, _ = await ledger.admit(with_prompt("p", prompt))
    before = await snapshot(engine)
    for other in ((*prompt[:50], 0, *prompt[51:]), ()):
        with pytest.raises(KvQuotaError) as reused:
            await ledger.admit(with_prompt("p", other))
        assert reused.value.reason == "REQUEST_ID_REUSED"
    assert await snapshot(engine) == before
    assert (await ledger.admit(with_prompt("p", prompt)))[0] == first


async def test_cancel_is_idempotent_and_wins_over_a_later_release(ledger: OwnedLedger) -> None:
    await ledger.admit(request("c", 100, 50))
    cancelled = await ledger.end("acme", "c", EndReason.CANCELLED)
    assert cancelled.end_reason is EndReason.CANCELLED
    assert await ledger.end("acme", "c", EndReason.CANCELLED) == cancelled
    assert await ledger.end("acme", "c", EndReason.RELEASED, 5) == cancelled


async def test_refusals_change_nothing(
    ledger: OwnedLedger, engine: AsyncEngine, owned: HotPath
) -> None:
    await owned.catalog.create_tenant("small", "Small", 1, TenantQuota(20, 1000, 1, 1, 1))
    await ledger.admit(request("held", 4096, 2048))
    await ledger.admit(request("small-held", 160, 16, tenant="small"))  # 11 of its 20 blocks
    before = await snapshot(engine)
    refusals = {
        "INVALID_REQUEST": request("bad", 0, 10),
        "CONTEXT_LENGTH_EXCEEDED": request("long", 8000, 512),
        "REQUEST_EXCEEDS_CAPACITY": request("huge", 8000, 100, n=16),
        "INSTANCE_OVERLOADED": request("busy", 2048, 1024),
        "TENANT_QUOTA_EXCEEDED": request("quota", 160, 16, tenant="small"),
        "TENANT_NOT_FOUND": request("ghost", 10, 10, tenant="nobody"),
        "INSTANCE_NOT_FOUND": request("nowhere", 10, 10, instance="gpu-9"),
    }
    for reason, refused in refusals.items():
        with pytest.raises(KvQuotaError) as error:
            await ledger.admit(refused)
        assert error.value.reason == reason
    assert await snapshot(engine) == before


async def test_tenant_quota_on_tokens_in_flight(ledger: OwnedLedger, owned: HotPath) -> None:
    await owned.catalog.create_tenant("tok", "Tok", 1, TenantQuota(1000, 1000, 1, 1, 1))
    await ledger.admit(request("one", 400, 200, tenant="tok"))
    with pytest.raises(KvQuotaError) as error:
        await ledger.admit(request("two", 400, 200, tenant="tok"))
    assert error.value.reason == "TENANT_QUOTA_EXCEEDED"
    assert [v.description for v in error.value.quota_violations] == [
        "tokens in flight: needs 600, 400 left in quota"
    ]
    assert error.value.retry_delay_seconds is not None


async def test_suspended_tenant_and_draining_instance(
    ledger: OwnedLedger, engine: AsyncEngine, owned: HotPath
) -> None:
    store = owned.catalog
    await store.set_tenant_state("acme", TenantState.SUSPENDED)
    before = await snapshot(engine)
    with pytest.raises(KvQuotaError) as suspended:
        await ledger.admit(request("s", 10, 10))
    assert suspended.value.reason == "TENANT_SUSPENDED"
    assert await snapshot(engine) == before
    await store.set_tenant_state("acme", TenantState.ACTIVE)
    await store.drain_instance("gpu-0")
    before = await snapshot(engine)
    with pytest.raises(KvQuotaError) as draining:
        await ledger.admit(request("d", 10, 10))
    assert draining.value.reason == "INSTANCE_DRAINING"
    assert await snapshot(engine) == before


async def test_lease_expiry_is_reaped_and_renewal_refused(
    ledger: OwnedLedger, engine: AsyncEngine
) -> None:
    await ledger.admit(request("short", 100, 100, lease_ttl=1.0))
    await ledger.admit(request("long", 100, 100, lease_ttl=60.0))
    renewed = await ledger.renew("acme", "short", 1.0)
    assert renewed.lease_ttl_seconds == 1.0
    await asyncio.sleep(1.2)
    with pytest.raises(KvQuotaError) as lapsed:
        await ledger.renew("acme", "short", None)
    assert lapsed.value.reason == "LEASE_EXPIRED"
    assert await ledger.reap_expired(1) == 1
    short = await ledger.get("acme", "short")
    assert (short.state, short.end_reason) == (ReservationState.ENDED, EndReason.LEASE_EXPIRED)
    assert (await ledger.get("acme", "long")).state is ReservationState.ADMITTED
    with pytest.raises(KvQuotaError) as expired:
        await ledger.renew("acme", "short", None)
    assert expired.value.reason == "LEASE_EXPIRED"
    # Releasing after the reaper is a no-op that reports how it ended.
    assert (
        await ledger.end("acme", "short", EndReason.RELEASED, 3)
    ).end_reason is EndReason.LEASE_EXPIRED
    await assert_invariants(engine)


async def test_renewing_an_ended_reservation_is_refused(ledger: OwnedLedger) -> None:
    await ledger.admit(request("done", 100, 100))
    await ledger.end("acme", "done", EndReason.RELEASED, 1)
    with pytest.raises(KvQuotaError) as ended:
        await ledger.renew("acme", "done", None)
    assert ended.value.reason == "RESERVATION_ENDED"


async def test_two_transactions_racing_for_the_last_blocks(
    ledger: OwnedLedger, engine: AsyncEngine, owned: HotPath
) -> None:
    await add_tenant(engine, "other")
    await ledger.admit(request("fill", 4096, 2048))  # 128 blocks left
    results = await asyncio.gather(
        ledger.admit(request("x", 1024, 1024)),  # 128 blocks each
        ledger.admit(request("y", 1024, 1024, tenant="other")),
        return_exceptions=True,
    )
    winners = [r for r in results if not isinstance(r, BaseException)]
    losers = [r for r in results if isinstance(r, KvQuotaError)]
    assert len(winners) == 1 and len(losers) == 1
    assert losers[0].reason == "INSTANCE_OVERLOADED"
    assert await free_blocks(engine, owned) == 0
    await assert_invariants(engine)


async def test_concurrent_duplicates_make_one_reservation(
    ledger: OwnedLedger, engine: AsyncEngine, owned: HotPath
) -> None:
    results = await asyncio.gather(*(ledger.admit(request("same", 160, 16)) for _ in range(10)))
    assert len({r for r, _ in results}) == 1
    assert await free_blocks(engine, owned) == 512 - 11
    async with engine.connect() as conn:
        count = await conn.execute(text("SELECT count(*) FROM reservations"))
        assert count.scalar_one() == 1


async def test_many_admits_and_releases_never_over_commit(
    ledger: OwnedLedger, engine: AsyncEngine, owned: HotPath
) -> None:
    await add_tenant(engine, "capped", TenantQuota(200, 10**9, 10, 10, 10))

    async def one(i: int) -> None:
        tenant = "capped" if i % 2 else "acme"
        try:
            await ledger.admit(request(f"r{i}", 100 + i, 60, tenant=tenant))
        except KvQuotaError as error:
            assert error.reason in ("INSTANCE_OVERLOADED", "TENANT_QUOTA_EXCEEDED")
            return
        if i % 3 == 0:
            await ledger.end(tenant, f"r{i}", EndReason.RELEASED, 1)

    await asyncio.gather(*(one(i) for i in range(120)))
    await assert_invariants(engine)
    assert (await derived_counters(engine, owned))["tenant:capped"]["blocks_in_use"] <= 200


async def test_racing_duplicates_at_the_quota_edge_both_get_the_reservation(
    ledger: OwnedLedger, engine: AsyncEngine
) -> None:
    """The loser of two identical Admits must see the winner's reservation (and replay it), not
    the winner's usage (and refuse for quota)."""
    await add_tenant(engine, "edge", TenantQuota(11, 10**6, 1, 1, 1))
    for attempt in range(5):
        same = request(f"dup{attempt}", 160, 16, tenant="edge")  # exactly 11 blocks
        first, second = await asyncio.gather(ledger.admit(same), ledger.admit(same))
        assert first[0] == second[0]
        await ledger.end("edge", f"dup{attempt}", EndReason.RELEASED, 1)
    await assert_invariants(engine)
