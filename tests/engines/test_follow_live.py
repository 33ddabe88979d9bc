"""The ledger following a real vLLM through its KV events: confirmations, and a restart."""

from __future__ import annotations

import asyncio
import signal
import subprocess
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from quota_service.config import Settings
from quota_service.core import catalog
from quota_service.core.admission import AdmitRequest
from quota_service.core.hashing import block_hashes, event_hash
from quota_service.core.kv_events import BlockRemoved, BlockStored
from quota_service.core.model import (
    AdmitParams,
    EndReason,
    EngineEndpoints,
    ReservationState,
    TenantQuota,
)
from quota_service.engine.vllm.subscriber import Received, Subscriber
from quota_service.jobs.follower import Followers
from quota_service.store.catalog import Catalog
from quota_service.store.ledger import Ledger
from quota_service.store.reconcile import Reconciler, signed
from tests.engines.conftest import (
    BLOCK_SIZE,
    MAX_MODEL_LEN,
    NUM_GPU_BLOCKS,
    Engine,
    engine_at,
    free_ports,
    start_vllm,
    stop_vllm,
)
from tests.engines.test_vllm_contract import complete
from tests.integration.invariants import assert_invariants

PROMPT = list(range(1, 2 * BLOCK_SIZE + 5))  # two full blocks, a partial third


async def until(condition: object, seconds: float = 30.0) -> None:
    for _ in range(int(seconds * 10)):
        if await condition():  # type: ignore[operator]
            return
        await asyncio.sleep(0.1)
    raise AssertionError("the condition never held")


@dataclass
class Followed:
    """A real vLLM, registered as instance "live" for tenant acme, and the ledger following it."""

    live: Engine
    ledger: Ledger
    process: subprocess.Popen[bytes]
    restart: Callable[[], subprocess.Popen[bytes]]


@asynccontextmanager
async def followed_engine(
    engine_python: Path,
    tiny_model: Path,
    log: Path,
    engine: AsyncEngine,
    database_url: str,
    own_engines: list[subprocess.Popen[bytes]],
) -> AsyncIterator[Followed]:
    ports = free_ports()
    live = engine_at(tiny_model, ports, engine_python)

    def start() -> subprocess.Popen[bytes]:
        own_engines.append(start_vllm(engine_python, tiny_model, ports, log))
        return own_engines[-1]

    followed = Followed(live, Ledger(engine, Settings().admission_limits), start(), start)
    spec = catalog.instance_spec(
        "live",
        live.model,
        None,
        BLOCK_SIZE,
        MAX_MODEL_LEN,
        None,
        NUM_GPU_BLOCKS - 1,
        engine=EngineEndpoints(live.base_url, live.events, live.replay),
    )
    await Catalog(engine).register_instance(spec)
    await Catalog(engine).create_tenant("acme", "Acme", 1, TenantQuota(10**6, 10**9, 10, 10, 1))
    followers = Followers(database_url, Reconciler(engine, followed.ledger), load_check_seconds=0.5)
    try:
        assert await followers.scan() == 1

        async def following() -> bool:
            async with engine.connect() as conn:
                seq = await conn.execute(text("SELECT last_event_seq FROM instances"))
                return seq.scalar_one() is not None

        await until(following)  # it started from empty (last_event_seq -1)

        async def load_read() -> bool:
            async with engine.connect() as conn:
                running = await conn.execute(text("SELECT engine_requests_running FROM instances"))
                return bool(running.scalar_one() == 0)  # idle, per vllm:num_requests_running

        await until(load_read)
        yield followed
    finally:
        await followers.stop()
        stop_vllm(followed.process)


async def engine_resyncs(engine: AsyncEngine) -> int:
    async with engine.connect() as conn:
        return int((await conn.execute(text("SELECT engine_resyncs FROM instances"))).scalar_one())


