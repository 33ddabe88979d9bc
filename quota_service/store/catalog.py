"""Tenants and instances: the operators' side of the ledger."""

from __future__ import annotations

import logging
import secrets
from datetime import datetime

from sqlalchemy import BigInteger, RowMapping, column, func, select, table, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from quota_service.core import engine_address
from quota_service.core.errors import (
    FieldViolation,
    KvQuotaError,
    already_exists,
    invalid_request,
    not_found,
)
from quota_service.core.geometry import KvGeometry, parse_dtype
from quota_service.core.hashing import HashAlgo
from quota_service.core.model import (
    EngineEndpoints,
    Instance,
    InstanceSpec,
    InstanceState,
    LmcacheEndpoint,
    QueueBounds,
    Tenant,
    TenantQuota,
    TenantState,
)
from quota_service.core.names import instance_name, tenant_name
from quota_service.core.pagination import Page
from quota_service.core.reasons import Reason
from quota_service.store.database import in_transaction
from quota_service.store.schema import InstanceRow, NamespaceRow, ReservationRow, TenantRow

log = logging.getLogger(__name__)

# vLLM accepts salts of at most 128 characters without "@", "/", "\\" or NUL: url-safe base64
# of 32 random bytes fits and is unguessable.
SALT_BYTES = 32

_live = ReservationRow.state == "ADMITTED"
_tenant_live = (
    select(func.count())
    .where(ReservationRow.tenant == TenantRow.tenant, _live)
    .scalar_subquery()
    .label("live_reservations")
)
_instance_live = (
    select(func.count())
    .where(ReservationRow.instance == InstanceRow.instance, _live)
    .scalar_subquery()
    .label("live_reservations")
)
# What its sessions hold in the CPU tier, as they are and compressed (a resume waiting in the
# queue still holds it).
_tenant_cpu_tier = [
    select(func.coalesce(func.sum(column), 0).cast(BigInteger))
    .where(ReservationRow.tenant == TenantRow.tenant, ReservationRow.state != "ENDED")
    .scalar_subquery()
    .label(label)
    for column, label in (
        (ReservationRow.offloaded_bytes, "cpu_tier_bytes"),
        (ReservationRow.compressed_bytes, "compressed_bytes"),
    )
]
_TENANT_VIEW = select(TenantRow.__table__, _tenant_live, *_tenant_cpu_tier)
# Each pool's counters as its owner last recorded them (migration 0030).
_POOL_COUNTERS = table(
    "instance_pool_counters",
    *(
        column(name)
        for name in (
            "instance",
            "free_blocks",
            "cached_blocks",
            "blocks_in_use",
            "pinned_blocks",
            "queued_requests",
            "queued_prompt_tokens",
            "mean_hold_seconds",
            "drift_blocks",
        )
    ),
)
_INSTANCE_VIEW = select(
    InstanceRow.__table__,
    *(c for c in _POOL_COUNTERS.c if c.name != "instance"),
    _instance_live,
).join_from(InstanceRow, _POOL_COUNTERS, _POOL_COUNTERS.c.instance == InstanceRow.instance)


