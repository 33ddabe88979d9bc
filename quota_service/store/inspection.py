"""What tenants hold, as the record has it: on the instances another replica serves (the
instances' owners answer for their own, owner/owned_inspection.py), and every tenant's totals in
each tier (for the metrics)."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from quota_service.core.model import InstanceUsage, TenantHoldings, TenantQuota

# What a tenant holds on each instance not in :here (the ones whose machines another replica
# holds), from the journal's record: distinct blocks, those it pins and those others reference
# too, and its live reservations with their tokens.
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


class RecordedUsage:
    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine

    async def recorded_tenant_usage(
        self, tenant: str, served_here: Sequence[str]
    ) -> list[InstanceUsage]:
        """What the tenant holds on each instance other than `served_here`, as the journal
        records it."""
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
