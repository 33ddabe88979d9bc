"""Reservations: the hot path. Each operation is one transaction with a bounded number of
statements, whatever the request; counters change in the same statement as the reservation row,
so the ledger never shows one without the other.

Lock order, everywhere: the instance's row, then the tenant's, then reservation and block rows.
PostgreSQL runs a statement's data-modifying CTEs in no fixed order, so each tenant update reads
the rows the instance update returned: that dependency is what orders the two locks. A locking
statement selects only the rows it locks, plus what may be read as it was before the locks were
granted (other rows come from the snapshot taken before the statement waited); the rest is read
by the next statement, which sees the world as it is once the locks are held.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime
from typing import NamedTuple

from sqlalchemy import RowMapping, TextClause, text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from quota_service.core import admission, block_table, geometry, queueing
from quota_service.core.admission import AdmissionLimits, AdmissionPlan, AdmitRequest, Shortfall
from quota_service.core.block_table import BlockHandle, CachedBlock
from quota_service.core.errors import KvQuotaError, not_found, refuse_invalid
from quota_service.core.hashing import HashAlgo
from quota_service.core.instance_machine import HOLD_EWMA_ALPHA
from quota_service.core.metering import METERED_REFUSALS
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
from quota_service.core.names import instance_name, reservation_name, tenant_name
from quota_service.core.queueing import QueuePolicy
from quota_service.core.reasons import Reason
from quota_service.store import blocks
from quota_service.store.database import in_transaction

# Retry-delay estimates look at the holdings that end soonest; more would not change the answer.
HOLDINGS_LIMIT = 1000

# Locks the instance, then the tenant (the order every transaction here takes them), and draws
# the holder id the new reservation's block references will carry. Two things it reads may be
# from before the locks were granted, and that is safe: a reservation with the same id that
# committed meanwhile (`existing`) makes the insert conflict, and the Admit is retried; a
# namespace's salt rotated meanwhile is the race any reader of it has (rotation takes no tenant
# lock). The tenant's own salt is its locked row's, current.
_LOCK_POOL_AND_ACCOUNT = text(
    f"""
    SELECT now() AS now, nextval('holder_ids') AS holder_id,
           i.state AS pool_state, i.block_size, i.capacity_blocks, i.max_model_len,
           i.free_blocks, i.cached_blocks, i.hash_algo, i.mean_hold_seconds AS pool_hold,
           i.queued_requests AS pool_queued, i.queued_prompt_tokens AS pool_queued_tokens,
           i.max_queued_requests AS pool_max_queued, i.target_ttft_seconds,
           i.prefill_tokens_per_second,
           {blocks.TENANT_ACCOUNT_COLUMNS},
           t.queued_requests AS account_queued, t.weight, {blocks.SALT_COLUMNS},
           (SELECT request_id FROM reservations
            WHERE tenant = :tenant AND request_id = :request_id) AS existing
    FROM instances i CROSS JOIN tenants t
    WHERE i.instance = :instance AND t.tenant = :tenant
    FOR UPDATE OF i, t
    """
)

_EXISTING_RESERVATION = text(
    "SELECT 1 FROM reservations WHERE tenant = :tenant AND request_id = :request_id"
)

_TENANT_SALT = text(blocks.TENANT_SALT)

_LOOKUP_PREFIX = text(blocks.PREFIX_LOOKUP)


def _admitting(
    reservation: str, pool_extra: str = "", tenant_extra: str = "", more_ctes: str = ""
) -> str:
    """One statement that admits: `reservation` (a CTE body returning the reservation row) gets
    its block table, and the pool and tenant counters move, all at once."""
    return f"""
    WITH reservation AS ({reservation}),
    counted AS (
        INSERT INTO usage_events (
            tenant, instance, tokens_reserved, admitted, cpu_bytes, compressed_bytes,
            shadow_refused)
        SELECT tenant, instance, reserved_tokens, 1, -was_offloaded, -was_compressed,
               CASE WHEN shadow_refusal IS NULL THEN '{{}}'::jsonb
                    ELSE jsonb_build_object(shadow_refusal, 1) END
        FROM reservation
    ),
    {blocks.ALLOCATE}, {blocks.pool_counts(pool_extra)},
    {blocks.tenant_additions(", tokens_in_flight = tokens_in_flight + :tokens" + tenant_extra)}
    {more_ctes}
    SELECT r.*, (SELECT count(*) FROM allocated) AS allocated,
           -- From the CTE: this statement's own inserts are invisible to a subquery on the table.
           (SELECT array_agg(block_id ORDER BY position) FROM entries) AS table_block_ids,
           (SELECT array_agg(generation ORDER BY position) FROM entries) AS table_generations,
           pg_notify('kvquota_events', 'changed:' || r.tenant || '/' || r.request_id)
    FROM reservation r
    """


_INSERT_RESERVATION = text(
    _admitting(
        """
        INSERT INTO reservations (
            tenant, request_id, holder_id, instance, prompt_tokens, max_output_tokens, n,
            priority, state, reserved_blocks, reserved_tokens, prefix_hit_blocks,
            lease_ttl_seconds, lease_expires_at, admitted_at, prompt_digest, shadow_refusal)
        VALUES (
            :tenant, :request_id, :holder, :instance, :prompt_tokens, :max_output_tokens, :n,
            :priority, 'ADMITTED', :blocks, :tokens, :hit_count,
            :ttl, now() + make_interval(secs => :ttl), now(), :prompt_digest, :shadow_refusal)
        ON CONFLICT DO NOTHING
        RETURNING *, 0::bigint AS was_offloaded, 0::bigint AS was_compressed
        """
    )
)

# A queued request leaves the queue admitted; its class's virtual time moves to its start tag.
_PROMOTE_RESERVATION = text(
    _admitting(
        """
        UPDATE reservations
        SET state = 'ADMITTED', reserved_blocks = :blocks, prefix_hit_blocks = :hit_count,
            lease_ttl_seconds = :ttl, lease_expires_at = now() + make_interval(secs => :ttl),
            admitted_at = now(), prompt_token_ids = NULL, suspended_at = NULL,
            offloaded_bytes = NULL, compressed_bytes = NULL, compress_before_bytes = NULL,
            compress_after_bytes = NULL,
            -- What would have refused it first: joining the queue, or being admitted now.
            shadow_refusal = coalesce(shadow_refusal, :shadow_refusal)
        WHERE tenant = :tenant AND request_id = :request_id AND state = 'QUEUED'
        -- A resumed session's bytes leave the CPU tier (the subquery sees the row as it was).
        RETURNING *, coalesce((SELECT o.offloaded_bytes FROM reservations o
                               WHERE o.tenant = reservations.tenant
                                 AND o.request_id = reservations.request_id), 0) AS was_offloaded,
                     coalesce((SELECT o.compressed_bytes FROM reservations o
                               WHERE o.tenant = reservations.tenant
                                 AND o.request_id = reservations.request_id), 0) AS was_compressed
        """,
        pool_extra="queued_requests = i.queued_requests - 1, "
        "queued_prompt_tokens = i.queued_prompt_tokens - :prompt_tokens",
        tenant_extra=", queued_requests = queued_requests - 1",
        more_ctes="""
        , clock AS (
            INSERT INTO fair_clocks AS c (instance, priority, virtual_time)
            SELECT instance, priority, :virtual_start FROM reservation
            ON CONFLICT (instance, priority)
            DO UPDATE SET virtual_time = greatest(c.virtual_time, EXCLUDED.virtual_time)
        )""",
    )
)

_FAIR_STATE = text(
    """
    SELECT (SELECT virtual_time FROM fair_clocks
            WHERE instance = :instance AND priority = :priority) AS virtual_time,
           (SELECT last_finish FROM fair_tags
            WHERE instance = :instance AND tenant = :tenant AND priority = :priority)
               AS last_finish
    """
)

_ENQUEUE = text(
    """
    WITH reservation AS (
        INSERT INTO reservations (
            tenant, request_id, holder_id, instance, prompt_tokens, max_output_tokens, n,
            priority, state, reserved_blocks, reserved_tokens, lease_ttl_seconds,
            queued_at, wait_deadline, virtual_start, virtual_finish, prompt_token_ids,
            prompt_digest, shadow_refusal)
        VALUES (
            :tenant, :request_id, :holder, :instance, :prompt_tokens, :max_output_tokens, :n,
            :priority, 'QUEUED', :blocks, :tokens, :ttl,
            now(), now() + make_interval(secs => :wait), :virtual_start, :virtual_finish,
            CAST(:prompt_token_ids AS int[]), :prompt_digest, :shadow_refusal)
        -- An offloaded session that resumes queues again as it is (same holder, its session's
        -- tokens kept for its prefix, offloaded_bytes kept until admitted: a resume that runs
        -- out of wait goes back to the CPU tier); any other row is an Admit's duplicate.
        ON CONFLICT (tenant, request_id) DO UPDATE
        SET state = 'QUEUED', queued_at = EXCLUDED.queued_at,
            wait_deadline = EXCLUDED.wait_deadline, virtual_start = EXCLUDED.virtual_start,
            virtual_finish = EXCLUDED.virtual_finish, suspended_at = NULL
        WHERE reservations.state = 'ADMITTED' AND reservations.offloaded_bytes IS NOT NULL
        RETURNING *
    ), pool AS (
        UPDATE instances
        SET queued_requests = queued_requests + 1,
            queued_prompt_tokens = queued_prompt_tokens + :prompt_tokens
        FROM reservation WHERE instances.instance = :instance
    ), account AS (
        UPDATE tenants SET queued_requests = queued_requests + 1
        FROM reservation WHERE tenants.tenant = :tenant
    ), counted AS (
        INSERT INTO usage_events (tenant, instance, queued)
        SELECT tenant, instance, 1 FROM reservation
    ), tag AS (
        INSERT INTO fair_tags AS f (instance, tenant, priority, last_finish)
        SELECT instance, tenant, priority, :virtual_finish FROM reservation
        ON CONFLICT (instance, tenant, priority) DO UPDATE SET last_finish = EXCLUDED.last_finish
    )
    SELECT request_id FROM reservation
    """
)

# Leaving the queue without being admitted: cancelled, timed out, or its tenant offboarded.
# A resumed session whose wait ran out is not ended: it goes back to the CPU tier, suspended.
_DEQUEUE = text(
    """
    WITH leaving AS (
        SELECT tenant, request_id, offloaded_bytes IS NOT NULL AND :reason = 'QUEUE_TIMEOUT'
               AS back_to_cpu
        FROM reservations
        WHERE tenant = :tenant AND request_id = :request_id AND state = 'QUEUED'
          AND (NOT :lapsed_only OR wait_deadline <= now())
    ), ended AS (
        UPDATE reservations r
        SET state = 'ENDED', ended_at = now(), end_reason = :reason, prompt_token_ids = NULL
        FROM leaving l
        WHERE r.tenant = l.tenant AND r.request_id = l.request_id AND NOT l.back_to_cpu
        RETURNING r.*
    ), offloaded AS (
        UPDATE reservations r SET state = 'ADMITTED', suspended_at = now()
        FROM leaving l
        WHERE r.tenant = l.tenant AND r.request_id = l.request_id AND l.back_to_cpu
        RETURNING r.*
    ), counted AS (
        INSERT INTO usage_events (tenant, instance, refused, cpu_bytes, compressed_bytes)
        SELECT tenant, instance,
               CASE WHEN end_reason = 'QUEUE_TIMEOUT'
                    THEN jsonb_build_object('QUEUE_TIMEOUT', 1) ELSE '{}'::jsonb END,
               -coalesce(offloaded_bytes, 0), -coalesce(compressed_bytes, 0)
        FROM ended WHERE end_reason = 'QUEUE_TIMEOUT' OR offloaded_bytes IS NOT NULL
    ), left_queue AS (
        SELECT * FROM ended UNION ALL SELECT * FROM offloaded
    ), pool AS (
        UPDATE instances i
        SET queued_requests = i.queued_requests - 1,
            queued_prompt_tokens = i.queued_prompt_tokens - e.prompt_tokens
        FROM left_queue e WHERE i.instance = e.instance
    ), account AS (
        UPDATE tenants t SET queued_requests = t.queued_requests - 1
        FROM left_queue e WHERE t.tenant = e.tenant
    )
    SELECT request_id, pg_notify('kvquota_events', 'changed:' || tenant || '/' || request_id)
    FROM left_queue
    """
)

# The queue of one instance in dispatch order (the caller holds the instance's lock).
_QUEUE_HEAD = text(
    """
    SELECT r.*, now() AS now, extract(epoch FROM now() - r.queued_at)::float8 AS waited
    FROM reservations r
    WHERE r.instance = :instance AND r.state = 'QUEUED'
    ORDER BY r.priority DESC, r.virtual_start, r.queued_at
    LIMIT :limit
    """
)

_EXTEND_WAIT = text(
    """
    UPDATE reservations
    SET wait_deadline = greatest(wait_deadline, now() + make_interval(secs => :wait))
    WHERE tenant = :tenant AND request_id = :request_id AND state = 'QUEUED'
    """
)

_QUEUED_AHEAD = text(
    """
    SELECT count(*) FROM reservations
    WHERE instance = :instance AND state = 'QUEUED' AND priority >= :priority
    """
)

_LOCK_POOL = text(
    """
    SELECT now() AS now, state AS pool_state, block_size, capacity_blocks, max_model_len,
           free_blocks, cached_blocks, hash_algo, mean_hold_seconds AS pool_hold,
           queued_requests AS pool_queued
    FROM instances WHERE instance = :instance FOR UPDATE
    """
)

# A queued request's tenant; SKIP LOCKED: a tenant busy in another transaction is passed over
# this time (as if it did not fit) rather than waited for while holding the instance.
_LOCK_QUEUED_TENANT = text(
    f"""
    SELECT {blocks.TENANT_ACCOUNT_COLUMNS} FROM tenants t
    WHERE t.tenant = :tenant
    FOR UPDATE OF t SKIP LOCKED
    """
)

_LIVE_ON_INSTANCE = text(
    "SELECT count(*) FROM reservations WHERE instance = :instance AND state = 'ADMITTED'"
)

# Locks the reservation's instance, then its tenant, before anything touches their blocks (a
# reservation never changes instance or tenant, so reading them here is safe).
_LOCK_FOR_RESERVATION = text(
    """
    SELECT r.instance
    FROM reservations r
    JOIN instances i ON i.instance = r.instance
    JOIN tenants t ON t.tenant = r.tenant
    WHERE r.tenant = :tenant AND r.request_id = :request_id
    FOR UPDATE OF i, t
    """
)

_RESERVATION_KEYS = text(
    "SELECT now() AS now, r.instance, r.holder_id, r.state, r.priority, "
    "t.state AS tenant_state, t.weight AS tenant_weight "
    "FROM reservations r JOIN tenants t USING (tenant) "
    "WHERE r.tenant = :tenant AND r.request_id = :request_id"
)

_HOLD = "extract(epoch FROM now() - e.admitted_at)::float8"


def _ewma(column: str) -> str:
    return (
        f"CASE WHEN :observed THEN coalesce({1 - HOLD_EWMA_ALPHA} * {column} "
        f"+ {HOLD_EWMA_ALPHA} * {_HOLD}, {_HOLD}) ELSE {column} END"
    )


def dropping_tables(holder: str) -> TextClause:
    """A statement that drops the whole block tables of the reservations `holder` updates (a CTE
    returning their rows, all of :tenant on :instance): their references go, tail first, and the
    pool and tenant counters follow. An offloaded reservation's tokens left the tenant's tokens
    in flight when it was offloaded. It returns each reservation's row as updated.
    """
    return text(
        f"""
    WITH holder AS ({holder}), {
            blocks.drop(
                "DELETE FROM block_refs r USING holder e "
                "WHERE r.holder_id = e.holder_id AND NOT r.released "
                "RETURNING r.block_id, r.position, r.pinned, r.tenant"
            )
        }, forgotten AS (
        DELETE FROM block_refs r USING holder e WHERE r.holder_id = e.holder_id AND r.released
    ), counted AS (
        -- Output tokens at release; CPU-tier bytes taken by an offload or given back by the
        -- end of an offloaded reservation (compressed or not).
        INSERT INTO usage_events (tenant, instance, output_tokens, cpu_bytes, compressed_bytes)
        SELECT tenant, instance, coalesce(output_tokens, 0),
               CASE WHEN :offloading THEN offloaded_bytes ELSE -coalesce(offloaded_bytes, 0) END,
               -coalesce(compressed_bytes, 0)
        FROM holder WHERE output_tokens IS NOT NULL OR offloaded_bytes IS NOT NULL
    ), ended AS (
        -- One row, or none when nothing ended (a holding time is observed for one at a time).
        SELECT max(admitted_at) AS admitted_at,
               sum(CASE WHEN :offloading OR offloaded_bytes IS NULL THEN reserved_tokens
                        ELSE 0 END) AS tokens
        FROM holder HAVING count(*) > 0
    ), {blocks.pool_counts("mean_hold_seconds = " + _ewma("i.mean_hold_seconds"), "ended e")},
    account AS (
        UPDATE tenants t
        SET blocks_in_use = t.blocks_in_use - c.removed,
            pinned_blocks = t.pinned_blocks - c.unpinned,
            tokens_in_flight = t.tokens_in_flight - e.tokens,
            mean_hold_seconds = {_ewma("t.mean_hold_seconds")}
        FROM ended e,
             (SELECT coalesce(sum(removed), 0) AS removed, coalesce(sum(unpinned), 0) AS unpinned
              FROM tenant_changes) c
        WHERE t.tenant = :tenant
    )
    SELECT holder.*, {blocks.NOTIFY_RELEASED},
           pg_notify('kvquota_events', 'changed:' || tenant || '/' || request_id),
           (SELECT count(*) FROM transitions
            WHERE state IN ('FREE', 'CACHED') AND state_before NOT IN ('FREE', 'CACHED'))
           AS freed_now
    FROM holder
    """
    )


_END_RESERVATION = dropping_tables(
    """
    UPDATE reservations
    SET state = 'ENDED', ended_at = now(), end_reason = :reason, output_tokens = :output_tokens,
        prompt_token_ids = NULL
    WHERE tenant = :tenant AND request_id = :request_id AND state = 'ADMITTED'
      AND (NOT :lapsed_only OR lease_expires_at <= now())
    RETURNING *
    """
)

# OFFLOAD: a suspended reservation's blocks leave the GPU; it stays live, in the CPU tier.
# What reservation r (on instance i) holds in the CPU tier once offloaded: its live table.
OFFLOADED_BYTES = """coalesce(i.bytes_per_block, 0) * (
        SELECT count(*) FROM block_refs b WHERE b.holder_id = r.holder_id AND NOT b.released)"""

# Which reservation an OFFLOAD may take: suspended, on the GPU.
OFFLOADABLE = "r.state = 'ADMITTED' AND r.suspended_at IS NOT NULL AND r.offloaded_bytes IS NULL"

_OFFLOAD_RESERVATION = dropping_tables(
    f"""
    UPDATE reservations r
    SET offloaded_bytes = {OFFLOADED_BYTES}
    FROM instances i
    WHERE r.tenant = :tenant AND r.request_id = :request_id AND {OFFLOADABLE}
      AND i.instance = r.instance
    RETURNING r.*
    """
)

_SUSPEND = text(
    """
    UPDATE reservations
    SET suspended_at = coalesce(suspended_at, now()),
        prompt_token_ids = coalesce(CAST(:session AS int[]), prompt_token_ids)
    WHERE tenant = :tenant AND request_id = :request_id AND state = 'ADMITTED'
    """
)

_UNSUSPEND = text(
    "UPDATE reservations SET suspended_at = NULL, prompt_token_ids = NULL "
    "WHERE tenant = :tenant AND request_id = :request_id AND state = 'ADMITTED'"
)

_METER_REFUSAL = text(
    "INSERT INTO usage_events (tenant, instance, refused) "
    "VALUES (:tenant, :instance, jsonb_build_object(CAST(:reason AS text), 1))"
)

# A statement may update a row only once, so what an end freed is recorded by a second one.
_RECORD_FREED = text(
    "UPDATE reservations SET freed_blocks = :freed "
    "WHERE tenant = :tenant AND request_id = :request_id"
)

_RELEASE_BLOCKS = text(
    f"""
    WITH {
        blocks.drop(
            "UPDATE block_refs r SET released = true "
            "WHERE r.holder_id = :holder AND r.position = ANY (CAST(:positions AS int[])) "
            "AND NOT r.released "
            "RETURNING r.block_id, r.position, r.pinned, r.tenant"
        )
    }, {blocks.pool_counts()}, {blocks.TENANT_REMOVALS}, shrunk AS (
        -- reserved_blocks is what the reservation holds now.
        UPDATE reservations SET reserved_blocks = reserved_blocks - (SELECT count(*) FROM dropped)
        WHERE tenant = :tenant AND request_id = :request_id
    )
    SELECT count(*) AS released, {blocks.NOTIFY_RELEASED} FROM dropped
    """
)

# What a reservation's table says about the handles a ReleaseBlocks names.
_TABLE_ENTRIES_FOR = text(
    """
    SELECT h.block_id, h.generation, r.position, r.released, b.generation AS current_generation
    FROM unnest(CAST(:block_ids AS int[]), CAST(:generations AS bigint[]))
         AS h(block_id, generation)
    LEFT JOIN block_refs r
      ON r.holder_id = :holder AND r.block_id = h.block_id AND r.generation = h.generation
    LEFT JOIN blocks b ON b.instance = :instance AND b.block_id = h.block_id
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
    f"""
    SELECT r.*, {blocks.live_table("r.holder_id")},
           CASE WHEN r.state = 'QUEUED' THEN (
               SELECT count(*) FROM reservations q
               WHERE q.instance = r.instance AND q.state = 'QUEUED'
                 AND (q.priority > r.priority OR (q.priority = r.priority
                      AND (q.virtual_start, q.queued_at) < (r.virtual_start, r.queued_at))))
           END AS queue_position
    FROM reservations r WHERE r.tenant = :tenant AND r.request_id = :request_id
    """
)

