"""Admission decisions, pure: validation, refusal order, shortfalls and computed retry delays."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from quota_service.core import admission, block_table, queueing
from quota_service.core.admission import AdmissionLimits, AdmissionPlan, AdmitRequest, Shortfall
from quota_service.core.block_table import BlockHandle, CachedBlock, TableLayout
from quota_service.core.errors import Code, KvQuotaError
from quota_service.core.hashing import HashAlgo
from quota_service.core.model import (
    AdmitParams,
    EndReason,
    Holding,
    InstancePool,
    InstanceState,
    Reservation,
    ReservationState,
    TenantAccount,
    TenantQuota,
    TenantState,
)

LIMITS = AdmissionLimits(
    max_n=16,
    default_lease_ttl_seconds=60,
    min_lease_ttl_seconds=1,
    max_lease_ttl_seconds=3600,
    min_retry_delay_seconds=0.1,
    max_retry_delay_seconds=300,
)
NOW = datetime(2026, 1, 1, tzinfo=UTC)
POOL = InstancePool("gpu-0", InstanceState.ACTIVE, 16, 512, 8192, 512, 0, HashAlgo.SHA256, None)
ACCOUNT = TenantAccount("acme", TenantState.ACTIVE, TenantQuota(1000, 100_000, 1, 1, 1), 0, 0, None)


def req(prompt: int = 100, output: int = 50, n: int = 1, **kw: object) -> AdmitRequest:
    params = AdmitParams("acme", "r-1", "gpu-0", prompt, output, n, 0)
    fields: dict[str, object] = {
        "params": params,
        "prompt_token_ids": (),
        "wait_timeout_seconds": 0.0,
        "lease_ttl_seconds": None,
    }
    fields.update(kw)
    return AdmitRequest(**fields)  # type: ignore[arg-type]


def table(request: AdmitRequest, pool: InstancePool = POOL) -> TableLayout:
    p = request.params
    return block_table.layout(
        p.prompt_tokens, p.max_output_tokens, p.n, pool.block_size, (), "salt", HashAlgo.SHA256
    )


def decide(
    request: AdmitRequest,
    pool: InstancePool = POOL,
    account: TenantAccount = ACCOUNT,
    hits: tuple[CachedBlock, ...] = (),
) -> AdmissionPlan | Shortfall:
    return admission.decide(request, pool, account, LIMITS, table(request, pool), hits)


def refusal(
    request: AdmitRequest, pool: InstancePool = POOL, account: TenantAccount = ACCOUNT
) -> KvQuotaError:
    with pytest.raises(KvQuotaError) as error:
        admission.validate(request, LIMITS)
        decide(request, pool, account)
    return error.value


def test_plan_reserves_blocks_tokens_and_default_lease() -> None:
    plan = decide(req(4096, 2048))
    assert plan == AdmissionPlan(384, 6144, 60, (), (None,) * 384)


def test_validation_lists_every_bad_field() -> None:
    error = refusal(
        req(
            0,
            0,
            n=17,
            params=AdmitParams("Acme", "a/b", "gpu-0", 0, 0, 17, 12),
            lease_ttl_seconds=0.5,
        )
    )
    assert (error.code, error.reason) == (Code.INVALID_ARGUMENT, "INVALID_REQUEST")
    fields = {v.field for v in error.field_violations}
    assert fields == {
        "tenant",
        "request_id",
        "prompt_tokens",
        "max_output_tokens",
        "n",
        "priority",
        "lease_ttl",
    }


def test_prompt_token_ids_must_match_the_prompt() -> None:
    error = refusal(req(3, 1, prompt_token_ids=(1, 2)))
    assert [v.field for v in error.field_violations] == ["prompt_token_ids"]
    negative = refusal(req(2, 1, prompt_token_ids=(1, -2)))
    assert [v.field for v in negative.field_violations] == ["prompt_token_ids"]


def test_context_cap() -> None:
    error = refusal(req(8000, 512))
    assert (error.code, error.reason) == (Code.INVALID_ARGUMENT, "CONTEXT_LENGTH_EXCEEDED")
    assert error.metadata == {"maxModelLen": "8192", "requestedTokens": "8512"}
    assert isinstance(decide(req(8000, 192)), AdmissionPlan)


@pytest.mark.parametrize(
    ("pool", "account", "prompt", "n"),
    [
        (POOL, ACCOUNT, 8000, 16),  # 612 blocks > 512 the instance has at all
        (POOL, replace(ACCOUNT, quota=TenantQuota(10, 100_000, 1, 1, 1)), 200, 1),  # > hard quota
        (POOL, replace(ACCOUNT, quota=TenantQuota(1000, 100, 1, 1, 1)), 200, 1),  # > token quota
    ],
)
def test_impossible_requests_are_refused_at_once(
    pool: InstancePool, account: TenantAccount, prompt: int, n: int
) -> None:
    error = refusal(req(prompt, 100, n=n), pool, account)
    assert (error.code, error.reason) == (Code.FAILED_PRECONDITION, "REQUEST_EXCEEDS_CAPACITY")


def test_suspended_and_draining_come_before_capacity() -> None:
    suspended = refusal(req(8000, 512), account=replace(ACCOUNT, state=TenantState.SUSPENDED))
    assert suspended.reason == "TENANT_SUSPENDED"
    draining = refusal(req(8000, 512), pool=replace(POOL, state=InstanceState.DRAINING))
    assert draining.reason == "INSTANCE_DRAINING"


def test_shortfalls_name_their_scope() -> None:
    tenant_full = replace(ACCOUNT, blocks_in_use=995)
    assert decide(req(), account=tenant_full) == Shortfall("tenant", 10, 150, 5, 100_000)
    instance_full = replace(POOL, free_blocks=7)
    assert decide(req(), pool=instance_full) == Shortfall("instance", 10, 150, 7, 0)


PROMPT = tuple(range(7, 107))


def test_replay_returns_a_live_reservation_and_refuses_an_ended_one() -> None:
    existing = Reservation(
        "acme",
        "r-1",
        "gpu-0",
        100,
        50,
        1,
        0,
        ReservationState.ENDED,
        10,
        150,
        0,
        60.0,
        NOW,
        NOW,
        NOW,
        EndReason.RELEASED,
        5,
        prompt_digest=admission.prompt_digest(PROMPT),
    )

    def again(params: AdmitParams, tokens: tuple[int, ...]) -> AdmitRequest:
        return AdmitRequest(params, tokens, 0.0, None)

    live = replace(existing, state=ReservationState.ADMITTED, end_reason=None)
    assert admission.check_replay(again(existing.params, PROMPT), live) is live
    with pytest.raises(KvQuotaError) as ended:
        admission.check_replay(again(existing.params, PROMPT), existing)
    assert (ended.value.code, ended.value.reason, ended.value.metadata["endReason"]) == (
        Code.FAILED_PRECONDITION,
        "RESERVATION_ENDED",
        "RELEASED",
    )
    other_counts = again(replace(existing.params, max_output_tokens=51), PROMPT)
    other_prompt = again(existing.params, (*PROMPT[:-1], PROMPT[-1] + 1))
    no_prompt = again(existing.params, ())
    for different in (other_counts, other_prompt, no_prompt):
        with pytest.raises(KvQuotaError) as reused:
            admission.check_replay(different, existing)
        assert (reused.value.code, reused.value.reason) == (
            Code.ALREADY_EXISTS,
            "REQUEST_ID_REUSED",
        )


def test_expected_end_uses_mean_hold_but_never_past_the_lease() -> None:
    admitted, lease = NOW, NOW + timedelta(seconds=60)
    assert admission.expected_end(admitted, lease, None) == lease
    assert admission.expected_end(admitted, lease, 5.0) == NOW + timedelta(seconds=5)
    assert admission.expected_end(admitted, lease, 600.0) == lease


def test_retry_delay_waits_for_enough_holdings_to_end() -> None:
    shortfall = Shortfall(
        "instance", blocks_needed=30, tokens_needed=0, blocks_available=5, tokens_available=0
    )
    holdings = [
        Holding(NOW + timedelta(seconds=20), 10, 0),
        Holding(NOW + timedelta(seconds=4), 10, 0),
        Holding(NOW + timedelta(seconds=9), 10, 0),
    ]
    # 25 blocks missing: the two soonest give 20, the third (at 20 s) covers it.
    assert admission.retry_delay(shortfall, holdings, NOW, LIMITS) == 20
    # 11 missing: the first (at 4 s) gives 10, the second (at 9 s) covers it.
    assert admission.retry_delay(replace(shortfall, blocks_needed=16), holdings, NOW, LIMITS) == 9


def test_retry_delay_is_clamped() -> None:
    shortfall = Shortfall("tenant", 10, 10, 0, 0)
    overdue = [Holding(NOW - timedelta(seconds=3), 50, 50)]
    assert admission.retry_delay(shortfall, overdue, NOW, LIMITS) == LIMITS.min_retry_delay_seconds
    assert admission.retry_delay(shortfall, [], NOW, LIMITS) == LIMITS.max_retry_delay_seconds
    far = [Holding(NOW + timedelta(hours=2), 50, 50)]
    assert admission.retry_delay(shortfall, far, NOW, LIMITS) == LIMITS.max_retry_delay_seconds


def test_shortfall_errors_carry_quota_failure_and_retry() -> None:
    tenant = admission.shortfall_error(Shortfall("tenant", 10, 150, 4, 100), 2.5, "acme", "gpu-0")
    assert (tenant.code, tenant.reason, tenant.retry_delay_seconds) == (
        Code.RESOURCE_EXHAUSTED,
        "TENANT_QUOTA_EXCEEDED",
        2.5,
    )
    assert [v.description for v in tenant.quota_violations] == [
        "blocks: needs 10, 4 left in quota",
        "tokens in flight: needs 150, 100 left in quota",
    ]
    instance = admission.shortfall_error(Shortfall("instance", 10, 150, 4, 0), 1.0, "acme", "gpu-0")
    assert (instance.code, instance.reason) == (Code.UNAVAILABLE, "INSTANCE_OVERLOADED")
    assert instance.metadata["freeBlocks"] == "4"


def cached(block_id: int, evictable: bool, held: bool) -> CachedBlock:
    return CachedBlock(bytes([block_id]) * 32, BlockHandle(block_id, 0), evictable, held)


def test_prefix_hits_need_no_new_blocks_and_shared_ones_cost_the_tenant_nothing() -> None:
    request = req(160, 16)  # 10 full prompt blocks + 1 tail
    hits = tuple(cached(i, evictable=i < 4, held=i < 6) for i in range(10))
    plan = decide(request, hits=hits)
    assert isinstance(plan, AdmissionPlan)
    assert (plan.blocks, len(plan.hits), plan.new_hashes) == (11, 10, (None,))
    # Tenant: 1 new block + 4 hits it does not hold yet. Instance: only the 1 new block, but the
    # 4 cached hits leave the evictable pool.
    tight_tenant = replace(ACCOUNT, blocks_in_use=996)
    assert decide(request, account=tight_tenant, hits=hits) == Shortfall(
        "tenant", 5, 176, 4, 100_000
    )
    tight_pool = replace(POOL, free_blocks=0, cached_blocks=4)
    assert decide(request, pool=tight_pool, hits=hits) == Shortfall("instance", 1, 176, 0, 0)
    assert isinstance(
        decide(request, pool=replace(tight_pool, cached_blocks=5), hits=hits), AdmissionPlan
    )


SHADOW = replace(ACCOUNT, quota=replace(ACCOUNT.quota, max_blocks=8), shadow_mode=True)


def test_shadow_mode_admits_what_the_tenants_quota_refuses_and_says_why() -> None:
    # 7 blocks fit the quota: nothing to report.
    assert isinstance(fits := decide(req(100, 12), account=SHADOW), AdmissionPlan)
    assert fits.shadow_refusal is None
    # Over what the tenant has left now, and over what its quota could ever give.
    over_now = decide(req(100, 12), account=replace(SHADOW, blocks_in_use=4))
    assert isinstance(over_now, AdmissionPlan)
    assert over_now.shadow_refusal == "TENANT_QUOTA_EXCEEDED"
    over_ever = decide(req(200, 12), account=SHADOW)
    assert isinstance(over_ever, AdmissionPlan)
    assert over_ever.shadow_refusal == "REQUEST_EXCEEDS_CAPACITY"
    # Without shadow mode, the same requests are refused.
    assert decide(req(100, 12), account=replace(SHADOW, blocks_in_use=4, shadow_mode=False)) == (
        Shortfall("tenant", 7, 112, 4, 100_000)
    )


def test_shadow_mode_never_hands_out_blocks_the_instance_does_not_have() -> None:
    full = replace(POOL, free_blocks=2)
    assert decide(req(100, 12), pool=full, account=SHADOW) == Shortfall("instance", 7, 112, 2, 0)
    too_big = refusal(req(8000, 100, n=16), account=SHADOW)
    assert too_big.reason == "REQUEST_EXCEEDS_CAPACITY"
    assert "instanceCapacityBlocks" in too_big.metadata
    suspended = refusal(req(), account=replace(SHADOW, state=TenantState.SUSPENDED))
    assert suspended.reason == "TENANT_SUSPENDED"


def test_shadow_mode_queues_past_the_tenants_own_queue_bound_only() -> None:
    load = queueing.QueueLoad(
        0, 0, 10, None, tenant_queued_requests=1, tenant_max_queued_requests=1
    )
    assert queueing.check_bounds(load, 10, "gpu-0", "acme", 1.0, shadow_mode=True) == "QUEUE_FULL"
    with pytest.raises(KvQuotaError, match="QUEUE_FULL"):
        queueing.check_bounds(load, 10, "gpu-0", "acme", 1.0)
    instance_full = replace(load, queued_requests=10, tenant_queued_requests=0)
    with pytest.raises(KvQuotaError, match="QUEUE_FULL"):
        queueing.check_bounds(instance_full, 10, "gpu-0", "acme", 1.0, shadow_mode=True)
