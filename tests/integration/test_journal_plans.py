"""A batch must read and write only what is its own tenants', however many tenants the fleet
has. How PostgreSQL runs a batch's statements as the journal prepares them: joined with the
batch's JSON rows alone (which PostgreSQL estimates at 100), the tenants' rows were read whole
in every batch (with 3,000 tenants, a one-operation batch cost twice its CPU); and planned
again for every batch, unless the journal's connections keep to the generic plans.
And what a batch writes: every tenant's fair clocks were kept in the owner's one row, which each
batch read and wrote whole (with 3,000 tenants served once, 13 ms of CPU instead of 1)."""

from __future__ import annotations

from typing import Any

import psycopg
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from quota_service.config import Settings
from quota_service.core.model import EndReason
from quota_service.core.queueing import QueuePolicy
from quota_service.owner.instance_owner import InstanceOwner, take_over
from quota_service.store.catalog import Catalog
from quota_service.store.journal import BatchRows, Journal, _Batch, transaction_statements
from tests.integration.ledger_fixtures import add_instance, add_tenant, request
from tests.unit.machine_fixtures import assert_same_machine

TENANTS = 5_000


async def test_a_batch_moves_its_tenants_totals_by_their_key(
    database_url: str, engine: AsyncEngine
) -> None:
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await conn.execute(
            "INSERT INTO tenants (tenant, max_blocks, max_tokens_in_flight, max_queued_requests, "
            "max_pinned_blocks, max_cpu_tier_bytes, cache_salt) "
            "SELECT 't' || g, 1000, 1000, 0, 0, 0, 's' FROM generate_series(1, %s) g",
            (TENANTS,),
        )
        await conn.execute("ANALYZE tenants")
    moved = {"blocks": 96, "tokens": 1536, "pinned": 0, "queued": 0}
    clocks = {"last_finish": {"0": 1.5}, "mean_hold": 0.2}
    rows = BatchRows(
        totals=[
            {"instance": "gpu-0", "tenant": tenant, **moved, **clocks} for tenant in ("t1", "t2")
        ],
    )
    # The journal's own write connection: it runs the plans PostgreSQL makes once per statement
    # (a custom plan per batch would cost a planning per batch).
    journal = Journal(engine)
    writer = await journal._connected()
    conn = writer.connection
    assert (await (await conn.execute("SHOW plan_cache_mode")).fetchone()) == (
        "force_generic_plan",
    )
    plans = []
    batch = _Batch("gpu-0", 1, rows)
    for sql, params in transaction_statements([batch])[len(batch.statements()) :]:
        for prepare in writer.prepare([sql]):
            await conn.execute(prepare)
        execute = writer.bound(sql, params)
        cursor = await conn.execute(f"EXPLAIN {execute}")
        plans.append("\n".join(str(line) for (line,) in await cursor.fetchall()))
    await journal.close()
    # One statement locks the tenants' rows in order, before it moves their totals (a one-time
    # filter on the lock's count), each by key.
    [plan] = plans
    assert plan.count("Index Cond: ((tenant)::text = ANY") == 2, plan
    assert "Seq Scan on tenants" not in plan, plan
    assert plan.index("LockRows") < plan.index("One-Time Filter"), plan


class RecordingJournal(Journal):
    """A journal that keeps the rows of every batch it commits."""

    def __init__(self, engine: AsyncEngine) -> None:
        super().__init__(engine)
        self.batches: list[BatchRows] = []

    async def write(self, instance: str, epoch: int, rows: BatchRows) -> int:
        self.batches.append(rows)
        return await super().write(instance, epoch, rows)


SERVED = 30
_OWNER_CLOCKS = text("SELECT clocks FROM instance_owners WHERE instance = 'gpu-0'")
_TENANT_CLOCKS = text(
    "SELECT tenant, last_finish, mean_hold_seconds FROM instance_tenant_totals "
    "WHERE instance = 'gpu-0' ORDER BY tenant"
)


async def admit_and_release(owner: InstanceOwner, tenant: str) -> None:
    wanted = request("r", 32, 4, tenant=tenant)
    await owner.apply(lambda m, now: m.admit(wanted, now))
    await owner.apply(lambda m, now: m.end(tenant, "r", EndReason.RELEASED, now))


async def test_a_batch_writes_the_clocks_of_its_own_tenants_alone(engine: AsyncEngine) -> None:
    await add_instance(engine, "gpu-0", blocks=64)
    tenants = [f"t{i:02}" for i in range(SERVED)]
    for tenant in tenants:
        await add_tenant(engine, tenant)
    journal = RecordingJournal(engine)
    limits = Settings().admission_limits
    owner = await take_over(journal, Catalog(engine), "gpu-0", limits, QueuePolicy(), "a")
    for tenant in tenants:
        await admit_and_release(owner, tenant)
    # Each batch names the one tenant it served, and the owner's row only the instance's own.
    named: list[set[str]] = [{row["tenant"] for row in rows.totals} for rows in journal.batches]
    assert named == [{t} for t in tenants for _ in range(2)]
    assert {key for rows in journal.batches for key in rows.clocks} == {
        "virtual_time",
        "mean_hold_seconds",
        "drift_blocks",
    }
    async with engine.connect() as conn:
        clocks: dict[str, Any] = (await conn.execute(_OWNER_CLOCKS)).scalar_one()
        recorded = (await conn.execute(_TENANT_CLOCKS)).all()
    assert set(clocks) == {"virtual_time", "mean_hold_seconds", "drift_blocks"}
    machine = owner.machine
    assert recorded == [
        (
            t,
            {str(p): f for p, f in machine.tenants[t].last_finish.items()},
            machine.tenants[t].mean_hold_seconds,
        )
        for t in tenants
    ]
    assert all(last_finish and mean_hold for _, last_finish, mean_hold in recorded)
    # A new owner reads them back.
    await journal.close()
    again = Journal(engine)
    fresh = await take_over(again, Catalog(engine), "gpu-0", limits, QueuePolicy(), "a")
    assert_same_machine(machine, fresh.machine)
    await again.close()