async def test_following_a_restarted_engine(
    engine_python: Path,
    tiny_model: Path,
    tmp_path: Path,
    engine: AsyncEngine,
    database_url: str,
    own_engines: list[subprocess.Popen[bytes]],
) -> None:
    async with followed_engine(
        engine_python, tiny_model, tmp_path / "vllm.log", engine, database_url, own_engines
    ) as followed:
        ledger, live = followed.ledger, followed.live
        params = AdmitParams("acme", "held", "live", len(PROMPT), 4, 1, 0)
        held, salt = await ledger.admit(AdmitRequest(params, tuple(PROMPT), 0.0, 600.0))
        await complete(live, PROMPT, max_tokens=4, request_id="held", cache_salt=salt)
        ours = [signed(event_hash(h)) for h in block_hashes(PROMPT, BLOCK_SIZE, salt)]

        async def confirmed() -> bool:
            async with engine.connect() as conn:
                rows = await conn.execute(
                    text(
                        "SELECT count(*) FROM blocks "
                        "WHERE engine_confirmed_at IS NOT NULL AND event_hash = ANY(:h)"
                    ),
                    {"h": ours},
                )
                return bool(rows.scalar_one() == len(ours))

        await until(confirmed)  # BlockStored confirmed exactly the ledger's prompt blocks
        resyncs_before = await engine_resyncs(engine)

        stop_vllm(followed.process, signal.SIGKILL)
        followed.process = followed.restart()
        await complete(live, [9] * 40, max_tokens=1)  # its first batch numbers from 0 again

        async def resynchronised() -> bool:
            # The reservations end before the cache is forgotten, in a later transaction that
            # also counts the resync: wait for that one, not only for the ended reservation.
            return await engine_resyncs(engine) > resyncs_before

        await until(resynchronised)
        after = await ledger.get("acme", "held")
        assert held.state is ReservationState.ADMITTED
        assert after.end_reason is EndReason.ENGINE_RESTARTED
        async with engine.connect() as conn:
            query = text("SELECT cached_blocks, blocks_in_use, engine_resyncs FROM instances")
            row = (await conn.execute(query)).one()
        assert (row.cached_blocks, row.blocks_in_use) == (0, 0) and row.engine_resyncs >= 2
        await assert_invariants(engine)


async def test_the_ledgers_cache_is_the_engines(
    engine_python: Path,
    tiny_model: Path,
    tmp_path: Path,
    engine: AsyncEngine,
    database_url: str,
    own_engines: list[subprocess.Popen[bytes]],
) -> None:
    """A scripted run that fills the pool and forces evictions: afterwards the ledger's cached
    blocks are exactly those the engine's events say it still caches (of the prompt blocks the
    ledger knows; full output blocks are the engine's own)."""
    engine_cache: set[int] = set()
    known: set[int] = set()
    async with followed_engine(
        engine_python, tiny_model, tmp_path / "vllm.log", engine, database_url, own_engines
    ) as followed:
        ledger, live = followed.ledger, followed.live
        watcher = Subscriber(live.events, live.replay)
        watcher.connect()

        async def watch() -> None:
            async for item in watcher.items():
                assert isinstance(item, Received)
                for event in item.batch.events:
                    if isinstance(event, BlockStored):
                        engine_cache.update(event.block_hashes)
                    elif isinstance(event, BlockRemoved):
                        engine_cache.difference_update(event.block_hashes)

        watching = asyncio.create_task(watch())
        await asyncio.sleep(0.5)
        try:
            for i in range(24):  # 3 full prompt blocks + a tail each: 24 x 3 > 63 evicts
                # Token ids inside the tiny model's vocabulary (512), a different start for each.
                prompt = [(i * 37 + j) % 500 + 1 for j in range(3 * BLOCK_SIZE + 5)]
                params = AdmitParams("acme", f"r{i}", "live", len(prompt), 20, 1, 0)
                _, salt = await ledger.admit(AdmitRequest(params, tuple(prompt), 0.0, None))
                known.update(event_hash(h) for h in block_hashes(prompt, BLOCK_SIZE, salt))
                await complete(live, prompt, max_tokens=20, request_id=f"r{i}", cache_salt=salt)
                await ledger.end("acme", f"r{i}", EndReason.RELEASED, 20)
            assert len(known) == 72 and len(engine_cache & known) < 72  # the engine did evict

            async def caught_up() -> bool:
                async with engine.connect() as conn:
                    query = text("SELECT event_hash FROM blocks WHERE state = 'CACHED'")
                    ledger_cache = {h & (2**64 - 1) for (h,) in await conn.execute(query)}
                return ledger_cache == engine_cache & known

            await until(caught_up, 10)
            await assert_invariants(engine)
        finally:
            watching.cancel()
            watcher.close()
