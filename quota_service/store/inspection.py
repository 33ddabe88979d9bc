"""Read-only views of the block pools for operators: blocks, what a tenant holds where, and
what every tenant holds in each tier (for the metrics)."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from quota_service.core.machine_comparison import Difference, not_in_memory
from quota_service.core.model import (
    Block,
    BlockState,
    InstanceUsage,
    TenantHoldings,
    TenantQuota,
)
from quota_service.core.pagination import Page

_BLOCKS = text(
    """
    SELECT b.* FROM blocks b
    WHERE b.instance = :instance AND b.block_id > :after
      AND (CAST(:state AS text) IS NULL OR b.state = :state)
      AND (CAST(:tenant AS text) IS NULL OR EXISTS (
            SELECT 1 FROM tenant_blocks tb
            WHERE tb.tenant = :tenant AND tb.instance = b.instance AND tb.block_id = b.block_id))
    ORDER BY b.block_id LIMIT :size
    """
)

_TENANT_USAGE = text(
    """
    WITH held AS (
        SELECT tb.instance, count(*) AS blocks, count(*) FILTER (WHERE tb.pin_refs > 0) AS pinned,
               count(*) FILTER (WHERE b.ref_count > tb.refs) AS shared
        FROM tenant_blocks tb JOIN blocks b USING (instance, block_id)
        WHERE tb.tenant = :tenant GROUP BY tb.instance
    ), live AS (
        SELECT instance, count(*) AS reservations, sum(reserved_tokens)::bigint AS tokens
        FROM reservations WHERE tenant = :tenant AND state = 'ADMITTED' GROUP BY instance
    )
    SELECT instance, coalesce(h.blocks, 0) AS blocks, coalesce(h.pinned, 0) AS pinned,
           coalesce(h.shared, 0) AS shared, coalesce(l.reservations, 0) AS reservations,
           coalesce(l.tokens, 0) AS tokens
    FROM held h FULL JOIN live l USING (instance)
    ORDER BY instance
    """
)

# The same, from the journal's record (instances served from memory), of the instances not in
# :here (the ones whose machines another replica holds).
_JOURNAL_TENANT_USAGE = text(
    """
    WITH mine AS (
        SELECT instance, block_id, count(*) AS entries, bool_or(pinned) AS pinned
        FROM journal_slot_references
        WHERE tenant = :tenant AND instance <> ALL(CAST(:here AS text[]))
        GROUP BY instance, block_id
    ), refs AS (
        SELECT s.instance, s.block_id, count(*) AS refs
        FROM journal_slot_references s JOIN mine m USING (instance, block_id)
        GROUP BY s.instance, s.block_id
    ), held AS (
        SELECT m.instance, count(*) AS blocks, count(*) FILTER (WHERE m.pinned) AS pinned,
               count(*) FILTER (WHERE r.refs > m.entries) AS shared
        FROM mine m JOIN refs r USING (instance, block_id) GROUP BY m.instance
    ), live AS (
        SELECT instance, count(*) AS reservations, sum(reserved_tokens)::bigint AS tokens
        FROM reservations WHERE tenant = :tenant AND state = 'ADMITTED'
          AND instance <> ALL(CAST(:here AS text[]))
        GROUP BY instance
    )
    SELECT instance, coalesce(h.blocks, 0) AS blocks, coalesce(h.pinned, 0) AS pinned,
           coalesce(h.shared, 0) AS shared, coalesce(l.reservations, 0) AS reservations,
           coalesce(l.tokens, 0) AS tokens
    FROM held h FULL JOIN live l USING (instance)
    ORDER BY instance
    """
)

# Every tenant not yet deleted: its counters and quota, its live reservations and the bytes its
# offloaded sessions hold in the CPU tier, compressed or not, as its CPU-tier quota counts them
# (one pass over the live reservations).
_TENANT_HOLDINGS = text(
    """
    SELECT t.tenant, t.blocks_in_use, t.pinned_blocks, coalesce(r.cpu_bytes, 0) AS cpu_bytes,
           coalesce(r.compressed_bytes, 0) AS compressed_bytes, t.tokens_in_flight,
           t.queued_requests, coalesce(r.live, 0) AS live,
           t.max_blocks, t.max_tokens_in_flight, t.max_queued_requests, t.max_pinned_blocks,
           t.max_cpu_tier_bytes
    FROM tenants t
    LEFT JOIN (
        SELECT tenant, count(*) AS live,
               sum(offloaded_bytes + coalesce(compressed_bytes, 0))::bigint AS cpu_bytes,
               sum(compressed_bytes)::bigint AS compressed_bytes
        FROM reservations WHERE state = 'ADMITTED' GROUP BY tenant
    ) r USING (tenant)
    WHERE t.state <> 'DELETED'
    ORDER BY t.tenant
    """
)

_PURGE_TOMBSTONES = text(
    """
    DELETE FROM tombstones WHERE (instance, block_id, generation) IN (
        SELECT instance, block_id, generation FROM tombstones
        WHERE freed_at < now() - make_interval(secs => :retention) LIMIT :batch)
    """
)


class Inspection:
    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine

    async def list_blocks(
        self, instance: str, tenant: str | None, state: BlockState | None, page: Page
    ) -> list[Block]:
        params = {
            "instance": instance,
            "tenant": tenant,
            "state": state.value if state else None,
            "after": int(page.after) if page.after else -1,
            "size": page.size,
        }
        async with self._engine.connect() as conn:
            rows = (await conn.execute(_BLOCKS, params)).mappings()
            return [
                Block(
                    instance=r["instance"],
                    block_id=r["block_id"],
                    generation=r["generation"],
                    state=BlockState(r["state"]),
                    ref_count=r["ref_count"],
                    pin_count=r["pin_count"],
                    content_hash=r["content_hash"],
                    hash_scope=r["hash_scope"],
                    tier=r["tier"],
                    last_used_at=r["last_used_at"],
                )
                for r in rows
            ]

    async def tenant_usage(self, tenant: str) -> list[InstanceUsage]:
        async with self._engine.connect() as conn:
            rows = await conn.execute(_TENANT_USAGE, {"tenant": tenant})
            return [InstanceUsage(*r) for r in rows]

    async def recorded_tenant_usage(
        self, tenant: str, served_here: Sequence[str]
    ) -> list[InstanceUsage]:
        """tenant_usage from the journal, on the instances other than `served_here`."""
        async with self._engine.connect() as conn:
            params = {"tenant": tenant, "here": list(served_here)}
            rows = await conn.execute(_JOURNAL_TENANT_USAGE, params)
            return [InstanceUsage(*r) for r in rows]

    async def tenant_holdings(self) -> list[TenantHoldings]:
        async with self._engine.connect() as conn:
            rows = (await conn.execute(_TENANT_HOLDINGS)).mappings()
            return [
                TenantHoldings(
                    tenant=r["tenant"],
                    gpu_blocks=r["blocks_in_use"],
                    pinned_blocks=r["pinned_blocks"],
                    cpu_tier_bytes=r["cpu_bytes"],
                    compressed_bytes=r["compressed_bytes"],
                    tokens_in_flight=r["tokens_in_flight"],
                    queued_requests=r["queued_requests"],
                    live_reservations=r["live"],
                    quota=TenantQuota(
                        max_blocks=r["max_blocks"],
                        max_tokens_in_flight=r["max_tokens_in_flight"],
                        max_queued_requests=r["max_queued_requests"],
                        max_pinned_blocks=r["max_pinned_blocks"],
                        max_cpu_tier_bytes=r["max_cpu_tier_bytes"],
                    ),
                )
                for r in rows
            ]

    async def check_instance(self, instance: str) -> tuple[int, list[Difference]]:
        """The epoch of this replica's owner of the instance, and what its memory holds
        differently from the record (invariant 8). The ledger holds no instance in memory."""
        raise not_in_memory(instance, "its hot path is the ledger")

    async def purge_tombstones(self, retention_seconds: float, batch: int) -> int:
        """Forget tombstones older than the retention period; returns how many went."""
        async with self._engine.begin() as conn:
            params = {"retention": retention_seconds, "batch": batch}
            return (await conn.execute(_PURGE_TOMBSTONES, params)).rowcount
