"""The reclaim planner on hand-built pools: tier order, pinned and shared blocks excluded, exact
expected counts."""

from __future__ import annotations

from dataclasses import replace

from quota_service.core.reclaim import (
    CachedScope,
    CompressMeasurement,
    CpuTier,
    Exclusion,
    InstanceLoad,
    LiveReservation,
    OffloadedSession,
    PoolSnapshot,
    ReclaimPlan,
    ReclaimTarget,
    SharedEntry,
    TenantExcess,
    Tier,
    Unreclaimable,
    plan,
    policy_jobs,
)

BPB = 100  # bytes per block


def reservation(
    tenant: str,
    rid: str,
    sole: int,
    *,
    shared: tuple[SharedEntry, ...] = (),
    pinned: int = 0,
    priority: int = 0,
    seq: int = 0,
    suspended: bool = False,
) -> LiveReservation:
    """A reservation whose table has `sole` entries naming blocks only it holds, `shared`
    entries, and `pinned` entries naming pinned blocks."""
    entries = sole + len(shared) + pinned
    return LiveReservation(tenant, rid, priority, seq, suspended, entries, pinned, shared)


def pool(
    cached: tuple[CachedScope, ...] = (),
    reservations: tuple[LiveReservation, ...] = (),
    cpu: CpuTier | None = None,
    pinned_only: tuple[tuple[str, int], ...] = (),
    cpu_room: dict[str, int] | None = None,
    offloaded: tuple[OffloadedSession, ...] = (),
) -> PoolSnapshot:
    """Without `cpu_room`, no tenant's CPU-tier quota limits the plan."""
    room = cpu_room if cpu_room is not None else {r.tenant: 1 << 60 for r in reservations}
    return PoolSnapshot(BPB, cached, reservations, pinned_only, cpu, offloaded, room)


def cpu(used: int, *, low: float = 0.5, high: float = 0.8, ratio: float | None = 0.5) -> CpuTier:
    return CpuTier(used, 1000, low, high, ratio)


def taken(p: ReclaimPlan) -> list[tuple[Tier, object, int]]:
    return [(s.tier, s.reservation, s.gpu_blocks) for s in p.steps]


def test_free_is_one_step_for_the_cached_blocks_the_target_needs() -> None:
    cached = (CachedScope("tenants/acme", 2), CachedScope("tenants/globex", 2))
    running = (reservation("acme", "r1", 1),)
    result = plan(pool(cached, running), ReclaimTarget(3, Tier.FREE))
    # Which 3 (cold scopes first, least recently used first) the executor picks when it runs.
    assert taken(result) == [(Tier.FREE, None, 3)]
    assert result.steps[0].block is None
    assert (result.total_blocks, result.total_bytes) == (3, 300)
    assert result.excluded == ()  # the target was reached
    everything = plan(pool(cached, running), ReclaimTarget(100, Tier.FREE))
    assert taken(everything) == [(Tier.FREE, None, 4)]


def test_a_tenant_scope_frees_only_its_own_cached_blocks() -> None:
    cached = (
        CachedScope("namespaces/shared", 2),
        CachedScope("tenants/acme", 1),
        CachedScope("tenants/globex", 3),
    )
    result = plan(pool(cached), ReclaimTarget(10, Tier.FREE, tenant="acme"))
    assert taken(result) == [(Tier.FREE, None, 1)]
    assert taken(plan(pool(cached), ReclaimTarget(10, Tier.FREE, tenant="initech"))) == []


def test_the_highest_tier_allowed_bounds_the_plan_and_says_what_is_left() -> None:
    cached = (CachedScope("tenants/acme", 1),)
    running = (reservation("acme", "r1", 3),)
    result = plan(pool(cached, running), ReclaimTarget(4, Tier.OFFLOAD))
    assert taken(result) == [(Tier.FREE, None, 1)]
    assert result.excluded == (Exclusion(Unreclaimable.ABOVE_MAX_TIER, 3),)


def test_offload_fills_the_cpu_tier_up_to_its_low_watermark_coldest_first() -> None:
    suspended = (
        reservation("acme", "later", 3, seq=2, suspended=True),
        reservation("acme", "first", 3, seq=1, suspended=True),
    )
    # 1000 bytes, low watermark 0.5: room for 500 bytes = one 3-block reservation.
    result = plan(pool((), suspended, cpu(0)), ReclaimTarget(6, Tier.OFFLOAD))
    assert taken(result) == [(Tier.OFFLOAD, ("acme", "first"), 3)]
    assert result.steps[0].cpu_bytes == 300
    assert result.excluded == (Exclusion(Unreclaimable.CPU_TIER_FULL, 3, ("acme", "later")),)
    without_lmcache = plan(pool((), suspended), ReclaimTarget(6, Tier.OFFLOAD))
    assert taken(without_lmcache) == []
    assert {e.reason for e in without_lmcache.excluded} == {Unreclaimable.NO_CPU_TIER}


