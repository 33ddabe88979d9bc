"""Admission decisions: validation, the permanent refusals, and check-and-reserve against the
instance's pool and the tenant's quota. Pure: the store locks the rows, calls `decide`, and writes
the plan in the same transaction, so the decision is atomic whichever replica makes it.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Literal

from quota_service.core import block_table, geometry
from quota_service.core.block_table import CachedBlock, TableLayout
from quota_service.core.catalog import MAX_CONTEXT_TOKENS
from quota_service.core.errors import (
    FieldViolation,
    KvQuotaError,
    QuotaViolation,
    preempted,
    refuse_invalid,
)
from quota_service.core.model import (
    AdmitParams,
    EndReason,
    Holding,
    InstancePool,
    InstanceState,
    Reservation,
    ReservationState,
    TenantAccount,
    TenantState,
)
from quota_service.core.names import check_request_id, check_resource_id, reservation_name
from quota_service.core.reasons import Reason

MAX_PRIORITY = 9


@dataclass(frozen=True, slots=True)
class AdmissionLimits:
    """Bounds that do not depend on any instance or tenant (server settings)."""

    max_n: int
    default_lease_ttl_seconds: float
    min_lease_ttl_seconds: float
    max_lease_ttl_seconds: float
    min_retry_delay_seconds: float
    max_retry_delay_seconds: float


@dataclass(frozen=True, slots=True)
class AdmitRequest:
    params: AdmitParams
    prompt_token_ids: tuple[int, ...]
    wait_timeout_seconds: float
    lease_ttl_seconds: float | None


@dataclass(frozen=True, slots=True)
class AdmissionPlan:
    """What to write: the table (cached prefix, then new blocks with what each will hold), the
    tokens to add to the tenant, and the lease."""

    blocks: int
    tokens: int
    lease_ttl_seconds: float
    hits: tuple[CachedBlock, ...] = ()
    new_hashes: tuple[bytes | None, ...] = ()
    # Shadow mode: the reason the tenant's own limits would have refused it with.
    shadow_refusal: str | None = None


@dataclass(frozen=True, slots=True)
class Shortfall:
    """Not enough room now, though there will be: the caller gets a retry delay."""

    scope: Literal["tenant", "instance"]
    blocks_needed: int
    tokens_needed: int
    blocks_available: int
    tokens_available: int
    # Requests queued ahead on the instance: nobody jumps the queue, even one that would fit.
    queued_ahead: int = 0


def validate(request: AdmitRequest, limits: AdmissionLimits) -> bytes | None:
    """Refuse malformed requests before any database work (INVALID_REQUEST), naming every
    fault. Returns the prompt's digest (`prompt_digest`): checking its token ids packs them."""
    p = request.params
    packed = _packed_for_checking(request.prompt_token_ids)
    refuse_invalid(
        [
            check_resource_id(p.tenant, "tenant"),
            check_resource_id(p.instance, "instance"),
            *_request_violations(request, limits, packed),
        ]
    )
    return _digest(packed) if packed is not None else None


def request_violations(request: AdmitRequest, limits: AdmissionLimits) -> list[FieldViolation]:
    """Every fault of an Admit but its tenant's and instance's ids, which the API reads from
    resource names (or an engine's address) and checks as it reads them."""
    return _request_violations(request, limits, _packed_for_checking(request.prompt_token_ids))


