"""The Prometheus exporter serves the record's figures, as the memory hot path keeps it: per
instance (drift among them), per
tenant and tier (compressed sessions counted at their compressed size), and what reclaim jobs
gave back by tier."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from quota_service.api.server import HotPath
from quota_service.config import Settings
from quota_service.core import catalog, geometry
from quota_service.core.admission import AdmitRequest
from quota_service.core.hashing import block_hashes, event_hash
from quota_service.core.kv_events import BlockRemoved, BlockStored, EventBatch
from quota_service.core.model import (
    EndReason,
    EngineEndpoints,
    LmcacheEndpoint,
    ReservationState,
    TenantQuota,
)
from quota_service.core.reclaim import DEFAULT_WATERMARKS, CompressMeasurement, ReclaimTarget, Tier
from quota_service.metrics import LedgerMetrics, ServiceMetrics, serve_metrics
from quota_service.store.cpu_tier import CpuTierBooks
from tests.integration.ledger_fixtures import add_instance, add_tenant, request
from tests.integration.scraping import body, key, matching, samples_of, scrape
from tests.integration.test_compress_steps import COMPRESS_ONLY, FULL, offloaded

BS = 16
GEOMETRY = geometry.KvGeometry(2, 2, 64, geometry.KvDtype.FP16)  # 16 KiB a block
BLOCK_BYTES = 16384


@pytest.fixture
async def exporter(
    engine: AsyncEngine, owned: HotPath, settings: Settings
) -> AsyncIterator[tuple[LedgerMetrics, str]]:
    """The record's snapshot, built and served as the server does; yields it and its URL."""
    reclaim = owned.reclaim(engine, settings.cpu_watermarks)
    metrics = LedgerMetrics(owned.catalog, owned.inspection(engine), reclaim, 60.0)
    served = ServiceMetrics()
    served.registry.register(metrics)
    server = serve_metrics("127.0.0.1:0", served.registry)
    try:
        yield metrics, f"http://127.0.0.1:{server.server_port}/metrics"
    finally:
        await asyncio.to_thread(server.shutdown)
        server.server_close()


async def test_drift_and_blocks_per_instance(
    engine: AsyncEngine, owned: HotPath, exporter: tuple[LedgerMetrics, str]
) -> None:
    await add_instance(engine, blocks=16)
    await add_tenant(engine, "acme")
    ledger = owned.ledger
    prompt = list(range(500, 500 + 4 * BS))
    _, salt = await ledger.admit(
        replace(request("a", len(prompt), 1), prompt_token_ids=tuple(prompt))
    )
    hashes = tuple(event_hash(h) for h in block_hashes(prompt, BS, salt))
    reconciler = owned.reconciler(engine)
    stored = BlockStored(hashes, None, tuple(prompt), BS, "GPU")
    await reconciler.apply("gpu-0", 0, EventBatch(0.0, (stored,), 0))
    # The engine evicts blocks the owner still references: drift.
    await reconciler.apply("gpu-0", 1, EventBatch(0.0, (BlockRemoved(hashes[2:], "GPU"),), 0))

    metrics, url = exporter
    await metrics.refresh()
    samples = await scrape(url)
    gpu = (("engine_instance", "gpu-0"),)
    assert samples[("kvquota_instance_drift_blocks_total", gpu)] == 2
    assert samples[("kvquota_instance_live_reservations", gpu)] == 1
    by_state = {
        dict(labels)["state"]: value
        for (name, labels), value in samples.items()
        if name == "kvquota_instance_blocks"
    }
    # The prompt's 4 blocks; its one output token never gets a slot.
    assert by_state == {"in_use": 4, "cached": 0, "free": 12, "pinned": 0}
    assert sum(by_state.values()) == 16  # every slot in exactly one state
    # Never read from an engine: no running figure rather than a made-up 0.
    assert ("kvquota_instance_engine_requests_running", gpu) not in samples
    # Within the refresh interval a scrape reads the snapshot, not the database.
    await ledger.admit(request("b", 10, 1))
    await metrics.refresh()
    assert (await scrape(url))[("kvquota_instance_live_reservations", gpu)] == 1


def turn(request_id: str, first_token: int, blocks: int, tenant: str = "acme") -> AdmitRequest:
    """A request of `blocks` blocks: blocks * 16 - 1 prompt tokens (with ids) and 1 output."""
    prompt = tuple(range(first_token, first_token + blocks * BS - 1))
    return replace(request(request_id, len(prompt), 1, tenant=tenant), prompt_token_ids=prompt)


