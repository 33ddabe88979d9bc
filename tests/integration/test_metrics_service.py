"""A replica's own figures, through a real server where they come from RPCs: admissions by
outcome and reason, RPC latency by method and status, queue waits; the database pool; and the
lag between an engine's KV events and their application by the instance's owner."""

from __future__ import annotations

import asyncio
import time
from contextlib import AsyncExitStack
from typing import Any

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration
from grpc_health.v1 import health_pb2, health_pb2_grpc
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from kvquota.v1 import admin_pb2, admin_pb2_grpc, admission_pb2, admission_pb2_grpc
from kvquota.v1 import resources_pb2 as pb
from quota_service.api.server import HotPath
from quota_service.config import Settings
from quota_service.core import catalog
from quota_service.core.model import EngineEndpoints
from quota_service.engine.simulated import EventPublisher
from quota_service.jobs.follower import Followers
from quota_service.metrics import PoolMetrics, ServiceMetrics
from quota_service.store.database import connect
from tests.integration.grpc_helpers import admit, free_port, quota, refused
from tests.integration.scraping import key, matching, scrape, serving, until

ADMISSION = "kvquota.v1.AdmissionService"


def waiting(request_id: str, seconds: float) -> admission_pb2.AdmitRequest:
    """A request for the whole 8-block instance that waits `seconds` for room."""
    budget = Duration()
    budget.FromNanoseconds(int(seconds * 1e9))
    return admit(request_id, 8 * 16 - 1, 1, wait_timeout=budget)


def name(request_id: str) -> str:
    return f"tenants/acme/reservations/{request_id}"


async def test_admissions_queue_waits_and_rpc_latency_through_the_server(
    database_url: str, settings: Settings
) -> None:
    async with serving(settings, database_url) as (channel, url):
        admin = admin_pb2_grpc.AdminServiceStub(channel)
        gateway = admission_pb2_grpc.AdmissionServiceStub(channel)
        await admin.RegisterInstance(
            admin_pb2.RegisterInstanceRequest(
                instance_id="gpu-0", block_size=16, max_model_len=4096, num_gpu_blocks=8
            )
        )
        await admin.CreateTenant(
            admin_pb2.CreateTenantRequest(tenant_id="acme", tenant=pb.Tenant(quota=quota()))
        )
        holder = await gateway.Admit(waiting("holder", 0))  # admitted at once
        waiter = asyncio.ensure_future(gateway.Admit(waiting("waiter", 30)))

        async def queued() -> bool:
            request = admission_pb2.GetReservationRequest(name=name("waiter"))
            try:
                found = await gateway.GetReservation(request)
            except grpc.aio.AioRpcError as error:  # its Admit has not arrived yet
                assert error.code() == grpc.StatusCode.NOT_FOUND
                return False
            return found.state == pb.RESERVATION_STATE_QUEUED

        await until(queued)
        # Nobody jumps the queue; one waits out its budget behind "waiter"; one is malformed.
        eager = await refused(gateway.Admit(waiting("eager", 0)))
        late = await refused(gateway.Admit(waiting("late", 0.3)))
        bad = await refused(gateway.Admit(admit("bad", 0, 1)))
        assert [e.reason for e in (eager, late, bad)] == [
            "INSTANCE_OVERLOADED",
            "QUEUE_TIMEOUT",
            "INVALID_REQUEST",
        ]
        await gateway.Release(admission_pb2.ReleaseRequest(name=name("holder")))
        admitted = await waiter  # admitted after its wait
        assert admitted.reservation.state == pb.RESERVATION_STATE_ADMITTED
        # A session suspended and resumed while its blocks are still there: admitted at once.
        await gateway.SuspendReservation(
            admission_pb2.SuspendReservationRequest(name=name("waiter"))
        )
        await gateway.ResumeReservation(admission_pb2.ResumeReservationRequest(name=name("waiter")))

        samples = await scrape(url)
        admissions = {
            (s.labels["method"], s.labels["outcome"], s.labels["reason"]): s.value
            for s in matching(samples, "kvquota_admissions_total")
        }
        assert admissions == {
            ("Admit", "admitted", ""): 1,
            ("Admit", "queued", ""): 1,
            ("Admit", "refused", "INSTANCE_OVERLOADED"): 1,
            ("Admit", "refused", "QUEUE_TIMEOUT"): 1,
            ("Admit", "refused", "INVALID_REQUEST"): 1,
            ("ResumeReservation", "admitted", ""): 1,
        }

        def calls(method: str, code: str, service: str = ADMISSION) -> float:
            labels = {"service": service, "method": method, "code": code}
            return samples[key("kvquota_rpc_duration_seconds_count", **labels)]

        assert calls("Admit", "OK") == 2
        assert calls("Admit", "UNAVAILABLE") == 1
        assert calls("Admit", "DEADLINE_EXCEEDED") == 1
        assert calls("Admit", "INVALID_ARGUMENT") == 1
        assert calls("Release", "OK") == 1
        assert calls("RegisterInstance", "OK", "kvquota.v1.AdminService") == 1
        # The timed-out call took its whole wait budget at least.
        timed_out = {"service": ADMISSION, "method": "Admit", "code": "DEADLINE_EXCEEDED"}
        assert samples[key("kvquota_rpc_duration_seconds_sum", **timed_out)] >= 0.3
        assert samples[key("kvquota_rpc_duration_seconds_bucket", **timed_out, le="+Inf")] == 1

        waits = {
            s.labels["result"]: s.value
            for s in matching(samples, "kvquota_queue_wait_seconds_count", engine_instance="gpu-0")
        }
        assert waits == {"admitted": 1, "timeout": 1}
        timeout = {"engine_instance": "gpu-0", "result": "timeout"}
        assert samples[key("kvquota_queue_wait_seconds_sum", **timeout)] >= 0.3

        assert samples[key("kvquota_db_pool_size")] == settings.db_pool_size
        # The owner's commits: every call above that changed gpu-0 was in one, some shared.
        commits = samples[key("kvquota_journal_batches_total", engine_instance="gpu-0")]
        operations = samples[key("kvquota_journal_operations_total", engine_instance="gpu-0")]
        assert 1 <= commits <= operations
        # The salt a caller got never shows in the metrics.
        assert holder.cache_salt and not any(holder.cache_salt in str(k) for k in samples)


