"""What the CPU tier (LMCache) should hold, as the ledger says: each salt's quota, each pin's
prefix, each suspended session's tokens; and the CPU tier's fill as last read."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass

from sqlalchemy import RowMapping, text
from sqlalchemy.ext.asyncio import AsyncEngine

from quota_service.core.model import LmcacheEndpoint
from quota_service.store import ownership
from quota_service.store.catalog import lmcache_from_row

# A salt's quota: what its tenants may hold in the CPU tier together (a namespace's tenants
# share its salt). An offboarded tenant's salt is replaced, so its old one is no longer here.
_SALT_QUOTAS = text(
    """
    SELECT coalesce(ns.cache_salt, t.cache_salt) AS salt,
           sum(t.max_cpu_tier_bytes)::bigint AS limit_bytes
    FROM tenants t LEFT JOIN namespaces ns ON ns.namespace = t.namespace
    WHERE t.state <> 'DELETED'
    GROUP BY 1
    """
)

_COORDINATORS = text(
    "SELECT DISTINCT lmcache_coordinator_url FROM instances "
    "WHERE lmcache_coordinator_url IS NOT NULL ORDER BY 1"
)

_LMCACHE_INSTANCES = text(
    """
    SELECT instance, lmcache_coordinator_url, lmcache_instance_id, lmcache_model_name,
           lmcache_world_size
    FROM instances WHERE lmcache_coordinator_url IS NOT NULL ORDER BY instance
    """
)

# The pins a coordinator must hold, and the unpins it still has to see.
_PINS = text(
    """
    -- Pins are fleet-wide at a coordinator: no MP server is named.
    SELECT holder_id, wanted, token_ids, chunk_keys, cache_salt,
           coordinator_url AS lmcache_coordinator_url, '' AS lmcache_instance_id,
           model_name AS lmcache_model_name, world_size AS lmcache_world_size
    FROM cpu_tier_pins WHERE coordinator_url = :url ORDER BY holder_id
    """
)

_SAVE_KEYS = text("UPDATE cpu_tier_pins SET chunk_keys = :keys WHERE holder_id = :holder")

_FORGET_UNPINNED = text(
    "DELETE FROM cpu_tier_pins WHERE holder_id = ANY (CAST(:holders AS bigint[])) AND NOT wanted"
)

# Coordinators with pins to mirror, including ones no instance names any more.
_PIN_COORDINATORS = text("SELECT DISTINCT coordinator_url FROM cpu_tier_pins")

_RECORD_USAGE = text(
    """
    UPDATE instances
    SET cpu_used_bytes = :used, cpu_capacity_bytes = :capacity, cpu_checked_at = now()
    WHERE instance = :instance
    """
)

_RECORD_COMPRESSION_RATIO = text(
    "UPDATE instances SET cpu_compression_ratio = :ratio WHERE instance = :instance"
)

# Suspended sessions in the CPU tier that a COMPRESS step may take (r): not compressed yet,
# and their session's tokens known (the CPU tier names their chunks by them).
COMPRESSIBLE = """r.state = 'ADMITTED' AND r.suspended_at IS NOT NULL
    AND r.offloaded_bytes IS NOT NULL AND r.compressed_bytes IS NULL
    AND r.prompt_token_ids IS NOT NULL"""

# The coldest session on the instance a COMPRESS step could take.
_COMPRESSIBLE_SAMPLE = text(
    f"""
    SELECT tenant, request_id FROM reservations r
    WHERE instance = :instance AND {COMPRESSIBLE}
    ORDER BY admitted_at LIMIT 1
    """
)

# A reservation's CPU tier and what it holds there: its salt and its session's tokens.
_SESSION = text(
    """
    SELECT i.lmcache_coordinator_url, i.lmcache_instance_id, i.lmcache_model_name,
           i.lmcache_world_size, coalesce(ns.cache_salt, t.cache_salt) AS salt,
           r.prompt_token_ids AS session
    FROM reservations r
    JOIN instances i ON i.instance = r.instance
    JOIN tenants t ON t.tenant = r.tenant
    LEFT JOIN namespaces ns ON ns.namespace = t.namespace
    WHERE r.tenant = :tenant AND r.request_id = :request_id
    """
)


@dataclass(frozen=True, slots=True)
class MirroredPin:
    holder_id: int
    where: LmcacheEndpoint
    salt: str
    token_ids: tuple[int, ...]
    chunk_keys: tuple[str, ...] | None  # None: not looked up yet
    wanted: bool


@dataclass(frozen=True, slots=True)
class Session:
    """A suspended session as the CPU tier holds it."""

    where: LmcacheEndpoint
    salt: str
    token_ids: tuple[int, ...]


def _endpoint(row: RowMapping) -> LmcacheEndpoint:
    """The row's CPU tier; every row here has one."""
    where = lmcache_from_row(row)
    assert where is not None
    return where


