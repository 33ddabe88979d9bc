"""Metering by the instances' owners: the batches that change what tenants hold append usage
events (shares of blocks held by several tenants included), and the hourly rollup integrates
them exactly, once, whichever replica closes the hour."""

from __future__ import annotations

import asyncio
import random
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from fractions import Fraction

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from quota_service.api.server import HotPath
from quota_service.core.errors import KvQuotaError
from quota_service.core.metering import MICROS
from quota_service.core.model import EndReason, ReservationState
from quota_service.core.reclaim import DEFAULT_WATERMARKS, ReclaimTarget, Tier
from quota_service.store.usage import UsageRollup
from tests.integration.ledger_fixtures import add_instance, add_tenant, request
from tests.integration.test_suspend_offload import with_cpu_tier

HOUR = datetime(2026, 11, 29, 10, tzinfo=UTC)
PROMPT = tuple(range(63))  # 3 full blocks and a partial one with the output token


async def scripted(engine: AsyncEngine, seconds: list[int]) -> None:
    """The controlled clock: the owner's batches, in the order they ran (their events
    share their start time), get these times."""
    async with engine.begin() as conn:
        query = text("SELECT DISTINCT at FROM usage_events ORDER BY at")
        times = [at for (at,) in await conn.execute(query)]
        assert len(times) == len(seconds)
        for at, second in zip(times, seconds, strict=True):
            await conn.execute(
                text("UPDATE usage_events SET at = :new WHERE at = :at"),
                {"new": HOUR + timedelta(seconds=second), "at": at},
            )


async def events(engine: AsyncEngine) -> list[tuple[str, dict[str, int]]]:
    async with engine.connect() as conn:
        query = "SELECT tenant, blocks FROM usage_events WHERE blocks <> '{}' ORDER BY id"
        rows = await conn.execute(text(query))
        return [(tenant, dict(blocks)) for tenant, blocks in rows]


async def shared_prompt_timeline(engine: AsyncEngine, owned: HotPath) -> None:
    """Two tenants of one namespace share a prompt's 3 blocks for 50 s of the hour HOUR."""
    await add_instance(engine, blocks=64)
    catalog = owned.catalog
    await catalog.create_namespace("pub")
    for tenant in ("acme", "bolt"):
        await add_tenant(engine, tenant)
        await catalog.update_tenant(tenant, {"namespace": "pub"})
    ledger = owned.ledger
    await ledger.admit(replace(request("r1", 63, 1), prompt_token_ids=PROMPT))
    shared = replace(request("r2", 63, 1, tenant="bolt"), prompt_token_ids=PROMPT)
    assert (await ledger.admit(shared))[0].prefix_hit_blocks == 3
    await ledger.end("bolt", "r2", EndReason.RELEASED, 1)
    await ledger.end("acme", "r1", EndReason.RELEASED, 1)
    assert await events(engine) == [
        ("acme", {"1": 4}),
        # bolt joins acme's 3 prompt blocks: both now hold them two ways.
        ("acme", {"1": -3, "2": 3}),
        ("bolt", {"1": 1, "2": 3}),
        ("acme", {"1": 3, "2": -3}),
        ("bolt", {"1": -1, "2": -3}),
        ("acme", {"1": -4}),
    ]
    await scripted(engine, [10, 20, 70, 100])


