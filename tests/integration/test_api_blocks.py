"""The gRPC contract for block tables, pins, namespaces, salts, inspection and offboarding."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc
import pytest
from google.protobuf.field_mask_pb2 import FieldMask

from kvquota.v1 import admin_pb2, admission_pb2
from kvquota.v1 import resources_pb2 as pb
from tests.integration.grpc_helpers import admit, quota, refused

if TYPE_CHECKING:  # the async stubs exist only in the type stubs
    from kvquota.v1.admin_pb2_grpc import AdminServiceAsyncStub as Admin
    from kvquota.v1.admission_pb2_grpc import AdmissionServiceAsyncStub as Gateway
SYSTEM = list(range(100, 164))  # 4 blocks of 16


@pytest.fixture
async def fleet(admin: Admin) -> None:
    await admin.RegisterInstance(
        admin_pb2.RegisterInstanceRequest(
            instance_id="gpu-0", block_size=16, max_model_len=4096, num_gpu_blocks=64
        )
    )
    for tenant in ("acme", "globex"):
        await admin.CreateTenant(
            admin_pb2.CreateTenantRequest(tenant_id=tenant, tenant=pb.Tenant(quota=quota()))
        )


def with_ids(request_id: str, ids: list[int], tenant: str = "acme") -> admission_pb2.AdmitRequest:
    return admit(request_id, len(ids), 8, tenant=tenant, prompt_token_ids=ids)


@pytest.mark.usefixtures("fleet")
async def test_block_tables_and_release_blocks(gateway: Gateway, admin: Admin) -> None:
    first = await gateway.Admit(with_ids("a", [*SYSTEM, 1, 2]))
    assert [h.block_id for h in first.reservation.block_table] == [0, 1, 2, 3, 4]
    second = await gateway.Admit(with_ids("b", [*SYSTEM, 3]))
    assert second.reservation.prefix_hit_blocks == 4
    assert list(second.reservation.block_table)[:4] == list(first.reservation.block_table)[:4]

    tail = first.reservation.block_table[4]
    name = first.reservation.name
    after = await gateway.ReleaseBlocks(
        admission_pb2.ReleaseBlocksRequest(name=name, handles=[tail])
    )
    assert len(after.block_table) == 4
    stale = pb.BlockHandle(block_id=0, generation=5)
    error = await refused(
        gateway.ReleaseBlocks(admission_pb2.ReleaseBlocksRequest(name=name, handles=[stale]))
    )
    assert (error.code, error.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "STALE_BLOCK_HANDLE")
    assert error.metadata["staleHandles"] == "0@5"
    empty = await refused(gateway.ReleaseBlocks(admission_pb2.ReleaseBlocksRequest(name=name)))
    assert empty.reason == "INVALID_REQUEST"
    got = await gateway.GetReservation(admission_pb2.GetReservationRequest(name=name))
    assert list(got.block_table) == list(after.block_table)


@pytest.mark.usefixtures("fleet")
async def test_pins_namespaces_and_salts(gateway: Gateway, admin: Admin) -> None:
    pin = await admin.PinPrefix(
        admin_pb2.PinPrefixRequest(
            parent="tenants/acme", pin_id="system", instance="instances/gpu-0", token_ids=SYSTEM
        )
    )
    assert (pin.name, pin.pinned_blocks, pin.state) == (
        "tenants/acme/pins/system",
        4,
        pb.PIN_STATE_ACTIVE,
    )
    listed = await admin.ListPins(admin_pb2.ListPinsRequest(parent="tenants/acme"))
    assert [p.name for p in listed.pins] == [pin.name]
    short = await refused(
        admin.PinPrefix(
            admin_pb2.PinPrefixRequest(
                parent="tenants/acme", pin_id="x", instance="instances/gpu-0", token_ids=[1]
            )
        )
    )
    assert short.reason == "INVALID_REQUEST"
    bad_parent = await refused(
        admin.PinPrefix(admin_pb2.PinPrefixRequest(parent="users/x", pin_id="x"))
    )
    assert bad_parent.reason == "INVALID_REQUEST"
    nowhere = await refused(
        admin.PinPrefix(
            admin_pb2.PinPrefixRequest(
                parent="tenants/acme", pin_id="x", instance="instances/none", token_ids=SYSTEM
            )
        )
    )
    assert nowhere.reason == "INSTANCE_NOT_FOUND"
    unpinned = await admin.UnpinPrefix(admin_pb2.UnpinPrefixRequest(name=pin.name))
    assert unpinned.state == pb.PIN_STATE_REMOVED

    namespace = await admin.CreateNamespace(admin_pb2.CreateNamespaceRequest(namespace_id="public"))
    assert namespace.name == "namespaces/public"
    assert [
        n.name for n in (await admin.ListNamespaces(admin_pb2.ListNamespacesRequest())).namespaces
    ] == [namespace.name]
    join = admin_pb2.UpdateTenantRequest(
        tenant=pb.Tenant(name="tenants/acme", shared_namespace="namespaces/public"),
        update_mask=FieldMask(paths=["shared_namespace"]),
    )
    assert (await admin.UpdateTenant(join)).shared_namespace == "namespaces/public"
    join.tenant.name = "tenants/globex"
    await admin.UpdateTenant(join)
    unknown = admin_pb2.UpdateTenantRequest(
        tenant=pb.Tenant(name="tenants/acme", shared_namespace="namespaces/none"),
        update_mask=FieldMask(paths=["shared_namespace"]),
    )
    assert (await refused(admin.UpdateTenant(unknown))).reason == "NAMESPACE_NOT_FOUND"

    a = await gateway.Admit(with_ids("a", SYSTEM))
    g = await gateway.Admit(with_ids("g", SYSTEM, tenant="globex"))
    # The same salt shares the prefix; like vLLM, the block holding the prompt's last token is
    # computed again (a hit covers at most prompt_tokens - 1 tokens).
    assert a.cache_salt == g.cache_salt and g.reservation.prefix_hit_blocks == 3
    await admin.RotateCacheSalt(admin_pb2.RotateCacheSaltRequest(name="namespaces/public"))
    rotated = await gateway.Admit(with_ids("a2", SYSTEM))
    assert rotated.cache_salt != a.cache_salt and rotated.reservation.prefix_hit_blocks == 0
    missing = await refused(
        admin.RotateCacheSalt(admin_pb2.RotateCacheSaltRequest(name="tenants/none"))
    )
    assert missing.reason == "TENANT_NOT_FOUND"


@pytest.mark.usefixtures("fleet")
async def test_inspection_and_offboarding(gateway: Gateway, admin: Admin) -> None:
    await gateway.Admit(with_ids("a", [*SYSTEM, 1]))
    await gateway.Admit(admit("private", 40, 8, tenant="globex"))
    page = await admin.ListBlocks(
        admin_pb2.ListBlocksRequest(parent="instances/gpu-0", page_size=3)
    )
    assert [b.name for b in page.blocks] == [f"instances/gpu-0/blocks/{i}" for i in range(3)]
    rest = await admin.ListBlocks(
        admin_pb2.ListBlocksRequest(
            parent="instances/gpu-0", page_size=100, page_token=page.next_page_token
        )
    )
    assert len(page.blocks) + len(rest.blocks) == 64
    in_use = await admin.ListBlocks(
        admin_pb2.ListBlocksRequest(
            parent="instances/gpu-0", tenant="tenants/acme", state=pb.BLOCK_STATE_IN_USE
        )
    )
    assert len(in_use.blocks) == 5
    assert all(b.block_hash != 0 for b in in_use.blocks[:4]) and in_use.blocks[4].block_hash == 0
    assert in_use.blocks[0].hash_scope == "tenants/acme"
    bad_token = await refused(
        admin.ListBlocks(admin_pb2.ListBlocksRequest(parent="instances/gpu-0", page_token="x"))
    )
    assert bad_token.reason == "INVALID_REQUEST"

    usage = await admin.GetTenantUsage(admin_pb2.GetTenantUsageRequest(name="tenants/acme"))
    assert usage.usage.blocks_in_use == 5
    assert [(u.instance, u.blocks_in_use, u.live_reservations) for u in usage.instances] == [
        ("instances/gpu-0", 5, 1)
    ]

    deleted = await admin.DeleteTenant(admin_pb2.DeleteTenantRequest(name="tenants/acme"))
    assert deleted.tenant.state == pb.TENANT_STATE_DELETED
    assert (deleted.report.freed_blocks, deleted.report.shared_blocks) == (5, 0)
    again = await admin.DeleteTenant(admin_pb2.DeleteTenantRequest(name="tenants/acme"))
    assert again.report == deleted.report
    refused_admit = await refused(gateway.Admit(admit("late", 10, 10)))
    assert refused_admit.reason == "TENANT_SUSPENDED"
    gone = await gateway.GetReservation(
        admission_pb2.GetReservationRequest(name="tenants/acme/reservations/a")
    )
    assert gone.end_reason == pb.END_REASON_TENANT_DELETED
    instance = await admin.GetInstance(admin_pb2.GetInstanceRequest(name="instances/gpu-0"))
    # globex's private request (40 + 8 tokens) keeps its 3 blocks.
    assert (instance.blocks_in_use, instance.free_blocks + instance.cached_blocks) == (3, 61)
