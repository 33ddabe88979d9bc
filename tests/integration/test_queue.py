"""The wait queue of an instance's owner, journaled to PostgreSQL: queueing, dispatch order,
bounds, fairness, starvation, cancellation and deadlines."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import replace

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from quota_service.api.server import HotPath
from quota_service.config import Settings
from quota_service.core import catalog
from quota_service.core.admission import AdmitRequest
from quota_service.core.errors import KvQuotaError
from quota_service.core.model import EndReason, QueueBounds, ReservationState, TenantQuota
from tests.integration.invariants import assert_invariants
from tests.integration.ledger_fixtures import (
    UNLIMITED,
    add_tenant,
    derived_counters,
    request,
    snapshot,
)

BS = 16


def waiting(
    request_id: str, blocks: int, tenant: str = "acme", wait: float = 60.0, priority: int = 0
) -> AdmitRequest:
    """A private request of exactly `blocks` blocks that will wait `wait` seconds."""
    base = request(request_id, blocks * BS - 1, 1, tenant=tenant)
    return replace(base, params=replace(base.params, priority=priority), wait_timeout_seconds=wait)


async def add_instance(
    owned: HotPath, blocks: int, bounds: QueueBounds | None = None, name: str = "gpu-0"
) -> None:
    spec = catalog.instance_spec(name, "m", None, BS, 8192, None, blocks, queue=bounds)
    await owned.catalog.register_instance(spec)


@pytest.fixture
def settings(settings: Settings, request: pytest.FixtureRequest) -> Settings:
    """How long a request that does not fit may be passed: 5 s, or what the test gives with
    `@pytest.mark.parametrize("settings", [seconds], indirect=True)`."""
    return replace(settings, max_bypass_wait_seconds=getattr(request, "param", 5.0))


async def test_queue_then_dispatch_in_order(engine: AsyncEngine, owned: HotPath) -> None:
    await add_instance(owned, 10)
    await add_tenant(engine, "acme")
    ledger = owned.ledger
    first, _ = await ledger.admit(waiting("a", 8))
    assert first.state is ReservationState.ADMITTED
    queued = [(await ledger.admit(waiting(f"q{i}", 4)))[0] for i in range(3)]
    assert [q.state for q in queued] == [ReservationState.QUEUED] * 3
    assert [q.queue_position for q in queued] == [0, 1, 2]
    assert (await derived_counters(engine, owned))["instance:gpu-0"]["blocks_in_use"] == 8
    await assert_invariants(engine)

    # A retry keeps its place; other parameters under its id are refused.
    again, _ = await ledger.admit(waiting("q1", 4))
    assert (again.state, again.queue_position) == (ReservationState.QUEUED, 1)
    with_prompt = replace(waiting("q1", 4), prompt_token_ids=(1,) * (4 * BS - 1))
    for other in (waiting("q1", 5), with_prompt):
        with pytest.raises(KvQuotaError) as reused:
            await ledger.admit(other)
        assert reused.value.reason == "REQUEST_ID_REUSED"
    # Without a wait budget nobody jumps the queue, even a request that would fit; the refusal
    # says so (the instance has room, three requests go first) rather than "no free blocks".
    with pytest.raises(KvQuotaError) as no_jump:
        await ledger.admit(request("small", 10, 5))
    assert no_jump.value.reason == "INSTANCE_OVERLOADED"
    assert (no_jump.value.metadata["freeBlocks"], no_jump.value.metadata["queuedAhead"]) == (
        "2",
        "3",
    )
    assert "3 queued requests go first" in no_jump.value.message

    # The release dispatches the queue in its own step: q0 and q1 fit in the 10 blocks, q2
    # waits, and a dispatch after it finds nothing more to admit.
    await ledger.end("acme", "a", EndReason.RELEASED, 1)
    assert await ledger.dispatch("gpu-0") == 0
    states = [(await ledger.get("acme", f"q{i}")).state for i in range(3)]
    assert states == [ReservationState.ADMITTED, ReservationState.ADMITTED, ReservationState.QUEUED]
    assert (await ledger.get("acme", "q2")).queue_position == 0
    await assert_invariants(engine)


async def test_bounds_give_queue_full(engine: AsyncEngine, owned: HotPath) -> None:
    # Two queued requests at most, and a TTFT guard of 1 s x 100 tokens/s = 100 prompt tokens.
    bounds = QueueBounds(
        max_queued_requests=2, target_ttft_seconds=1, prefill_tokens_per_second=100
    )
    await add_instance(owned, 16, bounds)
    await add_tenant(engine, "acme")
    await add_tenant(engine, "small", TenantQuota(1000, 10**6, 1, 1, 1))
    ledger = owned.ledger
    await ledger.admit(waiting("fill", 16))
    await ledger.admit(waiting("q0", 4))  # 63 prompt tokens queued

    async def queue_full(refused: AdmitRequest, why: str) -> None:
        before = await snapshot(engine)
        with pytest.raises(KvQuotaError) as full:
            await ledger.admit(refused)
        assert (full.value.reason, full.value.code.name) == ("QUEUE_FULL", "UNAVAILABLE")
        assert why in full.value.message
        assert full.value.retry_delay_seconds is not None
        assert await snapshot(engine) == before

    await queue_full(waiting("long", 4), "TTFT guard")  # 63 + 63 > 100
    await ledger.admit(waiting("s0", 2, tenant="small"))  # 63 + 31 = 94 tokens, 2 queued
    await queue_full(waiting("q1", 1), "its limit")  # a third
    await ledger.end("acme", "q0", EndReason.CANCELLED)
    await queue_full(waiting("s1", 1, tenant="small"), "tenant small")  # its one place is taken
    await assert_invariants(engine)


async def test_cancel_and_deadline_free_the_queue(engine: AsyncEngine, owned: HotPath) -> None:
    await add_instance(owned, 4)
    await add_tenant(engine, "acme")
    ledger = owned.ledger
    await ledger.admit(waiting("fill", 4))
    await ledger.admit(waiting("c", 4))
    await ledger.admit(waiting("t", 4, wait=0.5))
    cancelled = await ledger.end("acme", "c", EndReason.CANCELLED)
    assert (cancelled.state, cancelled.end_reason) == (ReservationState.ENDED, EndReason.CANCELLED)
    assert await ledger.end("acme", "c", EndReason.CANCELLED) == cancelled
    await asyncio.sleep(0.6)
    assert await ledger.reap_expired(10) == 1
    timed_out = await ledger.get("acme", "t")
    assert timed_out.end_reason is EndReason.QUEUE_TIMEOUT
    assert (await derived_counters(engine, owned))["instance:gpu-0"]["queued_requests"] == 0
    await assert_invariants(engine)


async def test_weighted_fair_share(engine: AsyncEngine, owned: HotPath) -> None:
    """Weights 1 and 3 flooding one instance, one tenant with short requests, the other with long
    ones: of the tokens the served queue admits over 60 admissions, the weight-3 tenant gets
    three times the other's, within 10%. tests/unit/test_fair_share.py drives the same loop
    for 600 admissions, in every shape, on the state machine that shares the queue's rules."""
    await add_instance(owned, 48)
    await owned.catalog.create_tenant("light", "Light", 1, TenantQuota(10**6, 10**9, 10**4, 1, 1))
    await owned.catalog.create_tenant("heavy", "Heavy", 3, TenantQuota(10**6, 10**9, 10**4, 1, 1))
    ledger = owned.ledger
    sizes = {"light": 2, "heavy": 6}  # short against long requests
    sent = 0
    seen: set[tuple[str, str]] = set()
    # The requests admitted on arrival while the instance filled up are no part of the share.
    from_queue = 0
    tokens = Counter[str]()
    read_state = text(
        "SELECT tenant, request_id, state, reserved_tokens, queued_at IS NOT NULL AS waited "
        "FROM reservations WHERE state IN ('QUEUED', 'ADMITTED') ORDER BY admitted_at NULLS LAST"
    )
    while from_queue < 60:
        async with engine.connect() as conn:
            rows = (await conn.execute(read_state)).all()
        queued = Counter(row.tenant for row in rows if row.state == "QUEUED")
        for tenant, blocks in sizes.items():  # keep both tenants backlogged
            for _ in range(12 - queued[tenant]):
                sent += 1
                await ledger.admit(waiting(f"r{sent}", blocks, tenant=tenant))
        async with engine.connect() as conn:
            rows = (await conn.execute(read_state)).all()
        admitted = [row for row in rows if row.state == "ADMITTED"]
        for row in admitted:
            if (row.tenant, row.request_id) not in seen:
                seen.add((row.tenant, row.request_id))
                if row.waited:
                    from_queue += 1
                    tokens[row.tenant] += row.reserved_tokens
        await ledger.end(admitted[0].tenant, admitted[0].request_id, EndReason.RELEASED, 1)
        await ledger.dispatch("gpu-0")
    ratio = tokens["heavy"] / tokens["light"]
    assert 3 * 0.9 <= ratio <= 3 * 1.1, (ratio, tokens)
    await assert_invariants(engine)


