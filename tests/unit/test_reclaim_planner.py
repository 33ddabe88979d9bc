"""The reclaim planner on hand-built pools: tier order, LRU and cold-first order, pinned and
shared blocks excluded, exact expected counts."""

from __future__ import annotations

from dataclasses import replace

import pytest

from quota_service.core.errors import Code, KvQuotaError
from quota_service.core.reclaim import (
    CpuTier,
    Exclusion,
    HeldBlock,
    InstanceLoad,
    LiveReservation,
    PoolSnapshot,
    ReclaimPlan,
    ReclaimTarget,
    TenantExcess,
    Tier,
    Unreclaimable,
    UnreferencedBlock,
    check_executable,
    plan,
    policy_jobs,
)

BPB = 100  # bytes per block


def private(*ids: int) -> tuple[HeldBlock, ...]:
    return tuple(HeldBlock(i, 0, 1, False) for i in ids)


def reservation(
    tenant: str,
    rid: str,
    blocks: tuple[HeldBlock, ...],
    *,
    priority: int = 0,
    seq: int = 0,
    suspended: bool = False,
) -> LiveReservation:
    return LiveReservation(tenant, rid, priority, seq, suspended, blocks)


def pool(
    cached: tuple[UnreferencedBlock, ...] = (),
    reservations: tuple[LiveReservation, ...] = (),
    cpu: CpuTier | None = None,
    pinned_only: tuple[tuple[str, int], ...] = (),
) -> PoolSnapshot:
    active = frozenset(f"tenants/{r.tenant}" for r in reservations)
    return PoolSnapshot(BPB, cached, reservations, active, pinned_only, cpu)


def cpu(used: int, *, low: float = 0.5, high: float = 0.8, ratio: float = 0.5) -> CpuTier:
    return CpuTier(used, 1000, low, high, used, ratio)


def taken(p: ReclaimPlan) -> list[tuple[Tier, object, int]]:
    return [(s.tier, s.block or s.reservation, s.gpu_blocks) for s in p.steps]


def test_free_takes_cold_scopes_first_then_least_recently_used() -> None:
    cached = (
        UnreferencedBlock(1, 0, 10, "tenants/acme"),
        UnreferencedBlock(2, 0, 11, "tenants/acme"),
        UnreferencedBlock(5, 3, 30, "tenants/globex"),
        UnreferencedBlock(6, 0, 20, "tenants/globex"),
    )
    running = (reservation("acme", "r1", private(40)),)
    result = plan(pool(cached, running), ReclaimTarget(3, Tier.FREE))
    assert taken(result) == [
        (Tier.FREE, (6, 0), 1),  # globex is cold (no live reservation), its LRU block first
        (Tier.FREE, (5, 3), 1),
        (Tier.FREE, (1, 0), 1),  # then acme's, least recently used first
    ]
    assert (result.total_blocks, result.total_bytes) == (3, 300)
    assert result.excluded == ()  # the target was reached


def test_a_tenant_scope_frees_only_its_own_cached_blocks() -> None:
    cached = (
        UnreferencedBlock(1, 0, 1, "tenants/acme"),
        UnreferencedBlock(2, 0, 2, "namespaces/shared"),
        UnreferencedBlock(3, 0, 3, "tenants/globex"),
    )
    result = plan(pool(cached), ReclaimTarget(10, Tier.FREE, tenant="acme"))
    assert taken(result) == [(Tier.FREE, (1, 0), 1)]


def test_the_highest_tier_allowed_bounds_the_plan_and_says_what_is_left() -> None:
    cached = (UnreferencedBlock(1, 0, 1, "tenants/acme"),)
    running = (reservation("acme", "r1", private(10, 11, 12)),)
    result = plan(pool(cached, running), ReclaimTarget(4, Tier.OFFLOAD))
    assert taken(result) == [(Tier.FREE, (1, 0), 1)]
    assert result.excluded == (Exclusion(Unreclaimable.ABOVE_MAX_TIER, 3),)


def test_offload_fills_the_cpu_tier_up_to_its_low_watermark_coldest_first() -> None:
    suspended = (
        reservation("acme", "later", private(20, 21, 22), seq=2, suspended=True),
        reservation("acme", "first", private(10, 11, 12), seq=1, suspended=True),
    )
    # 1000 bytes, low watermark 0.5: room for 500 bytes = one 3-block reservation.
    result = plan(pool((), suspended, cpu(0)), ReclaimTarget(6, Tier.OFFLOAD))
    assert taken(result) == [(Tier.OFFLOAD, ("acme", "first"), 3)]
    assert result.steps[0].cpu_bytes == 300
    assert result.excluded == (Exclusion(Unreclaimable.CPU_TIER_FULL, 3, ("acme", "later")),)
    without_lmcache = plan(pool((), suspended), ReclaimTarget(6, Tier.OFFLOAD))
    assert taken(without_lmcache) == []
    assert {e.reason for e in without_lmcache.excluded} == {Unreclaimable.NO_CPU_TIER}


