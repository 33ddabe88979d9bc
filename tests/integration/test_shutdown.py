"""SIGTERM during load: in-flight RPCs complete, new ones are refused, the process exits within
the grace, and the ledger loses nothing.

A real `kvquota serve` process is put under load (Admit/Release loops on one instance) while, on
another, full one, gateways wait in its queue and watch their reservations. Then it gets SIGTERM.
What was in flight runs on during the grace: the waiting Admits are admitted as another replica
releases blocks, the watches see their reservations end, a short
wait budget runs out with QUEUE_TIMEOUT. A wait longer than the grace is answered UNAVAILABLE
(SERVER_SHUTTING_DOWN) shortly before the grace ends, and its request stays queued, so that the
caller's retry on another replica keeps its place. New calls are refused (UNAVAILABLE) from the
drain on; one racing the signal may instead be cancelled by gRPC core before kvquota sees it
(grpc/grpc#41785), and the ledger shows that it never ran.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from kvquota.client import AsyncKvquotaClient
from kvquota.v1 import admission_pb2, admission_pb2_grpc
from kvquota.v1 import resources_pb2 as pb
from quota_service.api import server
from quota_service.config import Settings
from tests import processes
from tests.integration.grpc_helpers import STATUS_DETAILS_KEY, rich_error
from tests.integration.invariants import assert_invariants
from tests.integration.ledger_fixtures import add_instance, add_tenant
from tests.integration.test_replicas import serving_address, spawn_replica

GRACE_SECONDS = 5.0
# Interpreter and connection teardown after the grace: the "small margin".
EXIT_MARGIN_SECONDS = 3.0
BLOCK = 16
# Each reservation on the full instance takes 16 of its 64 blocks (255 + 1 tokens).
PROMPT, OUTPUT = 16 * BLOCK - 1, 1
HOLDERS = [f"h{i}" for i in range(4)]
NEXT = [f"q{i}" for i in range(4)]  # priority 1: admitted during the drain
LATE = ["z0", "z1"]  # priority 0, wait longer than the grace: never admitted on this server
SHORT = "s0"  # priority 0, its wait budget runs out during the drain
LOADERS = 8
# On the memory hot path, how soon the other replica may take over what this one served.
OWNER_LEASE_SECONDS = "2"


def admit_request(
    request_id: str, *, wait: int = 0, priority: int = 0, tenant: str = "acme"
) -> admission_pb2.AdmitRequest:
    request = admission_pb2.AdmitRequest(
        tenant=f"tenants/{tenant}",
        request_id=request_id,
        instance="instances/gpu-0",
        prompt_tokens=PROMPT,
        max_output_tokens=OUTPUT,
        priority=priority,
    )
    request.wait_timeout.FromSeconds(wait)
    return request


def unanswered(error: grpc.aio.AioRpcError) -> str | None:
    """How gRPC ended a call kvquota never answered: "refused" (UNAVAILABLE: the server takes
    no more calls), or "cancelled" — a call that reached the server just as it began to shut
    down, before the server had taken it, is cancelled by gRPC core, not refused
    (grpc/grpc#41785). None: kvquota answered (its status has details)."""
    if STATUS_DETAILS_KEY in dict(error.trailing_metadata() or ()):
        return None
    return {grpc.StatusCode.UNAVAILABLE: "refused", grpc.StatusCode.CANCELLED: "cancelled"}.get(
        error.code()
    )


@dataclass
class Call:
    """One RPC of the load: what it was, whether the client had already seen the server
    draining when it started it, and how it ended ("ok", a kvquota reason, or unanswered)."""

    method: str
    request_id: str
    after_drain_seen: bool
    outcome: str = ""


async def outcome_of(call: Awaitable[object]) -> str:
    try:
        await call
    except grpc.aio.AioRpcError as error:
        return unanswered(error) or rich_error(error).reason
    return "ok"


async def statuses(
    stream: AsyncIterator[health_pb2.HealthCheckResponse],
    serving: asyncio.Event,
    draining: asyncio.Event,
) -> None:
    async for reply in stream:
        if reply.status == health_pb2.HealthCheckResponse.SERVING:
            serving.set()
        elif reply.status == health_pb2.HealthCheckResponse.NOT_SERVING:
            draining.set()
            return


async def watch(
    stub: admission_pb2_grpc.AdmissionServiceAsyncStub, name: str, first: asyncio.Event
) -> list[int]:
    """The states a WatchReservation stream shows, to its end (an error is raised)."""
    seen: list[int] = []
    async for reservation in stub.WatchReservation(
        admission_pb2.WatchReservationRequest(name=name)
    ):
        seen.append(reservation.state)
        first.set()
    return seen


async def until(condition: Callable[[], Awaitable[bool]], seconds: float = 30) -> None:
    """Poll the database (or the test's own state) until the condition holds."""
    async with asyncio.timeout(seconds):
        while True:
            if await condition():
                return
            await asyncio.sleep(0.05)


async def test_sigterm_drains_in_flight_calls_refuses_new_ones_and_exits_within_the_grace(
    engine: AsyncEngine, database_url: str
) -> None:
    await add_instance(engine, "gpu-0", blocks=4 * 16)
    await add_instance(engine, "gpu-1", blocks=4096)
    await add_tenant(engine, "acme")
    await add_tenant(engine, "busy")
    process = spawn_replica(
        database_url,
        shutdown_grace_seconds=str(GRACE_SECONDS),
        auth_required="false",
        reaper_interval_seconds="0.2",
        owner_lease_seconds=OWNER_LEASE_SECONDS,
    )
    # Another replica of the fleet, which keeps serving; both start at once.
    other = spawn_replica(database_url, owner_lease_seconds=OWNER_LEASE_SECONDS)
    address, other_address = serving_address(process), serving_address(other)
    channel = grpc.aio.insecure_channel(address)
    # A gateway's client of it: on the memory hot path it retries INSTANCE_MOVING while the
    # instances this replica served move to the other one.
    elsewhere = AsyncKvquotaClient(other_address)
    stub = admission_pb2_grpc.AdmissionServiceStub(channel)
    serving, draining = asyncio.Event(), asyncio.Event()
    health_stub: Any = health_pb2_grpc.HealthStub(channel)  # its stubs lack the methods
    health_watch = health_stub.Watch(health_pb2.HealthCheckRequest())
    health = asyncio.ensure_future(statuses(health_watch, serving, draining))
    stop_load = asyncio.Event()
    calls: list[Call] = []

    async def load(worker: int) -> None:
        """Admit and release on gpu-1 until the server refuses a call."""
        for i in range(10**6):
            request_id = f"load-{worker}-{i}"
            admit = Call("Admit", request_id, draining.is_set())
            calls.append(admit)
            admit.outcome = await outcome_of(
                stub.Admit(
                    admission_pb2.AdmitRequest(
                        tenant="tenants/busy",
                        request_id=request_id,
                        instance="instances/gpu-1",
                        prompt_tokens=1 + (i * 37 + worker) % 200,
                        max_output_tokens=8,
                    )
                )
            )
            if admit.outcome != "ok":
                return
            release = Call("Release", request_id, draining.is_set())
            calls.append(release)
            name = f"tenants/busy/reservations/{request_id}"
            release.outcome = await outcome_of(
                stub.Release(admission_pb2.ReleaseRequest(name=name))
            )
            if release.outcome != "ok" or stop_load.is_set():
                return

    async def loaded() -> bool:
        return len(calls) >= 80

    try:
        async with asyncio.timeout(30):
            ready = asyncio.ensure_future(serving.wait())
            await asyncio.wait([ready, health], return_when=asyncio.FIRST_COMPLETED)
        if health.done():
            health.result()  # the watch failed: its error says why
        for request_id in HOLDERS:
            await stub.Admit(admit_request(request_id))
        firsts = {r: asyncio.Event() for r in HOLDERS}
        watches = {
            r: asyncio.ensure_future(watch(stub, f"tenants/acme/reservations/{r}", firsts[r]))
            for r in HOLDERS
        }
        waiting = {
            **{r: stub.Admit(admit_request(r, wait=30, priority=1)) for r in NEXT},
            **{r: stub.Admit(admit_request(r, wait=60)) for r in LATE},
            SHORT: stub.Admit(admit_request(SHORT, wait=3)),
        }
        answers = {r: asyncio.ensure_future(outcome_of(c)) for r, c in waiting.items()}

        async def all_in_flight() -> bool:
            async with engine.connect() as conn:
                taken = await conn.execute(
                    text("SELECT count(*) FROM reservations WHERE request_id = ANY(:ids)"),
                    {"ids": list(waiting)},
                )
                return taken.scalar_one() == len(waiting) and all(
                    e.is_set() for e in firsts.values()
                )

        # Every waiting call is in the server's hands: in the ledger (queued, or already timed
        # out if this machine is slow), or streaming.
        await until(all_in_flight)
        loaders = [asyncio.ensure_future(load(w)) for w in range(LOADERS)]
        await until(loaded)

        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(GRACE_SECONDS):
            await health  # NOT_SERVING, pushed to a watcher as the drain begins
        assert draining.is_set()
        health_watch.cancel()  # a watch never ends by itself: it would hold the drain

        # New calls are refused, on this channel and on a new one; so is a health check.
        assert await outcome_of(stub.Admit(admit_request("new"))) == "refused"
        async with grpc.aio.insecure_channel(address) as late_channel:
            late = admission_pb2_grpc.AdmissionServiceStub(late_channel)
            assert await outcome_of(late.Admit(admit_request("new-2"))) == "refused"
            late_health: Any = health_pb2_grpc.HealthStub(late_channel)
            check = late_health.Check(health_pb2.HealthCheckRequest())
            assert await outcome_of(check) == "refused"

        # Another replica releases the holders: the waiting Admits are admitted, the watches end.
        for request_id in HOLDERS:
            await elsewhere.admission.Release(
                admission_pb2.ReleaseRequest(
                    name=f"tenants/acme/reservations/{request_id}", output_tokens=OUTPUT
                )
            )
        for request_id in NEXT:
            assert await answers[request_id] == "ok", request_id
        for request_id in HOLDERS:
            assert await watches[request_id] == [
                pb.RESERVATION_STATE_ADMITTED,
                pb.RESERVATION_STATE_ENDED,
            ]
        assert await answers[SHORT] == "QUEUE_TIMEOUT"
        # Longer waits than the grace are answered before it ends, not cut off by it.
        for request_id in LATE:
            assert await answers[request_id] == "SERVER_SHUTTING_DOWN", request_id
        stop_load.set()
        await asyncio.gather(*loaders)

        returncode = await asyncio.to_thread(process.wait, GRACE_SECONDS + EXIT_MARGIN_SECONDS)
        assert returncode == 0
        assert time.monotonic() - signalled < GRACE_SECONDS + EXIT_MARGIN_SECONDS
    finally:
        await channel.close()
        await elsewhere.close()
        process.kill()  # it exited by now, unless the test failed
        processes.stop(process)
        processes.stop(other)

    # The load: every call started once the drain was seen is refused. One sent as the signal
    # arrived may be refused, or cancelled by gRPC core; check_ledger shows it never ran.
    assert all(c.outcome == "refused" for c in calls if c.after_drain_seen)
    assert all(c.outcome in ("ok", "refused", "cancelled") for c in calls), [
        c for c in calls if c.outcome not in ("ok", "refused", "cancelled")
    ]
    await check_ledger(engine, calls)


async def check_ledger(engine: AsyncEngine, calls: list[Call]) -> None:
    """Every call the server took ran to its answer, and nothing is lost: each reservation is
    live (admitted with a lease, or queued within its wait budget) or ended with a reason."""
    await assert_invariants(engine)
    async with engine.connect() as conn:
        rows = await conn.execute(
            text(
                "SELECT request_id, state, end_reason, lease_expires_at > now() AS leased, "
                "wait_deadline > now() AS waiting FROM reservations"
            )
        )
        found = {r.request_id: r for r in rows}
    for row in found.values():
        assert (
            (row.state == "ADMITTED" and row.leased)
            or (row.state == "QUEUED" and row.waiting)
            or (row.state == "ENDED" and row.end_reason)
        ), row
    expected = {
        **{r: ("ENDED", "RELEASED") for r in HOLDERS},
        **{r: ("ADMITTED", None) for r in NEXT},
        # Answered "ask another replica": still in the queue, in their place.
        **{r: ("QUEUED", None) for r in LATE},
        SHORT: ("ENDED", "QUEUE_TIMEOUT"),
    }
    for call in calls:
        if call.method == "Admit" and call.outcome == "ok":
            expected[call.request_id] = ("ADMITTED", None)
        elif call.method == "Release" and call.outcome == "ok":
            expected[call.request_id] = ("ENDED", "RELEASED")
    assert {r: (row.state, row.end_reason) for r, row in found.items()} == expected


async def test_no_call_is_taken_once_a_watcher_was_told_the_server_drains(
    engine: AsyncEngine, database_url: str, settings: Settings
) -> None:
    """Whatever a drain begins with (on the memory hot path: handing the instances over), the
    server refuses new calls before a health watcher hears NOT_SERVING."""
    await add_instance(engine, "gpu-0", blocks=4 * 16)
    await add_tenant(engine, "acme")
    running = await server.start(settings, database_url)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
        stub = admission_pb2_grpc.AdmissionServiceStub(channel)
        await stub.Admit(admit_request("h0"))  # gpu-0 is served here (in memory: owned)
        serving, draining = asyncio.Event(), asyncio.Event()
        health_stub: Any = health_pb2_grpc.HealthStub(channel)
        health_watch = health_stub.Watch(health_pb2.HealthCheckRequest())
        health = asyncio.ensure_future(statuses(health_watch, serving, draining))
        await asyncio.wait_for(serving.wait(), 30)
        stopping = asyncio.ensure_future(running.stop(GRACE_SECONDS))
        await asyncio.wait_for(health, GRACE_SECONDS)
        health_watch.cancel()
        assert await outcome_of(stub.Admit(admit_request("new"))) == "refused"
        await stopping
