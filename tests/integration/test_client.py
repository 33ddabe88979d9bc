"""kvquota.client against a real server and PostgreSQL: the reservation block releases, cancels
and renews as it promises, and refusals come out as the README's error table says, the same for
the blocking and the asyncio client."""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import pytest
from google.protobuf.duration_pb2 import Duration

from kvquota.client import (
    NO_RETRIES,
    AsyncKvquotaClient,
    InvalidRequest,
    KvquotaClient,
    KvquotaError,
    Preempted,
    QuotaExceeded,
    Reservation,
    RetryPolicy,
    Unavailable,
)
from kvquota.v1 import admin_pb2, admission_pb2
from kvquota.v1 import resources_pb2 as pb
from quota_service.api import server
from quota_service.config import Settings
from tests.conftest import SWEEP_SECONDS
from tests.integration.engine_stubs import closed_port
from tests.integration.grpc_helpers import quota


@pytest.fixture(scope="module")
def settings(settings: Settings) -> Settings:
    """The lease tests wait on the in-process reaper: it sweeps every 0.2 s here."""
    return replace(settings, reaper_interval_seconds=SWEEP_SECONDS)


CAPACITY = 64
ENGINE_PORT = closed_port()


@pytest.fixture
async def address(database_url: str, settings: Settings) -> AsyncIterator[str]:
    running = await server.start(settings, database_url)
    yield f"127.0.0.1:{running.port}"
    await running.stop(0)


@pytest.fixture
async def client(address: str) -> AsyncIterator[AsyncKvquotaClient]:
    """gpu-0 and gpu-1 (64 blocks of 16 tokens, context 2048; gpu-1 registered with an engine
    URL, which Admit and Release never call), tenants acme and small (8 blocks)."""
    async with AsyncKvquotaClient(address, retry=NO_RETRIES) as made:
        for instance, engine in (("gpu-0", None), ("gpu-1", f"http://127.0.0.1:{ENGINE_PORT}")):
            await made.admin.RegisterInstance(
                admin_pb2.RegisterInstanceRequest(
                    instance_id=instance,
                    model="m",
                    block_size=16,
                    max_model_len=2048,
                    num_gpu_blocks=CAPACITY,
                    engine=pb.EngineEndpoints(url=engine) if engine else None,
                )
            )
        for tenant, limit in (("acme", 10**6), ("small", 8)):
            await made.admin.CreateTenant(
                admin_pb2.CreateTenantRequest(
                    tenant_id=tenant, tenant=pb.Tenant(quota=quota(max_blocks=limit))
                )
            )
        yield made


def admit(
    request_id: str, prompt: int = 100, output: int = 28, tenant: str = "acme", **extra: Any
) -> admission_pb2.AdmitRequest:
    """By default 8 blocks."""
    return admission_pb2.AdmitRequest(
        tenant=f"tenants/{tenant}",
        request_id=request_id,
        instance="instances/gpu-0",
        prompt_tokens=prompt,
        max_output_tokens=output,
        **extra,
    )


async def free_blocks(client: AsyncKvquotaClient, instance: str = "instances/gpu-0") -> int:
    found = await client.admin.GetInstance(admin_pb2.GetInstanceRequest(name=instance))
    return found.free_blocks


async def reservation(client: AsyncKvquotaClient, request_id: str) -> pb.Reservation:
    name = f"tenants/acme/reservations/{request_id}"
    return await client.admission.GetReservation(admission_pb2.GetReservationRequest(name=name))


Body = Callable[[Reservation], None]


class Driver(Protocol):
    """One of the two clients, run from the test's event loop."""

    async def hold(self, request: admission_pb2.AdmitRequest, body: Body) -> None: ...


@dataclass
class AsyncDriver:
    client: AsyncKvquotaClient

    async def hold(self, request: admission_pb2.AdmitRequest, body: Body) -> None:
        async with self.client.reservation(request) as held:
            body(held)


@dataclass
class BlockingDriver:
    """The blocking client, in a thread: the server runs on the test's loop."""

    client: KvquotaClient

    async def hold(self, request: admission_pb2.AdmitRequest, body: Body) -> None:
        def run() -> None:
            with self.client.reservation(request) as held:
                body(held)

        await asyncio.to_thread(run)


