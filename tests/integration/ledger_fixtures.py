"""Building blocks shared by the integration tests: a small instance, tenants, admit requests,
and reads of every counter: as the record derives them (and the owners' memory holds them) on
the memory hot path, or straight from the per-block ledger's columns."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from quota_service.api.server import HotPath
from quota_service.core import catalog
from quota_service.core.admission import AdmitRequest
from quota_service.core.model import AdmitParams, TenantQuota
from quota_service.enforcement.termination import Termination
from quota_service.owner.owned_offboarding import OwnedOffboarding
from quota_service.owner.owners import OwnedLedger
from quota_service.store.catalog import Catalog
from quota_service.store.offboarding import RESERVATION_BATCH

UNLIMITED = TenantQuota(10**9, 10**12, 1000, 1000, 10**12)


async def add_instance(
    engine: AsyncEngine,
    name: str = "gpu-0",
    blocks: int = 512,
    block_size: int = 16,
    cap: int = 8192,
) -> None:
    spec = catalog.instance_spec(name, "test-model", None, block_size, cap, None, blocks)
    await Catalog(engine).register_instance(spec)


async def add_tenant(engine: AsyncEngine, name: str, quota: TenantQuota = UNLIMITED) -> None:
    await Catalog(engine).create_tenant(name, name.title(), 1, quota)


def request(
    request_id: str,
    prompt: int,
    output: int,
    tenant: str = "acme",
    instance: str = "gpu-0",
    n: int = 1,
    lease_ttl: float | None = None,
) -> AdmitRequest:
    return AdmitRequest(
        params=AdmitParams(tenant, request_id, instance, prompt, output, n, 0),
        prompt_token_ids=(),
        wait_timeout_seconds=0.0,
        lease_ttl_seconds=lease_ttl,
    )


async def counters(engine: AsyncEngine) -> dict[str, dict[str, int]]:
    """Instance and tenant counters as the per-block ledger stores them: "instance:<name>" and
    "tenant:<name>" map to their columns."""
    found: dict[str, dict[str, int]] = {}
    async with engine.connect() as conn:
        for row in await conn.execute(
            text(
                "SELECT instance, free_blocks, cached_blocks, blocks_in_use, pinned_blocks, "
                "queued_requests, queued_prompt_tokens FROM instance_pool_counters"
            )
        ):
            found[f"instance:{row.instance}"] = dict(row._mapping)
        for row in await conn.execute(
            text(
                "SELECT tenant, blocks_in_use, tokens_in_flight, pinned_blocks, queued_requests "
                "FROM tenants"
            )
        ):
            found[f"tenant:{row.tenant}"] = dict(row._mapping)
        count = await conn.execute(text("SELECT count(*) FROM reservations"))
        found["reservations"] = {"count": count.scalar_one()}
    return found


# The counters the record derives (migration 0021's views), in the shape `counters` returns;
# queued requests are reservation rows.
_DERIVED_INSTANCES = text(
    "SELECT p.instance, p.free_blocks, p.cached_blocks, p.blocks_in_use, p.pinned_blocks, "
    "count(r.request_id) AS queued_requests, "
    "coalesce(sum(r.prompt_tokens), 0)::bigint AS queued_prompt_tokens "
    "FROM journal_pool_counts p "
    "LEFT JOIN reservations r ON r.instance = p.instance AND r.state = 'QUEUED' "
    "GROUP BY p.instance, p.free_blocks, p.cached_blocks, p.blocks_in_use, p.pinned_blocks"
)
_DERIVED_TENANTS = text(
    "SELECT t.tenant, coalesce(h.blocks_in_use, 0)::bigint AS blocks_in_use, "
    "coalesce(h.tokens_in_flight, 0)::bigint AS tokens_in_flight, "
    "coalesce(h.pinned_blocks, 0)::bigint AS pinned_blocks, "
    "(SELECT count(*) FROM reservations r WHERE r.tenant = t.tenant AND r.state = 'QUEUED') "
    "AS queued_requests "
    "FROM tenants t LEFT JOIN ("
    "SELECT tenant, sum(blocks_in_use) AS blocks_in_use, "
    "sum(tokens_in_flight) AS tokens_in_flight, sum(pinned_blocks) AS pinned_blocks "
    "FROM journal_tenant_holdings GROUP BY tenant) AS h ON h.tenant = t.tenant"
)
_DERIVED_HOLDINGS = text(
    "SELECT tenant, instance, blocks_in_use, tokens_in_flight, pinned_blocks "
    "FROM journal_tenant_holdings"
)


async def derived_counters(
    engine: AsyncEngine, hot: HotPath | None = None
) -> dict[str, dict[str, int]]:
    """Instance and tenant counters as the record derives them, keyed as `counters` keys them.
    With `hot`, each machine its owners serve must hold the same (invariant 8): its pool, its
    queue and each tenant's holdings on it; only while no operation is being applied (a
    machine runs ahead of the record until its batch commits)."""
    found: dict[str, dict[str, int]] = {}
    async with engine.connect() as conn:
        for row in await conn.execute(_DERIVED_INSTANCES):
            found[f"instance:{row.instance}"] = dict(row._mapping)
        for row in await conn.execute(_DERIVED_TENANTS):
            found[f"tenant:{row.tenant}"] = dict(row._mapping)
        holdings = {
            (row.tenant, row.instance): (row.blocks_in_use, row.tokens_in_flight, row.pinned_blocks)
            for row in await conn.execute(_DERIVED_HOLDINGS)
        }
        count = await conn.execute(text("SELECT count(*) FROM reservations"))
        found["reservations"] = {"count": count.scalar_one()}
    for owner in hot.owners.served() if hot is not None else ():
        machine, recorded = owner.machine, found[f"instance:{owner.instance}"]
        pool = machine.pool.counts()
        in_memory = {
            "instance": owner.instance,
            "free_blocks": pool["FREE"],
            "cached_blocks": pool["CACHED"],
            "blocks_in_use": pool["IN_USE"],
            "pinned_blocks": pool["PINNED"],
            "queued_requests": machine.queue_length,
            "queued_prompt_tokens": machine.queued_prompt_tokens,
        }
        assert in_memory == recorded, f"{owner.instance}: memory {in_memory}, record {recorded}"
        for name, here in machine.tenants.items():
            held = (here.blocks, here.tokens, len(here.pinned))
            assert held == holdings.get((name, owner.instance), (0, 0, 0)), (name, owner.instance)
    return found


_RECORDED_SLOTS = text(
    "SELECT block_id, state, ref_count, generation FROM journal_slots WHERE instance = :instance"
)


async def slots(
    engine: AsyncEngine, hot: HotPath, instance: str = "gpu-0"
) -> dict[int, tuple[str, int, int]]:
    """Every slot of an instance served here, block_id → (state, references, generation), from
    its owner's memory; the record's view says the same of every slot that holds anything."""
    pool = (await hot.owners.owner(instance)).machine.pool
    held = {b: (pool.state(b), pool.ref_count(b), pool.generation(b)) for b in range(pool.capacity)}
    async with engine.connect() as conn:
        rows = await conn.execute(_RECORDED_SLOTS, {"instance": instance})
        recorded = {r.block_id: (r.state, r.ref_count, r.generation) for r in rows}
    assert recorded == {b: slot for b, slot in held.items() if slot[0] != "FREE"}
    return held


# Each table's rows as text, in one round trip: the fuzz test reads this around every call. The
# views show what the journal records of the pools.
SNAPSHOT_TABLES = (
    "tenants",
    "instances",
    "reservations",
    "pins",
    "journal_slots",
    "journal_tenant_holdings",
)
_SNAPSHOT = text(
    "SELECT "
    + ", ".join(f"ARRAY(SELECT row::text FROM {t} AS row ORDER BY 1)" for t in SNAPSHOT_TABLES)
)


async def snapshot(engine: AsyncEngine) -> tuple[object, ...]:
    """Every row of the record, to show that a refused request changed nothing."""
    async with engine.connect() as conn:
        return tuple((await conn.execute(_SNAPSHOT)).one())


def termination(ledger: OwnedLedger) -> Termination:
    """Engine aborts as the server makes them (the instances these tests register have no
    engine, so nothing is aborted)."""
    return Termination(ledger, abort_timeout_seconds=1.0, hard_timeout_seconds=5.0)


def owned_offboarding(
    engine: AsyncEngine, hot: HotPath, reservation_batch: int = RESERVATION_BATCH
) -> OwnedOffboarding:
    """Offboarding on the memory hot path, as the server builds it, ending reservations
    `reservation_batch` at a time (a test that crashes between batches makes them small)."""
    return hot.offboarding(engine, termination(hot.ledger), reservation_batch)


def crash_after_batches(
    offboarding: OwnedOffboarding, monkeypatch: pytest.MonkeyPatch, batches: int
) -> None:
    """Make the offboarding's process die once `batches` batches of reservations committed."""
    real_batch = offboarding._end_batch
    started = 0

    async def crashing_batch(instance: str, tenant: str, request_ids: Sequence[str]) -> None:
        nonlocal started
        started += 1
        if started > batches:
            raise RuntimeError("process killed")
        await real_batch(instance, tenant, request_ids)

    monkeypatch.setattr(offboarding, "_end_batch", crashing_batch)