def _request_violations(
    request: AdmitRequest, limits: AdmissionLimits, packed: array[int] | None
) -> list[FieldViolation]:
    """`request_violations`, given the prompt's token ids as `_packed_for_checking` packs them."""
    p = request.params
    violations = [v for v in (check_request_id(p.request_id, "request_id"),) if v is not None]
    if p.prompt_tokens < 1:
        violations.append(FieldViolation("prompt_tokens", "must be at least 1"))
    if p.max_output_tokens < 1:
        violations.append(FieldViolation("max_output_tokens", "must be at least 1"))
    if not 1 <= p.n <= limits.max_n:
        violations.append(FieldViolation("n", f"must be between 1 and {limits.max_n}"))
    if not 0 <= p.priority <= MAX_PRIORITY:
        violations.append(FieldViolation("priority", f"must be between 0 and {MAX_PRIORITY}"))
    token_ids = request.prompt_token_ids
    if token_ids:
        if len(token_ids) > MAX_CONTEXT_TOKENS:
            # Longer than any instance's context: refused before any hashing.
            violations.append(
                FieldViolation("prompt_token_ids", f"at most {MAX_CONTEXT_TOKENS} token ids")
            )
        elif len(token_ids) != p.prompt_tokens:
            violations.append(FieldViolation("prompt_token_ids", "length must equal prompt_tokens"))
        negative = min(token_ids) < 0 if packed is None else packed.typecode == "q"
        if negative:
            violations.append(FieldViolation("prompt_token_ids", "token ids are never negative"))
    return [
        *violations,
        *(
            v
            for v in (
                check_wait_timeout(request.wait_timeout_seconds),
                check_lease_ttl(request.lease_ttl_seconds, limits),
            )
            if v is not None
        ),
    ]


def check_wait_timeout(seconds: float) -> FieldViolation | None:
    """How long a caller will queue (Admit, ResumeReservation): zero fails fast."""
    return FieldViolation("wait_timeout", "must not be negative") if seconds < 0 else None


def check_output_tokens(output_tokens: int) -> FieldViolation | None:
    """What a Release reports the engine generated: a count, for billing."""
    return FieldViolation("output_tokens", "must not be negative") if output_tokens < 0 else None


def check_lease_ttl(ttl_seconds: float | None, limits: AdmissionLimits) -> FieldViolation | None:
    """None (use the default) or a TTL within the server's bounds."""
    if ttl_seconds is None or (
        limits.min_lease_ttl_seconds <= ttl_seconds <= limits.max_lease_ttl_seconds
    ):
        return None
    return FieldViolation(
        "lease_ttl",
        f"must be between {limits.min_lease_ttl_seconds:g}s and {limits.max_lease_ttl_seconds:g}s",
    )


def session_token_violations(session_token_ids: Sequence[int]) -> list[FieldViolation]:
    """What is wrong with a suspended session's tokens whatever its reservation is (no
    reservation holds room for more than any context)."""
    violations = []
    if len(session_token_ids) > MAX_CONTEXT_TOKENS:
        violations.append(
            FieldViolation("session_token_ids", f"at most {MAX_CONTEXT_TOKENS} token ids")
        )
    if any(t < 0 for t in session_token_ids):
        violations.append(FieldViolation("session_token_ids", "token ids are never negative"))
    return violations


def check_session_tokens(
    reservation: Reservation, session_token_ids: Sequence[int]
) -> list[FieldViolation]:
    """A suspended session's tokens: its prompt and what was generated, never more than the
    reservation holds room for."""
    violations = session_token_violations(session_token_ids)
    most = reservation.prompt_tokens + reservation.max_output_tokens
    if most < len(session_token_ids) <= MAX_CONTEXT_TOKENS:
        violations.append(
            FieldViolation(
                "session_token_ids", f"at most prompt_tokens + max_output_tokens ({most}) tokens"
            )
        )
    return violations


def prompt_of(stored_token_ids: Sequence[int], prompt_tokens: int) -> tuple[int, ...]:
    """The prompt's token ids from what a reservation stored: a queued request's prompt, or a
    resumed session that starts with it. None known (empty) when the session is shorter."""
    if len(stored_token_ids) < prompt_tokens:
        return ()
    return tuple(stored_token_ids[:prompt_tokens])


def prompt_digest(token_ids: Sequence[int]) -> bytes | None:
    """SHA-256 of a prompt's token ids (as signed 64-bit integers); None when none were given.
    A repeated Admit must carry the same prompt, not only as many tokens."""
    return _digest(_packed(token_ids)) if token_ids else None


