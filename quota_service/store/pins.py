"""Pins: system-prompt prefixes held resident on an instance, for a tenant or a namespace."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import RowMapping, text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from quota_service.core import pins
from quota_service.core.admission import AdmissionLimits, Shortfall
from quota_service.core.errors import not_found
from quota_service.core.hashing import block_hashes
from quota_service.core.model import Pin, PinState
from quota_service.core.names import instance_name
from quota_service.core.pagination import Page
from quota_service.core.reasons import Reason
from quota_service.store import blocks
from quota_service.store.database import in_transaction
from quota_service.store.ledger import (
    account_from_row,
    allocation_params,
    lookup_prefix,
    pool_from_row,
    refusal,
)

_LOCK_POOL = text(
    """
    SELECT now() AS now, nextval('holder_ids') AS holder_id,
           state AS pool_state, block_size, capacity_blocks, max_model_len, free_blocks,
           cached_blocks, hash_algo, mean_hold_seconds AS pool_hold
    FROM instances WHERE instance = :instance FOR UPDATE
    """
)

_LOCK_TENANT = text(
    f"""
    SELECT {blocks.TENANT_ACCOUNT_COLUMNS} FROM tenants t
    WHERE t.tenant = :tenant
    FOR UPDATE OF t
    """
)

_TENANT_SALT = text(blocks.TENANT_SALT)

# Locked (after the instance) so two pins of one namespace are decided one after the other.
_NAMESPACE_SALT = text("SELECT cache_salt FROM namespaces WHERE namespace = :namespace FOR UPDATE")

_PIN = text(
    f"""
    SELECT p.*, {blocks.live_table("p.holder_id")}
    FROM pins p WHERE p.owner = :owner AND p.pin_id = :pin_id
    """
)

_INSERT_PIN = text(
    f"""
    WITH pin AS (
        INSERT INTO pins (
            holder_id, owner, pin_id, tenant, instance, prompt_tokens, pinned_blocks, prefix_hash)
        VALUES (:holder, :owner, :pin_id, :tenant, :instance, :prompt_tokens, :blocks, :prefix)
        RETURNING holder_id
    ), cpu_tier AS (
        -- What the instance's CPU tier must pin too, as it is now (salt, coordinator): an unpin
        -- later reaches the same pins there whatever changed meanwhile.
        INSERT INTO cpu_tier_pins (
            holder_id, coordinator_url, model_name, world_size, cache_salt, token_ids)
        SELECT :holder, lmcache_coordinator_url, lmcache_model_name, lmcache_world_size, :salt,
               CAST(:token_ids AS int[])
        FROM instances WHERE instance = :instance AND lmcache_coordinator_url IS NOT NULL
    ), {blocks.ALLOCATE}, {blocks.pool_counts()}, {blocks.tenant_additions()}
    SELECT (SELECT count(*) FROM allocated) AS allocated
    """
)

_FORGET_REMOVED_PIN = text("DELETE FROM pins WHERE holder_id = :holder AND state = 'REMOVED'")

_UNPIN = text(
    f"""
    WITH removed AS (
        UPDATE pins SET state = 'REMOVED', removed_at = now()
        WHERE holder_id = :holder AND state = 'ACTIVE'
        RETURNING holder_id
    ), cpu_tier AS (
        UPDATE cpu_tier_pins c SET wanted = false FROM removed x WHERE c.holder_id = x.holder_id
    ), {
        blocks.drop(
            "DELETE FROM block_refs r USING removed x WHERE r.holder_id = x.holder_id "
            "RETURNING r.block_id, r.position, r.pinned, r.tenant"
        )
    }, {blocks.pool_counts()}, {blocks.TENANT_REMOVALS}
    SELECT count(*) FROM removed
    """
)

_LIST_PINS = text(
    """
    SELECT p.*, NULL AS table_block_ids, NULL AS table_generations FROM pins p
    WHERE p.owner = :owner AND p.pin_id > :after ORDER BY p.pin_id LIMIT :size
    """
)

_ACTIVE_PINS_OF_TENANT = text(
    "SELECT owner, pin_id FROM pins WHERE tenant = :tenant AND state = 'ACTIVE' "
    "AND (CAST(:here AS text[]) IS NULL OR instance = ANY(CAST(:here AS text[]))) LIMIT :batch"
)


def pin_from_row(row: RowMapping) -> Pin:
    return Pin(
        owner=row["owner"],
        pin_id=row["pin_id"],
        instance=row["instance"],
        prompt_tokens=row["prompt_tokens"],
        pinned_blocks=row["pinned_blocks"],
        state=PinState(row["state"]),
        created_at=row["created_at"],
        blocks=blocks.table_from_row(row),
    )


class Pins:
    def __init__(self, engine: AsyncEngine, limits: AdmissionLimits) -> None:
        self._engine = engine
        self._limits = limits

    async def pin(self, owner: str, pin_id: str, instance: str, token_ids: Sequence[int]) -> Pin:
        """Pin the full blocks of token_ids on the instance for owner (tenants/{t} or
        namespaces/{n}). The same pin again returns it; another prefix under its id is refused."""
        collection, owner_id = owner.split("/", 1)
        tenant = owner_id if collection == "tenants" else None

        async def work(conn: AsyncConnection) -> Pin:
            locked = (await conn.execute(_LOCK_POOL, {"instance": instance})).mappings().first()
            if locked is None:
                raise not_found(Reason.INSTANCE_NOT_FOUND, instance_name(instance))
            pool = pool_from_row(instance, locked)
            pins.check_prefix(token_ids, pool.block_size)
            account = None
            if tenant is not None:
                row = (await conn.execute(_LOCK_TENANT, {"tenant": tenant})).mappings().first()
                if row is None:
                    raise not_found(Reason.TENANT_NOT_FOUND, owner)
                account = account_from_row(tenant, row)
                salted = (await conn.execute(_TENANT_SALT, {"tenant": tenant})).mappings().one()
                salt, scope = salted["cache_salt"], salted["hash_scope"]
            else:
                salt = (
                    await conn.execute(_NAMESPACE_SALT, {"namespace": owner_id})
                ).scalar_one_or_none()
                if salt is None:
                    raise not_found(Reason.NAMESPACE_NOT_FOUND, owner)
                scope = owner
            hashes = block_hashes(token_ids, pool.block_size, salt, pool.hash_algo)
            existing = await self._find(conn, owner, pin_id)
            if existing is not None:
                same = existing[1] == hashes[-1] and existing[0].instance == instance
                if existing[0].state is PinState.ACTIVE:
                    if not same:
                        raise pins.pin_id_reused(owner, pin_id)
                    return existing[0]
                await conn.execute(_FORGET_REMOVED_PIN, {"holder": existing[2]})
            hits = await lookup_prefix(conn, instance, tenant, hashes)
            plan = pins.decide(hashes, hits, pool, account)
            if isinstance(plan, Shortfall):
                raise await refusal(conn, plan, pool, account, locked["now"], self._limits)
            params = {
                "holder": locked["holder_id"],
                "owner": owner,
                "pin_id": pin_id,
                "tenant": tenant,
                "instance": instance,
                "prompt_tokens": len(token_ids),
                "token_ids": list(token_ids),
                "salt": salt,
                "blocks": len(hashes),
                "prefix": hashes[-1],
                **allocation_params(plan.hits, plan.new_hashes, scope, pinned=True),
            }
            allocated = (await conn.execute(_INSERT_PIN, params)).scalar_one()
            assert allocated == len(plan.new_hashes), "block pool counters out of step"
            found = await self._find(conn, owner, pin_id)
            assert found is not None
            return found[0]

        return await in_transaction(self._engine, work)

    async def unpin(self, owner: str, pin_id: str) -> Pin:
        """Release a pin's blocks (they stay cached until evicted). Idempotent."""

        async def work(conn: AsyncConnection) -> Pin:
            found = await self._find(conn, owner, pin_id)
            if found is None:
                raise not_found(Reason.PIN_NOT_FOUND, f"{owner}/pins/{pin_id}")
            pin, _, holder = found
            if pin.state is PinState.ACTIVE:
                collection, owner_id = owner.split("/", 1)
                tenant = owner_id if collection == "tenants" else None
                await conn.execute(_LOCK_POOL, {"instance": pin.instance})
                if tenant is not None:
                    await conn.execute(_LOCK_TENANT, {"tenant": tenant})
                params = {"holder": holder, "instance": pin.instance, "tenant": tenant}
                await conn.execute(_UNPIN, params)
            after = await self._find(conn, owner, pin_id)
            assert after is not None
            return after[0]

        return await in_transaction(self._engine, work)

    async def list_pins(self, owner: str, page: Page) -> list[Pin]:
        params = {"owner": owner, "after": page.after or "", "size": page.size}
        async with self._engine.connect() as conn:
            return [pin_from_row(r) for r in (await conn.execute(_LIST_PINS, params)).mappings()]

    async def active_of_tenant(
        self, tenant: str, batch: int, here: Sequence[str] | None = None
    ) -> list[tuple[str, str]]:
        """The tenant's active pins (on the instances `here`, if given)."""
        keys = {"tenant": tenant, "batch": batch, "here": None if here is None else list(here)}
        async with self._engine.connect() as conn:
            rows = await conn.execute(_ACTIVE_PINS_OF_TENANT, keys)
            return [(r.owner, r.pin_id) for r in rows]

    async def _find(
        self, conn: AsyncConnection, owner: str, pin_id: str
    ) -> tuple[Pin, bytes, int] | None:
        row = (await conn.execute(_PIN, {"owner": owner, "pin_id": pin_id})).mappings().first()
        if row is None:
            return None
        return pin_from_row(row), row["prefix_hash"], row["holder_id"]