@pytest.mark.parametrize("settings", [0.5], indirect=True)
async def test_a_big_request_is_not_starved(engine: AsyncEngine, owned: HotPath) -> None:
    """Half the instance, for one tenant, behind a stream of small requests of another: the small
    ones may pass it only until it has waited max_bypass_wait, then it is admitted within one
    release cycle."""
    await add_instance(owned, 20)
    await add_tenant(engine, "acme")
    await owned.catalog.create_tenant("other", "Other", 100, TenantQuota(10**6, 10**9, 10**4, 1, 1))
    ledger = owned.ledger
    for i in range(10):
        await ledger.admit(waiting(f"s{i}", 2, tenant="other"))
    big, _ = await ledger.admit(waiting("big", 10))
    assert big.state is ReservationState.QUEUED
    started = time.monotonic()
    n = 10
    passed = 0
    while (await ledger.get("acme", "big")).state is ReservationState.QUEUED:
        assert time.monotonic() - started < 5, "the big request starved"
        async with engine.connect() as conn:
            rows = await conn.execute(
                text(
                    "SELECT request_id FROM reservations WHERE tenant = 'other' "
                    "AND state = 'ADMITTED' ORDER BY admitted_at"
                )
            )
            live = [r[0] for r in rows]
        await ledger.end("other", live[0], EndReason.RELEASED, 1)
        n += 1
        small, _ = await ledger.admit(waiting(f"s{n}", 2, tenant="other"))
        passed += small.state is ReservationState.ADMITTED
        await ledger.dispatch("gpu-0")
        await asyncio.sleep(0.05)
    assert passed > 0  # small ones did pass it for a while...
    # ...but none once it had waited max_bypass_wait: from then on capacity was held for it, so
    # it was admitted as soon as the releases made room.
    async with engine.connect() as conn:
        late = await conn.execute(
            text(
                "SELECT count(*) FROM reservations s, reservations b "
                "WHERE b.request_id = 'big' AND s.tenant = 'other' "
                "AND s.admitted_at > b.queued_at + interval '0.5 seconds' "
                "AND s.admitted_at < b.admitted_at"
            )
        )
        assert late.scalar_one() == 0
    await assert_invariants(engine)


