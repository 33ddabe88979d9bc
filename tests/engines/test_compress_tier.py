"""The COMPRESS tier against a real LMCache coordinator and MP server whose L2 adapter stores
chunks through an fp8 serde (half of float16's bytes): a suspended session is offloaded, then
compressed by a reclaim job (its CPU-tier bytes drop by the measured ratio, in the ledger, in
usage and in what `kvquota top` shows), then resumed (prefetched back into L1 at full size,
its next turn retrieving the whole prefix as LMCache's vLLM connector does);
pinned chunks are never compressed; a kvquota server killed in the middle of a compress step
leaves it to the next one, which applies it once; a session resumed between its demotion and
its booking is never booked compressed."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from quota_service.api import convert
from quota_service.api.server import HotPath, make_hot_path
from quota_service.api.waiting import Waiters
from quota_service.cli import top
from quota_service.config import Settings
from quota_service.core.admission import AdmitRequest
from quota_service.core.model import AdmitParams, ReservationState
from quota_service.core.reclaim import (
    DEFAULT_WATERMARKS,
    CompressMeasurement,
    CpuWatermarks,
    JobState,
    ReclaimTarget,
    StepState,
    Tier,
)
from quota_service.enforcement.cpu_tier_mirror import CpuTierMirror
from quota_service.enforcement.termination import Termination
from quota_service.engine.lmcache import DeleteResult, LmcacheCoordinator
from quota_service.jobs.reclaim_executor import ReclaimExecutor
from quota_service.owner.owned_reclaim import OwnedReclaimJobs
from quota_service.owner.owners import OwnedLedger
from quota_service.store.cpu_tier import CpuTierBooks
from quota_service.store.reclaim import NOT_OFFLOADED_ANY_MORE
from quota_service.store.usage import UsageBook, UsageRollup
from tests.engines.conftest import ChunkWriter, Lmcache
from tests.engines.lmcache_proxy import LmcacheProxy
from tests.engines.test_lmcache_contract import CHUNK, GIB, register, salt_of, until
from tests.engines.test_lmcache_contract import endpoint as lmcache_endpoint
from tests.integration.invariants import assert_invariants
from tests.integration.test_replicas import start_replica

L1_CHUNK_BYTES = 16 << 10  # the writer's chunk in float16
BLOCK_BYTES = 16384  # the registered instance's bytes per block (16 tokens)
# The writer's chunks fill a sliver of the 64 MiB L1: watermarks that low make it "full".
TINY = CpuWatermarks(offload=1e-6, compress=1e-6)
COMPRESS_ONLY = Tier.COMPRESS


@pytest.fixture(scope="module")
def fp8_writer(fp8_lmcache: Lmcache) -> Iterator[ChunkWriter]:
    writer = ChunkWriter(fp8_lmcache)
    yield writer
    writer.close()


async def sizes(lmcache: Lmcache, salt: str, tokens: list[int]) -> list[dict[str, int]]:
    """Per whole chunk: tier → bytes the MP server holds it in."""
    coordinator = LmcacheCoordinator(lmcache.coordinator_url)
    try:
        found = await coordinator.lookup(lmcache_endpoint(lmcache), salt, tokens)
    finally:
        await coordinator.close()
    return [dict(c.size_bytes) for c in found]


async def pinned_chunks(lmcache: Lmcache, salt: str) -> int:
    coordinator = LmcacheCoordinator(lmcache.coordinator_url)
    try:
        return len(await coordinator.pin_counts(lmcache_endpoint(lmcache), salt))
    finally:
        await coordinator.close()


FULL, COMPRESSED = {"l1": L1_CHUNK_BYTES}, {"l2": L1_CHUNK_BYTES // 2}
# What a two-chunk session's next turn gets back from LMCache once it went through fp8: every
# token of both chunks (the turn's own tokens are not cached), and the KV the writer stored,
# cast to fp8 and back.
FROM_FP8 = {"hit_tokens": 2 * CHUNK, "retrieved": True, "exact": False, "fp8_round_trip": True}
AS_STORED = {"hit_tokens": 2 * CHUNK, "retrieved": True, "exact": True, "fp8_round_trip": False}


def next_turn(session: list[int]) -> list[int]:
    return session + list(range(7, 7 + 40))


async def offloaded_session(
    engine: AsyncEngine,
    owned: HotPath,
    lmcache: Lmcache,
    writer: ChunkWriter,
    tenant: str,
    tokens: list[int],
    pinned_prefix: int = 0,
) -> tuple[OwnedLedger, CpuTierMirror]:
    """The tenant's session of `tokens` (its first `pinned_prefix` tokens pinned), stored in
    LMCache (L1, and fp8 in L2), admitted, suspended and offloaded by a reclaim job; the
    mirror has mirrored the pin and measured the instance's ratio."""
    await register(owned, lmcache, (tenant, GIB))
    if pinned_prefix:
        await owned.pins.pin(f"tenants/{tenant}", "system", "gpu-0", tokens[:pinned_prefix])
    salt = await salt_of(engine, tenant)
    chunks = writer.store(salt, tokens)
    await until([FULL | COMPRESSED] * chunks, lambda: sizes(lmcache, salt, tokens))
    ledger, tier, blocks = await offload(engine, owned, tenant, tokens[:-1], tokens)
    assert blocks == len(tokens) // 16
    assert (await ledger.get(tenant, "chat")).offloaded_bytes == blocks * BLOCK_BYTES
    return ledger, tier


