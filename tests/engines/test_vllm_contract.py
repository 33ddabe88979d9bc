"""What kvquota assumes of vLLM, checked against the real engine (ENGINES.md)."""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from quota_service import cli
from quota_service.api import server
from quota_service.api.server import HotPath
from quota_service.config import Settings
from quota_service.core import catalog
from quota_service.core.admission import AdmitRequest
from quota_service.core.hashing import block_hashes, event_hash
from quota_service.core.kv_events import BlockStored
from quota_service.core.model import (
    AdmitParams,
    EndReason,
    EngineEndpoints,
    ReservationState,
    TenantQuota,
)
from quota_service.core.reclaim import DEFAULT_WATERMARKS, JobState, ReclaimTarget, Tier
from quota_service.enforcement.cpu_tier_mirror import CpuTierMirror
from quota_service.enforcement.termination import Termination
from quota_service.engine.vllm.http import VllmHttp
from quota_service.engine.vllm.subscriber import Received, Subscriber
from quota_service.jobs.reclaim_executor import ReclaimExecutor
from quota_service.owner.owners import OwnedLedger
from quota_service.store.cpu_tier import CpuTierBooks
from tests.engines.conftest import BLOCK_SIZE, MAX_MODEL_LEN, NUM_GPU_BLOCKS, ROOT, Engine

# Tokens a generation asks for when it must still be running when an abort arrives.
LONG = MAX_MODEL_LEN - 64
STARTED_AFTER_CHUNKS = 1


async def complete(
    engine: Engine, prompt: list[int], max_tokens: int = 4, **extra: object
) -> dict[str, object]:
    async with httpx.AsyncClient(timeout=120) as client:
        response = await client.post(
            f"{engine.base_url}/v1/completions",
            json={"model": engine.model, "prompt": prompt, "max_tokens": max_tokens, **extra},
        )
        response.raise_for_status()
        result: dict[str, object] = response.json()
        return result


async def stream(
    engine: Engine, prompt: list[int], max_tokens: int, started: asyncio.Event, **extra: object
) -> str | None:
    """Generate with streaming; `started` is set once tokens flow (a few have arrived). Returns
    the finish reason."""
    body = {
        "model": engine.model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        **extra,
    }
    finish = None
    chunks = 0
    async with (
        httpx.AsyncClient(timeout=120) as client,
        client.stream("POST", f"{engine.base_url}/v1/completions", json=body) as response,
    ):
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunks += 1
            if chunks >= STARTED_AFTER_CHUNKS:
                started.set()
            finish = json.loads(line[len("data: ") :])["choices"][0].get("finish_reason") or finish
    return finish


async def collect(subscriber: Subscriber, seconds: float) -> list[Received]:
    got: list[Received] = []

    async def run() -> None:
        async for item in subscriber.items():
            assert isinstance(item, Received), item
            got.append(item)

    task = asyncio.create_task(run())
    await asyncio.sleep(seconds)
    task.cancel()
    return got


def stored_hashes(items: list[Received]) -> list[int]:
    return [
        h
        for r in items
        for e in r.batch.events
        if isinstance(e, BlockStored)
        for h in e.block_hashes
    ]


def test_hash_vectors_regenerate_identically(vllm: Engine, tmp_path: Path) -> None:
    """The committed parity vectors are what vLLM's own hasher gives today."""
    out = tmp_path / "vectors.json"
    subprocess.run(
        [vllm.python, ROOT / "scripts" / "vllm_hash_vectors.py", "--out", out], check=True
    )
    committed = json.loads((ROOT / "tests" / "data" / "vllm_block_hashes.json").read_text())
    assert json.loads(out.read_text())["vectors"] == committed["vectors"]


async def test_our_hashes_are_the_engines(vllm: Engine) -> None:
    subscriber = Subscriber(vllm.events, vllm.replay)
    subscriber.connect()
    await asyncio.sleep(0.5)
    prompts = {
        "tenantA": list(range(1, 70)),
        None: list(range(100, 200)),
        "ZmFrZQ-salt_x": [5] * 96,
    }
    for salt, prompt in prompts.items():
        extra = {"cache_salt": salt} if salt else {}
        await complete(vllm, prompt, max_tokens=1, **extra)
        items = await collect(subscriber, 1.0)
        ours = [event_hash(h) for h in block_hashes(prompt, BLOCK_SIZE, salt)]
        assert stored_hashes(items)[: len(ours)] == ours, salt
    subscriber.close()


