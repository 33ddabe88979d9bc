"""Suspend and resume over gRPC: an idle session is offloaded by a reclaim job and comes back
on resume with its blocks; bad requests are refused with their reason and change nothing."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import TYPE_CHECKING

import grpc
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from kvquota.v1 import admin_pb2, admission_pb2
from kvquota.v1 import resources_pb2 as pb
from quota_service.config import Settings
from quota_service.store.cpu_tier import CpuTierBooks
from tests.conftest import SWEEP_SECONDS
from tests.integration.engine_stubs import closed_port
from tests.integration.grpc_helpers import admit, quota, refused


@pytest.fixture(scope="module")
def settings(settings: Settings) -> Settings:
    """The offload waits for a maintenance loop: it sweeps every 0.2 s here."""
    return replace(settings, reaper_interval_seconds=SWEEP_SECONDS)


if TYPE_CHECKING:  # the async stubs exist only in the type stubs
    from kvquota.v1.admin_pb2_grpc import AdminServiceAsyncStub as Admin
    from kvquota.v1.admission_pb2_grpc import AdmissionServiceAsyncStub as Gateway


async def test_suspend_offload_and_resume_over_grpc(
    gateway: Gateway, admin: Admin, engine: AsyncEngine
) -> None:
    nowhere = f"http://127.0.0.1:{closed_port()}"  # no engine or coordinator answers here
    await admin.RegisterInstance(
        admin_pb2.RegisterInstanceRequest(
            instance_id="gpu-0",
            block_size=16,
            max_model_len=4096,
            num_gpu_blocks=64,
            geometry=pb.KvGeometry(
                num_layers=2, num_kv_heads=2, head_dim=64, dtype=pb.KV_DTYPE_FP16
            ),
            engine=pb.EngineEndpoints(
                url=nowhere,
                lmcache=pb.LmcacheEndpoint(
                    coordinator_url=nowhere, instance_id="mp-1", model_name="m"
                ),
            ),
        )
    )
    await admin.CreateTenant(
        admin_pb2.CreateTenantRequest(tenant_id="acme", tenant=pb.Tenant(quota=quota()))
    )
    prompt = list(range(63))
    admitted = await gateway.Admit(admit("chat", 63, 1, prompt_token_ids=prompt))
    name = admitted.reservation.name

    too_long = await refused(
        gateway.SuspendReservation(
            admission_pb2.SuspendReservationRequest(name=name, session_token_ids=range(100))
        )
    )
    assert (too_long.code, too_long.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST")
    nobody = await refused(
        gateway.SuspendReservation(
            admission_pb2.SuspendReservationRequest(name="tenants/acme/reservations/none")
        )
    )
    assert nobody.code == grpc.StatusCode.NOT_FOUND
    suspended = await gateway.SuspendReservation(
        admission_pb2.SuspendReservationRequest(name=name, session_token_ids=[*prompt, 7])
    )
    assert suspended.HasField("suspend_time") and len(suspended.block_table) == 4

    await CpuTierBooks(engine).record_usage("gpu-0", 0, 1 << 30)  # as the mirror reads L1
    job = await admin.CreateReclaimJob(
        admin_pb2.CreateReclaimJobRequest(
            instance="instances/gpu-0",
            target_blocks=4,
            max_tier=pb.RECLAIM_TIER_OFFLOAD,
            request_id="offload",
        )
    )
    assert [(s.tier, s.cpu_bytes) for s in job.steps] == [(pb.RECLAIM_TIER_OFFLOAD, 4 * 16384)]
    for _ in range(100):  # a maintenance loop runs it
        current = await gateway.GetReservation(admission_pb2.GetReservationRequest(name=name))
        if current.offloaded_bytes:
            break
        await asyncio.sleep(0.1)
    assert (current.offloaded, current.offloaded_bytes, list(current.block_table)) == (
        True,
        4 * 16384,
        [],
    )

    # The CPU tier does not answer here: the prefetch is best effort, the blocks come back.
    resumed = await gateway.ResumeReservation(admission_pb2.ResumeReservationRequest(name=name))
    assert resumed.state == pb.RESERVATION_STATE_ADMITTED
    assert (resumed.offloaded_bytes, len(resumed.block_table), resumed.prefix_hit_blocks) == (
        0,
        4,
        3,
    )
    assert not resumed.HasField("suspend_time") and not resumed.offloaded
    again = await gateway.ResumeReservation(admission_pb2.ResumeReservationRequest(name=name))
    assert again.block_table == resumed.block_table  # not suspended: nothing changes
    await gateway.Release(admission_pb2.ReleaseRequest(name=name))
    ended = await refused(
        gateway.ResumeReservation(admission_pb2.ResumeReservationRequest(name=name))
    )
    assert (ended.code, ended.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "RESERVATION_ENDED")