async def offload(
    engine: AsyncEngine, owned: HotPath, tenant: str, prompt: list[int], session: list[int]
) -> tuple[OwnedLedger, CpuTierMirror, int]:
    """The tenant's turn of `prompt` (one token of output) admitted on gpu-0, suspended with
    `session` as the CPU tier holds it, and offloaded by a reclaim job; the mirror has mirrored
    the tenant's pins and measured the instance's ratio. Returns the blocks it held."""
    ledger = owned.ledger
    params = AdmitParams(tenant, "chat", "gpu-0", len(prompt), 1, 1, 0)
    admitted, _ = await ledger.admit(AdmitRequest(params, tuple(prompt), 0.0, None))
    await ledger.suspend(tenant, "chat", session)
    tier = CpuTierMirror(CpuTierBooks(engine))
    await tier.mirror()
    jobs = owned.reclaim(engine, DEFAULT_WATERMARKS)
    target = ReclaimTarget(admitted.reserved_blocks, Tier.OFFLOAD, tenant)
    job = await jobs.create(f"offload-{tenant}", "gpu-0", target, dry_run=False)
    while await jobs.run_step(job.job_id):
        pass
    await tier.mirror()  # measures the ratio on the offloaded session
    return ledger, tier, admitted.reserved_blocks


async def compress_job(
    engine: AsyncEngine, owned: HotPath, tenant: str
) -> tuple[OwnedReclaimJobs, str]:
    jobs = owned.reclaim(engine, TINY)
    target = ReclaimTarget(1, Tier.COMPRESS, tenant, COMPRESS_ONLY)
    job = await jobs.create(f"compress-{tenant}", "gpu-0", target, dry_run=False)
    assert [(s.planned.tier, s.planned.reservation, s.planned.lossy) for s in job.steps] == [
        (Tier.COMPRESS, (tenant, "chat"), True)
    ]
    return jobs, job.job_id


async def compressed_events(engine: AsyncEngine, tenant: str) -> list[tuple[int, int]]:
    query = text(
        "SELECT cpu_bytes, compressed_bytes FROM usage_events "
        "WHERE tenant = :tenant AND compressed_bytes <> 0 ORDER BY id"
    )
    async with engine.connect() as conn:
        return [(r[0], r[1]) for r in await conn.execute(query, {"tenant": tenant})]