def _digest(packed: array[int]) -> bytes:
    return hashlib.sha256(packed).digest()


def _packed(token_ids: Sequence[int]) -> array[int]:
    """Token ids in the bytes of struct's "q" (signed 64-bit, native order). As unsigned ("Q")
    where none is negative, the same bytes: array packs those faster than struct does, or than
    min() looks for a negative one, and its typecode then says whether one is."""
    try:
        return array("Q", token_ids)
    except OverflowError:
        return array("q", token_ids)


def _packed_for_checking(token_ids: Sequence[int]) -> array[int] | None:
    """An Admit's token ids `_packed`; None when there are none, more than any context holds
    (refused without packing them), or one past 64 bits (min() then looks for a negative one)."""
    if not token_ids or len(token_ids) > MAX_CONTEXT_TOKENS:
        return None
    try:
        return _packed(token_ids)
    except OverflowError:
        return None


def check_replay(request: AdmitRequest, existing: Reservation) -> Reservation:
    """A repeated Admit gets the same reservation while it lives; a different one under the same
    id (other counts, or another prompt) is refused, and so is a repeat after it ended: an OK
    would read as admitted to a gateway that looks only at the status."""
    params = request.params
    if existing.params != params or existing.prompt_digest != prompt_digest(
        request.prompt_token_ids
    ):
        raise KvQuotaError(
            Reason.REQUEST_ID_REUSED,
            f"request_id {params.request_id!r} was already used with different parameters",
            metadata={"requestId": params.request_id},
        )
    if existing.state is ReservationState.ENDED:
        raise reservation_ended(existing)
    return existing


def reservation_ended(current: Reservation) -> KvQuotaError:
    """An ended reservation asked to change or to be admitted again; endReason says how it
    ended."""
    name = reservation_name(current.tenant, current.request_id)
    how = current.end_reason.value if current.end_reason else ""
    return KvQuotaError(
        Reason.RESERVATION_ENDED,
        f"{name} already ended ({how}): admit the request again under a new request_id",
        metadata={"name": name, "endReason": how},
    )


def not_live(current: Reservation) -> KvQuotaError:
    """Why a reservation that is not admitted (any more) cannot be renewed, suspended, resumed
    or have blocks released: what the caller should do next differs (admit again, wait)."""
    name = reservation_name(current.tenant, current.request_id)
    if current.end_reason is EndReason.PREEMPTED:
        return preempted(name)
    if current.state is ReservationState.ADMITTED or (
        current.end_reason is EndReason.LEASE_EXPIRED
    ):
        return KvQuotaError(
            Reason.LEASE_EXPIRED,
            f"the lease of {name} expired; admit the request again",
            metadata={"name": name},
        )
    if current.state is ReservationState.QUEUED:
        return KvQuotaError(Reason.NOT_ADMITTED, f"{name} is still queued", metadata={"name": name})
    return reservation_ended(current)


def tenant_not_active(tenant: str, state: TenantState) -> KvQuotaError:
    """A suspended or offboarded tenant asked for new work."""
    return KvQuotaError(
        Reason.TENANT_SUSPENDED,
        f"tenant {tenant} is {state.value.lower()}",
        metadata={"tenant": tenant, "state": state.value},
    )


@dataclass(frozen=True, slots=True)
class PrefixHits:
    """What a cached prefix changes for an admission: the blocks it covers, how many of them are
    evictable now (cached and unreferenced), and how many the tenant does not reference yet."""

    blocks: int = 0
    evictable: int = 0
    new_to_tenant: int = 0

    @classmethod
    def of(cls, hits: Sequence[CachedBlock]) -> PrefixHits:
        return cls(
            len(hits),
            sum(1 for h in hits if h.evictable),
            sum(1 for h in hits if not h.held_by_tenant),
        )


@dataclass(frozen=True, slots=True)
class Grant:
    """An admission that fits: the blocks and tokens it takes, and its lease."""

    blocks: int
    tokens: int
    lease_ttl_seconds: float
    # In the tenant's shadow mode, the refusal its own limits would have given.
    shadow_refusal: str | None = None