@pytest.fixture(params=["asyncio", "blocking"])
async def driver(
    request: pytest.FixtureRequest, client: AsyncKvquotaClient, address: str
) -> AsyncIterator[Driver]:
    if request.param == "asyncio":
        yield AsyncDriver(client)
        return
    blocking = KvquotaClient(address, retry=NO_RETRIES)
    yield BlockingDriver(blocking)
    await asyncio.to_thread(blocking.close)


@dataclass
class Scenario:
    request: admission_pb2.AdmitRequest
    # What the block does with the reservation (raising ends it with that exception).
    body: Body = lambda held: None
    # How it ends: the reservation's end reason and output tokens, or the error raised.
    end_reason: int = pb.END_REASON_RELEASED
    output_tokens: int = 0
    error: type[BaseException] | None = None
    http_status: int | None = None
    retry_after: bool = False
    # Admitted before it, and left running: what the scenario is refused against.
    held_before: list[admission_pb2.AdmitRequest] = field(default_factory=list)
    instance: str = "instances/gpu-0"


def record_output(held: Reservation) -> None:
    assert held.cache_salt and held.request_id == "r"
    assert len(held.block_table) == 8
    held.output_tokens = 21


def fail(held: Reservation) -> None:
    raise RuntimeError("the client went away")


SCENARIOS = {
    "released with its output tokens": Scenario(
        admit("r"), record_output, pb.END_REASON_RELEASED, 21
    ),
    "cancelled on an exception": Scenario(
        admit("r"), fail, pb.END_REASON_CANCELLED, error=RuntimeError
    ),
    "named by the engine's URL": Scenario(
        admission_pb2.AdmitRequest(
            tenant="tenants/acme",
            request_id="r",
            engine_address=f"http://127.0.0.1:{ENGINE_PORT}/",
            prompt_tokens=100,
            max_output_tokens=28,
        ),
        record_output,
        pb.END_REASON_RELEASED,
        21,
        instance="instances/gpu-1",
    ),
    "over quota: 429 and retry-after": Scenario(
        admit("r", tenant="small"),
        error=QuotaExceeded,
        http_status=429,
        retry_after=True,
        held_before=[admit("h", tenant="small", lease_ttl=Duration(seconds=30))],
    ),
    "instance full: 503 and retry-after": Scenario(
        admit("r"),
        error=Unavailable,
        http_status=503,
        retry_after=True,
        held_before=[admit("h", prompt=900, output=100, lease_ttl=Duration(seconds=30))],
    ),
    "over the context cap: 400": Scenario(
        admit("r", prompt=2000, output=100), error=InvalidRequest, http_status=400
    ),
}


@pytest.mark.parametrize("scenario", SCENARIOS.values(), ids=SCENARIOS.keys())
async def test_scenario_table(
    driver: Driver, client: AsyncKvquotaClient, scenario: Scenario
) -> None:
    for held in scenario.held_before:
        await client.admission.Admit(held)
    before = await free_blocks(client, scenario.instance)
    if scenario.error is None:
        await driver.hold(scenario.request, scenario.body)
    else:
        with pytest.raises(scenario.error) as raised:
            await driver.hold(scenario.request, scenario.body)
        if isinstance(raised.value, KvquotaError):
            refusal = raised.value
            assert refusal.http_status == scenario.http_status
            assert ("retry-after" in refusal.headers) is scenario.retry_after
            if scenario.retry_after:
                assert refusal.retry_delay_seconds is not None
                wait = math.ceil(refusal.retry_delay_seconds)
                assert refusal.headers == {"retry-after": str(wait)}
            assert await free_blocks(client, scenario.instance) == before
            return
    ended = await client.admission.GetReservation(
        admission_pb2.GetReservationRequest(name=f"{scenario.request.tenant}/reservations/r")
    )
    assert ended.state == pb.RESERVATION_STATE_ENDED
    assert ended.instance == scenario.instance
    assert (ended.end_reason, ended.output_tokens) == (scenario.end_reason, scenario.output_tokens)
    assert await free_blocks(client, scenario.instance) == before