async def test_every_event_decodes_and_replay_fills_a_gap(vllm: Engine) -> None:
    subscriber = Subscriber(vllm.events, vllm.replay)
    subscriber.connect()
    await asyncio.sleep(0.5)
    for i in range(6):  # enough long prompts to fill the 64-block pool and force evictions
        await complete(vllm, [20 + i] * 400, max_tokens=60)
    live = await collect(subscriber, 1.5)
    assert live and all(r.batch.events for r in live)
    kinds = {type(e).__name__ for r in live for e in r.batch.events}
    assert "BlockStored" in kinds and "BlockRemoved" in kinds, kinds
    # A subscriber that missed everything from the first of those batches on: the next live
    # batch shows the gap, and the replay fills it with exactly the batches missed.
    late = Subscriber(vllm.events, vllm.replay)
    late.connect()
    await asyncio.sleep(0.5)
    late.expected = live[0].seq
    await complete(vllm, [99] * 40, max_tokens=1)
    filled = await collect(late, 1.5)
    replayed = [r for r in filled if r.replayed]
    assert [r.seq for r in replayed][: len(live)] == [r.seq for r in live]
    assert [r.batch.events for r in replayed][: len(live)] == [r.batch.events for r in live]
    subscriber.close()
    late.close()


async def test_metrics_tell_the_real_pool(vllm: Engine) -> None:
    http = VllmHttp(vllm.base_url)
    metrics = await http.metrics()
    await http.close()
    assert (metrics.num_gpu_blocks, metrics.block_size) == (NUM_GPU_BLOCKS, BLOCK_SIZE)
    assert metrics.prefix_caching_hash_algo == "sha256"


async def abort_until_done(
    http: VllmHttp, request_id: str, generation: asyncio.Task[dict[str, object]]
) -> None:
    """Abort until the generation ends: an abort that reaches vLLM before the request does is
    ignored (and answered 200 all the same)."""
    while not generation.done():
        await http.abort([request_id])
        await asyncio.sleep(0.05)


async def test_abort_by_request_id_stops_a_long_generation(vllm: Engine) -> None:
    """The gateway sends kvquota's request_id; the driver aborts the ids vLLM derives from it."""
    http = VllmHttp(vllm.base_url)
    try:
        generation = asyncio.create_task(
            complete(vllm, [3] * 32, max_tokens=LONG, request_id="long-1", ignore_eos=True)
        )
        await abort_until_done(http, "long-1", generation)
        result = generation.result()
        choices, usage = result["choices"], result["usage"]
        assert isinstance(choices, list) and choices[0]["finish_reason"] == "abort"
        assert isinstance(usage, dict) and usage["completion_tokens"] < LONG
        for _ in range(100):  # the gauge follows a moment later
            if not (await http.metrics()).requests_running:
                break
            await asyncio.sleep(0.1)
        assert (await http.metrics()).requests_running == 0
    finally:
        await http.close()


async def test_register_from_the_engine_and_release_only_after_the_abort(
    vllm: Engine, owned: HotPath
) -> None:
    """The instance is registered from what the engine reports; cancelling a reservation aborts
    its generation in vLLM and only then gives its blocks back."""
    ledger = await register_tiny(vllm, owned)
    termination = Termination(ledger, abort_timeout_seconds=5, hard_timeout_seconds=30)

    async def cancel(tenant: str, request_id: str) -> None:
        ended = await termination.end(tenant, request_id, EndReason.CANCELLED)
        assert (ended.state, ended.end_reason) == (ReservationState.ENDED, EndReason.CANCELLED)

    try:
        assert await abort_while_generating(vllm, ledger, cancel) == "abort"
    finally:
        await termination.close()


async def test_an_evict_step_aborts_the_running_request(
    vllm: Engine, engine: AsyncEngine, owned: HotPath
) -> None:
    """A reclaim job allowed to EVICT preempts the running reservation: vLLM aborts the
    generation, the reservation ends PREEMPTED, and the job reports the blocks it freed."""
    ledger = await register_tiny(vllm, owned)
    termination = Termination(ledger, abort_timeout_seconds=5, hard_timeout_seconds=30)
    jobs = owned.reclaim(engine, DEFAULT_WATERMARKS)
    executor = ReclaimExecutor(jobs, termination, CpuTierMirror(CpuTierBooks(engine)))

    async def evict(tenant: str, request_id: str) -> None:
        target = ReclaimTarget(1, Tier.EVICT, tenant)
        job = await jobs.create(f"evict-{request_id}", "tiny", target, dry_run=False)
        assert [s.planned.reservation for s in job.steps] == [(tenant, request_id)]
        assert await executor.run(job.job_id, 10) == 1
        assert await jobs.run_step(job.job_id) is False
        done = await jobs.get(job.job_id)
        assert (done.state, done.differences) == (JobState.SUCCEEDED, ())
        assert done.actual_blocks == done.expected_blocks == 1 + LONG // BLOCK_SIZE
        ended = await ledger.get(tenant, request_id)
        assert (ended.state, ended.end_reason) == (ReservationState.ENDED, EndReason.PREEMPTED)

    try:
        assert await abort_while_generating(vllm, ledger, evict) == "abort"
    finally:
        await termination.close()