def tenant_from_row(row: RowMapping) -> Tenant:
    return Tenant(
        tenant=row["tenant"],
        display_name=row["display_name"],
        state=TenantState(row["state"]),
        weight=row["weight"],
        quota=TenantQuota(**{name: row[name] for name in TenantQuota.__dataclass_fields__}),
        blocks_in_use=row["blocks_in_use"],
        tokens_in_flight=row["tokens_in_flight"],
        pinned_blocks=row["pinned_blocks"],
        queued_requests=row["queued_requests"],
        namespace=row["namespace"],
        live_reservations=row["live_reservations"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        shadow_mode=row["shadow_mode"],
        cpu_tier_bytes=row["cpu_tier_bytes"],
        compressed_bytes=row["compressed_bytes"],
    )


def instance_from_row(row: RowMapping) -> Instance:
    kv_geometry = None
    if row["kv_dtype"] is not None:
        kv_geometry = KvGeometry(
            row["num_layers"],
            row["num_kv_heads"],
            row["head_dim"],
            parse_dtype(row["kv_dtype"]),
            row["mla"],
        )
    spec = InstanceSpec(
        row["instance"],
        row["model"],
        kv_geometry,
        row["block_size"],
        row["capacity_blocks"],
        row["max_model_len"],
        HashAlgo(row["hash_algo"]),
        QueueBounds(
            row["max_queued_requests"], row["target_ttft_seconds"], row["prefill_tokens_per_second"]
        ),
        _engine_from_row(row),
    )
    return Instance(
        spec=spec,
        state=InstanceState(row["state"]),
        free_blocks=row["free_blocks"],
        cached_blocks=row["cached_blocks"],
        blocks_in_use=row["blocks_in_use"],
        pinned_blocks=row["pinned_blocks"],
        live_reservations=row["live_reservations"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        queued_requests=row["queued_requests"],
        queued_prompt_tokens=row["queued_prompt_tokens"],
        drift_blocks=row["drift_blocks"],
        engine_resyncs=row["engine_resyncs"],
        engine_requests_running=row["engine_requests_running"],
        engine_checked_at=row["engine_checked_at"],
        cpu_used_bytes=row["cpu_used_bytes"],
        cpu_capacity_bytes=row["cpu_capacity_bytes"],
        cpu_checked_at=row["cpu_checked_at"],
        cpu_compression_ratio=row["cpu_compression_ratio"],
    )


class Catalog:
    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine

    # Tenants

    async def create_tenant(
        self,
        tenant: str,
        display_name: str,
        weight: int,
        quota: TenantQuota,
        shadow_mode: bool = False,
    ) -> Tenant:
        async def work(conn: AsyncConnection) -> Tenant:
            statement = (
                pg_insert(TenantRow)
                .values(
                    tenant=tenant,
                    display_name=display_name,
                    weight=weight,
                    cache_salt=new_salt(),
                    shadow_mode=shadow_mode,
                    **_quota_columns(quota),
                )
                .on_conflict_do_nothing()
                .returning(TenantRow.tenant)
            )
            if (await conn.execute(statement)).first() is None:
                raise already_exists(Reason.TENANT_ALREADY_EXISTS, tenant_name(tenant))
            return await self._tenant(conn, tenant)

        return await in_transaction(self._engine, work)

    async def get_tenant(self, tenant: str) -> Tenant:
        async with self._engine.connect() as conn:
            return await self._tenant(conn, tenant)

    async def list_tenants(self, page: Page) -> list[Tenant]:
        query = _TENANT_VIEW.order_by(TenantRow.tenant).limit(page.size)
        if page.after is not None:
            query = query.where(TenantRow.tenant > page.after)
        async with self._engine.connect() as conn:
            return [tenant_from_row(r) for r in (await conn.execute(query)).mappings()]

    async def update_tenant(self, tenant: str, changes: dict[str, object]) -> Tenant:
        """Set the given columns (display_name, weight, max_* quota fields, shadow_mode). A
        quota may go below what the tenant holds now: live work runs on, new admissions wait
        until it fits."""

        async def work(conn: AsyncConnection) -> Tenant:
            await self._set(conn, tenant, dict(changes))
            return await self._tenant(conn, tenant)

        return await in_transaction(self._engine, work)

    async def set_tenant_state(self, tenant: str, state: TenantState) -> Tenant:
        return await self.update_tenant(tenant, {"state": state.value})

    async def _set(self, conn: AsyncConnection, tenant: str, values: dict[str, object]) -> None:
        namespace = values.get("namespace")
        if namespace is not None:
            exists = select(NamespaceRow.namespace).where(NamespaceRow.namespace == namespace)
            if (await conn.execute(exists)).first() is None:
                raise not_found(Reason.NAMESPACE_NOT_FOUND, f"namespaces/{namespace}")
        statement = (
            update(TenantRow)
            .where(TenantRow.tenant == tenant, TenantRow.state.in_(("ACTIVE", "SUSPENDED")))
            .values(**values, updated_at=func.now())
            .returning(TenantRow.tenant)
        )
        if (await conn.execute(statement)).first() is None:
            current = await self._tenant(conn, tenant)  # raises when there is no such tenant
            raise KvQuotaError(
                Reason.TENANT_OFFBOARDED,
                f"{tenant_name(tenant)} is {current.state.value.lower()}; it cannot change",
                metadata={"name": tenant_name(tenant)},
            )

    async def _tenant(self, conn: AsyncConnection, tenant: str) -> Tenant:
        query = _TENANT_VIEW.where(TenantRow.tenant == tenant)
        row = (await conn.execute(query)).mappings().first()
        if row is None:
            raise not_found(Reason.TENANT_NOT_FOUND, tenant_name(tenant))
        return tenant_from_row(row)

    # Cache salts and shared namespaces

    async def create_namespace(self, namespace: str) -> tuple[str, datetime]:
        async def work(conn: AsyncConnection) -> tuple[str, datetime]:
            statement = (
                pg_insert(NamespaceRow)
                .values(namespace=namespace, cache_salt=new_salt())
                .on_conflict_do_nothing()
                .returning(NamespaceRow.namespace, NamespaceRow.created_at)
            )
            row = (await conn.execute(statement)).first()
            if row is None:
                raise already_exists(Reason.NAMESPACE_ALREADY_EXISTS, f"namespaces/{namespace}")
            return row[0], row[1]

        return await in_transaction(self._engine, work)

    async def list_namespaces(self, page: Page) -> list[tuple[str, datetime]]:
        query = select(NamespaceRow.namespace, NamespaceRow.created_at).order_by(
            NamespaceRow.namespace
        )
        if page.after is not None:
            query = query.where(NamespaceRow.namespace > page.after)
        async with self._engine.connect() as conn:
            return [(r[0], r[1]) for r in await conn.execute(query.limit(page.size))]

    async def rotate_salt(self, collection: str, owner_id: str) -> None:
        """A new secret salt: prefixes cached under the old one stop matching (and age out)."""
        table, key = (
            (TenantRow, TenantRow.tenant)
            if collection == "tenants"
            else (
                NamespaceRow,
                NamespaceRow.namespace,
            )
        )

        async def work(conn: AsyncConnection) -> None:
            statement = (
                update(table).where(key == owner_id).values(cache_salt=new_salt()).returning(key)
            )
            if (await conn.execute(statement)).first() is None:
                missing = (
                    Reason.TENANT_NOT_FOUND
                    if collection == "tenants"
                    else Reason.NAMESPACE_NOT_FOUND
                )
                raise not_found(missing, f"{collection}/{owner_id}")

        await in_transaction(self._engine, work)

    # Instances

    async def register_instance(self, spec: InstanceSpec) -> Instance:
        geometry = spec.geometry

        async def work(conn: AsyncConnection) -> Instance:
            statement = (
                pg_insert(InstanceRow)
                .values(
                    instance=spec.instance,
                    model=spec.model,
                    num_layers=geometry.num_layers if geometry else None,
                    num_kv_heads=geometry.num_kv_heads if geometry else None,
                    head_dim=geometry.head_dim if geometry else None,
                    kv_dtype=geometry.dtype.value if geometry else None,
                    mla=geometry.mla if geometry else False,
                    bytes_per_block=spec.bytes_per_block,
                    block_size=spec.block_size,
                    capacity_blocks=spec.capacity_blocks,
                    max_model_len=spec.max_model_len,
                    hash_algo=spec.hash_algo.value,
                    max_queued_requests=spec.queue.max_queued_requests,
                    target_ttft_seconds=spec.queue.target_ttft_seconds,
                    prefill_tokens_per_second=spec.queue.prefill_tokens_per_second,
                    **_engine_columns(spec.engine),
                )
                .on_conflict_do_nothing()
                .returning(InstanceRow.instance)
            )
            if (await conn.execute(statement)).first() is None:
                raise already_exists(Reason.INSTANCE_ALREADY_EXISTS, instance_name(spec.instance))
            return await self._instance(conn, spec.instance)

        return await in_transaction(self._engine, work)

    async def set_engine(self, instance: str, engine: EngineEndpoints) -> Instance:
        """Point an instance at where its engine is now (a new address or event sockets)."""

        async def work(conn: AsyncConnection) -> Instance:
            statement = (
                update(InstanceRow)
                .where(InstanceRow.instance == instance)
                .values(**_engine_columns(engine), updated_at=func.now())
                .returning(InstanceRow.instance)
            )
            if (await conn.execute(statement)).first() is None:
                raise not_found(Reason.INSTANCE_NOT_FOUND, instance_name(instance))
            return await self._instance(conn, instance)

        return await in_transaction(self._engine, work)

    async def instance_at(self, address: str) -> str:
        """The instance whose engine is at `address` (host:port, as core/engine_address.py
        keys it): INSTANCE_NOT_FOUND when none is, INVALID_REQUEST when several share it
        (data-parallel ranks behind one server), so the caller names the instance."""
        query = select(InstanceRow.instance).where(InstanceRow.engine_address == address).limit(2)
        async with self._engine.connect() as conn:
            found = list((await conn.execute(query)).scalars())
        if not found:
            raise KvQuotaError(
                Reason.INSTANCE_NOT_FOUND,
                f"no instance is registered with the engine at {address}",
                metadata={"engineAddress": address},
            )
        if len(found) > 1:
            raise invalid_request(
                [
                    FieldViolation(
                        "engine_address",
                        f"several instances share the engine at {address}: name the instance",
                    )
                ]
            )
        return str(found[0])

    async def get_instance(self, instance: str) -> Instance:
        async with self._engine.connect() as conn:
            return await self._instance(conn, instance)

    async def list_instances(self, page: Page) -> list[Instance]:
        query = _INSTANCE_VIEW.order_by(InstanceRow.instance).limit(page.size)
        if page.after is not None:
            query = query.where(InstanceRow.instance > page.after)
        async with self._engine.connect() as conn:
            return [instance_from_row(r) for r in (await conn.execute(query)).mappings()]

    async def drain_instance(self, instance: str) -> Instance:
        async def work(conn: AsyncConnection) -> Instance:
            statement = (
                update(InstanceRow)
                .where(InstanceRow.instance == instance)
                .values(state=InstanceState.DRAINING.value, updated_at=func.now())
                .returning(InstanceRow.instance)
            )
            if (await conn.execute(statement)).first() is None:
                raise not_found(Reason.INSTANCE_NOT_FOUND, instance_name(instance))
            return await self._instance(conn, instance)

        return await in_transaction(self._engine, work)

    async def _instance(self, conn: AsyncConnection, instance: str) -> Instance:
        query = _INSTANCE_VIEW.where(InstanceRow.instance == instance)
        row = (await conn.execute(query)).mappings().first()
        if row is None:
            raise not_found(Reason.INSTANCE_NOT_FOUND, instance_name(instance))
        return instance_from_row(row)


def new_salt() -> str:
    return secrets.token_urlsafe(SALT_BYTES)


def _quota_columns(quota: TenantQuota) -> dict[str, int]:
    return {name: getattr(quota, name) for name in TenantQuota.__dataclass_fields__}


def _engine_columns(engine: EngineEndpoints | None) -> dict[str, object]:
    lmcache = engine.lmcache if engine is not None else None
    return {
        "engine_url": engine.url if engine else None,
        "engine_address": engine_address.normalise(engine.url) if engine else None,
        "kv_events_endpoint": engine.kv_events if engine else None,
        "kv_replay_endpoint": engine.kv_replay if engine else None,
        "lmcache_coordinator_url": lmcache.coordinator_url if lmcache else None,
        "lmcache_instance_id": lmcache.instance_id if lmcache else None,
        "lmcache_model_name": lmcache.model_name if lmcache else None,
        "lmcache_world_size": lmcache.world_size if lmcache else None,
        # A CPU tier's reading is read again from whatever tier the instance has now.
        "cpu_used_bytes": None,
        "cpu_capacity_bytes": None,
        "cpu_checked_at": None,
        "cpu_compression_ratio": None,
    }


def lmcache_from_row(row: RowMapping) -> LmcacheEndpoint | None:
    """The CPU tier from a row's lmcache_* columns (None: the instance has none)."""
    if not row["lmcache_coordinator_url"]:
        return None
    return LmcacheEndpoint(
        row["lmcache_coordinator_url"],
        row["lmcache_instance_id"],
        row["lmcache_model_name"],
        row["lmcache_world_size"],
    )


def _engine_from_row(row: RowMapping) -> EngineEndpoints | None:
    if not row["engine_url"]:
        return None
    return EngineEndpoints(
        row["engine_url"],
        row["kv_events_endpoint"],
        row["kv_replay_endpoint"],
        lmcache_from_row(row),
    )