async def test_a_cancelled_task_cancels_its_reservation(client: AsyncKvquotaClient) -> None:
    admitted = asyncio.Event()

    async def request() -> None:
        async with client.reservation(admit("r")):
            admitted.set()
            await asyncio.Event().wait()  # streaming, until the client goes away

    task = asyncio.create_task(request())
    await admitted.wait()
    assert await free_blocks(client) == CAPACITY - 8
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    ended = await reservation(client, "r")
    assert (ended.state, ended.end_reason) == (pb.RESERVATION_STATE_ENDED, pb.END_REASON_CANCELLED)
    assert await free_blocks(client) == CAPACITY


@pytest.mark.slow
async def test_renewal_keeps_a_two_second_lease_alive_for_ten_seconds(
    client: AsyncKvquotaClient,
) -> None:
    async with client.reservation(admit("r", lease_ttl=Duration(seconds=2))) as held:
        first_expiry = held.lease_expire_time
        await asyncio.sleep(10)  # the in-process reaper sweeps every 0.2 s
        current = await reservation(client, "r")
        assert current.state == pb.RESERVATION_STATE_ADMITTED
        assert held.lost is None and held.lease_expire_time > first_expiry
    ended = await reservation(client, "r")
    assert ended.end_reason == pb.END_REASON_RELEASED


async def test_a_reservation_preempted_by_a_reclaim_is_lost(client: AsyncKvquotaClient) -> None:
    lost: list[tuple[Reservation, KvquotaError]] = []
    told = asyncio.Event()

    def on_lost(held: Reservation, why: KvquotaError) -> None:
        lost.append((held, why))
        told.set()

    scope = client.reservation(admit("r", lease_ttl=Duration(seconds=3)), on_lost=on_lost)
    async with scope as held:
        await client.admin.CreateReclaimJob(
            admin_pb2.CreateReclaimJobRequest(
                instance="instances/gpu-0",
                target_blocks=8,
                min_tier=pb.RECLAIM_TIER_EVICT,
                max_tier=pb.RECLAIM_TIER_EVICT,
                request_id="evict-1",
            )
        )
        await asyncio.wait_for(told.wait(), 10)
    assert [(h, type(e), e.reason) for h, e in lost] == [(held, Preempted, "PREEMPTED")]
    assert held.lost is lost[0][1]
    ended = await reservation(client, "r")
    assert ended.end_reason == pb.END_REASON_PREEMPTED
    assert await free_blocks(client) == CAPACITY


class MidpointRandom(random.Random):
    """Jitter always half its range: each wait is exactly 1.1 x the server's delay."""

    def random(self) -> float:
        return 0.5


async def test_retries_follow_retry_info_and_stop_at_the_budget(
    client: AsyncKvquotaClient, address: str
) -> None:
    # The instance is full until a 2-second lease lapses: refusals carry a delay of about 2 s.
    await client.admission.Admit(admit("h", prompt=900, output=100, lease_ttl=Duration(seconds=2)))
    waits: list[float] = []

    async def record(seconds: float) -> None:
        waits.append(seconds)

    policy = RetryPolicy(max_attempts=3, deadline_seconds=30, jitter=0.2)
    retrying = AsyncKvquotaClient(address, retry=policy, rng=MidpointRandom(), sleep=record)
    async with retrying:
        started = asyncio.get_running_loop().time()
        with pytest.raises(Unavailable) as refused:
            await retrying.admission.Admit(admit("r"))
        took = asyncio.get_running_loop().time() - started
        assert refused.value.reason == "INSTANCE_OVERLOADED"
        last = refused.value.retry_delay_seconds
        assert last is not None
        assert len(waits) == policy.max_attempts - 1
        # Each wait is 1.1 x the delay of the refusal before it; delays shrink as the lease nears
        # its end, so an earlier one exceeds the last by at most the time between them.
        for wait in waits:
            assert last - 0.01 <= wait / 1.1 <= last + took + 0.01
        # A budget shorter than the delay: no retry at all.
        waits.clear()
        short = AsyncKvquotaClient(address, retry=RetryPolicy(deadline_seconds=1), sleep=record)
        async with short:
            with pytest.raises(Unavailable):
                await short.admission.Admit(admit("r"))
        assert waits == []
