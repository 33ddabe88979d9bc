"""The planner's view of a real pool: cached blocks by scope, block tables with their shared
and pinned entries, pinned-only blocks; and a plan on it counts the right blocks."""

from __future__ import annotations

from dataclasses import replace

from sqlalchemy.ext.asyncio import AsyncEngine

from quota_service.api.server import HotPath
from quota_service.config import Settings
from quota_service.core.model import EndReason
from quota_service.core.reclaim import (
    CachedScope,
    PoolSnapshot,
    ReclaimTarget,
    SharedEntry,
    Tier,
    Unreclaimable,
    plan,
)
from quota_service.owner.owned_reclaim import pool_blocks
from quota_service.store.reclaim import load_snapshot
from tests.integration.ledger_fixtures import add_instance, add_tenant, counters, request

BS = 16


async def snapshot(engine: AsyncEngine, owned: HotPath) -> PoolSnapshot:
    """gpu-0's pool as its owner plans a reclaim on it: slots from memory, the rest read."""
    blocks = await owned.owners.run("gpu-0", lambda machine, now: pool_blocks(machine))
    return await load_snapshot(engine, "gpu-0", blocks=blocks)


def prompt(first: int, blocks: int, extra: int = 0) -> tuple[int, ...]:
    return tuple(range(first, first + blocks * BS + extra))


async def test_the_snapshot_is_the_pool_and_the_plan_counts_only_what_comes_back(
    engine: AsyncEngine, settings: Settings, owned: HotPath
) -> None:
    await add_instance(engine, blocks=64)
    for tenant in ("acme", "globex", "initech"):
        await add_tenant(engine, tenant)
    ledger = owned.ledger

    async def admit(tenant: str, rid: str, tokens: tuple[int, ...]) -> None:
        # Two output tokens: the first gets a slot (vLLM never computes the last one's KV).
        base = request(rid, len(tokens), 2, tenant=tenant)
        await ledger.admit(replace(base, prompt_token_ids=tokens))

    await owned.pins.pin("tenants/acme", "system", "gpu-0", prompt(1000, 2))
    await admit("acme", "pinned-prefix", prompt(1000, 3))  # 2 pinned blocks, 1 own + output
    await admit("acme", "c", prompt(1, 3, extra=5))  # c and d share 3 prompt blocks
    await admit("acme", "d", prompt(1, 3, extra=5))
    await admit("globex", "done", prompt(500, 2))
    await ledger.end("globex", "done", EndReason.RELEASED, 1)  # globex: cold, 2 cached blocks
    await admit("initech", "i", prompt(700, 1))

    pool = await snapshot(engine, owned)
    books = (await counters(engine))["instance:gpu-0"]
    assert pool.cached == (CachedScope("tenants/globex", 2),)
    assert sum(c.blocks for c in pool.cached) == books["cached_blocks"]
    assert pool.pinned_only == ()  # the pinned prefix is in use by a reservation too
    tables = {r.request_id: r for r in pool.reservations}
    c, d = tables["c"], tables["d"]
    assert (c.entries, c.pinned_entries, c.sole_blocks) == (4, 0, 1)  # 3 shared, 1 for output
    assert sorted(c.shared, key=lambda e: e.block_id) == sorted(d.shared, key=lambda e: e.block_id)
    assert [e.ref_count for e in c.shared] == [2, 2, 2]
    assert all(isinstance(e, SharedEntry) for e in c.shared)
    pinned = tables["pinned-prefix"]
    assert (pinned.entries, pinned.pinned_entries, pinned.shared) == (4, 2, ())
    assert (tables["i"].entries, tables["i"].sole_blocks) == (2, 2)
    # Admission order, for evicting the newest first.
    assert [r.request_id for r in pool.reservations] == ["pinned-prefix", "c", "d", "i"]

    acme = plan(pool, ReclaimTarget(100, Tier.EVICT, tenant="acme"))
    # Its evictions give back d's own block, then c's own block and the 3 shared ones, then the
    # pinned-prefix reservation's 2 unpinned ones; the 2 pinned blocks stay.
    assert [(s.reservation, s.gpu_blocks) for s in acme.steps] == [
        (("acme", "d"), 1),
        (("acme", "c"), 4),
        (("acme", "pinned-prefix"), 2),
    ]
    assert {(e.reason, e.blocks, e.reservation) for e in acme.excluded} == {
        (Unreclaimable.PINNED, 2, ("acme", "pinned-prefix"))
    }
    # The whole instance with no eviction: globex's cold cached blocks only.
    gentle = plan(pool, ReclaimTarget(100, Tier.COMPRESS))
    assert gentle.total_blocks == 2
    assert [(s.tier, s.gpu_blocks) for s in gentle.steps] == [(Tier.FREE, 2)]
    # After acme's pin would be the only holder: pinned-only blocks are reported, not taken.
    for rid in ("pinned-prefix", "c", "d"):
        await ledger.end("acme", rid, EndReason.RELEASED, 1)
    after = await snapshot(engine, owned)
    assert after.pinned_only == (("tenants/acme", 2),)
    freed = plan(after, ReclaimTarget(100, Tier.FREE, tenant="acme"))
    assert (freed.excluded[-1].reason, freed.excluded[-1].blocks) == (Unreclaimable.PINNED, 2)
