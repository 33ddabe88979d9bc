"""What kvquota assumes of LMCache's MP coordinator, checked against a real coordinator and MP
server on the CPU (ENGINES.md): quotas mirrored per salt, pins mirrored without double counting,
a pinned prefix surviving a reclaim's delete, prefetch on resume, capability discovery."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from quota_service.api.server import HotPath
from quota_service.core import catalog, geometry
from quota_service.core.admission import AdmitRequest
from quota_service.core.model import (
    AdmitParams,
    EndReason,
    EngineEndpoints,
    LmcacheEndpoint,
    ReservationState,
    TenantQuota,
)
from quota_service.core.reclaim import DEFAULT_WATERMARKS, JobState, ReclaimTarget, Tier
from quota_service.enforcement.cpu_tier_mirror import CpuTierMirror
from quota_service.enforcement.termination import Termination
from quota_service.engine.lmcache import LmcacheCoordinator
from quota_service.jobs.reclaim_executor import ReclaimExecutor
from quota_service.store.cpu_tier import CpuTierBooks
from tests.engines.conftest import (
    BLOCK_SIZE,
    LMCACHE_L1_BYTES,
    MAX_MODEL_LEN,
    NUM_GPU_BLOCKS,
    ChunkWriter,
    Engine,
    Lmcache,
)

BS = 16
CHUNK = 256
GIB = 1 << 30
# Chunks reach the coordinator's directory through the server's event flush (0.2 s here).
SETTLE_SECONDS = 10.0


def endpoint(lmcache: Lmcache) -> LmcacheEndpoint:
    return LmcacheEndpoint(lmcache.coordinator_url, lmcache.instance_id, lmcache.model_name)


async def register(
    owned: HotPath, lmcache: Lmcache, *tenants: tuple[str, int], served: Engine | None = None
) -> None:
    """Instance gpu-0 (16 KiB blocks, 256 of them; or, `served`, that vLLM as conftest serves
    it) with its CPU tier on the real coordinator, and tenants with CPU-tier quotas in bytes."""
    if served is None:
        url, model, block_size, context, blocks = "http://127.0.0.1:1", "m", BS, 8192, 256
        kv = geometry.KvGeometry(2, 2, 64, geometry.KvDtype.FP16)
    else:
        url, model, block_size, context = served.base_url, served.model, BLOCK_SIZE, MAX_MODEL_LEN
        blocks = NUM_GPU_BLOCKS - 1  # vLLM keeps one as its null block
        config = json.loads((Path(model) / "config.json").read_text())
        kv = geometry.geometry_from_hf_config(config, geometry.KvDtype.BF16)  # CONTRACT_POOL's
    endpoints = EngineEndpoints(url, lmcache=endpoint(lmcache))
    spec = catalog.instance_spec(
        "gpu-0", model, kv, block_size, context, None, blocks, engine=endpoints
    )
    await owned.catalog.register_instance(spec)
    for tenant, cpu_bytes in tenants:
        quota = TenantQuota(10**6, 10**9, 10, 1000, cpu_bytes)
        await owned.catalog.create_tenant(tenant, tenant.title(), 1, quota)


async def salt_of(engine: AsyncEngine, tenant: str) -> str:
    async with engine.connect() as conn:
        query = text("SELECT cache_salt FROM tenants WHERE tenant = :tenant")
        return str((await conn.execute(query, {"tenant": tenant})).scalar_one())


async def coordinator_get(lmcache: Lmcache, path: str, **params: str) -> dict[str, object]:
    async with httpx.AsyncClient(base_url=lmcache.coordinator_url, timeout=10) as client:
        response = await client.get(path, params=params)
        response.raise_for_status()
        return dict(response.json())


async def tiers_of_chunks(lmcache: Lmcache, salt: str, tokens: list[int]) -> list[set[str]]:
    """Per whole chunk of `tokens`: the tiers the MP server holds it in, per the directory."""
    coordinator = LmcacheCoordinator(lmcache.coordinator_url)
    try:
        found = await coordinator.lookup(endpoint(lmcache), salt, tokens)
    finally:
        await coordinator.close()
    return [set(chunk.tiers) for chunk in found]


async def until(condition: object, probe: object) -> None:
    """Poll the async `probe` until it returns `condition` (the directory settles a moment after
    the server acted); fails with the last value."""
    assert callable(probe)
    last = None
    for _ in range(int(SETTLE_SECONDS / 0.2)):
        last = await probe()
        if last == condition:
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"expected {condition!r}, the coordinator says {last!r}")


async def test_quotas_are_mirrored_per_salt_and_follow_the_ledger(
    lmcache: Lmcache, engine: AsyncEngine, owned: HotPath
) -> None:
    await register(owned, lmcache, ("acme", GIB), ("bolt", 256 << 20))
    tier = CpuTierMirror(CpuTierBooks(engine))
    try:
        assert await tier.mirror() == 2
        acme, bolt = await salt_of(engine, "acme"), await salt_of(engine, "bolt")
        seen = await coordinator_get(lmcache, f"/quota/{acme}", tier="l2")
        assert (seen["quota_exists"], seen["quota_limit_gb"]) == (True, 1.0)
        assert (await coordinator_get(lmcache, f"/quota/{bolt}"))["quota_limit_gb"] == 0.25
        assert await tier.mirror() == 0  # a replay changes nothing

        await owned.catalog.update_tenant("acme", {"max_cpu_tier_bytes": 512 << 20})
        termination = Termination(owned.ledger, abort_timeout_seconds=1, hard_timeout_seconds=5)
        await owned.offboarding(engine, termination).delete_tenant("bolt")
        await termination.close()
        assert await tier.mirror() == 2
        assert (await coordinator_get(lmcache, f"/quota/{acme}"))["quota_limit_gb"] == 0.5
        assert (await coordinator_get(lmcache, f"/quota/{bolt}"))["quota_exists"] is False

        # The instance's L1 as the coordinator reports it, and what the server can do.
        instance = await owned.catalog.get_instance("gpu-0")
        assert instance.cpu_capacity_bytes == LMCACHE_L1_BYTES
        assert instance.cpu_used_bytes is not None and instance.cpu_checked_at is not None
        coordinator = LmcacheCoordinator(lmcache.coordinator_url)
        capabilities = await coordinator.capabilities(endpoint(lmcache))
        await coordinator.close()
        assert (capabilities.chunk_size, capabilities.can_compress) == (CHUNK, False)
        assert capabilities.l1.capacity_bytes == LMCACHE_L1_BYTES
    finally:
        await tier.close()


async def test_pins_are_mirrored_once_and_survive_a_reclaim_delete(
    lmcache: Lmcache, chunk_writer: ChunkWriter, engine: AsyncEngine, owned: HotPath
) -> None:
    """A suspended session of three chunks whose first two are a pinned system prompt: an
    EVICT step deletes the session's CPU-tier copy, and the pinned chunks stay."""
    await register(owned, lmcache, ("pinner", GIB))
    salt = await salt_of(engine, "pinner")
    session_tokens = list(range(1000, 1000 + 3 * CHUNK))
    assert chunk_writer.store(salt, session_tokens) == 3
    await until([{"l1", "l2"}] * 3, lambda: tiers_of_chunks(lmcache, salt, session_tokens))

    pins = owned.pins
    system_prompt = session_tokens[: 2 * CHUNK]
    tier = CpuTierMirror(CpuTierBooks(engine))
    coordinator = LmcacheCoordinator(lmcache.coordinator_url)
    where = endpoint(lmcache)
    try:
        await tier.mirror()  # the salt's quota (and no pin: they are made below)
        await pins.pin("tenants/pinner", "system", "gpu-0", system_prompt)
        await pins.pin("tenants/pinner", "system-short", "gpu-0", system_prompt[:CHUNK])
        # A pass that sent this pin and died before it saw the answer: the next pass counts
        # what the coordinator holds and sends only what is still missing.
        await coordinator.pin(where, salt, system_prompt)
        assert await tier.mirror() == 1
        counts = await coordinator.pin_counts(where, salt)
        assert sorted(counts.values()) == [1, 2]  # the first chunk is in both prefixes
        assert await tier.mirror() == 0  # replayed: nothing pinned twice
        await pins.unpin("tenants/pinner", "system-short")
        assert await tier.mirror() == 1
        assert sorted((await coordinator.pin_counts(where, salt)).values()) == [1, 1]

        # The session, suspended with its tokens, is evicted by a reclaim job.
        ledger = owned.ledger
        prompt = tuple(session_tokens[:-1])
        params = AdmitParams("pinner", "chat", "gpu-0", len(prompt), 1, 1, 0)
        await ledger.admit(AdmitRequest(params, prompt, 0.0, None))
        await ledger.suspend("pinner", "chat", session_tokens)
        await tier.mirror()  # reads L1 fill, which the plan needs for OFFLOAD
        jobs = owned.reclaim(engine, DEFAULT_WATERMARKS)
        termination = Termination(ledger, abort_timeout_seconds=1, hard_timeout_seconds=5)
        job = await jobs.create(
            "evict-chat", "gpu-0", ReclaimTarget(48, Tier.EVICT, "pinner"), dry_run=False
        )
        # With room in L1 the plan offloads the idle session rather than evicting it; its
        # pinned system prompt (32 blocks) stays on the GPU either way.
        assert [(s.planned.tier, s.planned.gpu_blocks) for s in job.steps] == [(Tier.OFFLOAD, 16)]
        await jobs.cancel(job.job_id)
        await CpuTierBooks(engine).record_usage("gpu-0", LMCACHE_L1_BYTES, LMCACHE_L1_BYTES)
        job = await jobs.create(
            "evict-chat-full", "gpu-0", ReclaimTarget(48, Tier.EVICT, "pinner"), dry_run=False
        )
        assert [(s.planned.tier, s.planned.reservation) for s in job.steps] == [
            (Tier.EVICT, ("pinner", "chat"))
        ]
        executor = ReclaimExecutor(jobs, termination, tier)
        assert await executor.run(job.job_id, 10) == 1
        assert await jobs.run_step(job.job_id) is False
        done = await jobs.get(job.job_id)
        assert (done.state, done.actual_blocks, done.differences) == (JobState.SUCCEEDED, 16, ())
        ended = await ledger.get("pinner", "chat")
        assert (ended.state, ended.end_reason) == (ReservationState.ENDED, EndReason.PREEMPTED)
        # The directory shows the delete: the pinned system prompt stays in both tiers.
        await until(
            [{"l1", "l2"}, {"l1", "l2"}, set()],
            lambda: tiers_of_chunks(lmcache, salt, session_tokens),
        )
        await termination.close()

        await pins.unpin("tenants/pinner", "system")
        assert await tier.mirror() == 1
        assert await coordinator.pin_counts(where, salt) == {}
    finally:
        await coordinator.close()
        await tier.close()


