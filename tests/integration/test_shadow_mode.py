"""Shadow mode over gRPC: a tenant being tried out is admitted where its own quota would refuse
it, and the reservation and usage say what would have refused it; what the instance cannot
hold is refused all the same."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf.field_mask_pb2 import FieldMask
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from kvquota.v1 import admin_pb2, admin_pb2_grpc, admission_pb2_grpc
from kvquota.v1 import resources_pb2 as pb
from tests.integration.grpc_helpers import admit, quota, refused


@pytest.fixture
async def trial(admin: admin_pb2_grpc.AdminServiceAsyncStub) -> None:
    """gpu-0 (64 blocks of 16 tokens) and tenant trial, quota 8 blocks, then in shadow mode."""
    await admin.RegisterInstance(
        admin_pb2.RegisterInstanceRequest(
            instance_id="gpu-0", model="m", block_size=16, max_model_len=8192, num_gpu_blocks=64
        )
    )
    await admin.CreateTenant(
        admin_pb2.CreateTenantRequest(
            tenant_id="trial", tenant=pb.Tenant(quota=quota(max_blocks=8))
        )
    )
    updated = await admin.UpdateTenant(
        admin_pb2.UpdateTenantRequest(
            tenant=pb.Tenant(name="tenants/trial", shadow_mode=True),
            update_mask=FieldMask(paths=["shadow_mode"]),
        )
    )
    assert updated.shadow_mode


@pytest.mark.usefixtures("trial")
async def test_shadow_mode_admits_over_quota_and_reports_it(
    gateway: admission_pb2_grpc.AdmissionServiceAsyncStub,
    admin: admin_pb2_grpc.AdminServiceAsyncStub,
    engine: AsyncEngine,
) -> None:
    within = await gateway.Admit(admit("a", 100, 28, tenant="trial"))  # 8 blocks: the quota
    assert within.reservation.shadow_refusal == ""
    over = await gateway.Admit(admit("b", 100, 28, tenant="trial"))
    assert over.reservation.state == pb.RESERVATION_STATE_ADMITTED
    assert over.reservation.shadow_refusal == "TENANT_QUOTA_EXCEEDED"
    tenant = await admin.GetTenant(admin_pb2.GetTenantRequest(name="tenants/trial"))
    assert tenant.usage.blocks_in_use == 16  # over its quota of 8, as shadow mode allows

    # The instance's own limits still refuse: 48 blocks are left.
    full = await refused(gateway.Admit(admit("c", 1000, 24, tenant="trial")))
    assert (full.code, full.reason) == (grpc.StatusCode.UNAVAILABLE, "INSTANCE_OVERLOADED")
    never = await refused(gateway.Admit(admit("d", 1100, 24, tenant="trial")))
    assert never.reason == "REQUEST_EXCEEDS_CAPACITY"

    async with engine.connect() as conn:
        events = await conn.execute(
            text(
                "SELECT admitted, shadow_refused, refused FROM usage_events "
                "WHERE tenant = 'trial' AND (admitted > 0 OR refused <> '{}') ORDER BY id"
            )
        )
        assert [tuple(row) for row in events] == [
            (1, {}, {}),
            (1, {"TENANT_QUOTA_EXCEEDED": 1}, {}),
            (0, {}, {"INSTANCE_OVERLOADED": 1}),
            (0, {}, {"REQUEST_EXCEEDS_CAPACITY": 1}),
        ]
