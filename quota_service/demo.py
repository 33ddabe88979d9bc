"""Demo data for `make run`: one Llama-3-8B-class instance and two tenants. Idempotent."""

from __future__ import annotations

import logging
from collections.abc import Awaitable

from quota_service.core import catalog
from quota_service.core.errors import Code, KvQuotaError
from quota_service.core.geometry import KvDtype, KvGeometry, MemoryBudget
from quota_service.core.model import TenantQuota
from quota_service.store.catalog import Catalog
from quota_service.store.database import connect

log = logging.getLogger(__name__)

GIB = 1024**3
# Llama-3-8B: 32 layers, 8 KV heads of 128, bf16 → 128 KiB per token, 2 MiB per 16-token block,
# on an 80 GiB GPU at vLLM's 0.92 utilisation with 16 GiB of weights and 4 GiB of activations.
DEMO_INSTANCE = catalog.instance_spec(
    instance="demo-llama3-8b",
    model="meta-llama/Meta-Llama-3-8B-Instruct",
    kv_geometry=KvGeometry(32, 8, 128, KvDtype.BF16),
    block_size=16,
    max_model_len=8192,
    budget=MemoryBudget(80 * GIB, 16 * GIB, 4 * GIB, 0.92),
    num_gpu_blocks=None,
)
DEMO_TENANTS = {
    "acme": ("Acme Corp", TenantQuota(8192, 131072, 64, 512, 8 * GIB)),
    "globex": ("Globex", TenantQuota(4096, 65536, 32, 256, 4 * GIB)),
}


async def _unless_exists(write: Awaitable[object]) -> None:
    try:
        await write
    except KvQuotaError as exc:
        if exc.code is not Code.ALREADY_EXISTS:
            raise


async def seed(database_url: str) -> None:
    engine = connect(database_url, pool_size=1)
    store = Catalog(engine)
    try:
        await _unless_exists(store.register_instance(DEMO_INSTANCE))
        for tenant, (display_name, quota) in DEMO_TENANTS.items():
            await _unless_exists(store.create_tenant(tenant, display_name, 1, quota))
    finally:
        await engine.dispose()
    log.info("demo data: instance %s, tenants %s", DEMO_INSTANCE.instance, ", ".join(DEMO_TENANTS))