# Lapsed leases the ledger ends by itself: on instances with no engine to abort them in.
_LAPSED = text(
    """
    SELECT r.tenant, r.request_id FROM reservations r
    JOIN instances i ON i.instance = r.instance
    WHERE r.state = 'ADMITTED' AND r.lease_expires_at <= now() AND i.engine_url IS NULL
    ORDER BY r.lease_expires_at LIMIT :batch
    """
)

# Lapsed leases whose engine must abort the request first (see enforcement/termination.py).
_LAPSED_ON_ENGINES = text(
    """
    SELECT r.tenant, r.request_id, i.engine_url, r.suspended_at IS NULL AS running
    FROM reservations r
    JOIN instances i ON i.instance = r.instance
    WHERE r.state = 'ADMITTED' AND r.lease_expires_at <= now() AND i.engine_url IS NOT NULL
      AND r.abort_requested_at IS NULL
    ORDER BY r.lease_expires_at LIMIT :batch
    """
)

_PENDING_ABORTS = text(
    """
    SELECT r.tenant, r.request_id, r.abort_reason,
           extract(epoch FROM now() - r.abort_requested_at)::float8 AS pending_seconds,
           i.engine_url
    FROM reservations r
    JOIN instances i ON i.instance = r.instance
    WHERE r.state = 'ADMITTED' AND r.abort_requested_at IS NOT NULL
    ORDER BY r.abort_requested_at LIMIT :batch
    """
)

