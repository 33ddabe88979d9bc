"""The wait queue through the gRPC API: waiting Admits, timeouts, disconnects, Cancel, Watch."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration

from kvquota.v1 import admin_pb2, admission_pb2
from kvquota.v1 import resources_pb2 as pb
from tests.integration.grpc_helpers import admit, quota, refused

if TYPE_CHECKING:  # the async stubs exist only in the type stubs
    from kvquota.v1.admin_pb2_grpc import AdminServiceAsyncStub as Admin
    from kvquota.v1.admission_pb2_grpc import AdmissionServiceAsyncStub as Gateway


@pytest.fixture
async def small_instance(admin: Admin) -> None:
    await admin.RegisterInstance(
        admin_pb2.RegisterInstanceRequest(
            instance_id="gpu-0", block_size=16, max_model_len=4096, num_gpu_blocks=8
        )
    )
    await admin.CreateTenant(
        admin_pb2.CreateTenantRequest(tenant_id="acme", tenant=pb.Tenant(quota=quota()))
    )


def waiting(request_id: str, seconds: float) -> admission_pb2.AdmitRequest:
    """A request for the whole instance (8 blocks) that waits `seconds` for room."""
    budget = Duration()
    budget.FromNanoseconds(int(seconds * 1e9))
    return admit(request_id, 8 * 16 - 1, 1, wait_timeout=budget)


def name(request_id: str) -> str:
    return f"tenants/acme/reservations/{request_id}"


@pytest.mark.usefixtures("small_instance")
async def test_a_waiting_admit_returns_when_room_comes_back(gateway: Gateway) -> None:
    await gateway.Admit(waiting("holder", 0))
    wait = asyncio.ensure_future(gateway.Admit(waiting("waiter", 10)))
    await asyncio.sleep(0.3)
    assert not wait.done()
    queued = await gateway.GetReservation(admission_pb2.GetReservationRequest(name=name("waiter")))
    assert (queued.state, queued.queue_position) == (pb.RESERVATION_STATE_QUEUED, 0)
    released_at = time.monotonic()
    await gateway.Release(admission_pb2.ReleaseRequest(name=name("holder")))
    admitted = await asyncio.wait_for(wait, 5)
    assert admitted.reservation.state == pb.RESERVATION_STATE_ADMITTED
    # Woken by the notification, not by the one-second poll.
    assert time.monotonic() - released_at < 0.9


@pytest.mark.usefixtures("small_instance")
async def test_queue_timeout(gateway: Gateway, admin: Admin) -> None:
    await gateway.Admit(waiting("holder", 0))
    error = await refused(gateway.Admit(waiting("late", 0.4)))
    assert (error.code, error.reason) == (grpc.StatusCode.DEADLINE_EXCEEDED, "QUEUE_TIMEOUT")
    assert "RetryInfo" in error.details
    ended = await gateway.GetReservation(admission_pb2.GetReservationRequest(name=name("late")))
    assert ended.end_reason == pb.END_REASON_QUEUE_TIMEOUT
    instance = await admin.GetInstance(admin_pb2.GetInstanceRequest(name="instances/gpu-0"))
    assert instance.queued_requests == 0


@pytest.mark.usefixtures("small_instance")
async def test_a_caller_that_disconnects_leaves_the_queue(gateway: Gateway, admin: Admin) -> None:
    await gateway.Admit(waiting("holder", 0))
    with pytest.raises(grpc.aio.AioRpcError) as gone:
        await gateway.Admit(waiting("impatient", 30), timeout=0.5)  # the client gives up first
    assert gone.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    for _ in range(50):
        current = await gateway.GetReservation(
            admission_pb2.GetReservationRequest(name=name("impatient"))
        )
        if current.state == pb.RESERVATION_STATE_ENDED:
            break
        await asyncio.sleep(0.05)
    assert current.end_reason == pb.END_REASON_CANCELLED
    instance = await admin.GetInstance(admin_pb2.GetInstanceRequest(name="instances/gpu-0"))
    assert instance.queued_requests == 0


@pytest.mark.usefixtures("small_instance")
async def test_cancel_ends_a_waiting_admit(gateway: Gateway) -> None:
    await gateway.Admit(waiting("holder", 0))
    wait = asyncio.ensure_future(gateway.Admit(waiting("waiter", 10)))
    await asyncio.sleep(0.3)
    await gateway.Cancel(admission_pb2.CancelRequest(name=name("waiter")))
    error = await refused(wait)
    assert (error.code, error.reason) == (grpc.StatusCode.CANCELLED, "RESERVATION_CANCELLED")


@pytest.mark.usefixtures("small_instance")
async def test_watch_streams_queued_admitted_released(gateway: Gateway) -> None:
    await gateway.Admit(waiting("holder", 0))
    wait = asyncio.ensure_future(gateway.Admit(waiting("watched", 10)))
    await asyncio.sleep(0.3)
    states = []

    async def watch() -> None:
        stream = gateway.WatchReservation(
            admission_pb2.WatchReservationRequest(name=name("watched"))
        )
        async for update in stream:
            states.append((update.state, update.end_reason))

    watcher = asyncio.create_task(watch())
    await asyncio.sleep(0.3)
    await gateway.Release(admission_pb2.ReleaseRequest(name=name("holder")))
    await asyncio.wait_for(wait, 5)
    await gateway.Release(admission_pb2.ReleaseRequest(name=name("watched")))
    await asyncio.wait_for(watcher, 5)
    assert states == [
        (pb.RESERVATION_STATE_QUEUED, pb.END_REASON_UNSPECIFIED),
        (pb.RESERVATION_STATE_ADMITTED, pb.END_REASON_UNSPECIFIED),
        (pb.RESERVATION_STATE_ENDED, pb.END_REASON_RELEASED),
    ]
    missing = await refused(
        gateway.WatchReservation(admission_pb2.WatchReservationRequest(name=name("none"))).read()
    )
    assert missing.reason == "RESERVATION_NOT_FOUND"
