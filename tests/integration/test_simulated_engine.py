"""The whole engine path against the simulated host, fast and without vLLM: describe and
register, follow its events, abort before release, reset (the contract tests do this against
real vLLM)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from quota_service.api.server import HotPath
from quota_service.core import catalog
from quota_service.core.admission import AdmitRequest
from quota_service.core.model import AdmitParams, EndReason, EngineEndpoints, ReservationState
from quota_service.enforcement.termination import Termination
from quota_service.engine.simulated import EventPublisher, SimulatedHost, SimulatedPool
from quota_service.engine.vllm.http import VllmHttp
from quota_service.jobs.follower import Followers
from tests.integration.grpc_helpers import free_port
from tests.integration.invariants import assert_invariants
from tests.integration.ledger_fixtures import add_tenant, derived_counters

BS = 16


@pytest.fixture
async def host() -> AsyncIterator[tuple[SimulatedHost, EngineEndpoints]]:
    events, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    simulated = SimulatedHost(
        SimulatedPool(num_blocks=65, block_size=BS), EventPublisher(events, replay)
    )
    port = await simulated.serve("127.0.0.1", 0)
    yield simulated, EngineEndpoints(f"http://127.0.0.1:{port}", events, replay)
    await simulated.close()


async def until(condition: Callable[[], Awaitable[bool]], seconds: float = 10.0) -> None:
    for _ in range(int(seconds * 20)):
        if await condition():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the condition never held")


async def test_the_engine_path_against_the_simulated_host(
    host: tuple[SimulatedHost, EngineEndpoints],
    engine: AsyncEngine,
    database_url: str,
    owned: HotPath,
) -> None:
    _, endpoints = host
    http = VllmHttp(endpoints.url)
    described = await http.describe()
    assert (described.metrics.usable_blocks, described.metrics.block_size) == (64, BS)
    spec = catalog.instance_spec(
        "sim",
        described.model,
        None,
        BS,
        described.max_model_len,
        None,
        described.metrics.usable_blocks,
        engine=endpoints,
    )
    await owned.catalog.register_instance(spec)
    await add_tenant(engine, "acme")
    ledger = owned.ledger
    followers = Followers(database_url, owned.reconciler(engine), load_check_seconds=0.1)
    termination = Termination(ledger, abort_timeout_seconds=2, hard_timeout_seconds=5)
    try:
        # A lease round claims the instance whose engine publishes events; its owner follows it.
        await owned.owners.take_over_unowned()
        await followers.scan()

        async def scalar(query: str) -> object:
            async with engine.connect() as conn:
                return (await conn.execute(text(query))).scalar_one()

        async def following() -> bool:
            return await scalar("SELECT last_event_seq FROM instances") is not None

        async def confirmed() -> bool:
            query = "SELECT count(*) FROM journal_slots WHERE engine_copies > 0"
            return await scalar(query) == 3

        async def cache_dropped() -> bool:
            # The record alone: the follower may be applying a batch its owner has not
            # committed yet, so memory may be ahead of it.
            return (await derived_counters(engine))["instance:sim"]["cached_blocks"] == 0

        await until(following)
        prompt = list(range(1, 3 * BS + 1))
        params = AdmitParams("acme", "r1", "sim", len(prompt), 900, 1, 0)
        reservation, salt = await ledger.admit(AdmitRequest(params, tuple(prompt), 0.0, None))
        async with httpx.AsyncClient(timeout=30) as client:
            body = {"prompt": prompt, "max_tokens": 900, "request_id": "r1", "cache_salt": salt}
            generation = asyncio.create_task(
                client.post(f"{endpoints.url}/v1/completions", json=body)
            )
            await until(confirmed)
            assert (await http.metrics()).requests_running == 1

            async def load_recorded() -> bool:
                return await scalar("SELECT engine_requests_running FROM instances") == 1

            await until(load_recorded)  # the follower read vllm:num_requests_running
            described_instance = await owned.catalog.get_instance("sim")
            assert (
                described_instance.engine_requests_running,
                described_instance.live_reservations,
            ) == (1, 1)
            ended = await termination.end("acme", "r1", EndReason.CANCELLED)
            assert (ended.state, ended.end_reason) == (ReservationState.ENDED, EndReason.CANCELLED)
            reply = (await generation).json()
        assert reply["choices"][0]["finish_reason"] == "abort"
        assert reservation.reserved_blocks == 3 + 57  # 48 prompt tokens + 900 output, 16 a block

        assert await http.reset_prefix_cache()  # the engine drops its cache: so does its owner
        await until(cache_dropped)
        await assert_invariants(engine)
    finally:
        await followers.stop()
        await termination.close()
        await http.close()
