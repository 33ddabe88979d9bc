"""API keys and the audit log of administrative actions."""

from __future__ import annotations

import uuid

from sqlalchemy import RowMapping, func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from quota_service.core import access
from quota_service.core.access import ApiKey, AuditEvent, Role
from quota_service.core.errors import not_found
from quota_service.core.names import tenant_name
from quota_service.core.pagination import Page
from quota_service.core.reasons import Reason
from quota_service.store.database import connect, in_transaction
from quota_service.store.schema import ApiKeyRow, AuditEventRow, TenantRow

_KEY_COLUMNS = (
    ApiKeyRow.key_id,
    ApiKeyRow.display_name,
    ApiKeyRow.role,
    ApiKeyRow.tenants,
    ApiKeyRow.creator,
    ApiKeyRow.created_at,
    ApiKeyRow.revoked_at,
)


def _key(row: RowMapping) -> ApiKey:
    return ApiKey(
        row["key_id"],
        row["display_name"],
        Role(row["role"]),
        tuple(row["tenants"]),
        row["creator"],
        row["created_at"],
        row["revoked_at"],
    )


class ApiKeys:
    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine

    async def create(
        self, display_name: str, role: Role, tenants: list[str], creator: str
    ) -> tuple[ApiKey, str]:
        """A new key and its bearer token (returned once; only its digest is stored)."""
        access.check_binding(role, tenants)
        secret = access.new_secret()

        async def work(conn: AsyncConnection) -> ApiKey:
            known = await conn.execute(
                select(TenantRow.tenant).where(TenantRow.tenant.in_(tenants))
            )
            missing = sorted(set(tenants) - set(known.scalars()))
            if missing:
                raise not_found(Reason.TENANT_NOT_FOUND, tenant_name(missing[0]))
            row = await conn.execute(
                insert(ApiKeyRow)
                .values(
                    key_id=secret.key_id,
                    display_name=display_name,
                    role=role.value,
                    tenants=sorted(set(tenants)),
                    secret_sha256=secret.digest,
                    creator=creator,
                )
                .returning(*_KEY_COLUMNS)
            )
            return _key(row.mappings().one())

        return await in_transaction(self._engine, work), secret.token

    async def verified(self, key_id: str) -> tuple[ApiKey, bytes] | None:
        """A working (not revoked) key and its secret's digest, or None."""
        query = select(*_KEY_COLUMNS, ApiKeyRow.secret_sha256).where(
            ApiKeyRow.key_id == key_id, ApiKeyRow.revoked_at.is_(None)
        )
        async with self._engine.connect() as conn:
            row = (await conn.execute(query)).mappings().first()
        return None if row is None else (_key(row), row["secret_sha256"])

    async def list(self, page: Page, show_revoked: bool) -> list[ApiKey]:
        query = select(*_KEY_COLUMNS).order_by(ApiKeyRow.key_id).limit(page.size)
        if page.after is not None:
            query = query.where(ApiKeyRow.key_id > page.after)
        if not show_revoked:
            query = query.where(ApiKeyRow.revoked_at.is_(None))
        async with self._engine.connect() as conn:
            return [_key(r) for r in (await conn.execute(query)).mappings()]

    async def revoke(self, key_id: str) -> ApiKey:
        """Idempotent: revoking a revoked key keeps its first revocation time."""
        statement = (
            update(ApiKeyRow)
            .where(ApiKeyRow.key_id == key_id)
            .values(revoked_at=func.coalesce(ApiKeyRow.revoked_at, func.now()))
            .returning(*_KEY_COLUMNS)
        )
        async with self._engine.begin() as conn:
            row = (await conn.execute(statement)).mappings().first()
        if row is None:
            raise not_found(Reason.API_KEY_NOT_FOUND, access.key_name(key_id))
        return _key(row)


class AuditLog:
    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine

    async def record(self, event: AuditEvent) -> None:
        async with self._engine.begin() as conn:
            await conn.execute(
                insert(AuditEventRow).values(
                    principal=event.principal,
                    method=event.method,
                    resource=event.resource[:300],
                    request_id=event.request_id,
                    code=event.code,
                )
            )

    async def list(
        self, page: Page, principal: str | None, method: str | None
    ) -> list[tuple[int, AuditEvent]]:
        """Newest first, each with the id its page token carries."""
        query = select(AuditEventRow.__table__).order_by(AuditEventRow.id.desc()).limit(page.size)
        if page.after is not None:  # a number: the API refuses any other token
            query = query.where(AuditEventRow.id < int(page.after))
        if principal:
            query = query.where(AuditEventRow.principal == principal)
        if method:
            query = query.where(AuditEventRow.method == method)
        async with self._engine.connect() as conn:
            rows = (await conn.execute(query)).all()
        return [
            (r.id, AuditEvent(r.at, r.principal, r.method, r.resource, r.request_id, r.code))
            for r in rows
        ]


async def create_bootstrap_key(database_url: str, display_name: str) -> tuple[ApiKey, str]:
    """An admin key made without the API (there is no admin to call it yet), audited as such."""
    engine = connect(database_url, pool_size=1)
    try:
        key, token = await ApiKeys(engine).create(display_name, Role.ADMIN, [], access.BOOTSTRAP)
        event = AuditEvent(None, access.BOOTSTRAP, "CreateApiKey", key.name, uuid.uuid4().hex, "OK")
        await AuditLog(engine).record(event)
        return key, token
    finally:
        await engine.dispose()