async def test_retry_delays_grow_with_the_queue_and_shrink_near_lease_expiry(
    engine: AsyncEngine, owned: HotPath
) -> None:
    await add_instance(owned, 8)
    await add_tenant(engine, "acme")
    ledger = owned.ledger
    # Observe a holding time so Little's law has a service time to work with.
    await ledger.admit(waiting("warm", 1))
    await asyncio.sleep(0.2)
    await ledger.end("acme", "warm", EndReason.RELEASED, 1)
    await ledger.admit(replace(waiting("hold", 8), lease_ttl_seconds=30.0))

    async def refused_delay() -> float:
        with pytest.raises(KvQuotaError) as refused:
            await ledger.admit(request("probe", 10, 5))
        assert refused.value.retry_delay_seconds is not None
        return refused.value.retry_delay_seconds

    delays = []
    for depth in range(4):
        delays.append(await refused_delay())
        await ledger.admit(waiting(f"q{depth}", 8))
    assert delays == sorted(delays) and delays[-1] > delays[0], delays

    # Shrinks as leases near their expiry: with nothing observed, the lease bounds the wait.
    await owned.catalog.create_tenant("fresh", "Fresh", 1, UNLIMITED)
    await add_instance(owned, 4, name="gpu-1")
    await ledger.admit(
        replace(
            request("lease", 4 * BS - 1, 1, tenant="fresh", instance="gpu-1"), lease_ttl_seconds=3.0
        )
    )
    early = await probe_instance(owned, "gpu-1")
    await asyncio.sleep(1.0)
    late = await probe_instance(owned, "gpu-1")
    assert late < early <= 3.0


async def probe_instance(owned: HotPath, instance: str) -> float:
    with pytest.raises(KvQuotaError) as refused:
        await owned.ledger.admit(request("probe", 10, 5, tenant="fresh", instance=instance))
    assert refused.value.retry_delay_seconds is not None
    return refused.value.retry_delay_seconds