def test_offload_stays_within_each_tenants_cpu_tier_quota() -> None:
    """A tenant's offloaded sessions hold no more CPU-tier bytes than its quota allows, on
    every instance together; what does not fit is evicted when the job may, or stays."""
    suspended = (
        reservation("acme", "a1", 2, seq=1, suspended=True),
        reservation("bolt", "b1", 2, seq=2, suspended=True),
        reservation("acme", "a2", 2, seq=3, suspended=True),
    )
    # Room in the CPU tier for all three (600 of 1000 bytes); acme may add 250 bytes, one.
    roomy = cpu(0, low=0.9)
    with_quota = pool((), suspended, roomy, cpu_room={"acme": 250, "bolt": 1000})
    offloading = plan(with_quota, ReclaimTarget(6, Tier.OFFLOAD))
    assert taken(offloading) == [
        (Tier.OFFLOAD, ("acme", "a1"), 2),
        (Tier.OFFLOAD, ("bolt", "b1"), 2),
    ]
    assert offloading.excluded == (Exclusion(Unreclaimable.TENANT_CPU_QUOTA, 2, ("acme", "a2")),)
    evicting = plan(with_quota, ReclaimTarget(6, Tier.EVICT))
    assert [s.tier for s in evicting.steps] == [Tier.OFFLOAD, Tier.OFFLOAD, Tier.EVICT]
    assert evicting.steps[-1].reservation == ("acme", "a2")
    # A tenant with no room at all (or not in the snapshot) offloads nothing.
    nothing = plan(pool((), suspended, roomy, cpu_room={}), ReclaimTarget(6, Tier.OFFLOAD))
    assert taken(nothing) == []
    assert {e.reason for e in nothing.excluded} == {Unreclaimable.TENANT_CPU_QUOTA}


def test_compress_only_above_the_high_watermark_and_only_with_the_capability() -> None:
    suspended = (reservation("acme", "s", 1, suspended=True),)
    # Two offloaded sessions of 400 bytes: 900 of 1000 used, above 0.85. At 0.5 the coldest
    # saves 200, which leaves 700, still above the low watermark (0.6); the next saves 200
    # more, and then the suspended session (100) fits below it.
    offloaded = (
        OffloadedSession("acme", "new", 2, 400),
        OffloadedSession("acme", "old", 1, 400),
        OffloadedSession("bolt", "other", 0, 100),
    )
    full, target = cpu(900, low=0.6, high=0.85), ReclaimTarget(1, Tier.COMPRESS, "acme")
    result = plan(pool((), suspended, full, offloaded=offloaded), target)
    assert taken(result) == [
        (Tier.COMPRESS, ("acme", "old"), 0),
        (Tier.COMPRESS, ("acme", "new"), 0),
        (Tier.OFFLOAD, ("acme", "s"), 1),
    ]
    assert [(s.lossy, s.cpu_bytes) for s in result.steps[:2]] == [(True, -200)] * 2
    incapable = plan(pool((), suspended, replace(full, compression_ratio=None)), target)
    assert taken(incapable) == []
    assert incapable.excluded == (
        Exclusion(Unreclaimable.NO_COMPRESSION, 0),
        Exclusion(Unreclaimable.CPU_TIER_FULL, 1, ("acme", "s")),
    )
    # Below the high watermark nothing is compressed even when allowed.
    roomy = plan(pool((), suspended, replace(full, used_bytes=100)), target)
    assert [s.tier for s in roomy.steps] == [Tier.OFFLOAD]
    # A job of the COMPRESS tier alone compresses, and offloads nothing.
    alone = ReclaimTarget(1, Tier.COMPRESS, None, Tier.COMPRESS)
    only = plan(pool((), suspended, full, offloaded=offloaded), alone)
    assert [(s.tier, s.reservation) for s in only.steps] == [
        (Tier.COMPRESS, ("bolt", "other")),
        (Tier.COMPRESS, ("acme", "old")),
        (Tier.COMPRESS, ("acme", "new")),
    ]


def test_a_compressed_session_is_booked_by_the_measured_shares() -> None:
    # 3 chunks of 16 KiB in L1; the unpinned two go to an L2 at half their size.
    measured = CompressMeasurement(32 << 10, 16 << 10, 16 << 10)
    assert measured.ratio == 0.5
    # Booked in the ledger's geometry: a third stays in the CPU tier, two thirds at half size.
    assert measured.booked(3000) == (1000, 1000)
    assert CompressMeasurement(0, 0, 16 << 10).booked(3000) == (3000, 0)
    assert CompressMeasurement(0, 0, 0).ratio == 1.0


def test_evict_takes_the_lowest_priority_and_most_recently_admitted_first() -> None:
    running = (
        reservation("acme", "important", 1, priority=5, seq=1),
        reservation("acme", "old", 1, priority=0, seq=2),
        reservation("acme", "new", 1, priority=0, seq=3),
    )
    result = plan(pool((), running), ReclaimTarget(2, Tier.EVICT))
    assert taken(result) == [
        (Tier.EVICT, ("acme", "new"), 1),
        (Tier.EVICT, ("acme", "old"), 1),
    ]