async def test_tenants_by_tier_queues_and_reclaim_by_tier(
    engine: AsyncEngine, owned: HotPath, exporter: tuple[LedgerMetrics, str]
) -> None:
    lmcache = LmcacheEndpoint("http://127.0.0.1:1", "mp-1", "m")
    endpoints = EngineEndpoints("http://127.0.0.1:1", lmcache=lmcache)
    spec = catalog.instance_spec("gpu-0", "m", GEOMETRY, BS, 8192, None, 16, engine=endpoints)
    await owned.catalog.register_instance(spec)
    await CpuTierBooks(engine).record_usage("gpu-0", 0, 1 << 20)
    acme_quota = TenantQuota(100, 10**6, 5, 8, 1 << 20)
    await add_tenant(engine, "acme", acme_quota)
    await add_tenant(engine, "globex")
    ledger = owned.ledger
    salts = set()
    # acme: a pinned system prompt (2 blocks), an idle session (4) and a running request (4).
    await owned.pins.pin("tenants/acme", "system", "gpu-0", list(range(2 * BS)))
    for admit in (turn("chat", 1000, 4), turn("busy", 5000, 4), turn("g1", 9000, 3, "globex")):
        salts.add((await ledger.admit(admit))[1])
    await ledger.suspend("acme", "chat", ())
    # globex leaves its 2 full prompt blocks cached (its last block is simply free).
    await ledger.end("globex", "g1", EndReason.RELEASED, 1)

    jobs = owned.reclaim(engine, DEFAULT_WATERMARKS)
    reclaimed = 0
    for request_id, target in (
        ("free", ReclaimTarget(2, Tier.FREE)),
        ("offload", ReclaimTarget(4, Tier.OFFLOAD)),
    ):
        job = await jobs.create(request_id, "gpu-0", target, dry_run=False)
        while await jobs.run_step(job.job_id):
            pass
        reclaimed += (await jobs.get(job.job_id)).actual_blocks
    assert reclaimed == 6
    # A dry run applies nothing, so it counts for nothing.
    await jobs.create("dry", "gpu-0", ReclaimTarget(2, Tier.FREE), dry_run=True)
    # The pool has 6 of 16 blocks held now: a 12-block request waits in the queue.
    later = replace(turn("later", 20000, 12), wait_timeout_seconds=60.0)
    assert (await ledger.admit(later))[0].state is ReservationState.QUEUED

    metrics, url = exporter
    await metrics.refresh()
    text = await body(url)
    samples = samples_of(text)

    def tenant(name: str) -> dict[str, float]:
        prefix = "kvquota_tenant_"
        return {
            n.removeprefix(prefix): v
            for (n, labels), v in samples.items()
            if n.startswith(prefix) and labels == (("tenant", name),)
        }

    assert tenant("acme") == {
        "gpu_blocks": 2 + 4,  # the pin and "busy": "chat" left the GPU
        "pinned_blocks": 2,
        "cpu_tier_bytes": 4 * BLOCK_BYTES,  # "chat", offloaded
        "cpu_tier_compressed_bytes": 0,
        "tokens_in_flight": 4 * BS,  # "busy" alone: an offloaded session's tokens left too
        "queued_requests": 1,
        "live_reservations": 2,
        "max_gpu_blocks": 100,
        "max_tokens_in_flight": 10**6,
        "max_queued_requests": 5,
        "max_pinned_blocks": 8,
        "max_cpu_tier_bytes": 1 << 20,
    }
    globex = tenant("globex")
    assert [globex[n] for n in ("gpu_blocks", "pinned_blocks", "cpu_tier_bytes")] == [0, 0, 0]
    assert globex["live_reservations"] == 0

    gpu = {"engine_instance": "gpu-0"}
    assert samples[key("kvquota_instance_queued_requests", **gpu)] == 1
    assert samples[key("kvquota_instance_queued_prompt_tokens", **gpu)] == 12 * BS - 1
    assert samples[key("kvquota_instance_cpu_tier_capacity_bytes", **gpu)] == 1 << 20

    def by_tier(name: str) -> dict[str, float]:
        return {s.labels["tier"]: s.value for s in matching(samples, name, **gpu)}

    assert by_tier("kvquota_reclaimed_blocks_total") == {"free": 2, "offload": 4}
    assert by_tier("kvquota_reclaimed_bytes_total") == {
        "free": 2 * BLOCK_BYTES,
        "offload": 4 * BLOCK_BYTES,
    }
    steps = {
        (s.labels["tier"], s.labels["state"]): s.value
        for s in matching(samples, "kvquota_reclaim_steps_total", **gpu)
    }
    assert steps == {("free", "applied"): 1, ("offload", "applied"): 1}
    assert ("kvquota_ledger_snapshot_timestamp_seconds", ()) in samples
    # Tenant labels are tenant ids; their secrets never reach the exporter.
    assert len(salts) == 2 and not any(salt in text for salt in salts)


async def test_a_compressed_session_counts_in_the_cpu_tier_at_its_compressed_size(
    engine: AsyncEngine, owned: HotPath, exporter: tuple[LedgerMetrics, str]
) -> None:
    """Two offloaded sessions of 4 blocks; a COMPRESS step takes the coldest to a quarter of
    its bytes. The tenant's CPU-tier bytes are what its quota counts: the other session whole
    and the compressed one at its compressed size, which is also shown on its own."""
    await offloaded(engine, owned, "chat", "idle")
    await CpuTierBooks(engine).record_compression_ratio("gpu-0", 0.25)
    jobs = owned.reclaim(engine, FULL)
    job = await jobs.create("compress", "gpu-0", COMPRESS_ONLY, dry_run=False)
    assert [s.planned.reservation for s in job.steps] == [("acme", "chat")]
    await jobs.run_step(job.job_id)
    await jobs.record_measurement(job.job_id, 0, CompressMeasurement(4096, 1024, 0))
    assert await jobs.compress(job.job_id, 0)

    metrics, url = exporter
    await metrics.refresh()
    samples = await scrape(url)
    acme = (("tenant", "acme"),)
    whole = 4 * BLOCK_BYTES
    assert samples[("kvquota_tenant_cpu_tier_bytes", acme)] == whole + whole // 4
    assert samples[("kvquota_tenant_cpu_tier_compressed_bytes", acme)] == whole // 4