_REQUEST_ABORT = text(
    """
    UPDATE reservations
    SET abort_requested_at = coalesce(abort_requested_at, now()),
        abort_reason = coalesce(abort_reason, :reason)
    WHERE tenant = :tenant AND request_id = ANY (CAST(:request_ids AS text[]))
      AND state = 'ADMITTED'
    """
)

_ENGINE_URL = text(
    "SELECT i.engine_url FROM reservations r JOIN instances i ON i.instance = r.instance "
    "WHERE r.tenant = :tenant AND r.request_id = :request_id"
)

_LAPSED_QUEUED = text(
    """
    SELECT tenant, request_id FROM reservations
    WHERE state = 'QUEUED' AND wait_deadline <= now()
    ORDER BY wait_deadline LIMIT :batch
    """
)

_QUEUED_INSTANCES = text("SELECT instance FROM instances WHERE queued_requests > 0")

_HOLDINGS = {
    scope: text(
        f"""
        SELECT admitted_at, lease_expires_at, reserved_blocks, reserved_tokens FROM reservations
        WHERE {scope} = :key AND state = 'ADMITTED' ORDER BY lease_expires_at LIMIT :limit
        """
    )
    for scope in ("tenant", "instance")
}

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
        prefix_hit_blocks=row["prefix_hit_blocks"],
        lease_ttl_seconds=row["lease_ttl_seconds"],
        lease_expires_at=row["lease_expires_at"],
        admitted_at=row["admitted_at"],
        ended_at=row["ended_at"],
        end_reason=EndReason(row["end_reason"]) if row["end_reason"] else None,
        output_tokens=row["output_tokens"],
        block_table=blocks.table_from_row(row),
        queued_at=row["queued_at"],
        wait_deadline=row["wait_deadline"],
        queue_position=row.get("queue_position"),
        suspended_at=row.get("suspended_at"),
        offloaded_bytes=row.get("offloaded_bytes"),
        compressed_bytes=row.get("compressed_bytes"),
        compression_ratio=(
            row["compress_after_bytes"] / row["compress_before_bytes"]
            if row.get("compressed_bytes") is not None
            else None
        ),
        prompt_digest=row.get("prompt_digest"),
        shadow_refusal=row.get("shadow_refusal"),
    )


