"""Reservations: the hot path. Each operation is one transaction with a bounded number of
statements, whatever the request; counters change in the same statement as the reservation row,
so the ledger never shows one without the other.

Lock order, everywhere: reservation rows, then instance rows, then tenant rows (Admit locks the
instance and the tenant, then inserts a new reservation row nobody else can hold yet). PostgreSQL
runs a statement's data-modifying CTEs in no fixed order, so each tenant update reads the rows the
instance update returned: that dependency is what orders the two locks.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import RowMapping, text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from quota_service.core import admission
from quota_service.core.admission import AdmissionLimits, AdmissionPlan, AdmitRequest, Shortfall
from quota_service.core.errors import Code, KvQuotaError, invalid_request, not_found
from quota_service.core.model import (
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
from quota_service.core.names import instance_name, reservation_name, tenant_name
from quota_service.store.database import in_transaction

# Weight of the newest observation in the mean holding time (an exponentially weighted mean, so
# it follows a changing workload within tens of requests).
HOLD_EWMA_ALPHA = 0.2
# Retry-delay estimates look at the holdings that end soonest; more would not change the answer.
HOLDINGS_LIMIT = 1000

_LOCK_POOL_AND_ACCOUNT = text(
    """
    SELECT now() AS now,
           i.state AS pool_state, i.block_size, i.capacity_blocks, i.max_model_len,
           i.blocks_in_use AS pool_blocks, i.mean_hold_seconds AS pool_hold,
           t.state AS account_state, t.max_blocks, t.max_tokens_in_flight,
           t.max_queued_requests, t.max_pinned_blocks, t.max_cpu_tier_bytes,
           t.blocks_in_use AS account_blocks, t.tokens_in_flight,
           t.mean_hold_seconds AS account_hold,
           t.cache_salt, r.request_id AS existing
    FROM instances i
    CROSS JOIN tenants t
    LEFT JOIN reservations r ON r.tenant = t.tenant AND r.request_id = :request_id
    WHERE i.instance = :instance AND t.tenant = :tenant
    FOR UPDATE OF i, t
    """
)

_INSERT_RESERVATION = text(
    """
    WITH reservation AS (
        INSERT INTO reservations (
            tenant, request_id, instance, prompt_tokens, max_output_tokens, n, priority, state,
            reserved_blocks, reserved_tokens, lease_ttl_seconds, lease_expires_at, admitted_at)
        VALUES (
            :tenant, :request_id, :instance, :prompt_tokens, :max_output_tokens, :n, :priority,
            'ADMITTED', :blocks, :tokens, :ttl, now() + make_interval(secs => :ttl), now())
        ON CONFLICT DO NOTHING
        RETURNING *
    ), pool AS (
        UPDATE instances SET blocks_in_use = blocks_in_use + :blocks
        FROM reservation WHERE instances.instance = :instance
    ), account AS (
        UPDATE tenants
        SET blocks_in_use = blocks_in_use + :blocks, tokens_in_flight = tokens_in_flight + :tokens
        FROM reservation WHERE tenants.tenant = :tenant
    )
    SELECT * FROM reservation
    """
)

_END_RESERVATION = text(
    f"""
    WITH ended AS (
        UPDATE reservations
        SET state = 'ENDED', ended_at = now(), end_reason = :reason,
            output_tokens = :output_tokens
        WHERE tenant = :tenant AND request_id = :request_id AND state = 'ADMITTED'
        RETURNING *
    ), held AS (
        SELECT *, extract(epoch FROM now() - admitted_at)::float8 AS hold FROM ended
    ), pool AS (
        UPDATE instances i
        SET blocks_in_use = i.blocks_in_use - h.reserved_blocks,
            mean_hold_seconds = CASE WHEN :observed
                THEN coalesce({1 - HOLD_EWMA_ALPHA} * i.mean_hold_seconds
                              + {HOLD_EWMA_ALPHA} * h.hold, h.hold)
                ELSE i.mean_hold_seconds END
        FROM held h WHERE i.instance = h.instance
        RETURNING i.instance
    ), account AS (
        -- Reading pool's rows makes this update run after it: instance, then tenant.
        UPDATE tenants t
        SET blocks_in_use = t.blocks_in_use - h.reserved_blocks,
            tokens_in_flight = t.tokens_in_flight - h.reserved_tokens,
            mean_hold_seconds = CASE WHEN :observed
                THEN coalesce({1 - HOLD_EWMA_ALPHA} * t.mean_hold_seconds
                              + {HOLD_EWMA_ALPHA} * h.hold, h.hold)
                ELSE t.mean_hold_seconds END
        FROM held h JOIN pool ON pool.instance = h.instance WHERE t.tenant = h.tenant
    )
    SELECT * FROM ended
    """
)

_REAP_EXPIRED = text(
    """
    WITH expired AS (
        SELECT tenant, request_id FROM reservations
        WHERE state = 'ADMITTED' AND lease_expires_at <= now()
        ORDER BY lease_expires_at
        LIMIT :batch
        FOR UPDATE SKIP LOCKED
    ), ended AS (
        UPDATE reservations r
        SET state = 'ENDED', ended_at = now(), end_reason = 'LEASE_EXPIRED'
        FROM expired e
        WHERE r.tenant = e.tenant AND r.request_id = e.request_id
        RETURNING r.tenant, r.instance, r.reserved_blocks, r.reserved_tokens
    ), per_instance AS (
        SELECT instance, sum(reserved_blocks) AS blocks FROM ended GROUP BY instance
    ), pool AS (
        UPDATE instances i SET blocks_in_use = i.blocks_in_use - p.blocks
        FROM per_instance p WHERE i.instance = p.instance
        RETURNING i.instance
    ), per_tenant AS (
        SELECT tenant, sum(reserved_blocks) AS blocks, sum(reserved_tokens) AS tokens
        FROM ended GROUP BY tenant
    ), account AS (
        UPDATE tenants t
        SET blocks_in_use = t.blocks_in_use - p.blocks,
            tokens_in_flight = t.tokens_in_flight - p.tokens
        FROM per_tenant p WHERE t.tenant = p.tenant AND (SELECT count(*) FROM pool) >= 0
    )
    SELECT count(*) FROM ended
    """
)

_RENEW_LEASE = text(
    """
    UPDATE reservations
    SET lease_ttl_seconds = coalesce(:ttl, lease_ttl_seconds),
        lease_expires_at = now() + make_interval(secs => coalesce(:ttl, lease_ttl_seconds))
    WHERE tenant = :tenant AND request_id = :request_id
      AND state = 'ADMITTED' AND lease_expires_at > now()
    RETURNING *
    """
)

_GET_RESERVATION = text(
    "SELECT * FROM reservations WHERE tenant = :tenant AND request_id = :request_id"
)

_HOLDINGS_OF_TENANT = text(
    """
    SELECT admitted_at, lease_expires_at, reserved_blocks, reserved_tokens FROM reservations
    WHERE tenant = :key AND state = 'ADMITTED' ORDER BY lease_expires_at LIMIT :limit
    """
)

_HOLDINGS_ON_INSTANCE = text(
    """
    SELECT admitted_at, lease_expires_at, reserved_blocks, reserved_tokens FROM reservations
    WHERE instance = :key AND state = 'ADMITTED' ORDER BY lease_expires_at LIMIT :limit
    """
)

_EXISTS = {
    "instance": text("SELECT 1 FROM instances WHERE instance = :key"),
    "tenant": text("SELECT 1 FROM tenants WHERE tenant = :key"),
}


class _DuplicateRace(Exception):
    """Another transaction inserted the same (tenant, request_id) after our lock read."""


def reservation_from_row(row: RowMapping) -> Reservation:
    return Reservation(
        tenant=row["tenant"],
        request_id=row["request_id"],
        instance=row["instance"],
        prompt_tokens=row["prompt_tokens"],
        max_output_tokens=row["max_output_tokens"],
        n=row["n"],
        priority=row["priority"],
        state=ReservationState(row["state"]),
        reserved_blocks=row["reserved_blocks"],
        reserved_tokens=row["reserved_tokens"],
        lease_ttl_seconds=row["lease_ttl_seconds"],
        lease_expires_at=row["lease_expires_at"],
        admitted_at=row["admitted_at"],
        ended_at=row["ended_at"],
        end_reason=EndReason(row["end_reason"]) if row["end_reason"] else None,
        output_tokens=row["output_tokens"],
    )


class Ledger:
    """Admit, renew, release and expire reservations against the shared PostgreSQL ledger."""

    def __init__(self, engine: AsyncEngine, limits: AdmissionLimits) -> None:
        self._engine = engine
        self._limits = limits

    async def admit(self, request: AdmitRequest) -> tuple[Reservation, str]:
        """Reserve blocks for one request; returns the reservation and the tenant's cache salt."""
        admission.validate(request, self._limits)
        for _ in range(2):
            try:
                return await in_transaction(self._engine, lambda conn: self._admit(conn, request))
            except _DuplicateRace:
                continue  # the next attempt finds the winner's row and replays it
        raise AssertionError("a duplicate Admit raced twice under the tenant's row lock")

    async def _admit(self, conn: AsyncConnection, request: AdmitRequest) -> tuple[Reservation, str]:
        p = request.params
        keys = {"tenant": p.tenant, "instance": p.instance, "request_id": p.request_id}
        row = (await conn.execute(_LOCK_POOL_AND_ACCOUNT, keys)).mappings().first()
        if row is None:
            raise await self._missing(conn, p.tenant, p.instance)
        salt: str = row["cache_salt"]
        if row["existing"] is not None:
            existing = await self._get(conn, p.tenant, p.request_id)
            return admission.check_replay(p, existing), salt
        pool = InstancePool(
            instance=p.instance,
            state=InstanceState(row["pool_state"]),
            block_size=row["block_size"],
            capacity_blocks=row["capacity_blocks"],
            max_model_len=row["max_model_len"],
            blocks_in_use=row["pool_blocks"],
            mean_hold_seconds=row["pool_hold"],
        )
        account = TenantAccount(
            tenant=p.tenant,
            state=TenantState(row["account_state"]),
            quota=TenantQuota(
                max_blocks=row["max_blocks"],
                max_tokens_in_flight=row["max_tokens_in_flight"],
                max_queued_requests=row["max_queued_requests"],
                max_pinned_blocks=row["max_pinned_blocks"],
                max_cpu_tier_bytes=row["max_cpu_tier_bytes"],
            ),
            blocks_in_use=row["account_blocks"],
            tokens_in_flight=row["tokens_in_flight"],
            mean_hold_seconds=row["account_hold"],
        )
        decision = admission.decide(request, pool, account, self._limits)
        if isinstance(decision, Shortfall):
            raise await self._refusal(conn, decision, pool, account, row["now"])
        return await self._insert(conn, request, decision), salt

    async def _insert(
        self, conn: AsyncConnection, request: AdmitRequest, plan: AdmissionPlan
    ) -> Reservation:
        p = request.params
        params = {
            "tenant": p.tenant,
            "request_id": p.request_id,
            "instance": p.instance,
            "prompt_tokens": p.prompt_tokens,
            "max_output_tokens": p.max_output_tokens,
            "n": p.n,
            "priority": p.priority,
            "blocks": plan.blocks,
            "tokens": plan.tokens,
            "ttl": plan.lease_ttl_seconds,
        }
        row = (await conn.execute(_INSERT_RESERVATION, params)).mappings().first()
        if row is None:
            raise _DuplicateRace()
        return reservation_from_row(row)

    async def _refusal(
        self,
        conn: AsyncConnection,
        shortfall: Shortfall,
        pool: InstancePool,
        account: TenantAccount,
        now: datetime,
    ) -> KvQuotaError:
        if shortfall.scope == "tenant":
            query, key, mean_hold = _HOLDINGS_OF_TENANT, account.tenant, account.mean_hold_seconds
        else:
            query, key, mean_hold = _HOLDINGS_ON_INSTANCE, pool.instance, pool.mean_hold_seconds
        rows = (await conn.execute(query, {"key": key, "limit": HOLDINGS_LIMIT})).all()
        holdings = [
            Holding(admission.expected_end(admitted, expires, mean_hold), blocks, tokens)
            for admitted, expires, blocks, tokens in rows
        ]
        delay = admission.retry_delay(shortfall, holdings, now, self._limits)
        return admission.shortfall_error(shortfall, delay, account.tenant, pool.instance)

    async def _missing(self, conn: AsyncConnection, tenant: str, instance: str) -> KvQuotaError:
        for kind, key, name in (
            ("tenant", tenant, tenant_name(tenant)),
            ("instance", instance, instance_name(instance)),
        ):
            if (await conn.execute(_EXISTS[kind], {"key": key})).first() is None:
                return not_found(kind, name)
        raise AssertionError("the lock query found nothing although both rows exist")

    async def get(self, tenant: str, request_id: str) -> Reservation:
        async with self._engine.connect() as conn:
            return await self._get(conn, tenant, request_id)

    async def _get(self, conn: AsyncConnection, tenant: str, request_id: str) -> Reservation:
        keys = {"tenant": tenant, "request_id": request_id}
        row = (await conn.execute(_GET_RESERVATION, keys)).mappings().first()
        if row is None:
            raise not_found("reservation", reservation_name(tenant, request_id))
        return reservation_from_row(row)

    async def end(
        self, tenant: str, request_id: str, reason: EndReason, output_tokens: int | None = None
    ) -> Reservation:
        """End a live reservation and give its blocks back. Idempotent: ending an ended
        reservation returns it unchanged, whatever the reason given now."""

        async def work(conn: AsyncConnection) -> Reservation:
            params = {
                "tenant": tenant,
                "request_id": request_id,
                "reason": reason.value,
                "output_tokens": output_tokens,
                # Only work that ran to its end says how long requests really hold blocks.
                "observed": reason is EndReason.RELEASED,
            }
            row = (await conn.execute(_END_RESERVATION, params)).mappings().first()
            if row is None:
                return await self._get(conn, tenant, request_id)
            return reservation_from_row(row)

        return await in_transaction(self._engine, work)

    async def renew(self, tenant: str, request_id: str, ttl_seconds: float | None) -> Reservation:
        violation = admission.check_lease_ttl(ttl_seconds, self._limits)
        if violation:
            raise invalid_request([violation])

        async def work(conn: AsyncConnection) -> Reservation:
            params = {"tenant": tenant, "request_id": request_id, "ttl": ttl_seconds}
            row = (await conn.execute(_RENEW_LEASE, params)).mappings().first()
            if row is not None:
                return reservation_from_row(row)
            current = await self._get(conn, tenant, request_id)
            name = reservation_name(tenant, request_id)
            if current.state is ReservationState.ADMITTED or (
                current.end_reason is EndReason.LEASE_EXPIRED
            ):
                raise KvQuotaError(
                    Code.FAILED_PRECONDITION,
                    "LEASE_EXPIRED",
                    f"the lease of {name} expired; admit the request again",
                    metadata={"name": name},
                )
            raise KvQuotaError(
                Code.FAILED_PRECONDITION,
                "RESERVATION_ENDED",
                f"{name} already ended ({current.end_reason.value if current.end_reason else ''})",
                metadata={"name": name},
            )

        return await in_transaction(self._engine, work)

    async def reap_expired(self, batch: int) -> int:
        """End up to `batch` reservations whose lease ran out; returns how many. Safe to run in
        every replica at once: rows another replica is reaping are skipped, not waited for."""

        async def work(conn: AsyncConnection) -> int:
            return int((await conn.execute(_REAP_EXPIRED, {"batch": batch})).scalar_one())

        return await in_transaction(self._engine, work)