async def test_shared_blocks_are_metered_and_an_hour_adds_up_exactly(
    engine: AsyncEngine, owned: HotPath
) -> None:
    await shared_prompt_timeline(engine, owned)
    rollup = UsageRollup(engine)
    grace = timedelta(minutes=5)
    too_soon = HOUR + timedelta(hours=1, minutes=4)
    assert await rollup.close_due(too_soon, grace) == 0  # still within the grace period
    later = HOUR + timedelta(hours=3)
    # Two replicas at once: the hour is closed once.
    assert sorted(await asyncio.gather(*(rollup.close_due(later, grace) for _ in range(2)))) == [
        0,
        1,
    ]
    async with engine.connect() as conn:
        rows = await conn.execute(
            text("SELECT tenant, block_us FROM usage_hours WHERE hour = :hour ORDER BY tenant"),
            {"hour": HOUR},
        )
        hours = {tenant: {int(k): v for k, v in block_us.items()} for tenant, block_us in rows}
    # acme: 4 blocks alone 10..20 s, 1 alone and 3 shared 20..70 s, 4 alone 70..100 s.
    assert hours["acme"] == {1: 210 * MICROS, 2: 150 * MICROS}
    assert hours["bolt"] == {1: 50 * MICROS, 2: 150 * MICROS}
    fair = {t: sum(Fraction(us, k) for k, us in b.items()) / MICROS for t, b in hours.items()}
    assert fair == {"acme": 285, "bolt": 125}
    # Conservation: acme's 4 blocks held 10..100 s and bolt's own block 20..70 s.
    assert sum(fair.values()) == 4 * 90 + 50
    async with engine.connect() as conn:
        counters = await conn.execute(
            text(
                "SELECT tenant, admitted, tokens_reserved, output_tokens FROM usage_hours "
                "WHERE hour = :hour ORDER BY tenant"
            ),
            {"hour": HOUR},
        )
        assert [tuple(r) for r in counters] == [("acme", 1, 64, 1), ("bolt", 1, 64, 1)]

    # A late event (its hour had closed) counts in the next hour; the closed one never changes.
    async with engine.begin() as conn:
        await conn.execute(
            text(
                "INSERT INTO usage_events (at, tenant, instance, blocks) "
                "VALUES (:at, 'acme', 'gpu-0', CAST(:blocks AS jsonb))"
            ),
            {"at": HOUR + timedelta(minutes=30), "blocks": '{"1": 1}'},
        )
    assert await rollup.close_due(HOUR + timedelta(hours=5), grace) == 3  # hours 1, 2, 3
    async with engine.connect() as conn:
        closed = (
            await conn.execute(
                text("SELECT hour, events, late_events FROM usage_closed_hours ORDER BY hour")
            )
        ).all()
        next_hour = (
            await conn.execute(
                text("SELECT block_us FROM usage_hours WHERE hour = :hour AND tenant = 'acme'"),
                {"hour": HOUR + timedelta(hours=1)},
            )
        ).scalar_one()
    # Each batch wrote one event per tenant it touched: 4 batches, the middle two touching
    # both tenants.
    assert [(c.events, c.late_events) for c in closed] == [(6, 0), (1, 1), (0, 0), (0, 0)]
    assert next_hour == {"1": 3600 * MICROS}
    # Closed hours' events go after their retention (HOUR is hours before now()).
    assert await rollup.purge_events(retention_seconds=60.0, batch=5) == 5
    assert await rollup.purge_events(retention_seconds=60.0, batch=100) == 2


async def test_refusals_and_queueing_are_counted_by_reason(
    engine: AsyncEngine, owned: HotPath
) -> None:
    await add_instance(engine, blocks=8)
    await add_tenant(engine, "acme")
    ledger = owned.ledger
    await ledger.admit(request("big", 100, 27))  # 8 blocks: all of them
    for attempt in range(2):
        with pytest.raises(KvQuotaError):
            await ledger.admit(request(f"no-room-{attempt}", 16, 1))
    waiting, _ = await ledger.admit(replace(request("waits", 16, 1), wait_timeout_seconds=60))
    assert waiting.state is ReservationState.QUEUED
    async with engine.connect() as conn:
        rows = await conn.execute(
            text(
                "SELECT sum(admitted), sum(queued), jsonb_agg(refused) FILTER "
                "(WHERE refused <> '{}') FROM usage_events WHERE tenant = 'acme'"
            )
        )
        admitted, queued, refused = rows.one()
    assert (admitted, queued) == (1, 1)
    assert refused == [{"INSTANCE_OVERLOADED": 1}] * 2


