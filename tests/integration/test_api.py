"""The gRPC contract: what a gateway and an operator see, error table included."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration
from google.protobuf.field_mask_pb2 import FieldMask
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2
from sqlalchemy.ext.asyncio import AsyncEngine

from kvquota.v1 import admin_pb2, admin_pb2_grpc, admission_pb2, admission_pb2_grpc
from kvquota.v1 import resources_pb2 as pb
from quota_service.config import Settings
from tests.conftest import SWEEP_SECONDS
from tests.integration.grpc_helpers import GIB, admit, quota, refused
from tests.integration.ledger_fixtures import snapshot


@pytest.fixture(scope="module")
def settings(settings: Settings) -> Settings:
    """The lease test waits for the in-process reaper: it sweeps every 0.2 s here."""
    return replace(settings, reaper_interval_seconds=SWEEP_SECONDS)


@pytest.fixture
async def fleet(admin: admin_pb2_grpc.AdminServiceAsyncStub) -> None:
    """The reference instance (512 blocks of 16 tokens, context 8192) and tenant acme."""
    await admin.RegisterInstance(
        admin_pb2.RegisterInstanceRequest(
            instance_id="gpu-0", model="m", block_size=16, max_model_len=8192, num_gpu_blocks=512
        )
    )
    await admin.CreateTenant(
        admin_pb2.CreateTenantRequest(tenant_id="acme", tenant=pb.Tenant(quota=quota()))
    )


async def free_blocks(admin: admin_pb2_grpc.AdminServiceAsyncStub) -> int:
    instance = await admin.GetInstance(admin_pb2.GetInstanceRequest(name="instances/gpu-0"))
    return instance.free_blocks


async def test_health_and_reflection(channel: grpc.aio.Channel) -> None:
    check = channel.unary_unary(
        "/grpc.health.v1.Health/Check",
        request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
        response_deserializer=health_pb2.HealthCheckResponse.FromString,
    )
    for service in ("", "kvquota.v1.AdmissionService", "kvquota.v1.AdminService"):
        answer = await check(health_pb2.HealthCheckRequest(service=service))
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
    reflect = channel.stream_stream(
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
    )
    responses = reflect(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = set()
    async for response in responses:
        names |= {s.name for s in response.list_services_response.service}
    assert {"kvquota.v1.AdmissionService", "kvquota.v1.AdminService"} <= names


@pytest.mark.usefixtures("fleet")
async def test_reference_scenario_over_grpc(
    gateway: admission_pb2_grpc.AdmissionServiceAsyncStub,
    admin: admin_pb2_grpc.AdminServiceAsyncStub,
) -> None:
    a = await gateway.Admit(admit("a", 4096, 2048))
    assert a.reservation.reserved_blocks == 384
    assert a.reservation.name == "tenants/acme/reservations/a"
    assert a.reservation.state == pb.RESERVATION_STATE_ADMITTED
    assert len(a.cache_salt) >= 32
    assert await free_blocks(admin) == 128

    b_refused = await refused(gateway.Admit(admit("b", 2048, 1024)))
    assert (b_refused.code, b_refused.reason) == (
        grpc.StatusCode.UNAVAILABLE,
        "INSTANCE_OVERLOADED",
    )
    assert "RetryInfo" in b_refused.details

    c_refused = await refused(gateway.Admit(admit("c", 8000, 512)))
    assert c_refused.code == grpc.StatusCode.INVALID_ARGUMENT
    assert c_refused.reason == "CONTEXT_LENGTH_EXCEEDED"
    assert c_refused.metadata == {"maxModelLen": "8192", "requestedTokens": "8512"}

    await gateway.Release(admission_pb2.ReleaseRequest(name=a.reservation.name))
    assert await free_blocks(admin) == 512
    b = await gateway.Admit(admit("b", 2048, 1024))
    assert b.reservation.reserved_blocks == 192
    assert await free_blocks(admin) == 320
    again = await gateway.Admit(admit("b", 2048, 1024))
    assert again == b
    assert await free_blocks(admin) == 320
    for _ in range(2):
        await gateway.Release(admission_pb2.ReleaseRequest(name=b.reservation.name))
    assert await free_blocks(admin) == 512


@pytest.mark.usefixtures("fleet")
async def test_error_table(
    gateway: admission_pb2_grpc.AdmissionServiceAsyncStub,
    admin: admin_pb2_grpc.AdminServiceAsyncStub,
    engine: AsyncEngine,
) -> None:
    await admin.CreateTenant(
        admin_pb2.CreateTenantRequest(
            tenant_id="small", tenant=pb.Tenant(quota=quota(max_blocks=20, max_tokens=1000))
        )
    )
    await gateway.Admit(admit("held", 160, 16, tenant="small", lease_ttl=Duration(seconds=30)))
    await gateway.Admit(admit("big", 4096, 2048))
    before = await snapshot(engine)

    bad = await refused(gateway.Admit(admit("bad", 0, 10, n=-1)))
    assert (bad.code, bad.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST")
    violations = bad.details["BadRequest"]
    assert isinstance(violations, error_details_pb2.BadRequest)
    assert {v.field for v in violations.field_violations} == {"prompt_tokens", "n"}

    bad_name = await refused(gateway.Admit(admission_pb2.AdmitRequest(tenant="acme")))
    assert bad_name.reason == "INVALID_REQUEST"

    huge = await refused(gateway.Admit(admit("huge", 8000, 100, n=16)))
    assert (huge.code, huge.reason) == (
        grpc.StatusCode.FAILED_PRECONDITION,
        "REQUEST_EXCEEDS_CAPACITY",
    )

    over = await refused(gateway.Admit(admit("over", 160, 16, tenant="small")))
    assert (over.code, over.reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "TENANT_QUOTA_EXCEEDED")
    failure = over.details["QuotaFailure"]
    assert isinstance(failure, error_details_pb2.QuotaFailure)
    assert failure.violations[0].subject == "tenants/small"
    retry = over.details["RetryInfo"]
    assert isinstance(retry, error_details_pb2.RetryInfo)
    # Nothing released yet, so the estimate is the holder's lease expiry, about 30 s away.
    assert 25 < retry.retry_delay.ToTimedelta().total_seconds() <= 30

    busy = await refused(gateway.Admit(admit("busy", 2048, 1024)))
    assert (busy.code, busy.reason) == (grpc.StatusCode.UNAVAILABLE, "INSTANCE_OVERLOADED")
    assert busy.metadata["freeBlocks"] == "117"

    reused = await refused(gateway.Admit(admit("big", 4096, 2047)))
    assert (reused.code, reused.reason) == (grpc.StatusCode.ALREADY_EXISTS, "REQUEST_ID_REUSED")

    missing = await refused(gateway.Admit(admit("x", 10, 10, tenant="nobody")))
    assert (missing.code, missing.reason) == (grpc.StatusCode.NOT_FOUND, "TENANT_NOT_FOUND")

    no_reservation = await refused(
        gateway.GetReservation(
            admission_pb2.GetReservationRequest(name="tenants/acme/reservations/none")
        )
    )
    assert no_reservation.reason == "RESERVATION_NOT_FOUND"
    assert await snapshot(engine) == before

    await admin.SuspendTenant(admin_pb2.SuspendTenantRequest(name="tenants/small"))
    suspended = await refused(gateway.Admit(admit("s", 10, 10, tenant="small")))
    assert (suspended.code, suspended.reason) == (
        grpc.StatusCode.FAILED_PRECONDITION,
        "TENANT_SUSPENDED",
    )
    await admin.DrainInstance(admin_pb2.DrainInstanceRequest(name="instances/gpu-0"))
    draining = await refused(gateway.Admit(admit("d", 10, 10)))
    assert (draining.code, draining.reason) == (
        grpc.StatusCode.FAILED_PRECONDITION,
        "INSTANCE_DRAINING",
    )


@pytest.mark.usefixtures("fleet")
async def test_lease_expires_and_reaper_ends_it(
    gateway: admission_pb2_grpc.AdmissionServiceAsyncStub,
    admin: admin_pb2_grpc.AdminServiceAsyncStub,
) -> None:
    admitted = await gateway.Admit(admit("brief", 100, 100, lease_ttl=Duration(seconds=1)))
    name = admitted.reservation.name
    renewed = await gateway.RenewLease(admission_pb2.RenewLeaseRequest(name=name))
    assert (
        renewed.lease_expire_time.ToDatetime()
        >= admitted.reservation.lease_expire_time.ToDatetime()
    )
    for _ in range(50):  # the in-process reaper sweeps every 0.2 s
        await asyncio.sleep(0.1)
        current = await gateway.GetReservation(admission_pb2.GetReservationRequest(name=name))
        if current.state == pb.RESERVATION_STATE_ENDED:
            break
    assert current.end_reason == pb.END_REASON_LEASE_EXPIRED
    assert await free_blocks(admin) == 512
    expired = await refused(gateway.RenewLease(admission_pb2.RenewLeaseRequest(name=name)))
    assert (expired.code, expired.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "LEASE_EXPIRED")
    bad_ttl = await refused(
        gateway.RenewLease(
            admission_pb2.RenewLeaseRequest(name=name, lease_ttl=Duration(seconds=-5))
        )
    )
    assert bad_ttl.reason == "INVALID_REQUEST"


@pytest.mark.usefixtures("fleet")
async def test_cancel_and_release_report_what_ended(
    gateway: admission_pb2_grpc.AdmissionServiceAsyncStub,
) -> None:
    await gateway.Admit(admit("c", 100, 100))
    name = "tenants/acme/reservations/c"
    cancelled = await gateway.Cancel(admission_pb2.CancelRequest(name=name))
    assert cancelled.end_reason == pb.END_REASON_CANCELLED
    assert await gateway.Cancel(admission_pb2.CancelRequest(name=name)) == cancelled
    assert (
        await gateway.Release(admission_pb2.ReleaseRequest(name=name, output_tokens=9)) == cancelled
    )
    await gateway.Admit(admit("r", 100, 100, n=3))
    released = await gateway.Release(
        admission_pb2.ReleaseRequest(name="tenants/acme/reservations/r", output_tokens=77)
    )
    assert (released.output_tokens, released.n, released.reserved_tokens) == (77, 3, 600)
    assert released.end_time.seconds > 0
    negative = await refused(
        gateway.Release(
            admission_pb2.ReleaseRequest(name="tenants/acme/reservations/r", output_tokens=-1)
        )
    )
    assert negative.reason == "INVALID_REQUEST"


async def test_tenants_crud_and_pagination(admin: admin_pb2_grpc.AdminServiceAsyncStub) -> None:
    for i in range(5):
        created = await admin.CreateTenant(
            admin_pb2.CreateTenantRequest(
                tenant_id=f"t{i}", tenant=pb.Tenant(display_name=f"T {i}", quota=quota())
            )
        )
        assert created.name == f"tenants/t{i}"
        assert created.state == pb.TENANT_STATE_ACTIVE
        assert created.weight == 1
    duplicate = await refused(
        admin.CreateTenant(admin_pb2.CreateTenantRequest(tenant_id="t0", tenant=pb.Tenant()))
    )
    assert (duplicate.code, duplicate.reason) == (
        grpc.StatusCode.ALREADY_EXISTS,
        "TENANT_ALREADY_EXISTS",
    )
    bad_id = await refused(admin.CreateTenant(admin_pb2.CreateTenantRequest(tenant_id="Bad/Id")))
    assert bad_id.reason == "INVALID_REQUEST"

    seen: list[str] = []
    token = ""
    while True:
        page = await admin.ListTenants(admin_pb2.ListTenantsRequest(page_size=2, page_token=token))
        assert len(page.tenants) <= 2
        seen.extend(t.name for t in page.tenants)
        token = page.next_page_token
        if not token:
            break
    assert seen == [f"tenants/t{i}" for i in range(5)]
    bad_token = await refused(admin.ListTenants(admin_pb2.ListTenantsRequest(page_token="nope")))
    assert bad_token.reason == "INVALID_REQUEST"

    updated = await admin.UpdateTenant(
        admin_pb2.UpdateTenantRequest(
            tenant=pb.Tenant(name="tenants/t1", weight=3, quota=pb.TenantQuota(max_blocks=7)),
            update_mask=FieldMask(paths=["weight", "quota.max_blocks"]),
        )
    )
    assert (updated.weight, updated.quota.max_blocks) == (3, 7)
    assert updated.quota.max_tokens_in_flight == 10**9  # not in the mask, unchanged
    assert updated.display_name == "T 1"
    bad_mask = await refused(
        admin.UpdateTenant(
            admin_pb2.UpdateTenantRequest(
                tenant=pb.Tenant(name="tenants/t1"), update_mask=FieldMask(paths=["cache_salt"])
            )
        )
    )
    assert bad_mask.reason == "INVALID_REQUEST"
    negative = await refused(
        admin.UpdateTenant(
            admin_pb2.UpdateTenantRequest(
                tenant=pb.Tenant(name="tenants/t1", quota=pb.TenantQuota(max_blocks=-1)),
                update_mask=FieldMask(paths=["quota.max_blocks"]),
            )
        )
    )
    assert negative.reason == "INVALID_REQUEST"
    missing = await refused(
        admin.UpdateTenant(
            admin_pb2.UpdateTenantRequest(
                tenant=pb.Tenant(name="tenants/zz", weight=2),
                update_mask=FieldMask(paths=["weight"]),
            )
        )
    )
    assert missing.reason == "TENANT_NOT_FOUND"

    suspended = await admin.SuspendTenant(admin_pb2.SuspendTenantRequest(name="tenants/t2"))
    assert suspended.state == pb.TENANT_STATE_SUSPENDED
    resumed = await admin.ResumeTenant(admin_pb2.ResumeTenantRequest(name="tenants/t2"))
    assert resumed.state == pb.TENANT_STATE_ACTIVE


async def test_register_instances(admin: admin_pb2_grpc.AdminServiceAsyncStub) -> None:
    llama = pb.KvGeometry(num_layers=32, num_kv_heads=8, head_dim=128, dtype=pb.KV_DTYPE_BF16)
    from_budget = await admin.RegisterInstance(
        admin_pb2.RegisterInstanceRequest(
            instance_id="llama",
            model="meta-llama/Meta-Llama-3-8B",
            geometry=llama,
            block_size=16,
            max_model_len=8192,
            memory_budget=pb.MemoryBudget(
                total_bytes=24 * GIB,
                weights_bytes=16 * GIB,
                overhead_bytes=2 * GIB,
                gpu_memory_utilization=1.0,
            ),
        )
    )
    # 6 GiB at 128 KiB per token = 49152 tokens = 3072 blocks of 16.
    assert from_budget.capacity_blocks == 3072
    assert from_budget.bytes_per_block == 16 * 131072
    assert from_budget.geometry == llama
    assert from_budget.state == pb.INSTANCE_STATE_ACTIVE

    from_count = await admin.RegisterInstance(
        admin_pb2.RegisterInstanceRequest(
            instance_id="engine", block_size=32, max_model_len=512, num_gpu_blocks=64
        )
    )
    assert (from_count.capacity_blocks, from_count.bytes_per_block) == (64, 0)

    no_room = await refused(
        admin.RegisterInstance(
            admin_pb2.RegisterInstanceRequest(
                instance_id="tight",
                geometry=llama,
                block_size=16,
                max_model_len=8192,
                memory_budget=pb.MemoryBudget(total_bytes=16 * GIB, weights_bytes=16 * GIB),
            )
        )
    )
    assert no_room.reason == "INVALID_REQUEST"
    no_capacity = await refused(
        admin.RegisterInstance(
            admin_pb2.RegisterInstanceRequest(instance_id="x", block_size=16, max_model_len=10)
        )
    )
    assert no_capacity.reason == "INVALID_REQUEST"
    again = await refused(
        admin.RegisterInstance(
            admin_pb2.RegisterInstanceRequest(
                instance_id="engine", block_size=32, max_model_len=512, num_gpu_blocks=64
            )
        )
    )
    assert again.reason == "INSTANCE_ALREADY_EXISTS"

    listed = await admin.ListInstances(admin_pb2.ListInstancesRequest())
    assert [i.name for i in listed.instances] == ["instances/engine", "instances/llama"]
    assert listed.next_page_token == ""
    drained = await admin.DrainInstance(admin_pb2.DrainInstanceRequest(name="instances/engine"))
    assert drained.state == pb.INSTANCE_STATE_DRAINING
    unknown = await refused(admin.GetInstance(admin_pb2.GetInstanceRequest(name="instances/none")))
    assert (unknown.code, unknown.reason) == (grpc.StatusCode.NOT_FOUND, "INSTANCE_NOT_FOUND")