def test_shared_and_pinned_blocks_are_never_counted() -> None:
    shared = SharedEntry(7, 0, 2)  # acme's and globex's requests both reference it
    running = (
        # Blocks 1 and 2 its own, 7 shared, and 8 pinned (acme's request and a pin hold it).
        reservation("acme", "a", 2, shared=(shared,), pinned=1),
        reservation("globex", "g", 1, shared=(shared,)),  # block 3 its own
    )
    snapshot = pool((), running, pinned_only=(("tenants/acme", 4), ("tenants/globex", 9)))
    result = plan(snapshot, ReclaimTarget(100, Tier.EVICT, tenant="acme"))
    assert taken(result) == [(Tier.EVICT, ("acme", "a"), 2)]  # blocks 1 and 2 only
    assert set(result.excluded) == {
        Exclusion(Unreclaimable.PINNED, 4),  # acme's pinned-only blocks; globex's not its business
        Exclusion(Unreclaimable.PINNED, 1, ("acme", "a")),
        Exclusion(Unreclaimable.SHARED, 1, ("acme", "a")),
    }
    # The whole instance: the shared block comes back once both references are dropped.
    everything = plan(snapshot, ReclaimTarget(100, Tier.EVICT))
    assert everything.total_blocks == 4  # 1, 2, 3 and the shared 7; never the pinned 8
    assert Exclusion(Unreclaimable.SHARED, 1, ("acme", "a")) not in everything.excluded


def test_a_block_named_twice_in_one_table_comes_back_with_that_table() -> None:
    twice = SharedEntry(5, 1, 2)  # n > 1: two sequences of one request share a prompt block
    running = (reservation("acme", "n2", 1, shared=(twice, twice)),)
    result = plan(pool((), running), ReclaimTarget(10, Tier.EVICT))
    assert taken(result) == [(Tier.EVICT, ("acme", "n2"), 2)]
    assert result.excluded == ()


def test_offloading_a_request_that_shares_its_prefix_frees_only_its_own_blocks() -> None:
    prefix = SharedEntry(1, 0, 2)
    table = (
        reservation("acme", "idle", 2, shared=(prefix,), suspended=True),
        reservation("acme", "busy", 1, shared=(prefix,)),
    )
    result = plan(pool((), table, cpu(0)), ReclaimTarget(2, Tier.OFFLOAD))
    assert taken(result) == [(Tier.OFFLOAD, ("acme", "idle"), 2)]
    assert result.steps[0].cpu_bytes == 300  # the CPU copy holds the whole context
    assert result.excluded == (Exclusion(Unreclaimable.SHARED, 1, ("acme", "idle")),)


def test_evict_takes_idle_sessions_the_cpu_tier_cannot_hold_before_running_work() -> None:
    idle = reservation("acme", "idle", 2, suspended=True, seq=1)
    busy = reservation("acme", "busy", 2, seq=2)
    full = cpu(1000, ratio=None)  # and nothing to compress
    result = plan(pool((), (idle, busy), full), ReclaimTarget(2, Tier.EVICT))
    assert taken(result) == [(Tier.EVICT, ("acme", "idle"), 2)]
    # Room in the CPU tier: the idle session is offloaded instead, nothing is evicted.
    roomy = plan(pool((), (idle, busy), cpu(0)), ReclaimTarget(2, Tier.EVICT))
    assert taken(roomy) == [(Tier.OFFLOAD, ("acme", "idle"), 2)]


def test_the_lowest_tier_skips_what_comes_before_it() -> None:
    cached = (CachedScope("tenants/acme", 1),)
    idle = reservation("acme", "idle", 2, suspended=True)
    target = ReclaimTarget(2, Tier.EVICT, None, Tier.OFFLOAD)
    assert taken(plan(pool(cached, (idle,), cpu(0)), target)) == [
        (Tier.OFFLOAD, ("acme", "idle"), 2)
    ]
    only_evict = replace(target, min_tier=Tier.EVICT)
    assert taken(plan(pool(cached, (idle,), cpu(0)), only_evict)) == [
        (Tier.EVICT, ("acme", "idle"), 2)
    ]


def test_the_policy_reclaims_down_to_the_watermark_and_a_tenant_s_excess() -> None:
    loads = [
        InstanceLoad("hot", 100, 98, 3),  # above 0.9 with work queued: 8 blocks
        InstanceLoad("busy-idle", 100, 99, 0),  # nothing waits: left alone
        InstanceLoad("cool", 100, 50, 5),
    ]
    excesses = [TenantExcess("acme", 10, (("hot", 4), ("cool", 20)))]
    jobs = policy_jobs(loads, excesses, 0.9, Tier.OFFLOAD)
    assert [(j.instance, j.target) for j in jobs] == [
        ("hot", ReclaimTarget(8, Tier.OFFLOAD, None, Tier.OFFLOAD)),
        ("cool", ReclaimTarget(10, Tier.OFFLOAD, "acme", Tier.OFFLOAD)),
    ]
    spread = policy_jobs([], [TenantExcess("acme", 10, (("a", 6), ("b", 6)))], 0.9, Tier.EVICT)
    assert [(j.instance, j.target.target_blocks) for j in spread] == [("a", 6), ("b", 4)]