class LapsedOnEngine(NamedTuple):
    tenant: str
    request_id: str
    engine_url: str
    running: bool  # not suspended: the engine may be generating for it


class PendingAbort(NamedTuple):
    tenant: str
    request_id: str
    reason: EndReason  # what it ends with once the engine confirmed
    pending_seconds: float
    engine_url: str | None


class Ledger:
    """Admit (or queue), dispatch, renew, release and expire reservations against the shared
    PostgreSQL ledger."""

    def __init__(
        self, engine: AsyncEngine, limits: AdmissionLimits, queue: QueuePolicy | None = None
    ) -> None:
        self._engine = engine
        self._limits = limits
        self._queue = queue or QueuePolicy()

    @property
    def limits(self) -> AdmissionLimits:
        """The server's bounds, for checking a request whole before it reaches the ledger."""
        return self._limits

    @property
    def min_retry_delay_seconds(self) -> float:
        return self._limits.min_retry_delay_seconds

    async def admit(self, request: AdmitRequest) -> tuple[Reservation, str]:
        """Reserve a block table for one request, or queue it when it has a wait budget and
        cannot be admitted now (the reservation is then QUEUED). Returns the reservation and the
        salt the gateway passes to vLLM as cache_salt."""
        admission.validate(request, self._limits)
        for _ in range(2):
            try:
                return await in_transaction(self._engine, lambda conn: self._admit(conn, request))
            except _DuplicateRace:
                continue  # the next attempt finds the winner's row and replays it
            except KvQuotaError as refused:
                if refused.reason in METERED_REFUSALS:
                    await self._meter_refusal(request.params, refused.reason)
                raise
        raise AssertionError("a duplicate Admit raced twice under the tenant's row lock")

    async def _meter_refusal(self, params: AdmitParams, reason: str) -> None:
        """The refusal rolled the Admit back: it is metered on its own."""
        keys = {"tenant": params.tenant, "instance": params.instance, "reason": reason}
        async with self._engine.begin() as conn:
            await conn.execute(_METER_REFUSAL, keys)

    async def _admit(self, conn: AsyncConnection, request: AdmitRequest) -> tuple[Reservation, str]:
        p = request.params
        keys = {"tenant": p.tenant, "instance": p.instance, "request_id": p.request_id}
        row = (await conn.execute(_LOCK_POOL_AND_ACCOUNT, keys)).mappings().first()
        if row is None:
            raise await self._missing(conn, p.tenant, p.instance)
        salt: str = row["cache_salt"]
        if row["existing"] is not None:
            return await self._replay(conn, request), salt
        try:
            return await self._admit_new(conn, request, row), salt
        except KvQuotaError:
            # `existing` was read before the locks were granted: an identical Admit that
            # committed while this one waited is answered as a repeat, not refused.
            if (await conn.execute(_EXISTING_RESERVATION, keys)).first() is None:
                raise
            return await self._replay(conn, request), salt

    async def _replay(self, conn: AsyncConnection, request: AdmitRequest) -> Reservation:
        """A repeated Admit: the reservation as it is, if the parameters are the same."""
        p = request.params
        existing = admission.check_replay(request, await self._get(conn, p.tenant, p.request_id))
        if existing.state is ReservationState.QUEUED and request.wait_timeout_seconds > 0:
            # A retry keeps its place, and waits at least as long as this call will.
            extend = {"tenant": p.tenant, "request_id": p.request_id}
            await conn.execute(_EXTEND_WAIT, {**extend, "wait": request.wait_timeout_seconds})
        return existing

    async def _admit_new(
        self, conn: AsyncConnection, request: AdmitRequest, row: RowMapping
    ) -> Reservation:
        p = request.params
        salt: str = row["cache_salt"]
        pool = pool_from_row(p.instance, row)
        account = account_from_row(p.tenant, row)
        table = block_table.layout(
            p.prompt_tokens,
            p.max_output_tokens,
            p.n,
            pool.block_size,
            request.prompt_token_ids,
            salt,
            pool.hash_algo,
        )
        hits = await lookup_prefix(conn, p.instance, p.tenant, table.hit_candidates)
        decision = admission.decide(request, pool, account, self._limits, table, hits)
        ahead = 0
        if row["pool_queued"]:
            place = {"instance": p.instance, "priority": p.priority}
            ahead = (await conn.execute(_QUEUED_AHEAD, place)).scalar_one()
        # Requests already waiting go first: nobody jumps the queue, however small.
        if isinstance(decision, AdmissionPlan) and ahead == 0:
            return await self._insert(conn, request, decision, row["holder_id"], row["hash_scope"])
        shortfall = (
            decision
            if isinstance(decision, Shortfall)
            else Shortfall("instance", table.total, 0, pool.allocatable_blocks, 0)
        )
        if shortfall.scope == "instance":
            shortfall = replace(shortfall, queued_ahead=ahead)
        if request.wait_timeout_seconds <= 0:
            raise await refusal(conn, shortfall, pool, account, row["now"], self._limits, ahead)
        delay = await self._queue_delay(conn, pool, ahead)
        load = queueing.QueueLoad(
            queued_requests=row["pool_queued"],
            queued_prompt_tokens=row["pool_queued_tokens"],
            max_queued_requests=row["pool_max_queued"],
            max_queued_prompt_tokens=queueing.max_queued_prompt_tokens(
                row["target_ttft_seconds"], row["prefill_tokens_per_second"]
            ),
            tenant_queued_requests=row["account_queued"],
            tenant_max_queued_requests=account.quota.max_queued_requests,
        )
        shadow_refusal = queueing.check_bounds(
            load, p.prompt_tokens, p.instance, p.tenant, delay, account.shadow_mode
        )
        await self._enqueue(
            conn, request, table.total, row["holder_id"], row["weight"], shadow_refusal
        )
        await self._dispatch(conn, p.instance)
        return await self._get(conn, p.tenant, p.request_id)

    async def _insert(
        self,
        conn: AsyncConnection,
        request: AdmitRequest,
        plan: AdmissionPlan,
        holder: int,
        hash_scope: str,
    ) -> Reservation:
        p = request.params
        params = {
            "tenant": p.tenant,
            "request_id": p.request_id,
            "holder": holder,
            "instance": p.instance,
            "prompt_tokens": p.prompt_tokens,
            "max_output_tokens": p.max_output_tokens,
            "n": p.n,
            "priority": p.priority,
            "blocks": plan.blocks,
            "tokens": plan.tokens,
            "ttl": plan.lease_ttl_seconds,
            "prompt_digest": admission.prompt_digest(request.prompt_token_ids),
            "shadow_refusal": plan.shadow_refusal,
            **allocation_params(plan.hits, plan.new_hashes, hash_scope, pinned=False),
        }
        row = (await conn.execute(_INSERT_RESERVATION, params)).mappings().first()
        if row is None:
            raise _DuplicateRace()
        # The decision was made under the instance's lock from its counters: running short here
        # would mean the counters and the block rows disagree.
        assert row["allocated"] == len(plan.new_hashes), "block pool counters out of step"
        return reservation_from_row(row)

    async def _enqueue(
        self,
        conn: AsyncConnection,
        request: AdmitRequest,
        blocks_needed: int,
        holder: int,
        weight: int,
        shadow_refusal: str | None = None,
    ) -> None:
        p = request.params
        place = {"instance": p.instance, "tenant": p.tenant, "priority": p.priority}
        fair = (await conn.execute(_FAIR_STATE, place)).one()
        tokens = geometry.tokens_in_flight(p.prompt_tokens, p.max_output_tokens, p.n)
        tags = queueing.fair_tags(fair.virtual_time or 0.0, fair.last_finish or 0.0, tokens, weight)
        params = {
            **place,
            "request_id": p.request_id,
            "holder": holder,
            "prompt_tokens": p.prompt_tokens,
            "max_output_tokens": p.max_output_tokens,
            "n": p.n,
            "blocks": blocks_needed,
            "tokens": tokens,
            "ttl": request.lease_ttl_seconds or self._limits.default_lease_ttl_seconds,
            "wait": request.wait_timeout_seconds,
            "virtual_start": tags.start,
            "virtual_finish": tags.finish,
            "prompt_token_ids": list(request.prompt_token_ids) or None,
            "prompt_digest": admission.prompt_digest(request.prompt_token_ids),
            "shadow_refusal": shadow_refusal,
        }
        if (await conn.execute(_ENQUEUE, params)).first() is None:
            raise _DuplicateRace()

    async def dispatch(self, instance: str) -> int:
        """Admit what fits from the head of an instance's queue, in order; returns how many.
        Any replica may call it at any time: the instance's lock makes each pass exclusive."""

        async def work(conn: AsyncConnection) -> int:
            locked = (await conn.execute(_LOCK_POOL, {"instance": instance})).first()
            if locked is None or not locked.pool_queued:
                return 0
            return await self._dispatch(conn, instance)

        return await in_transaction(self._engine, work)

    async def _dispatch(self, conn: AsyncConnection, instance: str) -> int:
        """One dispatch pass under the instance's lock (see core.queueing for the rules)."""
        head = await conn.execute(
            _QUEUE_HEAD, {"instance": instance, "limit": self._queue.dispatch_batch}
        )
        admitted = 0
        rules = queueing.DispatchPass(self._queue.max_bypass_wait_seconds)
        for queued in head.mappings().all():
            step = await self._try_queued(conn, queued, rules)
            if step is queueing.Step.ADMIT:
                admitted += 1
            elif step is queueing.Step.HOLD:
                break
        return admitted

    async def _try_queued(
        self, conn: AsyncConnection, queued: RowMapping, rules: queueing.DispatchPass
    ) -> queueing.Step:
        tenant, request_id = queued["tenant"], queued["request_id"]
        if queued["wait_deadline"] <= queued["now"]:
            await self._dequeue(conn, tenant, request_id, EndReason.QUEUE_TIMEOUT)
            return queueing.Step.SKIP
        lock = await conn.execute(_LOCK_QUEUED_TENANT, {"tenant": tenant})
        account_row = lock.mappings().first()
        waited = queued["waited"]
        priority = queued["priority"]
        tags = queueing.FairTags(queued["virtual_start"], queued["virtual_finish"])
        if account_row is None:  # its tenant is busy in another transaction: as if no room now
            busy = Shortfall("instance", 0, 0, 0, 0)
            return rules.step(priority, tags, busy, waited)
        pool_row = await conn.execute(_LOCK_POOL, {"instance": queued["instance"]})
        pool = pool_from_row(queued["instance"], pool_row.mappings().one())
        account = account_from_row(tenant, account_row)
        reservation = reservation_from_row(queued)
        params = reservation.params
        try:
            decision, salt = await self._decide_queued(conn, reservation, queued, pool, account)
        except KvQuotaError:
            # Suspended, draining, or a quota cut below it: it waits (or times out) in place.
            return queueing.Step.SKIP
        step = rules.step(priority, tags, decision, waited)
        if step is queueing.Step.ADMIT:
            assert isinstance(decision, AdmissionPlan)
            promoted = await conn.execute(
                _PROMOTE_RESERVATION,
                {
                    "tenant": tenant,
                    "request_id": request_id,
                    "holder": queued["holder_id"],
                    "instance": params.instance,
                    "prompt_tokens": params.prompt_tokens,
                    "blocks": decision.blocks,
                    "tokens": decision.tokens,
                    "ttl": decision.lease_ttl_seconds,
                    "virtual_start": queued["virtual_start"],
                    "shadow_refusal": decision.shadow_refusal,
                    **allocation_params(
                        decision.hits, decision.new_hashes, salt["hash_scope"], pinned=False
                    ),
                },
            )
            assert promoted.mappings().one()["allocated"] == len(decision.new_hashes)
        return step

    async def _decide_queued(
        self,
        conn: AsyncConnection,
        reservation: Reservation,
        row: RowMapping,
        pool: InstancePool,
        account: TenantAccount,
    ) -> tuple[AdmissionPlan | Shortfall, RowMapping]:
        """Whether a queued reservation fits now (its stored prompt, or a resumed session
        that starts with it, gives its prefix hits), and its tenant's salt."""
        salt = (await conn.execute(_TENANT_SALT, {"tenant": reservation.tenant})).mappings().one()
        params = reservation.params
        token_ids = admission.prompt_of(row["prompt_token_ids"] or (), params.prompt_tokens)
        request = AdmitRequest(params, token_ids, 0.0, row["lease_ttl_seconds"])
        table = block_table.layout(
            params.prompt_tokens,
            params.max_output_tokens,
            params.n,
            pool.block_size,
            token_ids,
            salt["cache_salt"],
            pool.hash_algo,
        )
        hits = await lookup_prefix(conn, params.instance, reservation.tenant, table.hit_candidates)
        return admission.decide(request, pool, account, self._limits, table, hits), salt

    async def _dequeue(
        self,
        conn: AsyncConnection,
        tenant: str,
        request_id: str,
        reason: EndReason,
        *,
        lapsed_only: bool = False,
    ) -> None:
        params = {
            "tenant": tenant,
            "request_id": request_id,
            "reason": reason.value,
            "lapsed_only": lapsed_only,
        }
        await conn.execute(_DEQUEUE, params)

    async def stop_waiting(
        self, tenant: str, request_id: str, reason: EndReason
    ) -> tuple[Reservation, float]:
        """Take a request out of the queue if it is still there (its caller's budget ran out, or
        the caller went away); returns the reservation as it is then, which may have been
        admitted meanwhile, and a retry delay for the caller from the queue it left. (An owner
        elsewhere may leave it queued: see OwnedLedger.)"""

        async def work(conn: AsyncConnection) -> tuple[Reservation, float]:
            locked = await self._lock(conn, tenant, request_id)
            if locked["state"] == ReservationState.QUEUED.value:
                await self._dequeue(conn, tenant, request_id, reason)
            pool_row = await conn.execute(_LOCK_POOL, {"instance": locked["instance"]})
            pool = pool_from_row(locked["instance"], pool_row.mappings().one())
            place = {"instance": locked["instance"], "priority": locked["priority"]}
            ahead = (await conn.execute(_QUEUED_AHEAD, place)).scalar_one()
            delay = await self._queue_delay(conn, pool, ahead)
            return await self._get(conn, tenant, request_id), delay

        return await in_transaction(self._engine, work)

    async def _queue_delay(self, conn: AsyncConnection, pool: InstancePool, ahead: int) -> float:
        live = (await conn.execute(_LIVE_ON_INSTANCE, {"instance": pool.instance})).scalar_one()
        delay = queueing.queue_delay(ahead, pool.mean_hold_seconds, live, self._limits)
        return delay if delay is not None else self._limits.min_retry_delay_seconds

    async def _missing(self, conn: AsyncConnection, tenant: str, instance: str) -> KvQuotaError:
        for kind, key, name, reason in (
            ("tenant", tenant, tenant_name(tenant), Reason.TENANT_NOT_FOUND),
            ("instance", instance, instance_name(instance), Reason.INSTANCE_NOT_FOUND),
        ):
            if (await conn.execute(_EXISTS[kind], {"key": key})).first() is None:
                return not_found(reason, name)
        raise AssertionError("the lock query found nothing although both rows exist")

    async def get(self, tenant: str, request_id: str) -> Reservation:
        async with self._engine.connect() as conn:
            return await self._get(conn, tenant, request_id)

    async def follow(self, tenant: str, request_id: str) -> Reservation:
        """`get`, for a caller whose wait on the reservation began on this server: answered
        here even if its instance has moved to another replica since (see OwnedLedger)."""
        return await self.get(tenant, request_id)

    async def _get(self, conn: AsyncConnection, tenant: str, request_id: str) -> Reservation:
        keys = {"tenant": tenant, "request_id": request_id}
        row = (await conn.execute(_GET_RESERVATION, keys)).mappings().first()
        if row is None:
            raise not_found(Reason.RESERVATION_NOT_FOUND, reservation_name(tenant, request_id))
        return reservation_from_row(row)

    async def _lock(self, conn: AsyncConnection, tenant: str, request_id: str) -> RowMapping:
        keys = {"tenant": tenant, "request_id": request_id}
        await self._lock_instance_of(conn, tenant, request_id)
        # Its state as it is now that the locks are held.
        return (await conn.execute(_RESERVATION_KEYS, keys)).mappings().one()

    async def _lock_instance_of(self, conn: AsyncConnection, tenant: str, request_id: str) -> str:
        """Lock a reservation's instance and tenant; returns the instance."""
        keys = {"tenant": tenant, "request_id": request_id}
        instance = (await conn.execute(_LOCK_FOR_RESERVATION, keys)).scalar()
        if instance is None:
            raise not_found(Reason.RESERVATION_NOT_FOUND, reservation_name(tenant, request_id))
        return str(instance)

    async def end(
        self,
        tenant: str,
        request_id: str,
        reason: EndReason,
        output_tokens: int | None = None,
        *,
        lapsed_only: bool = False,
    ) -> Reservation:
        """End a live reservation: a queued one leaves the queue, an admitted one drops its block
        table, tail first. Idempotent: ending an ended reservation returns it unchanged, whatever
        the reason given now. With lapsed_only, only one whose lease (or, queued, whose wait
        budget) has run out is ended: a renewal may have won."""

        async def work(conn: AsyncConnection) -> Reservation:
            keys = {"tenant": tenant, "request_id": request_id}
            params = {
                **keys,
                "instance": await self._lock_instance_of(conn, tenant, request_id),
                "reason": reason.value,
                "output_tokens": output_tokens,
                "lapsed_only": lapsed_only,
                # Only work that ran to its end says how long requests really hold blocks.
                "observed": reason is EndReason.RELEASED,
                "offloading": False,
            }
            # The common case first, in one statement that answers too: an admitted reservation
            # ends (the statement sees its state as it is now that the locks are held).
            ended = (await conn.execute(_END_RESERVATION, params)).mappings().first()
            if ended is not None:
                if reason is EndReason.PREEMPTED:
                    await conn.execute(_RECORD_FREED, {**keys, "freed": ended["freed_now"]})
                return reservation_from_row(ended)
            current = await self._get(conn, tenant, request_id)
            if current.state is not ReservationState.QUEUED:
                return current  # ended already, or admitted with a lease that has not lapsed
            await self._dequeue(conn, tenant, request_id, reason, lapsed_only=lapsed_only)
            return await self._get(conn, tenant, request_id)

        return await in_transaction(self._engine, work)

    async def release_blocks(
        self, tenant: str, request_id: str, handles: Sequence[BlockHandle]
    ) -> Reservation:
        """Drop chosen entries of a live reservation's table (a sliding window, a tail the engine
        evicted). Releasing an entry again changes nothing; a handle whose block has moved on to
        other contents is refused with STALE_BLOCK_HANDLE, and then nothing is released."""

        async def work(conn: AsyncConnection) -> Reservation:
            locked = await self._lock(conn, tenant, request_id)
            if locked["state"] != ReservationState.ADMITTED.value:
                raise admission.not_live(await self._get(conn, tenant, request_id))
            found = await conn.execute(
                _TABLE_ENTRIES_FOR,
                {
                    "holder": locked["holder_id"],
                    "instance": locked["instance"],
                    "block_ids": [h.block_id for h in handles],
                    "generations": [h.generation for h in handles],
                },
            )
            positions = block_table.positions_to_release(
                reservation_name(tenant, request_id),
                [
                    block_table.EntryLookup(
                        BlockHandle(r.block_id, r.generation),
                        r.position,
                        r.released,
                        r.current_generation,
                    )
                    for r in found
                ],
            )
            if positions:
                await conn.execute(
                    _RELEASE_BLOCKS,
                    {
                        "holder": locked["holder_id"],
                        "instance": locked["instance"],
                        "tenant": tenant,
                        "request_id": request_id,
                        "positions": positions,
                    },
                )
            return await self._get(conn, tenant, request_id)

        return await in_transaction(self._engine, work)

    async def renew(self, tenant: str, request_id: str, ttl_seconds: float | None) -> Reservation:
        refuse_invalid([admission.check_lease_ttl(ttl_seconds, self._limits)])

        async def work(conn: AsyncConnection) -> Reservation:
            params = {"tenant": tenant, "request_id": request_id, "ttl": ttl_seconds}
            if (await conn.execute(_RENEW_LEASE, params)).first() is not None:
                return await self._get(conn, tenant, request_id)
            current = await self._get(conn, tenant, request_id)
            if current.state is ReservationState.QUEUED:
                return current  # no lease yet: its wait budget is what bounds it
            raise admission.not_live(current)

        return await in_transaction(self._engine, work)

    async def suspend(
        self, tenant: str, request_id: str, session_token_ids: Sequence[int]
    ) -> Reservation:
        """Mark an admitted reservation idle between turns (a reclaim may then offload it);
        the session's tokens, when given, say what the CPU tier holds of it. Idempotent."""

        async def work(conn: AsyncConnection) -> Reservation:
            current = await self._get(conn, tenant, request_id)
            if current.state is not ReservationState.ADMITTED:
                raise admission.not_live(current)
            refuse_invalid(admission.check_session_tokens(current, session_token_ids))
            params = {
                "tenant": tenant,
                "request_id": request_id,
                "session": list(session_token_ids) or None,
            }
            await conn.execute(_SUSPEND, params)
            return await self._get(conn, tenant, request_id)

        return await in_transaction(self._engine, work)

    async def resume(self, tenant: str, request_id: str, wait_seconds: float) -> Reservation:
        """End a suspension. An offloaded reservation goes back through the instance's queue
        (it is admitted at once when there is room and nobody waits ahead); with no wait budget
        and no room it is refused and stays offloaded."""

        async def work(conn: AsyncConnection) -> Reservation:
            locked = await self._lock(conn, tenant, request_id)
            current = await self._get(conn, tenant, request_id)
            resuming = current.offloaded_bytes is not None
            if current.state is ReservationState.QUEUED and resuming:
                return current  # a retried resume waits where the first one queued it
            if current.state is not ReservationState.ADMITTED or (
                current.lease_expires_at is not None and current.lease_expires_at <= locked["now"]
            ):
                raise admission.not_live(current)
            tenant_state = TenantState(locked["tenant_state"])
            if tenant_state in (TenantState.DELETING, TenantState.DELETED):
                # Offboarding ends an idle session without asking its engine to abort: it
                # must not start running again. (A suspended tenant's sessions run to their end.)
                raise admission.tenant_not_active(tenant, tenant_state)
            keys = {"tenant": tenant, "request_id": request_id}
            if not resuming:
                await conn.execute(_UNSUSPEND, keys)
                return await self._get(conn, tenant, request_id)
            weight = locked["tenant_weight"]
            # Without a wait budget it still passes through the queue (a moment's deadline),
            # and is refused below unless admitted in this transaction.
            back = AdmitRequest(current.params, (), max(wait_seconds, 1.0), None)
            await self._enqueue(conn, back, current.reserved_blocks, locked["holder_id"], weight)
            await self._dispatch(conn, current.instance)
            resumed = await self._get(conn, tenant, request_id)
            if resumed.state is ReservationState.QUEUED and wait_seconds <= 0:
                # Refused as an Admit would be; the rollback leaves it offloaded.
                raise await self._resume_refusal(conn, resumed)
            return resumed

        return await in_transaction(self._engine, work)

    async def _resume_refusal(self, conn: AsyncConnection, queued: Reservation) -> KvQuotaError:
        keys = {
            "tenant": queued.tenant,
            "instance": queued.instance,
            "request_id": queued.request_id,
        }
        row = (await conn.execute(_LOCK_POOL_AND_ACCOUNT, keys)).mappings().one()
        stored = await conn.execute(_GET_RESERVATION, keys)
        pool, account = pool_from_row(queued.instance, row), account_from_row(queued.tenant, row)
        decision, _ = await self._decide_queued(
            conn, queued, stored.mappings().one(), pool, account
        )
        ahead = queued.queue_position or 0
        shortfall = (
            decision
            if isinstance(decision, Shortfall)
            else Shortfall("instance", queued.reserved_blocks, 0, 0, 0)  # others wait ahead
        )
        return await refusal(conn, shortfall, pool, account, row["now"], self._limits, ahead)

    async def reap_expired(self, batch: int) -> int:
        """End up to `batch` reservations whose lease ran out (LEASE_EXPIRED) and as many queued
        ones whose wait budget did (QUEUE_TIMEOUT: their waiting caller may have died with its
        replica); returns how many. Safe in every replica at once: each is ended in its own
        transaction, only if still lapsed."""
        async with self._engine.connect() as conn:
            lapsed = (await conn.execute(_LAPSED, {"batch": batch})).all()
            timed_out = (await conn.execute(_LAPSED_QUEUED, {"batch": batch})).all()
        ended = 0
        for rows, reason in (
            (lapsed, EndReason.LEASE_EXPIRED),
            (timed_out, EndReason.QUEUE_TIMEOUT),
        ):
            for tenant, request_id in rows:
                reservation = await self.end(tenant, request_id, reason, lapsed_only=True)
                ended += reservation.end_reason is reason
        return ended

    async def engine_url(self, tenant: str, request_id: str) -> str | None:
        """The engine that runs this reservation's request, if kvquota follows one."""
        async with self._engine.connect() as conn:
            keys = {"tenant": tenant, "request_id": request_id}
            return (await conn.execute(_ENGINE_URL, keys)).scalar_one_or_none()

    async def request_aborts(
        self, tenant: str, request_ids: Sequence[str], reason: EndReason
    ) -> None:
        """Remember that these reservations must end with `reason` once their engine confirms
        the abort (they keep their blocks until then)."""
        async with self._engine.begin() as conn:
            params = {"tenant": tenant, "request_ids": list(request_ids), "reason": reason.value}
            await conn.execute(_REQUEST_ABORT, params)

    async def lapsed_on_engines(self, batch: int) -> list[LapsedOnEngine]:
        """Admitted reservations whose lease ran out on instances with an engine, no abort
        asked yet."""
        async with self._engine.connect() as conn:
            rows = await conn.execute(_LAPSED_ON_ENGINES, {"batch": batch})
            return [LapsedOnEngine(*row) for row in rows]

    async def pending_aborts(self, batch: int) -> list[PendingAbort]:
        """Aborts asked of an engine that it has not confirmed yet, oldest first."""
        async with self._engine.connect() as conn:
            rows = await conn.execute(_PENDING_ABORTS, {"batch": batch})
            return [
                PendingAbort(t, r, EndReason(reason), pending, url)
                for t, r, reason, pending, url in rows
            ]

    async def dispatch_all(self) -> int:
        """A dispatch pass on every instance with requests waiting (the periodic sweep that
        backs up notifications)."""
        async with self._engine.connect() as conn:
            instances = [r[0] for r in await conn.execute(_QUEUED_INSTANCES)]
        return sum([await self.dispatch(instance) for instance in instances])


