"""Building blocks shared by the integration tests: a small instance, tenants, admit requests,
and a read of every counter straight from the database."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from quota_service.core import catalog
from quota_service.core.admission import AdmitRequest
from quota_service.core.model import AdmitParams, TenantQuota
from quota_service.store.catalog import Catalog

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


@dataclass(frozen=True)
class Books:
    """Every counter and what the live reservations say it should be."""

    instance_blocks: dict[str, int]
    instance_capacity: dict[str, int]
    live_instance_blocks: dict[str, int]
    tenant_blocks: dict[str, int]
    tenant_tokens: dict[str, int]
    live_tenant_blocks: dict[str, int]
    live_tenant_tokens: dict[str, int]
    reservations: int

    def assert_consistent(self) -> None:
        """Invariants 1 and 3 for reservations without block tables: counters equal the sums
        over live reservations, and no instance holds more than its capacity."""
        for name, used in self.instance_blocks.items():
            assert used == self.live_instance_blocks.get(name, 0), name
            assert 0 <= used <= self.instance_capacity[name], name
        for name, used in self.tenant_blocks.items():
            assert used == self.live_tenant_blocks.get(name, 0), name
            assert self.tenant_tokens[name] == self.live_tenant_tokens.get(name, 0), name


async def read_books(engine: AsyncEngine) -> Books:
    async with engine.connect() as conn:
        instances = (
            await conn.execute(
                text("SELECT instance, blocks_in_use, capacity_blocks FROM instances")
            )
        ).all()
        tenants = (
            await conn.execute(text("SELECT tenant, blocks_in_use, tokens_in_flight FROM tenants"))
        ).all()
        live_i = (
            await conn.execute(
                text(
                    "SELECT instance, sum(reserved_blocks) FROM reservations "
                    "WHERE state = 'ADMITTED' GROUP BY instance"
                )
            )
        ).all()
        live_t = (
            await conn.execute(
                text(
                    "SELECT tenant, sum(reserved_blocks), sum(reserved_tokens) FROM reservations "
                    "WHERE state = 'ADMITTED' GROUP BY tenant"
                )
            )
        ).all()
        count = (await conn.execute(text("SELECT count(*) FROM reservations"))).scalar_one()
    return Books(
        instance_blocks={r[0]: r[1] for r in instances},
        instance_capacity={r[0]: r[2] for r in instances},
        live_instance_blocks={r[0]: int(r[1]) for r in live_i},
        tenant_blocks={r[0]: r[1] for r in tenants},
        tenant_tokens={r[0]: r[2] for r in tenants},
        live_tenant_blocks={r[0]: int(r[1]) for r in live_t},
        live_tenant_tokens={r[0]: int(r[2]) for r in live_t},
        reservations=count,
    )


async def snapshot(engine: AsyncEngine) -> tuple[object, ...]:
    """Every row of every ledger table, to show that a refused request changed nothing."""
    async with engine.connect() as conn:
        rows = []
        for table in ("tenants", "instances", "reservations"):
            result = await conn.execute(text(f"SELECT * FROM {table} ORDER BY 1, 2"))
            rows.append(tuple(tuple(r) for r in result))
        return tuple(rows)
