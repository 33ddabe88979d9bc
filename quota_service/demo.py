"""Demo data for `make run`: one Llama-3-8B-class instance and two tenants. Idempotent."""

from __future__ import annotations

import logging
from collections.abc import Awaitable

from quota_service.core import catalog
from quota_service.core.errors import Code, KvQuotaError
from quota_service.core.geometry import KvDtype, KvGeometry, MemoryBudget
from quota_service.core.model import EngineEndpoints, TenantQuota
from quota_service.engine.simulated import EventPublisher, SimulatedHost, SimulatedPool
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
# The simulated host's pool, small enough that the demo shows evictions.
SIMULATED_INSTANCE = "demo-simulated"
SIMULATED_BLOCKS = 512

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


async def start_simulated_host() -> tuple[SimulatedHost, EngineEndpoints]:
    """A simulated vLLM host on free loopback ports: the demo's engine, followed like a real one."""
    pool = SimulatedPool(num_blocks=SIMULATED_BLOCKS + 1, block_size=16)
    host = SimulatedHost(pool, EventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*"))
    port = await host.serve("127.0.0.1", 0)
    endpoints = EngineEndpoints(
        f"http://127.0.0.1:{port}", host.publisher.events_endpoint, host.publisher.replay_endpoint
    )
    log.info("simulated vLLM host at %s (events %s)", endpoints.url, endpoints.kv_events)
    return host, endpoints


async def seed(database_url: str, simulated: EngineEndpoints | None = None) -> None:
    engine = connect(database_url, pool_size=1)
    store = Catalog(engine)
    try:
        await _unless_exists(store.register_instance(DEMO_INSTANCE))
        if simulated is not None:
            spec = catalog.instance_spec(
                SIMULATED_INSTANCE,
                "simulated",
                None,
                16,
                SIMULATED_BLOCKS * 16,
                None,
                SIMULATED_BLOCKS,
                engine=simulated,
            )
            await _unless_exists(store.register_instance(spec))
            await store.set_engine(SIMULATED_INSTANCE, simulated)  # its ports change each run
        for tenant, (display_name, quota) in DEMO_TENANTS.items():
            await _unless_exists(store.create_tenant(tenant, display_name, 1, quota))
    finally:
        await engine.dispose()
    instances = [DEMO_INSTANCE.instance] + ([SIMULATED_INSTANCE] if simulated else [])
    log.info("demo data: instances %s, tenants %s", ", ".join(instances), ", ".join(DEMO_TENANTS))
