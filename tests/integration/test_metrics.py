"""The Prometheus exporter serves the ledger's per-instance figures, drift among them."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import httpx
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.ext.asyncio import AsyncEngine

from quota_service.config import Settings
from quota_service.core.hashing import block_hashes, event_hash
from quota_service.engine.vllm.events import BlockRemoved, BlockStored, EventBatch
from quota_service.jobs.metrics import InstanceMetrics, serve_metrics
from quota_service.store.catalog import Catalog
from quota_service.store.ledger import Ledger
from quota_service.store.reconcile import Reconciler
from tests.integration.ledger_fixtures import add_instance, add_tenant, request

BS = 16


async def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    async with httpx.AsyncClient() as client:
        body = (await client.get(url)).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
        if s.name.startswith("kvquota_")
    }


async def test_drift_and_blocks_per_instance(engine: AsyncEngine, settings: Settings) -> None:
    await add_instance(engine, blocks=16)
    await add_tenant(engine, "acme")
    ledger = Ledger(engine, settings.admission_limits)
    prompt = list(range(500, 500 + 4 * BS))
    _, salt = await ledger.admit(
        replace(request("a", len(prompt), 1), prompt_token_ids=tuple(prompt))
    )
    hashes = tuple(event_hash(h) for h in block_hashes(prompt, BS, salt))
    reconciler = Reconciler(engine, ledger)
    stored = BlockStored(hashes, None, tuple(prompt), BS, "GPU")
    await reconciler.apply("gpu-0", 0, EventBatch(0.0, (stored,), 0))
    # The engine evicts blocks the ledger still references: drift.
    await reconciler.apply("gpu-0", 1, EventBatch(0.0, (BlockRemoved(hashes[2:], "GPU"),), 0))

    metrics = InstanceMetrics(Catalog(engine), refresh_seconds=60.0)
    await metrics.refresh()
    server = serve_metrics("127.0.0.1:0", metrics)
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        samples = await scrape(url)
        gpu = (("instance", "gpu-0"),)
        assert samples[("kvquota_instance_drift_blocks_total", gpu)] == 2
        assert samples[("kvquota_instance_live_reservations", gpu)] == 1
        by_state = {
            dict(labels)["state"]: value
            for (name, labels), value in samples.items()
            if name == "kvquota_instance_blocks"
        }
        assert by_state == {"in_use": 5, "cached": 0, "free": 11, "pinned": 0}
        assert sum(by_state.values()) == 16  # every slot in exactly one state
        # Never read from an engine: no running figure rather than a made-up 0.
        assert ("kvquota_instance_engine_requests_running", gpu) not in samples
        # Within the refresh interval a scrape reads the snapshot, not the database.
        await ledger.admit(request("b", 10, 1))
        await metrics.refresh()
        assert (await scrape(url))[("kvquota_instance_live_reservations", gpu)] == 1
    finally:
        await asyncio.to_thread(server.shutdown)
        server.server_close()