def pool_from_row(instance: str, row: RowMapping) -> InstancePool:
    return InstancePool(
        instance=instance,
        state=InstanceState(row["pool_state"]),
        block_size=row["block_size"],
        capacity_blocks=row["capacity_blocks"],
        max_model_len=row["max_model_len"],
        free_blocks=row["free_blocks"],
        cached_blocks=row["cached_blocks"],
        hash_algo=HashAlgo(row["hash_algo"]),
        mean_hold_seconds=row["pool_hold"],
    )


def account_from_row(tenant: str, row: RowMapping) -> TenantAccount:
    return TenantAccount(
        tenant=tenant,
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
        pinned_blocks=row["account_pinned"],
        shadow_mode=row["account_shadow_mode"],
    )


async def refusal(
    conn: AsyncConnection,
    shortfall: Shortfall,
    pool: InstancePool,
    account: TenantAccount | None,
    now: datetime,
    limits: AdmissionLimits,
    ahead: int = 0,
) -> KvQuotaError:
    """The refusal for a shortfall, with a retry delay computed from the live holdings (a
    namespace's pin has no account and can only fall short on the instance): the time until
    enough of them are expected to end; with `ahead` requests queued in front, at least the
    time Little's law gives for those to be served."""
    if shortfall.scope == "tenant":
        assert account is not None
        key, mean_hold = account.tenant, account.mean_hold_seconds
    else:
        key, mean_hold = pool.instance, pool.mean_hold_seconds
    query = _HOLDINGS[shortfall.scope]
    rows = (await conn.execute(query, {"key": key, "limit": HOLDINGS_LIMIT})).all()
    holdings = [
        Holding(admission.expected_end(admitted, expires, mean_hold), blocks, tokens)
        for admitted, expires, blocks, tokens in rows
    ]
    delay = admission.retry_delay(shortfall, holdings, now, limits)
    if ahead:
        by_queue = queueing.queue_delay(ahead, mean_hold, len(rows), limits)
        delay = max(delay, by_queue) if by_queue is not None else delay
    tenant = account.tenant if account else ""
    return admission.shortfall_error(shortfall, delay, tenant, pool.instance)