async def test_a_session_is_offloaded_compressed_and_resumed(
    fp8_lmcache: Lmcache, fp8_writer: ChunkWriter, engine: AsyncEngine, owned: HotPath
) -> None:
    tokens = list(range(20_000, 20_000 + 2 * CHUNK))
    ledger, tier = await offloaded_session(engine, owned, fp8_lmcache, fp8_writer, "talker", tokens)
    salt = await salt_of(engine, "talker")
    termination = Termination(ledger, abort_timeout_seconds=1, hard_timeout_seconds=5)
    try:
        instance = await owned.catalog.get_instance("gpu-0")
        assert instance.cpu_compression_ratio == 0.5  # measured on the session's chunks
        l1_before = instance.cpu_used_bytes
        assert l1_before is not None and l1_before >= 2 * L1_CHUNK_BYTES

        jobs, job_id = await compress_job(engine, owned, "talker")
        assert await ReclaimExecutor(jobs, termination, tier).run(job_id, 10) == 1
        done = await jobs.get(job_id)
        assert (done.state, done.steps[0].state) == (JobState.SUCCEEDED, StepState.APPLIED)
        # Both chunks left L1; LMCache holds them in half the bytes.
        await until([COMPRESSED] * 2, lambda: sizes(fp8_lmcache, salt, tokens))
        offloaded = 32 * BLOCK_BYTES
        session = await ledger.get("talker", "chat")
        assert (session.offloaded_bytes, session.compressed_bytes) == (0, offloaded // 2)
        assert session.compression_ratio == 0.5
        assert await compressed_events(engine, "talker") == [(-offloaded, offloaded // 2)]

        # Top shows the tenant's CPU-tier bytes halved, and the instance's L1 emptier.
        await tier.mirror()
        instance = await owned.catalog.get_instance("gpu-0")
        assert instance.cpu_used_bytes == l1_before - 2 * L1_CHUNK_BYTES
        row = top.tenant_row(convert.tenant(await owned.catalog.get_tenant("talker")))
        assert (row["cpu tier"], row["compressed"]) == ("0B", "256KiB")
        assert top.instance_row(convert.instance(instance))["compress"] == "0.50x"

        # Usage: the closed hour ends with the session compressed, billed as such.
        now = datetime.now(UTC)
        await UsageRollup(engine).close_due(now + timedelta(hours=1), timedelta(0))
        hours = [
            h
            async for h in UsageBook(engine).hours(
                now - timedelta(hours=1), now + timedelta(hours=1), "talker", None
            )
        ]
        assert [(h.usage.end.cpu_bytes, h.usage.end.compressed_bytes) for h in hours] == [
            (0, offloaded // 2)
        ]
        assert hours[0].compressed_gib_hours > 0 and hours[0].cpu_gib_hours > 0

        # Resume: the chunks come back into L1 at full size (decompressed), so the next turn
        # finds them there; the session leaves the compressed tier.
        await tier.prefetch_session("talker", "chat")
        await until([FULL | COMPRESSED] * 2, lambda: sizes(fp8_lmcache, salt, tokens))
        resumed = await ledger.resume("talker", "chat", 0.0)
        assert (resumed.state, resumed.offloaded_bytes, resumed.compressed_bytes) == (
            ReservationState.ADMITTED,
            None,
            None,
        )
        assert (await compressed_events(engine, "talker"))[-1] == (0, -(offloaded // 2))
        # Its next turn finds the session's prefix in the CPU tier, as LMCache's vLLM
        # connector asks for it: both chunks, retrieved decompressed from their fp8 form.
        assert fp8_writer.retrieve(salt, next_turn(tokens)) == FROM_FP8
    finally:
        await termination.close()
        await tier.close()


async def test_pinned_chunks_are_never_compressed(
    fp8_lmcache: Lmcache, fp8_writer: ChunkWriter, engine: AsyncEngine, owned: HotPath
) -> None:
    """A session of three chunks whose first is its tenant's pinned system prompt: only the
    other two are demoted, and the booking keeps the pinned third uncompressed."""
    tokens = list(range(40_000, 40_000 + 3 * CHUNK))
    ledger, tier = await offloaded_session(
        engine, owned, fp8_lmcache, fp8_writer, "pinner", tokens, pinned_prefix=CHUNK
    )
    salt = await salt_of(engine, "pinner")
    termination = Termination(ledger, abort_timeout_seconds=1, hard_timeout_seconds=5)
    try:
        assert await pinned_chunks(fp8_lmcache, salt) == 1  # mirrored into LMCache
        jobs, job_id = await compress_job(engine, owned, "pinner")
        assert await ReclaimExecutor(jobs, termination, tier).run(job_id, 10) == 1
        await until(
            [FULL | COMPRESSED, COMPRESSED, COMPRESSED], lambda: sizes(fp8_lmcache, salt, tokens)
        )
        offloaded = 48 * BLOCK_BYTES
        session = await ledger.get("pinner", "chat")
        assert (session.offloaded_bytes, session.compressed_bytes) == (
            offloaded // 3,
            offloaded // 3,
        )
        # Measured on the demoted chunks alone: two of them, at half their size.
        query = text(
            "SELECT compress_before_bytes, compress_after_bytes FROM reservations "
            "WHERE tenant = 'pinner'"
        )
        async with engine.connect() as conn:
            measured = tuple((await conn.execute(query)).one())
        assert measured == (2 * L1_CHUNK_BYTES, L1_CHUNK_BYTES)
    finally:
        await termination.close()
        await tier.close()


@contextlib.asynccontextmanager
async def proxied(lmcache: Lmcache) -> AsyncIterator[tuple[Lmcache, LmcacheProxy]]:
    """The LMCache that kvquota is given, reached through a proxy that can hold a demotion's
    answer (tests/engines/lmcache_proxy.py)."""
    proxy = LmcacheProxy(lmcache.coordinator_url, lmcache.instance_id)
    await proxy.start()
    try:
        yield replace(lmcache, coordinator_url=proxy.url), proxy
    finally:
        await proxy.close()


def start_server(database_url: str) -> subprocess.Popen[str]:
    """A `kvquota serve` process whose maintenance loop runs reclaim steps every 0.2 s (and
    starts no job of its own), on short owner leases: a killed one's instances move soon."""
    process, _ = start_replica(
        database_url,
        reaper_interval_seconds="0.2",
        reclaim_policy_max_tier="none",
        owner_lease_seconds="2",
    )
    return process


def stop_server(process: subprocess.Popen[str], sig: int = signal.SIGTERM) -> None:
    process.send_signal(sig)
    process.wait(timeout=30)
    assert process.stdout is not None
    process.stdout.close()


async def test_a_compress_step_survives_a_kill_of_the_server_running_it(
    fp8_lmcache: Lmcache,
    fp8_writer: ChunkWriter,
    engine: AsyncEngine,
    settings: Settings,
    owned: HotPath,
    database_url: str,
) -> None:
    """A kvquota server's reclaim executor is killed (SIGKILL) right after LMCache demoted the
    session, before the ledger heard of it; the next server finishes the step, once, and the
    ledger's tiers and bytes agree with what LMCache holds."""
    tokens = list(range(60_000, 60_000 + 2 * CHUNK))
    async with proxied(fp8_lmcache) as (lmcache, proxy):
        _, tier = await offloaded_session(engine, owned, lmcache, fp8_writer, "crasher", tokens)
        await tier.close()
        salt = await salt_of(engine, "crasher")
        l1_before = (await owned.catalog.get_instance("gpu-0")).cpu_used_bytes
        assert l1_before is not None
        jobs, job_id = await compress_job(engine, owned, "crasher")
        await owned.owners.hand_over()  # the servers below serve gpu-0 from now on
        proxy.hold.armed = True
        first = await asyncio.to_thread(start_server, database_url)
        try:
            await asyncio.wait_for(proxy.hold.demoted.wait(), 60)
        finally:
            stop_server(first, signal.SIGKILL)
        proxy.hold.armed = False
        proxy.hold.released.set()

        # Killed between LMCache and the ledger: the chunks are compressed, the step is still
        # planned with what was measured before they left L1, the session not booked yet.
        await until([COMPRESSED] * 2, lambda: sizes(fp8_lmcache, salt, tokens))
        step = (await jobs.get(job_id)).steps[0]
        assert step.state is StepState.PLANNED
        assert (await session_bytes(engine, "crasher"))[1] is None
        assert await compressed_events(engine, "crasher") == []

        # The restarted server finds nothing left in L1 to demote and books what was
        # measured, once; its CPU-tier mirror reads L1 two chunks emptier.
        second = await asyncio.to_thread(start_server, database_url)
        try:
            await until(JobState.SUCCEEDED, lambda: job_state(jobs, job_id))
            await until(
                l1_before - 2 * L1_CHUNK_BYTES,
                lambda: cpu_used_bytes(engine),
            )
        finally:
            stop_server(second)
    done = await jobs.get(job_id)
    assert [(s.state, s.note) for s in done.steps] == [(StepState.APPLIED, None)]
    offloaded = 32 * BLOCK_BYTES
    assert await session_bytes(engine, "crasher") == (0, offloaded // 2)
    assert await compressed_events(engine, "crasher") == [(-offloaded, offloaded // 2)]
    # The last server handed gpu-0 over as it stopped: a new owner, recovered from the record.
    successor = make_hot_path(settings, engine, Waiters(0.05), "successor")
    try:
        session = await successor.ledger.get("crasher", "chat")
        assert (session.offloaded_bytes, session.compressed_bytes) == (0, offloaded // 2)
        tenant = await successor.catalog.get_tenant("crasher")
        assert (tenant.cpu_tier_bytes, tenant.compressed_bytes) == (0, offloaded // 2)
    finally:
        await successor.owners.close()
    await assert_invariants(engine)


async def session_bytes(engine: AsyncEngine, tenant: str) -> tuple[int | None, int | None]:
    """The session's offloaded and compressed bytes as its reservation's row records them
    (read without an owner: the servers serve the instance)."""
    query = text(
        "SELECT offloaded_bytes, compressed_bytes FROM reservations "
        "WHERE tenant = :tenant AND request_id = 'chat'"
    )
    async with engine.connect() as conn:
        row = (await conn.execute(query, {"tenant": tenant})).one()
    return row[0], row[1]


async def job_state(jobs: OwnedReclaimJobs, job_id: str) -> JobState:
    return (await jobs.get(job_id)).state


async def cpu_used_bytes(engine: AsyncEngine) -> int | None:
    query = text("SELECT cpu_used_bytes FROM instances WHERE instance = 'gpu-0'")
    async with engine.connect() as conn:
        used = (await conn.execute(query)).scalar_one()
    return None if used is None else int(used)


class Paused(CpuTierMirror):
    """The executor's CPU tier, pausing until `go` is set right after it measured the session
    (`after="measure"`) or right after LMCache demoted it (`after="demote"`, its delete
    answered): either way, the ledger has not heard of it yet."""

    def __init__(self, books: CpuTierBooks, after: str) -> None:
        super().__init__(books)
        self.after = after
        self.reached = asyncio.Event()
        self.go = asyncio.Event()

    async def _pause(self, where: str) -> None:
        if where == self.after:
            self.reached.set()
            await self.go.wait()

    async def measure_session(self, tenant: str, request_id: str) -> CompressMeasurement:
        measured = await super().measure_session(tenant, request_id)
        await self._pause("measure")
        return measured

    async def demote_session(self, tenant: str, request_id: str) -> DeleteResult | None:
        result = await super().demote_session(tenant, request_id)
        await self._pause("demote")
        return result


@pytest.mark.parametrize("after", ["measure", "demote"])
async def test_a_session_resumed_during_its_compress_step_stays_uncompressed_and_in_l1(
    after: str,
    fp8_lmcache: Lmcache,
    fp8_writer: ChunkWriter,
    engine: AsyncEngine,
    owned: HotPath,
) -> None:
    """The session resumes (its chunks prefetched back into L1, decompressed, as
    ResumeReservation does) while its COMPRESS step runs: after the step measured it, or after
    LMCache demoted it. The step is then skipped: the ledger never books a resumed session
    compressed, its usage nets to zero, and its next turn finds the whole prefix in the CPU
    tier: prefetched back from its fp8 form after a demotion, or, resumed before the demotion,
    as it was (the demotion leaves the chunks a prefetch just brought into L1 where they are,
    as LMCache 0.5.6 does)."""
    tokens = list(range(80_000, 80_000 + 2 * CHUNK))
    tenant = f"resumer-{after}"
    ledger, tier = await offloaded_session(engine, owned, fp8_lmcache, fp8_writer, tenant, tokens)
    salt = await salt_of(engine, tenant)
    termination = Termination(ledger, abort_timeout_seconds=1, hard_timeout_seconds=5)
    paused = Paused(CpuTierBooks(engine), after)
    try:
        jobs, job_id = await compress_job(engine, owned, tenant)
        run = asyncio.create_task(ReclaimExecutor(jobs, termination, paused).run(job_id, 10))
        await asyncio.wait_for(paused.reached.wait(), 30)
        if after == "demote":
            await until([COMPRESSED] * 2, lambda: sizes(fp8_lmcache, salt, tokens))

        await tier.prefetch_session(tenant, "chat")
        resumed = await ledger.resume(tenant, "chat", 0.0)
        assert resumed.state is ReservationState.ADMITTED
        paused.go.set()
        assert await asyncio.wait_for(run, 30) == 1

        done = await jobs.get(job_id)
        assert (done.state, [(s.state, s.note) for s in done.steps]) == (
            JobState.SUCCEEDED,
            [(StepState.SKIPPED, NOT_OFFLOADED_ANY_MORE)],
        )
        session = await ledger.get(tenant, "chat")
        assert (session.offloaded_bytes, session.compressed_bytes) == (None, None)
        assert await compressed_events(engine, tenant) == []
        assert await cpu_events(engine, tenant) == 0  # offloaded, then back on the GPU
        await until([FULL | COMPRESSED] * 2, lambda: sizes(fp8_lmcache, salt, tokens))
        found = fp8_writer.retrieve(salt, next_turn(tokens))
        assert found == (FROM_FP8 if after == "demote" else AS_STORED)
        await assert_invariants(engine)
    finally:
        await termination.close()
        await paused.close()
        await tier.close()


async def cpu_events(engine: AsyncEngine, tenant: str) -> int:
    """The tenant's CPU-tier bytes by its usage events: what it holds there now."""
    query = text("SELECT coalesce(sum(cpu_bytes), 0) FROM usage_events WHERE tenant = :tenant")
    async with engine.connect() as conn:
        return int((await conn.execute(query, {"tenant": tenant})).scalar_one())
