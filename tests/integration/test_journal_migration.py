"""Migration 0023 carries a live per-block ledger into the instance journal. A database at the
revision before it, as the per-block ledger filled it (tests/integration/data: pins of a tenant
and of a namespace, shared prefixes, single blocks given back, blocks cached by ended
reservations and counted by the engine's KV events, an idle and an offloaded session, a queue of
two tenants at two priorities, and an instance already served from memory), is upgraded; each
instance taken over from the journal must then hold exactly what the per-block tables held, the
journal's views must say what those tables say, and reservations and Admits must be what the
per-block ledger answered on that database (kept beside it)."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, replace
from datetime import datetime
from enum import Enum
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from quota_service.config import Settings
from quota_service.core.admission import AdmitRequest
from quota_service.core.errors import KvQuotaError
from quota_service.core.instance_machine import InstanceMachine
from quota_service.core.model import Reservation
from quota_service.core.queueing import QueuePolicy
from quota_service.owner.instance_owner import InstanceOwner, take_over
from quota_service.store import migrate
from quota_service.store.catalog import Catalog
from quota_service.store.database import connect
from quota_service.store.journal import NO_TOTALS, Journal, totals_of
from tests.integration.ledger_fixtures import request
from tests.integration.test_pins_and_offboarding import BS, tokens
from tests.unit.machine_fixtures import assert_same_machine, recount, slot_rows

LIMITS = Settings().admission_limits
# The revision the per-block ledger fills, before the migration.
PREVIOUS = "0022"
# The last revision that keeps the per-block tables (0026 drops them).
CARRIED_ONLY = "0025"
CARRIED = ("gpu-0", "gpu-1")
# Served from memory before the migration: it must be left as it is.
JOURNALED = "gpu-2"


def prompt(
    request_id: str,
    ids: list[int],
    tenant: str = "acme",
    instance: str = "gpu-0",
    priority: int = 0,
    wait: float = 0.0,
) -> AdmitRequest:
    # Two output tokens: the first gets a slot (vLLM never computes the last one's KV).
    base = request(request_id, len(ids), 2, tenant=tenant, instance=instance)
    return replace(
        base,
        params=replace(base.params, priority=priority),
        prompt_token_ids=tuple(ids),
        wait_timeout_seconds=wait,
    )


DATA = Path(__file__).parent / "data"


@pytest.fixture
async def ledger_engine(database_url: str) -> AsyncIterator[AsyncEngine]:
    """The test's database at the revision before the migration, as the per-block ledger
    filled it."""
    migrate.downgrade(database_url, PREVIOUS)
    with psycopg.connect(database_url) as conn:
        conn.execute((DATA / "per_block_ledger_0022.sql").read_text())
    engine = connect(database_url)
    yield engine
    await engine.dispose()


def per_block_answers() -> dict[str, Any]:
    """What the per-block ledger answered on that database: each live reservation (as
    GetReservation returned it), and the Admits of WANTED."""
    answers: dict[str, Any] = json.loads((DATA / "per_block_ledger_0022.json").read_text())
    return answers


@asynccontextmanager
async def today_on_an_earlier_revision(engine: AsyncEngine) -> AsyncIterator[None]:
    """Today's journal reading and writing a database at an earlier revision: what later
    migrations made that it uses (the function of 0027 it calls, the tenants' clock columns of
    0029, the owners' pool counters of 0030 with the fence that writes them), made for the
    while, and then undone as those migrations' downgrades undo them (the tenants' clocks go
    back into their owners' rows)."""
    quota, clocks = migrate.revision_module("0027"), migrate.revision_module("0029")
    counters = migrate.revision_module("0030")
    async with engine.begin() as conn:
        await conn.execute(text(quota.WITHIN_QUOTA))
        await conn.execute(text(clocks.ADD_COLUMNS))
        await conn.execute(text(counters.ADD_OWNER_COUNTS))
        await conn.execute(text(counters.POOL_COUNTERS))
        await conn.execute(text(counters.NEXT_BATCH))
    try:
        yield
    finally:
        async with engine.begin() as conn:
            await conn.execute(text("DROP FUNCTION journal_within_quota(text[])"))
            await conn.execute(text(clocks.TO_OWNER_ROWS))
            await conn.execute(text(clocks.DROP_COLUMNS))
            await conn.execute(
                text(f"DROP FUNCTION journal_next_batch({counters.NEXT_BATCH_ARGS})")
            )
            await conn.execute(text("DROP VIEW instance_pool_counters"))
            await conn.execute(text(counters.DROP_OWNER_COUNTS))


async def add_instance(engine: AsyncEngine, name: str, blocks: int) -> None:
    """An instance registered before 0030, whose row holds its pool's counters (all free)."""
    async with engine.begin() as conn:
        await conn.execute(
            text(
                "INSERT INTO instances (instance, model, block_size, capacity_blocks, "
                "free_blocks, max_model_len) VALUES (:name, 'test-model', 16, :blocks, :blocks, "
                "8192)"
            ),
            {"name": name, "blocks": blocks},
        )


async def served_from_memory(engine: AsyncEngine, journal: Journal) -> None:
    """gpu-2, served from memory before the migration, with a reservation in its journal."""
    await add_instance(engine, JOURNALED, blocks=16)
    async with today_on_an_earlier_revision(engine):
        owner = await owner_of(engine, journal, JOURNALED, "replica-0")
        await owner.apply(
            lambda m, now: m.admit(prompt("mem", tokens(11, 2), instance=JOURNALED), now)
        )


async def owner_of(
    engine: AsyncEngine, journal: Journal, instance: str, name: str = "replica-a"
) -> InstanceOwner:
    return await take_over(journal, Catalog(engine), instance, LIMITS, QueuePolicy(), name)


@dataclass(frozen=True)
class Held:
    """What one instance holds, as one layout or the other says it (comparable with ==)."""

    # Slots not free: id, state, references, pins, generation, hash, scope, engine copies.
    slots: list[tuple[Any, ...]]
    # Cached slots, the next to be evicted first.
    lru: list[int]
    counts: dict[str, int]
    # Each live block table by its holder's name: (slot, generation, released) in table order.
    tables: dict[str, list[tuple[int, int, bool]]]
    queue: list[str]
    # Each tenant's distinct slots, pinned slots and tokens in flight there.
    holdings: dict[str, tuple[int, int, int]]


@dataclass(frozen=True)
class Layout:
    """Where a layout of the record keeps what `Held` compares."""

    slots: str
    pool: str
    tables: str
    queue: str
    holdings: str


_NAME = "'tenants/' || tenant || '/reservations/' || request_id"
_LIVE = "instance = :i AND state IN ('QUEUED', 'ADMITTED')"

PER_BLOCK = Layout(
    slots="blocks",
    pool="instances",
    tables=(
        "SELECT h.name, array_agg(b.block_id ORDER BY b.position), "
        "array_agg(b.generation ORDER BY b.position), array_agg(b.released ORDER BY b.position) "
        f"FROM (SELECT holder_id, {_NAME} AS name FROM reservations WHERE {_LIVE} "
        "      UNION ALL "
        "      SELECT holder_id, owner || '/pins/' || pin_id FROM pins "
        "      WHERE instance = :i AND state = 'ACTIVE') AS h "
        "JOIN block_refs b USING (holder_id) GROUP BY h.name"
    ),
    # The per-block ledger's dispatch order.
    queue="ORDER BY priority DESC, virtual_start, queued_at",
    holdings=(
        "SELECT tenant, sum(blocks), sum(pinned), sum(tokens) FROM ("
        "  SELECT tenant, count(*) AS blocks, count(*) FILTER (WHERE pin_refs > 0) AS pinned, "
        "         0 AS tokens FROM tenant_blocks WHERE instance = :i GROUP BY tenant "
        "  UNION ALL "
        "  SELECT tenant, 0, 0, sum(reserved_tokens) FROM reservations "
        "  WHERE instance = :i AND state = 'ADMITTED' AND offloaded_bytes IS NULL GROUP BY tenant"
        ") AS h GROUP BY tenant"
    ),
)
# The journal's rows, and the views derived from them.
JOURNALED_ROWS = Layout(
    slots="journal_slots",
    pool="journal_pool_counts",
    tables=(
        f"SELECT {_NAME}, block_ids, block_generations, "
        "       ARRAY(SELECT p - 1 = ANY(coalesce(released_positions, '{}')) "
        "             FROM generate_subscripts(block_ids, 1) AS p ORDER BY p) "
        f"FROM reservations WHERE {_LIVE} AND block_ids IS NOT NULL "
        "UNION ALL "
        "SELECT owner || '/pins/' || pin_id, block_ids, block_generations, "
        "       ARRAY(SELECT false FROM generate_subscripts(block_ids, 1)) "
        "FROM pins WHERE instance = :i AND state = 'ACTIVE'"
    ),
    # The machine's order: queue_arrival breaks ties of priority and start tag.
    queue="ORDER BY priority DESC, virtual_start, queue_arrival",
    holdings=(
        "SELECT tenant, blocks_in_use, pinned_blocks, tokens_in_flight "
        "FROM journal_tenant_holdings WHERE instance = :i"
    ),
)


async def held_in(engine: AsyncEngine, layout: Layout, instance: str) -> Held:
    keys = {"i": instance}
    async with engine.connect() as conn:

        async def rows(query: str) -> Any:
            return await conn.execute(text(query), keys)

        slots = await rows(
            "SELECT block_id, state, ref_count, pin_count, generation, content_hash, hash_scope, "
            f"engine_copies FROM {layout.slots} WHERE instance = :i AND state <> 'FREE' "
            "ORDER BY block_id"
        )
        lru = await rows(
            f"SELECT block_id FROM {layout.slots} WHERE instance = :i AND state = 'CACHED' "
            "ORDER BY lru_seq, block_id"
        )
        counts = await rows(
            'SELECT free_blocks AS "FREE", cached_blocks AS "CACHED", '
            f'blocks_in_use AS "IN_USE", pinned_blocks AS "PINNED" FROM {layout.pool} '
            "WHERE instance = :i"
        )
        tables = await rows(layout.tables)
        queue = await rows(
            f"SELECT {_NAME} FROM reservations WHERE instance = :i AND state = 'QUEUED' "
            + layout.queue
        )
        holdings = await rows(layout.holdings)
        return Held(
            [tuple(row) for row in slots],
            list(lru.scalars()),
            dict(counts.mappings().one()),
            {name: list(zip(b, g, r, strict=True)) for name, b, g, r in tables},
            list(queue.scalars()),
            {tenant: (int(b), int(p), int(t)) for tenant, b, p, t in holdings},
        )


def held_by_machine(machine: InstanceMachine) -> Held:
    pool = machine.pool
    slots = [
        (
            *row,
            machine.scopes[pool.scope_id(row[0])] if row[5] else None,
            pool.engine_copies(row[0]),
        )
        for row in slot_rows(machine)
        if row[1] != "FREE"
    ]
    tables = {r.name: r.table for r in machine.reservations.values() if r.table is not None} | {
        f"{p.owner}/pins/{p.pin_id}": p.table for p in machine.pins.values()
    }
    return Held(
        slots,
        pool.lru_order(),
        pool.counts(),
        {
            name: list(zip(t.blocks, t.generations, map(bool, t.released), strict=True))
            for name, t in tables.items()
        },
        [r.name for r in machine.queued()],
        {
            name: (here.blocks, len(here.pinned), here.tokens)
            for name, here in machine.tenants.items()
            if here.blocks or here.tokens
        },
    )


_FREE_GENERATIONS = text(
    "SELECT block_id, generation FROM blocks WHERE instance = :i AND state = 'FREE'"
)
_CLOCKS = text(
    "SELECT (SELECT jsonb_object_agg(priority, virtual_time) FROM fair_clocks "
    "        WHERE instance = :i) AS virtual_time, "
    "       (SELECT jsonb_object_agg(tenant, last_finish) FROM ("
    "            SELECT tenant, jsonb_object_agg(priority, last_finish) AS last_finish "
    "            FROM fair_tags WHERE instance = :i GROUP BY tenant) AS f) AS last_finish, "
    "       mean_hold_seconds, drift_blocks, "
    "       (SELECT jsonb_object_agg(tenant, mean_hold_seconds) FROM tenants "
    "        WHERE tenant IN (SELECT tenant FROM fair_tags WHERE instance = :i "
    "                         UNION SELECT tenant FROM reservations "
    "                         WHERE instance = :i AND state IN ('QUEUED', 'ADMITTED') "
    "                         UNION SELECT tenant FROM pins "
    "                         WHERE instance = :i AND state = 'ACTIVE')) AS tenant_holds "
    "FROM instances WHERE instance = :i"
)


@dataclass(frozen=True)
class Clocks:
    virtual_time: dict[int, float]
    last_finish: dict[str, dict[int, float]]
    mean_hold_seconds: float | None
    drift_blocks: int
    # Each tenant's mean holding time (None where the instance knows nothing of it).
    tenant_holds: dict[str, float | None]


async def clocks_of_ledger(engine: AsyncEngine, instance: str, tenants: list[str]) -> Clocks:
    async with engine.connect() as conn:
        row = (await conn.execute(_CLOCKS, {"i": instance})).mappings().one()
    holds = row["tenant_holds"] or {}
    return Clocks(
        {int(p): t for p, t in (row["virtual_time"] or {}).items()},
        {
            tenant: {int(p): t for p, t in finish.items()}
            for tenant, finish in (row["last_finish"] or {}).items()
        },
        row["mean_hold_seconds"],
        row["drift_blocks"],
        {tenant: holds.get(tenant) for tenant in tenants},
    )


def clocks_of_machine(machine: InstanceMachine) -> Clocks:
    return Clocks(
        machine.virtual_time,
        {name: here.last_finish for name, here in machine.tenants.items() if here.last_finish},
        machine.mean_hold_seconds,
        machine.drift_blocks,
        {name: here.mean_hold_seconds for name, here in machine.tenants.items()},
    )


# What the migration must not change: the per-block tables, tenants' totals, usage history, and
# every column of reservations and pins but the journal's.
_UNTOUCHED_TABLES = (
    "blocks",
    "block_refs",
    "tenant_blocks",
    "tenants",
    "instances",
    "tombstones",
    "fair_clocks",
    "fair_tags",
    "usage_events",
    "usage_hours",
)
_UNTOUCHED = text(
    "SELECT "
    + ", ".join(f"ARRAY(SELECT row::text FROM {t} AS row ORDER BY 1)" for t in _UNTOUCHED_TABLES)
    + ", ARRAY(SELECT (to_jsonb(r) - 'block_ids' - 'block_generations' - 'released_positions' "
    "- 'queue_arrival')::text FROM reservations r ORDER BY 1), "
    "ARRAY(SELECT (to_jsonb(p) - 'block_ids' - 'block_generations')::text FROM pins p ORDER BY 1)"
)
# What the journal holds (times of writing aside).
_JOURNAL = text(
    "SELECT ARRAY(SELECT (instance, owner, epoch, batch, clocks)::text FROM instance_owners "
    "             ORDER BY 1), "
    "       ARRAY(SELECT (instance, batch, scopes, slots, generations, digests, scope_ids, "
    "                     engine_copies, lru_seqs)::text FROM pool_checkpoints ORDER BY 1), "
    "       ARRAY(SELECT (instance, batch)::text FROM pool_deltas ORDER BY 1), "
    "       ARRAY(SELECT (tenant, request_id, block_ids, block_generations, released_positions, "
    "                     queue_arrival)::text FROM reservations ORDER BY 1), "
    "       ARRAY(SELECT (owner, pin_id, block_ids, block_generations)::text FROM pins "
    "             ORDER BY 1)"
)


_OWNERS = text("SELECT instance, owner, epoch, batch, clocks FROM instance_owners ORDER BY 1")
_CHECKPOINTED = text("SELECT instance, batch FROM pool_checkpoints ORDER BY 1")
FIELDS = ("blocks", "tokens", "pinned", "queued")
_TOTALS = text(
    "SELECT tenant, blocks_in_use, tokens_in_flight, pinned_blocks, queued_requests FROM tenants"
)
_TOTALS_PER_INSTANCE = text(
    "SELECT tenant, instance, blocks_in_use, tokens_in_flight, pinned_blocks, queued_requests "
    "FROM instance_tenant_totals WHERE blocks_in_use <> 0 OR tokens_in_flight <> 0 "
    "OR pinned_blocks <> 0 OR queued_requests <> 0"
)


async def check_totals(
    engine: AsyncEngine, owners: dict[str, InstanceOwner], tenants: list[str]
) -> None:
    """Tenants' totals, fleet-wide and per instance, are what the machines hold."""
    per_instance = {
        (tenant, name): totals_of(owner.machine, tenant)
        for name, owner in owners.items()
        for tenant in tenants
    }
    fleet = {
        tenant: [sum(getattr(per_instance[(tenant, name)], f) for name in owners) for f in FIELDS]
        for tenant in tenants
    }
    assert {row[0]: list(row[1:]) for row in await all_rows(engine, _TOTALS)} == fleet
    assert {
        (row[0], row[1]): list(row[2:]) for row in await all_rows(engine, _TOTALS_PER_INSTANCE)
    } == {
        key: [getattr(held_there, f) for f in FIELDS]
        for key, held_there in per_instance.items()
        if held_there != NO_TOTALS
    }


async def all_rows(engine: AsyncEngine, query: Any) -> list[tuple[Any, ...]]:
    async with engine.connect() as conn:
        return [tuple(row) for row in await conn.execute(query)]


async def revision(engine: AsyncEngine) -> str:
    async with engine.connect() as conn:
        return str((await conn.execute(text("SELECT version_num FROM alembic_version"))).scalar())


async def rows_of(engine: AsyncEngine, query: Any) -> tuple[Any, ...]:
    async with engine.connect() as conn:
        return tuple((await conn.execute(query)).one())


@pytest.mark.slow
async def test_a_taken_over_instance_holds_what_the_per_block_ledger_held(
    ledger_engine: AsyncEngine,
    database_url: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = ledger_engine
    journal = Journal(engine)
    await served_from_memory(engine, journal)
    await journal.close()
    tenants = ["acme", "beta", "gamma"]
    held = {name: await held_in(engine, PER_BLOCK, name) for name in CARRIED}
    clocks = {name: await clocks_of_ledger(engine, name, tenants) for name in CARRIED}
    answered = per_block_answers()
    async with engine.connect() as conn:
        free: dict[str, dict[int, int]] = {
            name: {b: g for b, g in await conn.execute(_FREE_GENERATIONS, {"i": name})}
            for name in CARRIED
        }
    untouched = await rows_of(engine, _UNTOUCHED)
    owned_before = await all_rows(engine, _OWNERS)

    caplog.set_level(logging.INFO, logger="alembic.runtime.migration")
    migrate.upgrade(database_url, CARRIED_ONLY)
    assert await rows_of(engine, _UNTOUCHED) == untouched
    for done, name in enumerate(CARRIED, 1):
        assert f"instances/{name} carried ({done} of 2)" in caplog.text
    # Owner rows that any replica may claim, with epochs above the generations handed out (a
    # slot of gpu-1 turned over 3 x 2**40 times); gpu-2's journal as it was.
    owned = await all_rows(engine, _OWNERS)
    assert [row[:4] for row in owned[:2]] == [
        ("gpu-0", "migrations/0023", 1, 0),
        ("gpu-1", "migrations/0023", 4, 0),
    ]
    assert owned[2:] == owned_before
    assert await all_rows(engine, _CHECKPOINTED) == [("gpu-0", 0), ("gpu-1", 0)]

    # The per-block tables go (0026), the journal's functions change (0027): what follows is
    # served as today's servers serve it.
    migrate.upgrade(database_url)
    journal = Journal(engine)
    owners = {name: await owner_of(engine, journal, name) for name in (*CARRIED, JOURNALED)}
    for name in CARRIED:
        machine = owners[name].machine
        recount(machine)
        assert held_by_machine(machine) == held[name], name
        assert await held_in(engine, JOURNALED_ROWS, name) == held[name], name
        assert clocks_of_machine(machine) == clocks[name], name
        assert {
            r.name: as_json(r.snapshot(machine.queue_position(r)))
            for r in machine.reservations.values()
        } == answered["reservations"][name], name
        # Every handle the ledger handed out is stale on a slot that is free now.
        for block, generation in free[name].items():
            assert machine.pool.generation(block) > generation, (name, block)
    assert list(owners[JOURNALED].machine.reservations) == [("acme", "mem")]
    await check_totals(engine, owners, tenants)

    # The same Admits as the per-block ledger was asked on that database: the same hits on the
    # same cached and shared blocks, and the same blocks evicted for the rest.
    for one, by_ledger in zip(WANTED, answered["admits"], strict=True):
        by_owner = await admitted(owners[one.params.instance].apply(admit_in_memory(one)))
        assert answer_json(by_owner) == by_ledger, one.params.request_id
    # What the owners journaled since is what a next owner rebuilds.
    for name in CARRIED:
        fresh = await owner_of(engine, journal, name, "replica-b")
        assert_same_machine(owners[name].machine, fresh.machine)
    await journal.close()


# The Admits asked of both layouts after the migration: priority 2 goes ahead of the queue.
WANTED = [
    prompt("again-1", tokens(6, 3, extra=1), priority=2),
    prompt("again-2", tokens(2, 2) + tokens(4, 1, extra=3), tenant="gamma", priority=2),
    prompt("again-3", tokens(5, 3, extra=3), tenant="beta", priority=2),
    prompt("again-4", tokens(1, 3) + tokens(3, 1, extra=5), priority=2),
    prompt("again-5", tokens(7, 3, extra=1), tenant="beta", priority=2),
    prompt("again-6", tokens(10, 3, extra=2), tenant="beta", instance="gpu-1"),
]


def as_json(reservation: Reservation) -> dict[str, Any]:
    """A reservation as the frozen answers of the per-block ledger keep it."""
    fields = asdict(reservation)
    fields["block_table"] = [[h.block_id, h.generation] for h in reservation.block_table]
    for key, value in fields.items():
        if isinstance(value, datetime):
            fields[key] = value.isoformat()
        elif isinstance(value, Enum):
            fields[key] = value.value
        elif isinstance(value, bytes):
            fields[key] = value.hex()
    return fields


def answer_json(answer: tuple[Any, ...]) -> list[Any]:
    """An Admit's answer (`admitted`) as the frozen answers keep it."""
    if len(answer) == 1:
        return [answer[0].value]
    state, hits, hit_blocks, table = answer
    return [state.value, hits, [[h.block_id, h.generation] for h in hit_blocks], table]


def admit_in_memory(wanted: AdmitRequest) -> Callable[[InstanceMachine, float], Reservation]:
    return lambda machine, now: machine.admit(wanted, now).snapshot()


async def admitted(admit: Awaitable[Any]) -> tuple[Any, ...]:
    """What an Admit got: the refusal's reason, or its state, hits and block table (the
    generations of new blocks from free slots differ: the new owner's start higher)."""
    try:
        answer = await admit
    except KvQuotaError as refused:
        return (refused.reason,)
    found: Reservation = answer[0] if isinstance(answer, tuple) else answer
    hits = found.prefix_hit_blocks
    return (
        found.state,
        hits,
        found.block_table[:hits],
        [h.block_id for h in found.block_table],
    )


async def test_downgrade_clears_what_was_carried_until_an_owner_writes(
    ledger_engine: AsyncEngine, database_url: str
) -> None:
    engine = ledger_engine
    untouched = await rows_of(engine, _UNTOUCHED)
    cleared = await rows_of(engine, _JOURNAL)
    migrate.upgrade(database_url, CARRIED_ONLY)
    carried = await rows_of(engine, _JOURNAL)
    migrate.downgrade(database_url, PREVIOUS)
    assert await rows_of(engine, _JOURNAL) == cleared
    assert await rows_of(engine, _UNTOUCHED) == untouched
    migrate.upgrade(database_url, CARRIED_ONLY)
    assert await rows_of(engine, _JOURNAL) == carried

    # Once an owner has committed a batch, the per-block tables no longer hold all there is:
    # the downgrade refuses, and changes nothing.
    journal = Journal(engine)
    after = request("after", 2 * BS, BS, instance="gpu-1")
    async with today_on_an_earlier_revision(engine):
        owner = await owner_of(engine, journal, "gpu-1")
        await owner.apply(lambda m, now: m.admit(after, now))
    await journal.close()
    written = await rows_of(engine, _JOURNAL)
    with pytest.raises(RuntimeError, match=r"instances/gpu-1 at batch 1; nothing was changed"):
        migrate.downgrade(database_url, PREVIOUS)
    assert await rows_of(engine, _JOURNAL) == written
    assert await revision(engine) == CARRIED_ONLY


@pytest.mark.parametrize(
    ("corruption", "error"),
    [
        (
            "UPDATE blocks SET content_hash = substring(content_hash FROM 2) "
            "WHERE instance = 'gpu-0' AND block_id = 1",
            "instances/gpu-0: a block's content hash is not 32 bytes long",
        ),
        (
            "UPDATE blocks SET hash_scope = NULL WHERE instance = 'gpu-0' AND block_id = 1",
            "instances/gpu-0: a block holds a hash with no scope",
        ),
    ],
    ids=["short digest", "no scope"],
)
async def test_a_slot_the_journal_cannot_hold_stops_the_migration(
    ledger_engine: AsyncEngine, database_url: str, corruption: str, error: str
) -> None:
    engine = ledger_engine
    async with engine.begin() as conn:
        await conn.execute(text(corruption))
    before = await rows_of(engine, _JOURNAL)
    with pytest.raises(RuntimeError, match=error):
        migrate.upgrade(database_url)
    assert await rows_of(engine, _JOURNAL) == before
    assert migrate.pending(database_url)


# Migration 0026: the per-block tables go once everything they held is in the journal.
_PER_BLOCK_TABLES = text(
    "SELECT count(*) FROM pg_class WHERE relname IN "
    "('blocks', 'block_refs', 'tenant_blocks', 'tombstones', 'fair_clocks', 'fair_tags')"
)


async def test_the_per_block_tables_go_and_the_journal_stays(
    ledger_engine: AsyncEngine, database_url: str
) -> None:
    engine = ledger_engine
    migrate.upgrade(database_url, CARRIED_ONLY)
    carried = await rows_of(engine, _JOURNAL)
    migrate.upgrade(database_url)
    assert await rows_of(engine, _PER_BLOCK_TABLES) == (0,)
    # As 0028 keeps it (0029 moves the tenants' clocks out of their owners' rows, and its
    # downgrade back), the journal is what was carried.
    migrate.downgrade(database_url, "0028")
    assert await rows_of(engine, _JOURNAL) == carried
    migrate.upgrade(database_url)

    # Back, the tables are made again only when they would hold all there is: not while the
    # journal holds live block tables and cached slots.
    with pytest.raises(RuntimeError, match="the journal holds block tables or cached slots"):
        migrate.downgrade(database_url, CARRIED_ONLY)
    assert await rows_of(engine, _PER_BLOCK_TABLES) == (0,)
    assert not migrate.pending(database_url)


async def test_the_per_block_tables_stay_while_they_hold_an_instance_not_carried(
    ledger_engine: AsyncEngine, database_url: str
) -> None:
    """An instance registered after 0023 by a server still on the per-block hot path is in no
    journal: dropping the tables would lose what it holds."""
    engine = ledger_engine
    migrate.upgrade(database_url, CARRIED_ONLY)
    await add_instance(engine, "late", blocks=4)
    async with engine.begin() as conn:
        await conn.execute(
            text(
                "INSERT INTO blocks (instance, block_id, content_hash, hash_scope, lru_seq) "
                "VALUES ('late', 0, decode(repeat('ab', 32), 'hex'), 'tenants/acme', 1)"
            )
        )
    with pytest.raises(RuntimeError, match="on instances late: downgrade to 0022"):
        migrate.upgrade(database_url)
    assert await rows_of(engine, _PER_BLOCK_TABLES) == (6,)
    assert await revision(engine) == CARRIED_ONLY