def decide(
    request: AdmitRequest,
    pool: InstancePool,
    account: TenantAccount,
    limits: AdmissionLimits,
    table: TableLayout,
    hits: Sequence[CachedBlock] = (),
) -> AdmissionPlan | Shortfall:
    """`judge`, with the plan to write: the cached prefix `hits` of `table` on this instance and
    what each new block will hold."""
    verdict = judge(request, pool, account, limits, table.total, PrefixHits.of(hits))
    if isinstance(verdict, Shortfall):
        return verdict
    return AdmissionPlan(
        verdict.blocks,
        verdict.tokens,
        verdict.lease_ttl_seconds,
        tuple(hits),
        tuple(block_table.new_block_hashes(table, len(hits))),
        verdict.shadow_refusal,
    )


def judge(
    request: AdmitRequest,
    pool: InstancePool,
    account: TenantAccount,
    limits: AdmissionLimits,
    blocks: int,
    hits: PrefixHits,
) -> Grant | Shortfall:
    """Check-and-reserve: raise for refusals that waiting cannot fix, return a Shortfall for those
    it can, or the grant. `blocks` is the whole table; `hits` what its cached prefix covers.

    In the tenant's shadow mode, what only its own quota refuses (REQUEST_EXCEEDS_CAPACITY of
    a tenant limit, TENANT_QUOTA_EXCEEDED) is admitted and the grant says why it would not have
    been; the instance's limits still refuse, since blocks it does not have cannot be handed
    out. A suspended tenant is refused all the same: that is an operator's decision, not a
    limit being tried out."""
    p = request.params
    if account.state is not TenantState.ACTIVE:
        raise tenant_not_active(p.tenant, account.state)
    if pool.state is InstanceState.DRAINING:
        raise KvQuotaError(
            Reason.INSTANCE_DRAINING,
            f"instance {p.instance} is draining and admits nothing new",
            metadata={"instance": p.instance},
        )
    asked = p.prompt_tokens + p.max_output_tokens
    if asked > pool.max_model_len:
        raise KvQuotaError(
            Reason.CONTEXT_LENGTH_EXCEEDED,
            f"prompt + max_output = {asked} tokens exceeds the context cap of {pool.max_model_len}",
            metadata={"maxModelLen": str(pool.max_model_len), "requestedTokens": str(asked)},
        )
    tokens = geometry.tokens_in_flight(p.prompt_tokens, p.max_output_tokens, p.n)
    new_blocks = blocks - hits.blocks
    # Blocks the tenant does not reference yet: sharing within a tenant is free.
    new_to_tenant = new_blocks + hits.new_to_tenant
    quota = account.quota
    shadow_refusal = None
    hard_limits = (
        ("instanceCapacityBlocks", blocks, pool.capacity_blocks),
        ("tenantMaxBlocks", new_to_tenant, quota.max_blocks),
        ("tenantMaxTokensInFlight", tokens, quota.max_tokens_in_flight),
    )
    for limit_name, asked_for, limit in hard_limits:
        if asked_for > limit:
            if account.shadow_mode and limit_name.startswith("tenant"):
                shadow_refusal = "REQUEST_EXCEEDS_CAPACITY"
                continue
            raise KvQuotaError(
                Reason.REQUEST_EXCEEDS_CAPACITY,
                f"needs {blocks} blocks and {tokens} tokens in flight; {limit_name} is {limit}, "
                "so it can never be admitted",
                metadata={
                    "requestedBlocks": str(blocks),
                    "requestedTokens": str(tokens),
                    limit_name: str(limit),
                },
            )
    free_blocks_tenant = quota.max_blocks - account.blocks_in_use
    free_tokens_tenant = quota.max_tokens_in_flight - account.tokens_in_flight
    if new_to_tenant > free_blocks_tenant or tokens > free_tokens_tenant:
        if not account.shadow_mode:
            return Shortfall(
                "tenant", new_to_tenant, tokens, free_blocks_tenant, free_tokens_tenant
            )
        shadow_refusal = shadow_refusal or "TENANT_QUOTA_EXCEEDED"
    # A hit on a cached block takes it out of what can be evicted to make room.
    allocatable = pool.allocatable_blocks - hits.evictable
    if new_blocks > allocatable:
        return Shortfall("instance", new_blocks, tokens, allocatable, 0)
    ttl = request.lease_ttl_seconds or limits.default_lease_ttl_seconds
    return Grant(blocks, tokens, ttl, shadow_refusal)