def test_compress_only_above_the_high_watermark_and_only_with_the_capability() -> None:
    suspended = (reservation("acme", "s", private(1, 2, 3), suspended=True),)
    # 900 of 1000 bytes used, above 0.85: compressing at 0.5 saves 450; then 300 more stay
    # below the low watermark, 0.8.
    full, target = cpu(900, low=0.8, high=0.85), ReclaimTarget(3, Tier.COMPRESS)
    result = plan(pool((), suspended, full), target)
    assert taken(result) == [(Tier.COMPRESS, None, 0), (Tier.OFFLOAD, ("acme", "s"), 3)]
    assert (result.steps[0].lossy, result.steps[0].cpu_bytes) == (True, -450)
    incapable = plan(pool((), suspended, replace(full, compression_ratio=1.0)), target)
    assert taken(incapable) == []
    assert incapable.excluded == (
        Exclusion(Unreclaimable.NO_COMPRESSION, 0),
        Exclusion(Unreclaimable.CPU_TIER_FULL, 3, ("acme", "s")),
    )
    # Below the high watermark nothing is compressed even when allowed.
    roomy = plan(pool((), suspended, replace(full, used_bytes=100)), target)
    assert [s.tier for s in roomy.steps] == [Tier.OFFLOAD]
    # No engine kvquota drives can compress yet: such a plan can be shown, not executed.
    with pytest.raises(KvQuotaError) as refused:
        check_executable(result)
    assert (refused.value.code, refused.value.reason) == (
        Code.FAILED_PRECONDITION,
        "TIER_NOT_EXECUTABLE",
    )
    assert "COMPRESS" in refused.value.message


def test_evict_takes_the_lowest_priority_and_most_recently_admitted_first() -> None:
    running = (
        reservation("acme", "important", private(1), priority=5, seq=1),
        reservation("acme", "old", private(2), priority=0, seq=2),
        reservation("acme", "new", private(3), priority=0, seq=3),
    )
    result = plan(pool((), running), ReclaimTarget(2, Tier.EVICT))
    assert taken(result) == [
        (Tier.EVICT, ("acme", "new"), 1),
        (Tier.EVICT, ("acme", "old"), 1),
    ]


def test_shared_and_pinned_blocks_are_never_counted() -> None:
    shared = HeldBlock(7, 0, 2, False)  # acme's and globex's requests both reference it
    pinned = HeldBlock(8, 0, 2, True)  # acme's request and a pin
    running = (
        reservation("acme", "a", (pinned, shared, *private(1, 2))),
        reservation("globex", "g", (shared, *private(3))),
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


def test_offloading_a_request_that_shares_its_prefix_frees_only_its_own_blocks() -> None:
    prefix = HeldBlock(1, 0, 2, False)
    table = (
        reservation("acme", "idle", (prefix, *private(2, 3)), suspended=True),
        reservation("acme", "busy", (prefix, *private(4))),
    )
    result = plan(pool((), table, cpu(0)), ReclaimTarget(2, Tier.OFFLOAD))
    assert taken(result) == [(Tier.OFFLOAD, ("acme", "idle"), 2)]
    assert result.steps[0].cpu_bytes == 300  # the CPU copy holds the whole context
    assert result.excluded == (Exclusion(Unreclaimable.SHARED, 1, ("acme", "idle")),)


def test_evict_takes_idle_sessions_the_cpu_tier_cannot_hold_before_running_work() -> None:
    idle = reservation("acme", "idle", private(1, 2), suspended=True, seq=1)
    busy = reservation("acme", "busy", private(3, 4), seq=2)
    full = cpu(1000, ratio=1.0)  # and nothing to compress
    result = plan(pool((), (idle, busy), full), ReclaimTarget(2, Tier.EVICT))
    assert taken(result) == [(Tier.EVICT, ("acme", "idle"), 2)]
    # Room in the CPU tier: the idle session is offloaded instead, nothing is evicted.
    roomy = plan(pool((), (idle, busy), cpu(0)), ReclaimTarget(2, Tier.EVICT))
    assert taken(roomy) == [(Tier.OFFLOAD, ("acme", "idle"), 2)]


def test_the_lowest_tier_skips_what_comes_before_it() -> None:
    cached = (UnreferencedBlock(9, 0, 1, "tenants/acme"),)
    idle = reservation("acme", "idle", private(1, 2), suspended=True)
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