async def test_offboarding_aborts_the_tenants_generation(
    vllm: Engine, engine: AsyncEngine, owned: HotPath
) -> None:
    """DeleteTenant stops the tenant's generation in vLLM, and only then gives its blocks back
    and finishes (each attempt offboards a tenant of its own)."""
    ledger = await register_tiny(vllm, owned)
    termination = Termination(ledger, abort_timeout_seconds=5, hard_timeout_seconds=30)
    offboarding = owned.offboarding(engine, termination)

    async def new_tenant(attempt: int) -> str:
        tenant = f"gone-{attempt}"
        await owned.catalog.create_tenant(tenant, tenant, 1, TenantQuota(10**6, 10**9, 10, 10, 1))
        return tenant

    async def offboard(tenant: str, request_id: str) -> None:
        report = await offboarding.delete_tenant(tenant)
        assert report.finished
        ended = await ledger.get(tenant, request_id)
        assert (ended.state, ended.end_reason) == (
            ReservationState.ENDED,
            EndReason.TENANT_DELETED,
        )

    try:
        assert await abort_while_generating(vllm, ledger, offboard, new_tenant) == "abort"
    finally:
        await termination.close()


async def register_tiny(vllm: Engine, owned: HotPath) -> OwnedLedger:
    """Register the engine as instance "tiny" from what it reports, and a tenant acme; the
    ledger (its owner)."""
    http = VllmHttp(vllm.base_url)
    try:
        described = await http.describe()
    finally:
        await http.close()
    registered = (described.max_model_len, described.metrics.num_gpu_blocks)
    assert registered == (MAX_MODEL_LEN, NUM_GPU_BLOCKS)
    spec = catalog.instance_spec(
        "tiny",
        described.model,
        None,
        described.metrics.block_size,
        described.max_model_len,
        None,
        described.metrics.usable_blocks,
        engine=EngineEndpoints(vllm.base_url, vllm.events, vllm.replay),
    )
    await owned.catalog.register_instance(spec)
    await owned.catalog.create_tenant("acme", "Acme", 1, TenantQuota(10**6, 10**9, 10, 10, 1))
    return owned.ledger


EOS = {"ignore_eos": True}  # generate all LONG tokens, unless aborted
# On a loaded machine the tiny model may finish before the first token reaches the client.
ATTEMPTS = 6


async def acme(attempt: int) -> str:
    return "acme"


async def abort_while_generating(
    vllm: Engine,
    ledger: OwnedLedger,
    stop: Callable[[str, str], Awaitable[None]],
    tenant_of_attempt: Callable[[int], Awaitable[str]] = acme,
) -> str | None:
    """Admit a long generation, start it in vLLM, and `stop(tenant, request_id)` its
    reservation once a token came; returns how the generation finished. The client may read the
    first token only after a loaded machine's tiny model has generated everything, and then
    there is nothing left to abort: several attempts, so that one stop lands while vLLM still
    generates."""
    finish: str | None = None
    for attempt in range(ATTEMPTS):
        request_id = f"gen-{attempt}"
        tenant = await tenant_of_attempt(attempt)
        params = AdmitParams(tenant, request_id, "tiny", 32, LONG, 1, 0)
        reservation, salt = await ledger.admit(AdmitRequest(params, (3,) * 32, 0.0, None))
        assert reservation.reserved_blocks == 1 + LONG // BLOCK_SIZE
        started = asyncio.Event()
        generation = asyncio.create_task(
            stream(
                vllm,
                [3] * 32,
                LONG,
                started,
                request_id=request_id,
                cache_salt=salt,
                ignore_eos=True,
            )
        )
        await asyncio.wait_for(started.wait(), 60)  # a token came: vLLM runs it now
        await stop(tenant, request_id)
        finish = await asyncio.wait_for(generation, 60)
        if finish == "abort":
            break
    return finish


async def test_the_cli_registers_an_instance_from_its_engine(
    vllm: Engine, database_url: str, settings: Settings, capsys: pytest.CaptureFixture[str]
) -> None:
    running = await server.start(settings, database_url)
    try:
        argv = [
            "instance",
            "register",
            "from-cli",
            "--vllm-url",
            vllm.base_url,
            "--kv-events",
            vllm.events,
            "--kv-replay",
            vllm.replay,
            "--server",
            f"127.0.0.1:{running.port}",
            "--json",
        ]
        assert await asyncio.to_thread(cli.main, argv) == 0
        registered = json.loads(capsys.readouterr().out)
        assert registered["capacityBlocks"] == str(NUM_GPU_BLOCKS - 1)
        assert (registered["blockSize"], registered["maxModelLen"]) == (BLOCK_SIZE, MAX_MODEL_LEN)
        assert registered["hashAlgo"] == "PREFIX_HASH_ALGO_SHA256"
        assert registered["engine"]["kvEventsEndpoint"] == vllm.events
    finally:
        await running.stop(0)