def expected_end(
    admitted_at: datetime, lease_expires_at: datetime, mean_hold_seconds: float | None
) -> datetime:
    """A live reservation ends at its lease expiry at the latest, typically after the observed
    mean holding time."""
    if mean_hold_seconds is None:
        return lease_expires_at
    return min(lease_expires_at, admitted_at + timedelta(seconds=mean_hold_seconds))


def retry_delay(
    shortfall: Shortfall, holdings: list[Holding], now: datetime, limits: AdmissionLimits
) -> float:
    """Seconds until enough of the current holdings should have ended to cover the shortfall.

    Walk the holdings in order of expected end, adding up what each gives back, until both blocks
    and tokens cover what is missing. Holdings already past their expected end count as "now".
    When even all of them would not cover it, the last expected end is the best estimate.
    """
    blocks_missing = shortfall.blocks_needed - shortfall.blocks_available
    tokens_missing = shortfall.tokens_needed - shortfall.tokens_available
    delay = limits.max_retry_delay_seconds
    for holding in sorted(holdings, key=lambda h: h.expected_end):
        blocks_missing -= holding.blocks
        tokens_missing -= holding.tokens
        delay = (holding.expected_end - now).total_seconds()
        if blocks_missing <= 0 and tokens_missing <= 0:
            break
    return min(max(delay, limits.min_retry_delay_seconds), limits.max_retry_delay_seconds)


def shortfall_error(
    shortfall: Shortfall, delay_seconds: float, tenant: str, instance: str
) -> KvQuotaError:
    """The refusal for a Shortfall: TENANT_QUOTA_EXCEEDED (429) or INSTANCE_OVERLOADED (503)."""
    if shortfall.scope == "tenant":
        violations = []
        if shortfall.blocks_needed > shortfall.blocks_available:
            violations.append(
                QuotaViolation(
                    f"tenants/{tenant}",
                    f"blocks: needs {shortfall.blocks_needed}, "
                    f"{max(shortfall.blocks_available, 0)} left in quota",
                )
            )
        if shortfall.tokens_needed > shortfall.tokens_available:
            violations.append(
                QuotaViolation(
                    f"tenants/{tenant}",
                    f"tokens in flight: needs {shortfall.tokens_needed}, "
                    f"{max(shortfall.tokens_available, 0)} left in quota",
                )
            )
        return KvQuotaError(
            Reason.TENANT_QUOTA_EXCEEDED,
            f"tenant {tenant} is over its quota now",
            metadata={"tenant": tenant, "requestedBlocks": str(shortfall.blocks_needed)},
            quota_violations=tuple(violations),
            retry_delay_seconds=delay_seconds,
        )
    message = (
        f"instance {instance} has {shortfall.blocks_available} free blocks, "
        f"the request needs {shortfall.blocks_needed}"
    )
    if shortfall.queued_ahead:
        message += f", and {shortfall.queued_ahead} queued requests go first"
    return KvQuotaError(
        Reason.INSTANCE_OVERLOADED,
        message,
        metadata={
            "instance": instance,
            "freeBlocks": str(shortfall.blocks_available),
            "requestedBlocks": str(shortfall.blocks_needed),
            "queuedAhead": str(shortfall.queued_ahead),
        },
        retry_delay_seconds=delay_seconds,
    )