async def test_a_resumed_session_is_prefetched_back_into_l1(
    lmcache: Lmcache, chunk_writer: ChunkWriter, engine: AsyncEngine, owned: HotPath
) -> None:
    await register(owned, lmcache, ("resumer", GIB))
    salt = await salt_of(engine, "resumer")
    session_tokens = list(range(50_000, 50_000 + 2 * CHUNK))
    assert chunk_writer.store(salt, session_tokens) == 2
    await until([{"l1", "l2"}] * 2, lambda: tiers_of_chunks(lmcache, salt, session_tokens))
    # L1 let it go (as its LRU would under pressure); L2 still has it.
    async with httpx.AsyncClient(base_url=lmcache.coordinator_url, timeout=10) as client:
        body = {
            "instance_id": lmcache.instance_id,
            "model_name": lmcache.model_name,
            "world_size": 1,
            "token_ids": session_tokens,
            "cache_salt": salt,
            "tier": "l1",
        }
        (await client.post("/cache/delete", json=body)).raise_for_status()
    await until([{"l2"}] * 2, lambda: tiers_of_chunks(lmcache, salt, session_tokens))

    ledger = owned.ledger
    prompt = tuple(session_tokens[:-1])
    params = AdmitParams("resumer", "chat", "gpu-0", len(prompt), 1, 1, 0)
    await ledger.admit(AdmitRequest(params, prompt, 0.0, None))
    await ledger.suspend("resumer", "chat", session_tokens)
    tier = CpuTierMirror(CpuTierBooks(engine))
    try:
        await tier.mirror()
        jobs = owned.reclaim(engine, DEFAULT_WATERMARKS)
        job = await jobs.create(
            "offload", "gpu-0", ReclaimTarget(32, Tier.OFFLOAD, "resumer"), dry_run=False
        )
        while await jobs.run_step(job.job_id):
            pass
        assert (await ledger.get("resumer", "chat")).offloaded_bytes == 32 * 16384
        await tier.prefetch_session("resumer", "chat")
        await until([{"l1", "l2"}] * 2, lambda: tiers_of_chunks(lmcache, salt, session_tokens))
        resumed = await ledger.resume("resumer", "chat", 0.0)
        assert (resumed.state, resumed.offloaded_bytes) == (ReservationState.ADMITTED, None)
    finally:
        await tier.close()