async def lookup_prefix(
    conn: AsyncConnection, instance: str, tenant: str | None, hashes: Sequence[bytes]
) -> list[CachedBlock]:
    """The longest prefix of `hashes` cached on the instance (call under its row lock)."""
    if not hashes:
        return []
    rows = await conn.execute(
        _LOOKUP_PREFIX, {"instance": instance, "tenant": tenant, "hashes": list(hashes)}
    )
    cached = {
        r.content_hash: CachedBlock(
            r.content_hash,
            BlockHandle(r.block_id, r.generation),
            r.evictable,
            r.held_by_tenant,
            r.pinned_by_tenant,
        )
        for r in rows
    }
    return block_table.longest_cached_prefix(hashes, cached)


def allocation_params(
    hits: Sequence[CachedBlock],
    new_hashes: Sequence[bytes | None],
    hash_scope: str,
    *,
    pinned: bool,
) -> dict[str, object]:
    """The parameters blocks.ALLOCATE takes, for a cached prefix and the new blocks after it."""
    return {
        "hit_ids": [h.handle.block_id for h in hits],
        "hit_count": len(hits),
        "new_hashes": list(new_hashes),
        "k": len(new_hashes),
        "pin": int(pinned),
        "hash_scope": hash_scope,
    }


async def offload(conn: AsyncConnection, instance: str, tenant: str, request_id: str) -> int | None:
    """OFFLOAD, in the caller's transaction (the instance locked first; the statement takes
    the tenant's row after it, as admission does): a suspended
    reservation's blocks leave the GPU and its tokens leave the tenant's tokens in flight; it
    stays live, in the CPU tier. Returns the blocks that freed, or None when it is not
    suspended on the GPU (any more)."""
    params = {
        "instance": instance,
        "tenant": tenant,
        "request_id": request_id,
        "observed": False,
        "offloading": True,
    }
    offloaded = (await conn.execute(_OFFLOAD_RESERVATION, params)).mappings().first()
    return None if offloaded is None else int(offloaded["freed_now"])