class CpuTierBooks:
    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine

    async def coordinators(self) -> list[str]:
        """Every coordinator an instance names, or that still holds pins to undo."""
        async with self._engine.connect() as conn:
            urls = {url for (url,) in await conn.execute(_COORDINATORS)}
            urls |= {url for (url,) in await conn.execute(_PIN_COORDINATORS)}
        return sorted(urls)

    async def salt_quotas(self) -> dict[str, int]:
        """Salt → the CPU-tier bytes its tenants may hold together."""
        async with self._engine.connect() as conn:
            return {salt: limit for salt, limit in await conn.execute(_SALT_QUOTAS)}

    async def instances(self) -> list[tuple[str, LmcacheEndpoint]]:
        async with self._engine.connect() as conn:
            rows = (await conn.execute(_LMCACHE_INSTANCES)).mappings()
            return [(row["instance"], _endpoint(row)) for row in rows]

    async def pins(self, coordinator_url: str) -> list[MirroredPin]:
        async with self._engine.connect() as conn:
            rows = (await conn.execute(_PINS, {"url": coordinator_url})).mappings().all()
        return [
            MirroredPin(
                row["holder_id"],
                _endpoint(row),
                row["cache_salt"],
                tuple(row["token_ids"]),
                tuple(row["chunk_keys"]) if row["chunk_keys"] is not None else None,
                row["wanted"],
            )
            for row in rows
        ]

    async def save_chunk_keys(self, holder_id: int, keys: Sequence[str]) -> None:
        async with self._engine.begin() as conn:
            await conn.execute(_SAVE_KEYS, {"holder": holder_id, "keys": list(keys)})

    async def forget_unpinned(self, holder_ids: Sequence[int]) -> None:
        """Unwanted pins the coordinator shows gone: nothing is left to mirror of them."""
        async with self._engine.begin() as conn:
            await conn.execute(_FORGET_UNPINNED, {"holders": list(holder_ids)})

    async def record_usage(self, instance: str, used_bytes: int, capacity_bytes: int) -> None:
        params = {"instance": instance, "used": used_bytes, "capacity": capacity_bytes}
        async with self._engine.begin() as conn:
            await conn.execute(_RECORD_USAGE, params)

    async def record_compression_ratio(self, instance: str, ratio: float | None) -> None:
        async with self._engine.begin() as conn:
            await conn.execute(_RECORD_COMPRESSION_RATIO, {"instance": instance, "ratio": ratio})

    async def compressible_sample(self, instance: str) -> Session | None:
        """The session the instance's compression ratio is measured on (None: none to)."""
        async with self._engine.connect() as conn:
            row = (await conn.execute(_COMPRESSIBLE_SAMPLE, {"instance": instance})).first()
        return None if row is None else await self.session(row.tenant, row.request_id)

    async def session(self, tenant: str, request_id: str) -> Session | None:
        """The reservation's session in its instance's CPU tier (None: no CPU tier, or no
        tokens were given when it was suspended)."""
        async with self._engine.connect() as conn:
            keys = {"tenant": tenant, "request_id": request_id}
            row = (await conn.execute(_SESSION, keys)).mappings().first()
        if row is None or row["lmcache_coordinator_url"] is None or not row["session"]:
            return None
        return Session(_endpoint(row), row["salt"], tuple(row["session"]))

    def exclusive(self, key: str) -> AbstractAsyncContextManager[bool]:
        """Whether this replica holds the mirror of `key` for the block (False: another does).
        One mirror pass at a time per coordinator: pins are refcounted, and two passes deciding
        at once would both send the same change."""
        return ownership.exclusive(self._engine, f"kvquota-cpu-tier:{key}")
