"""Building blocks shared by the integration tests: a small instance, tenants, admit requests,
and a read of every counter straight from the database."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from quota_service.core import catalog
from quota_service.core.admission import AdmitRequest
from quota_service.core.model import AdmitParams, TenantQuota
from quota_service.enforcement.termination import Termination
from quota_service.store.catalog import Catalog
from quota_service.store.ledger import Ledger
from quota_service.store.offboarding import RESERVATION_BATCH, Offboarding
from quota_service.store.pins import Pins

UNLIMITED = TenantQuota(10**9, 10**12, 1000, 1000, 10**12)


async def add_instance(
    engine: AsyncEngine,
    name: str = "gpu-0",
    blocks: int = 512,
    block_size: int = 16,
    cap: int = 8192,
) -> None:
    spec = catalog.instance_spec(name, "test-model", None, block_size, cap, None, blocks)
    await Catalog(engine).register_instance(spec)


async def add_tenant(engine: AsyncEngine, name: str, quota: TenantQuota = UNLIMITED) -> None:
    await Catalog(engine).create_tenant(name, name.title(), 1, quota)


def request(
    request_id: str,
    prompt: int,
    output: int,
    tenant: str = "acme",
    instance: str = "gpu-0",
    n: int = 1,
    lease_ttl: float | None = None,
) -> AdmitRequest:
    return AdmitRequest(
        params=AdmitParams(tenant, request_id, instance, prompt, output, n, 0),
        prompt_token_ids=(),
        wait_timeout_seconds=0.0,
        lease_ttl_seconds=lease_ttl,
    )


async def counters(engine: AsyncEngine) -> dict[str, dict[str, int]]:
    """Instance and tenant counters straight from the database: "instance:<name>" and
    "tenant:<name>" map to their columns."""
    found: dict[str, dict[str, int]] = {}
    async with engine.connect() as conn:
        for row in await conn.execute(
            text(
                "SELECT instance, free_blocks, cached_blocks, blocks_in_use, pinned_blocks, "
                "queued_requests, queued_prompt_tokens FROM instances"
            )
        ):
            found[f"instance:{row.instance}"] = dict(row._mapping)
        for row in await conn.execute(
            text(
                "SELECT tenant, blocks_in_use, tokens_in_flight, pinned_blocks, queued_requests "
                "FROM tenants"
            )
        ):
            found[f"tenant:{row.tenant}"] = dict(row._mapping)
        count = await conn.execute(text("SELECT count(*) FROM reservations"))
        found["reservations"] = {"count": count.scalar_one()}
    return found


LEDGER_TABLES = ("tenants", "instances", "reservations", "blocks", "block_refs")
# Each table's rows as text, in one round trip: the fuzz test reads this around every call.
_SNAPSHOT = text(
    "SELECT "
    + ", ".join(f"ARRAY(SELECT row::text FROM {t} AS row ORDER BY 1)" for t in LEDGER_TABLES)
)


async def snapshot(engine: AsyncEngine) -> tuple[object, ...]:
    """Every row of every ledger table, to show that a refused request changed nothing."""
    async with engine.connect() as conn:
        return tuple((await conn.execute(_SNAPSHOT)).one())


def offboarding_service(
    engine: AsyncEngine, ledger: Ledger, pins: Pins, reservation_batch: int = RESERVATION_BATCH
) -> Offboarding:
    """Offboarding as the server builds it (the instances these tests register have no engine,
    so nothing is aborted)."""
    termination = Termination(ledger, abort_timeout_seconds=1.0, hard_timeout_seconds=5.0)
    return Offboarding(engine, ledger, pins, termination, reservation_batch)


def crash_after_batches(
    offboarding: Offboarding, monkeypatch: pytest.MonkeyPatch, batches: int
) -> None:
    """Make the offboarding's process die once `batches` batches of reservations committed."""
    real_batch = offboarding._end_batch
    started = 0

    async def crashing_batch(instance: str, tenant: str, request_ids: Sequence[str]) -> None:
        nonlocal started
        started += 1
        if started > batches:
            raise RuntimeError("process killed")
        await real_batch(instance, tenant, request_ids)

    monkeypatch.setattr(offboarding, "_end_batch", crashing_batch)
