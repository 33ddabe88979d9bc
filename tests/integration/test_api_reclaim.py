"""The gRPC contract for reclaim jobs: create (dry run and real), get, list, cancel, refusals."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import TYPE_CHECKING

import grpc
import pytest
from google.rpc import error_details_pb2

from kvquota.v1 import admin_pb2, admission_pb2
from kvquota.v1 import resources_pb2 as pb
from quota_service.config import Settings
from tests.conftest import SWEEP_SECONDS
from tests.integration.grpc_helpers import admit, quota, refused


@pytest.fixture(scope="module")
def settings(settings: Settings) -> Settings:
    """The jobs wait for a maintenance loop: it sweeps every 0.2 s here."""
    return replace(settings, reaper_interval_seconds=SWEEP_SECONDS)


if TYPE_CHECKING:  # the async stubs exist only in the type stubs
    from kvquota.v1.admin_pb2_grpc import AdminServiceAsyncStub as Admin
    from kvquota.v1.admission_pb2_grpc import AdmissionServiceAsyncStub as Gateway


def reclaim(request_id: str, **fields: object) -> admin_pb2.CreateReclaimJobRequest:
    given: dict[str, object] = {
        "instance": "instances/gpu-0",
        "max_tier": pb.RECLAIM_TIER_FREE,
        "request_id": request_id,
    }
    return admin_pb2.CreateReclaimJobRequest(**(given | fields))  # type: ignore[arg-type]


async def finished(admin: Admin, name: str) -> pb.ReclaimJob:
    """The job once a maintenance loop has run it to its end (or as it is after 10 s)."""
    for _ in range(100):
        job = await admin.GetReclaimJob(admin_pb2.GetReclaimJobRequest(name=name))
        if job.state == pb.RECLAIM_JOB_STATE_SUCCEEDED:
            break
        await asyncio.sleep(0.1)
    return job


async def test_reclaim_jobs_over_grpc(gateway: Gateway, admin: Admin) -> None:
    geometry = pb.KvGeometry(
        num_layers=2, num_kv_heads=2, head_dim=64, dtype=pb.KV_DTYPE_FP16
    )  # 16 tokens x 2 x 2 layers x 2 heads x 64 x 2 bytes = 16 KiB a block
    await admin.RegisterInstance(
        admin_pb2.RegisterInstanceRequest(
            instance_id="gpu-0",
            block_size=16,
            max_model_len=4096,
            num_gpu_blocks=64,
            geometry=geometry,
        )
    )
    await admin.CreateTenant(
        admin_pb2.CreateTenantRequest(tenant_id="acme", tenant=pb.Tenant(quota=quota()))
    )
    for i in range(2):  # 8 cached prompt blocks once released
        ids = list(range(i * 1000, i * 1000 + 64))
        done = await gateway.Admit(admit(f"r{i}", len(ids), 1, prompt_token_ids=ids))
        await gateway.Release(admission_pb2.ReleaseRequest(name=done.reservation.name))

    dry = await admin.CreateReclaimJob(
        reclaim("dry", target_bytes=3 * 16384 - 1, tenant="tenants/acme", dry_run=True)
    )
    assert (dry.state, dry.target_blocks, dry.expected_blocks) == (
        pb.RECLAIM_JOB_STATE_SUCCEEDED,
        3,  # bytes round up to whole blocks
        3,
    )
    assert [(s.tier, s.expected_blocks) for s in dry.steps] == [(pb.RECLAIM_TIER_FREE, 3)]
    assert all(s.actual_blocks == -1 and not s.HasField("block") for s in dry.steps)

    job = await admin.CreateReclaimJob(reclaim("real", target_blocks=8))
    # Idempotent: the same job, not a second one (its steps may have run meanwhile).
    again = await admin.CreateReclaimJob(reclaim("real", target_blocks=8))
    assert (again.name, again.target_blocks, again.expected_blocks, len(again.steps)) == (
        job.name,
        job.target_blocks,
        job.expected_blocks,
        len(job.steps),
    )
    job = await finished(admin, job.name)
    assert (job.state, job.actual_blocks) == (pb.RECLAIM_JOB_STATE_SUCCEEDED, 8)
    instance = await admin.GetInstance(admin_pb2.GetInstanceRequest(name="instances/gpu-0"))
    assert (instance.cached_blocks, instance.free_blocks) == (0, 64)

    listed = await admin.ListReclaimJobs(admin_pb2.ListReclaimJobsRequest(instance=job.instance))
    assert sorted(j.name for j in listed.reclaim_jobs) == sorted([dry.name, job.name])
    cancelled = await admin.CancelReclaimJob(admin_pb2.CancelReclaimJobRequest(name=job.name))
    assert cancelled.state == pb.RECLAIM_JOB_STATE_SUCCEEDED  # finished jobs stay as they are

    both = await refused(admin.CreateReclaimJob(reclaim("both", target_blocks=1, target_bytes=1)))
    assert both.code == grpc.StatusCode.INVALID_ARGUMENT
    no_tier = await refused(
        admin.CreateReclaimJob(
            reclaim("tierless", target_blocks=1, max_tier=pb.RECLAIM_TIER_UNSPECIFIED)
        )
    )
    violations = no_tier.details["BadRequest"]
    assert isinstance(violations, error_details_pb2.BadRequest)
    assert [v.field for v in violations.field_violations] == ["max_tier"]
    # Proto enums are open: a tier number from a newer client is refused, not an INTERNAL.
    unknown_tier = await refused(
        admin.CreateReclaimJob(reclaim("future", target_blocks=1, max_tier=7))
    )
    assert unknown_tier.code == grpc.StatusCode.INVALID_ARGUMENT
    nobody = await refused(
        admin.CreateReclaimJob(reclaim("nobody", target_blocks=1, tenant="tenants/nobody"))
    )
    assert (nobody.code, nobody.reason) == (grpc.StatusCode.NOT_FOUND, "TENANT_NOT_FOUND")
    missing = await refused(
        admin.GetReclaimJob(admin_pb2.GetReclaimJobRequest(name="reclaimJobs/nope"))
    )
    assert (missing.code, missing.reason) == (grpc.StatusCode.NOT_FOUND, "RECLAIM_JOB_NOT_FOUND")
    after = await admin.ListReclaimJobs(admin_pb2.ListReclaimJobsRequest())
    assert len(after.reclaim_jobs) == 2  # refusals stored nothing


async def test_an_evicted_reservation_ends_preempted_on_watch(
    gateway: Gateway, admin: Admin
) -> None:
    await admin.RegisterInstance(
        admin_pb2.RegisterInstanceRequest(
            instance_id="gpu-0", block_size=16, max_model_len=4096, num_gpu_blocks=64
        )
    )
    await admin.CreateTenant(
        admin_pb2.CreateTenantRequest(tenant_id="acme", tenant=pb.Tenant(quota=quota()))
    )
    admitted = await gateway.Admit(admit("victim", 63, 1))
    name = admitted.reservation.name
    seen: list[tuple[int, int]] = []

    async def watch() -> grpc.StatusCode:
        stream = gateway.WatchReservation(admission_pb2.WatchReservationRequest(name=name))
        try:
            async for update in stream:
                seen.append((update.state, update.end_reason))
        except grpc.aio.AioRpcError as error:
            return error.code()
        return grpc.StatusCode.OK

    watcher = asyncio.create_task(watch())
    job = await admin.CreateReclaimJob(
        reclaim("evict", target_blocks=4, max_tier=pb.RECLAIM_TIER_EVICT)
    )
    assert [(s.tier, s.expected_blocks) for s in job.steps] == [(pb.RECLAIM_TIER_EVICT, 4)]
    assert await asyncio.wait_for(watcher, 10) == grpc.StatusCode.ABORTED
    assert seen == [
        (pb.RESERVATION_STATE_ADMITTED, pb.END_REASON_UNSPECIFIED),
        (pb.RESERVATION_STATE_ENDED, pb.END_REASON_PREEMPTED),
    ]
    renewed = await refused(gateway.RenewLease(admission_pb2.RenewLeaseRequest(name=name)))
    assert (renewed.code, renewed.reason) == (grpc.StatusCode.ABORTED, "PREEMPTED")
    done = await finished(admin, job.name)
    assert (done.state, done.actual_blocks) == (pb.RECLAIM_JOB_STATE_SUCCEEDED, 4)