async def test_the_pool_gauges_follow_connections_checked_out(database_url: str) -> None:
    engine = connect(database_url, pool_size=3)  # and as many again in overflow
    metrics = ServiceMetrics()
    metrics.registry.register(PoolMetrics(engine))

    def pool() -> dict[str, float | None]:
        return {
            n: metrics.registry.get_sample_value(f"kvquota_db_pool_{n}")
            for n in ("size", "checked_out", "idle", "overflow")
        }

    try:
        assert pool() == {"size": 3, "checked_out": 0, "idle": 0, "overflow": 0}
        async with AsyncExitStack() as held:
            connections: list[AsyncConnection] = []
            for _ in range(5):
                connections.append(await held.enter_async_context(engine.connect()))
                await connections[-1].execute(text("SELECT 1"))
            assert pool() == {"size": 3, "checked_out": 5, "idle": 0, "overflow": 2}
        # Overflow connections close when they come back; the pool keeps its size open.
        assert pool() == {"size": 3, "checked_out": 0, "idle": 3, "overflow": 0}
    finally:
        await engine.dispose()


async def test_engine_event_lag_is_observed_when_a_batch_is_applied(
    engine: AsyncEngine, database_url: str, owned: HotPath
) -> None:
    events, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    publisher = EventPublisher(events, replay)
    spec = catalog.instance_spec(
        "sim",
        "m",
        None,
        16,
        4096,
        None,
        64,
        engine=EngineEndpoints("http://127.0.0.1:1", events, replay),
    )
    await owned.catalog.register_instance(spec)
    metrics = ServiceMetrics()
    followers = Followers(database_url, owned.reconciler(engine), 60.0, metrics)

    def applied() -> float:
        found = metrics.registry.get_sample_value(
            "kvquota_engine_event_lag_seconds_count", {"engine_instance": "sim"}
        )
        return found or 0.0

    started = time.time()
    try:
        # A lease round claims the instance whose engine publishes events; its owner follows it.
        await owned.owners.take_over_unowned()
        await followers.scan()

        async def lag_observed() -> bool:
            # Until the follower has subscribed, live batches go nowhere: publish until one
            # lands (an eviction of contents the owner never had changes nothing).
            await publisher.publish(
                [{"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"}]
            )
            return applied() >= 1

        await until(lag_observed)
    finally:
        await followers.stop()
        publisher.close()
    observed = applied()
    lag_sum = metrics.registry.get_sample_value(
        "kvquota_engine_event_lag_seconds_sum", {"engine_instance": "sim"}
    )
    last = metrics.registry.get_sample_value(
        "kvquota_engine_event_last_batch_timestamp_seconds", {"engine_instance": "sim"}
    )
    assert lag_sum is not None and last is not None
    # Each batch was stamped after `started` and applied before now: its lag lies between.
    assert 0 <= lag_sum <= observed * (time.time() - started)
    assert started <= last <= time.time()
    async with engine.connect() as conn:
        seq = await conn.execute(text("SELECT last_event_seq FROM instances"))
        assert seq.scalar_one() is not None


async def test_health_is_measured_and_an_unknown_method_is_not(
    database_url: str, settings: Settings
) -> None:
    async with serving(settings, database_url) as (channel, url):
        health: Any = health_pb2_grpc.HealthStub(channel)  # its stubs lack the methods
        checked = await health.Check(health_pb2.HealthCheckRequest())
        assert checked.status == health_pb2.HealthCheckResponse.SERVING
        # A stream written through its context (grpc's own Watch) still streams.
        watch = health.Watch(health_pb2.HealthCheckRequest())
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()
        method = "/kvquota.v1.AdmissionService/NoSuchMethod"
        unknown: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(method)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await unknown(b"")
        assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED
        samples = await scrape(url)
        check = {"service": "grpc.health.v1.Health", "method": "Check", "code": "OK"}
        assert samples[key("kvquota_rpc_duration_seconds_count", **check)] == 1
        measured = {
            s.labels["method"] for s in matching(samples, "kvquota_rpc_duration_seconds_count")
        }
        assert "NoSuchMethod" not in measured