async def test_fair_shares_add_up_to_the_referenced_blocks_whatever_happens(
    engine: AsyncEngine, owned: HotPath
) -> None:
    """Random admissions and releases of shared and private prompts by three tenants of one
    namespace, each at its own scripted second: the hour's fair shares add up to the physical
    block-seconds of the referenced blocks, measured from the record after each step."""
    await add_instance(engine, blocks=256)
    catalog = owned.catalog
    await catalog.create_namespace("pub")
    tenants = ("acme", "bolt", "cora")
    for tenant in tenants:
        await add_tenant(engine, tenant)
        await catalog.update_tenant(tenant, {"namespace": "pub"})
    ledger = owned.ledger
    prompts = [tuple(range(p * 1000, p * 1000 + 63)) for p in range(3)]
    chooser = random.Random(7)
    live: list[tuple[str, str]] = []
    referenced_after: list[int] = []  # distinct referenced blocks after each step
    for step in range(40):
        if live and chooser.random() < 0.45:
            tenant, request_id = live.pop(chooser.randrange(len(live)))
            await ledger.end(tenant, request_id, EndReason.RELEASED, 1)
        else:
            tenant, prompt = chooser.choice(tenants), chooser.choice(prompts)
            admit = replace(request(f"s{step}", 63, 1, tenant=tenant), prompt_token_ids=prompt)
            await ledger.admit(admit)
            live.append((tenant, f"s{step}"))
        async with engine.connect() as conn:
            query = (
                "SELECT count(DISTINCT (instance, block_id)) FROM journal_slot_references "
                "WHERE tenant IS NOT NULL"
            )
            referenced_after.append((await conn.execute(text(query))).scalar_one())
    await scripted(engine, [10 * (step + 1) for step in range(40)])
    assert await UsageRollup(engine).close_due(HOUR + timedelta(hours=1), timedelta(0)) == 1
    physical = sum(n * 10 for n in referenced_after[:-1]) + referenced_after[-1] * (3600 - 400)
    async with engine.connect() as conn:
        rows = await conn.execute(
            text("SELECT block_us FROM usage_hours WHERE hour = :hour"), {"hour": HOUR}
        )
        fair = sum(
            (Fraction(int(us), int(k)) for (block_us,) in rows for k, us in block_us.items()),
            Fraction(),
        )
    assert fair / MICROS == physical


async def test_pins_the_cpu_tier_and_reclaims_are_metered(
    engine: AsyncEngine, owned: HotPath
) -> None:
    await with_cpu_tier(engine, blocks=32, cpu_used=0, cpu_capacity=1 << 30)
    ledger = owned.ledger
    pins = owned.pins
    await pins.pin("tenants/acme", "system", "gpu-0", tuple(range(32)))  # 2 blocks
    await ledger.admit(replace(request("chat", 63, 1), prompt_token_ids=tuple(range(63))))
    await ledger.suspend("acme", "chat", ())
    jobs = owned.reclaim(engine, DEFAULT_WATERMARKS)
    job = await jobs.create("offload", "gpu-0", ReclaimTarget(2, Tier.OFFLOAD), dry_run=False)
    while await jobs.run_step(job.job_id):
        pass
    await ledger.end("acme", "chat", EndReason.CANCELLED)
    await pins.unpin("tenants/acme", "system")
    async with engine.connect() as conn:
        totals = (
            await conn.execute(
                text(
                    "SELECT array_agg(pinned ORDER BY id) FILTER (WHERE pinned <> 0), "
                    "array_agg(cpu_bytes ORDER BY id) FILTER (WHERE cpu_bytes <> 0), "
                    "jsonb_agg(reclaimed) FILTER (WHERE reclaimed <> '{}') "
                    "FROM usage_events WHERE tenant = 'acme'"
                )
            )
        ).one()
    pinned, cpu_bytes, reclaimed = totals
    assert pinned == [2, -2]
    # The whole session (4 blocks) went to the CPU tier, and left it when it ended; the GPU
    # got back the 2 blocks the pin did not hold.
    assert cpu_bytes == [4 * 16384, -4 * 16384]
    assert reclaimed == [{"OFFLOAD": 2}]
