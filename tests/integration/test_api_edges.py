"""The API at its edges: payloads that do not parse, values far too long, and the
answers a gateway can act on without reading messages."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterable, Awaitable, Callable

import grpc
import pytest
from google.protobuf.descriptor import MethodDescriptor
from google.protobuf.duration_pb2 import Duration
from google.protobuf.field_mask_pb2 import FieldMask
from google.protobuf.timestamp_pb2 import Timestamp
from google.rpc import error_details_pb2
from sqlalchemy.ext.asyncio import AsyncEngine

from kvquota.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    admission_pb2,
    admission_pb2_grpc,
    billing_pb2,
    billing_pb2_grpc,
)
from kvquota.v1 import resources_pb2 as pb
from quota_service.core import pagination
from tests.integration.grpc_helpers import GIB, RichError, admit, quota, refused, rich_error
from tests.integration.ledger_fixtures import snapshot

METHODS: list[MethodDescriptor] = [
    method
    for descriptor, name in (
        (admission_pb2.DESCRIPTOR, "AdmissionService"),
        (admin_pb2.DESCRIPTOR, "AdminService"),
        (billing_pb2.DESCRIPTOR, "BillingService"),
    )
    for method in descriptor.services_by_name[name].methods
]
# Each fails to parse as any request: a length running past the end, a field number 0 (never
# valid), bytes that are not UTF-8 in field 1 (a string in every request that has one).
UNPARSABLE = (b"\x0a\x05ab", b"\x00\x01", b"\x0a\x02\xff\xfe")


async def raw_call(channel: grpc.aio.Channel, method: MethodDescriptor, payload: bytes) -> None:
    path = f"/{method.containing_service.full_name}/{method.name}"
    if method.server_streaming:
        stream = channel.unary_stream(path, _as_is, _as_is)
        async for _ in stream(payload, timeout=5):
            pass
    else:
        await channel.unary_unary(path, _as_is, _as_is)(payload, timeout=5)


def _as_is(raw: bytes) -> bytes:
    return raw


async def test_a_payload_that_does_not_parse_is_invalid_and_logs_no_error(
    channel: grpc.aio.Channel, caplog: pytest.LogCaptureFixture
) -> None:
    for method in METHODS:
        fields = method.input_type.fields
        string_one = any(f.number == 1 and f.type == f.TYPE_STRING for f in fields)
        for payload in UNPARSABLE if string_one else UNPARSABLE[:2]:
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await raw_call(channel, method, payload)
            rich = rich_error(error.value)
            assert (rich.code, rich.reason) == (
                grpc.StatusCode.INVALID_ARGUMENT,
                "INVALID_REQUEST",
            ), method.name
            bad = rich.details["BadRequest"]
            assert isinstance(bad, error_details_pb2.BadRequest)
            assert [v.field for v in bad.field_violations] == ["payload"]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.fixture
async def fleet(admin: admin_pb2_grpc.AdminServiceAsyncStub) -> None:
    """Instance gpu-0 (512 blocks of 16 tokens, context 8192) and tenant acme."""
    await admin.RegisterInstance(
        admin_pb2.RegisterInstanceRequest(
            instance_id="gpu-0", model="m", block_size=16, max_model_len=8192, num_gpu_blocks=512
        )
    )
    await admin.CreateTenant(
        admin_pb2.CreateTenantRequest(tenant_id="acme", tenant=pb.Tenant(quota=quota()))
    )


def violations(error: RichError) -> dict[str, str]:
    bad = error.details["BadRequest"]
    assert isinstance(bad, error_details_pb2.BadRequest)
    return {v.field: v.description for v in bad.field_violations}


LONG = "x" * 5000


async def test_a_very_long_value_is_invalid_and_never_echoed_whole(
    channel: grpc.aio.Channel,
    admin: admin_pb2_grpc.AdminServiceAsyncStub,
    gateway: admission_pb2_grpc.AdmissionServiceAsyncStub,
    fleet: None,
) -> None:
    calls: list[Awaitable[object]] = [
        gateway.Admit(admit(LONG, 16, 16)),
        gateway.Admit(admit("r", 16, 16, tenant=LONG)),
        gateway.GetReservation(admission_pb2.GetReservationRequest(name=f"tenants/acme/{LONG}")),
        gateway.Release(admission_pb2.ReleaseRequest(name=f"tenants/{LONG}/reservations/r")),
        admin.GetTenant(admin_pb2.GetTenantRequest(name=f"tenants/{LONG}")),
        admin.CreateTenant(admin_pb2.CreateTenantRequest(tenant_id=LONG)),
        admin.GetInstance(admin_pb2.GetInstanceRequest(name=LONG)),
        admin.PinPrefix(admin_pb2.PinPrefixRequest(parent=LONG, pin_id=LONG, instance=LONG)),
        admin.RevokeApiKey(admin_pb2.RevokeApiKeyRequest(name=LONG)),
        admin.ListAuditEvents(admin_pb2.ListAuditEventsRequest(principal=LONG)),
        admin.ListTenants(admin_pb2.ListTenantsRequest(page_token=LONG)),
        admin.CreateApiKey(
            admin_pb2.CreateApiKeyRequest(
                display_name="gw", role=pb.ROLE_GATEWAY, tenants=[LONG] * 150
            )
        ),
    ]
    for call in calls:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await call
        rich = rich_error(error.value)
        assert (rich.code, rich.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST")
        trailers = sum(len(k) + len(v) for k, v in error.value.trailing_metadata() or ())
        assert trailers < 4096, error.value.details()
        assert LONG[:100] not in (error.value.details() or "")


async def test_register_instance_refuses_impossible_geometry_all_at_once(
    admin: admin_pb2_grpc.AdminServiceAsyncStub,
) -> None:
    """The issue's case: a block size of 2^31 - 1 with a context cap of 100, and an unknown hash
    algorithm, were stored (the algorithm as the default)."""
    error = await refused(
        admin.RegisterInstance(
            admin_pb2.RegisterInstanceRequest(
                instance_id="gpu-1",
                block_size=2**31 - 1,
                max_model_len=100,
                num_gpu_blocks=0,
                hash_algo=99,  # type: ignore[arg-type]
            )
        )
    )
    assert error.reason == "INVALID_REQUEST"
    assert set(violations(error)) == {"block_size", "max_model_len", "num_gpu_blocks", "hash_algo"}
    for block_size, max_model_len in ((24, 8192), (16, 8)):
        error = await refused(
            admin.RegisterInstance(
                admin_pb2.RegisterInstanceRequest(
                    instance_id="gpu-1",
                    block_size=block_size,
                    max_model_len=max_model_len,
                    num_gpu_blocks=8,
                )
            )
        )
        assert error.reason == "INVALID_REQUEST"
    broken_geometry = await refused(
        admin.RegisterInstance(
            admin_pb2.RegisterInstanceRequest(
                instance_id="-",
                geometry=pb.KvGeometry(num_layers=32, num_kv_heads=8, head_dim=128, dtype=77),  # type: ignore[arg-type]
                block_size=16,
                max_model_len=8192,
                memory_budget=pb.MemoryBudget(total_bytes=GIB),
                target_ttft=Duration(seconds=1, nanos=-1),
            )
        )
    )
    assert set(violations(broken_geometry)) == {"instance_id", "geometry.dtype", "target_ttft"}
    listed = await admin.ListInstances(admin_pb2.ListInstancesRequest())
    assert list(listed.instances) == []


async def test_list_blocks_refuses_a_state_it_does_not_know(
    admin: admin_pb2_grpc.AdminServiceAsyncStub, fleet: None
) -> None:
    request = admin_pb2.ListBlocksRequest(parent="instances/gpu-0", state=9)  # type: ignore[arg-type]
    error = await refused(admin.ListBlocks(request))
    assert set(violations(error)) == {"state"}
    free = admin_pb2.ListBlocksRequest(parent="instances/gpu-0", state=pb.BLOCK_STATE_FREE)
    assert len((await admin.ListBlocks(free)).blocks) == 100


async def test_a_negative_reclaim_target_gets_one_clear_violation(
    admin: admin_pb2_grpc.AdminServiceAsyncStub, fleet: None
) -> None:
    error = await refused(
        admin.CreateReclaimJob(
            admin_pb2.CreateReclaimJobRequest(
                instance="instances/gpu-0",
                target_blocks=-5,
                max_tier=pb.RECLAIM_TIER_FREE,
                request_id="r1",
            )
        )
    )
    assert violations(error) == {"target_blocks": "must not be negative"}


async def test_what_a_gateway_sees_of_ended_reservations_and_stale_handles(
    admin: admin_pb2_grpc.AdminServiceAsyncStub,
    gateway: admission_pb2_grpc.AdmissionServiceAsyncStub,
    fleet: None,
) -> None:
    """The issue's cases: each answered with a code and reason a gateway acts on, never an OK
    for something that did not happen."""
    first = (await gateway.Admit(admit("a", 32, 32))).reservation  # 4 blocks, none hashed
    name = first.name
    shrunk = await gateway.ReleaseBlocks(
        admission_pb2.ReleaseBlocksRequest(name=name, handles=[first.block_table[3]])
    )
    assert shrunk.reserved_blocks == 3 == len(shrunk.block_table)
    # Its own handle to a block freed since (and reused by another request): stale.
    await gateway.Admit(admit("b", 32, 32))
    for handle in (first.block_table[3], pb.BlockHandle(block_id=0, generation=99)):
        before = await admin.GetInstance(admin_pb2.GetInstanceRequest(name="instances/gpu-0"))
        stale = await refused(
            gateway.ReleaseBlocks(admission_pb2.ReleaseBlocksRequest(name=name, handles=[handle]))
        )
        assert (stale.code, stale.reason) == (
            grpc.StatusCode.FAILED_PRECONDITION,
            "STALE_BLOCK_HANDLE",
        )
        assert stale.metadata["staleHandleCount"] == "1"
        after = await admin.GetInstance(admin_pb2.GetInstanceRequest(name="instances/gpu-0"))
        assert after.blocks_in_use == before.blocks_in_use
    await gateway.Release(admission_pb2.ReleaseRequest(name=name, output_tokens=5))
    # Release and Cancel repeated: idempotent, OK.
    await gateway.Release(admission_pb2.ReleaseRequest(name=name, output_tokens=5))
    await gateway.Cancel(admission_pb2.CancelRequest(name=name))
    # Changing it, or admitting it again, is refused with how it ended.
    for call in (
        gateway.ReleaseBlocks(
            admission_pb2.ReleaseBlocksRequest(name=name, handles=[first.block_table[0]])
        ),
        gateway.SuspendReservation(admission_pb2.SuspendReservationRequest(name=name)),
        gateway.Admit(admit("a", 32, 32)),
    ):
        ended = await refused(call)
        assert (ended.code, ended.reason) == (
            grpc.StatusCode.FAILED_PRECONDITION,
            "RESERVATION_ENDED",
        )
        assert ended.metadata == {"name": name, "endReason": "RELEASED"}


async def test_text_with_a_nul_character_is_invalid(
    admin: admin_pb2_grpc.AdminServiceAsyncStub, fleet: None
) -> None:
    """Valid protobuf, but text PostgreSQL cannot hold: refused, not INTERNAL (found by the
    fuzz test, in ListAuditEvents' method filter)."""
    for call, field in (
        (admin.ListAuditEvents(admin_pb2.ListAuditEventsRequest(method="tenants/\0")), "method"),
        (
            admin.CreateTenant(
                admin_pb2.CreateTenantRequest(
                    tenant_id="globex", tenant=pb.Tenant(display_name="G\0", quota=quota())
                )
            ),
            "tenant.display_name",
        ),
    ):
        error = await refused(call)
        assert violations(error) == {field: "must not contain a NUL character"}


def _faulty_requests(
    admin: admin_pb2_grpc.AdminServiceAsyncStub,
    gateway: admission_pb2_grpc.AdmissionServiceAsyncStub,
    billing: billing_pb2_grpc.BillingServiceAsyncStub,
) -> list[tuple[str, Callable[[], Awaitable[object] | AsyncIterable[object]], set[str]]]:
    """Requests with faults that were once found in different places (name parsing, wire
    conversion, the domain's checks, the store), each with every field it must be told of."""
    bad_reservation = "tenants/acme/reservation/r"
    not_a_duration = Duration(seconds=1, nanos=-1)
    half_past = Timestamp(seconds=1_800)
    return [
        (
            "Admit",
            lambda: gateway.Admit(
                admission_pb2.AdmitRequest(
                    tenant="acme",
                    request_id="r",
                    instance="instances/gpu-0",
                    prompt_tokens=0,
                    max_output_tokens=16,
                    wait_timeout=Duration(seconds=-1),
                    lease_ttl=not_a_duration,
                )
            ),
            {"tenant", "prompt_tokens", "wait_timeout", "lease_ttl"},
        ),
        (
            "Admit by engine address",
            lambda: gateway.Admit(
                admission_pb2.AdmitRequest(
                    tenant="tenants/acme",
                    request_id="r",
                    engine_address="gpu-0",
                    prompt_tokens=16,
                    max_output_tokens=0,
                    n=1000,
                )
            ),
            {"engine_address", "max_output_tokens", "n"},
        ),
        (
            "RenewLease",
            lambda: gateway.RenewLease(
                admission_pb2.RenewLeaseRequest(
                    name=bad_reservation, lease_ttl=Duration(seconds=10**9)
                )
            ),
            {"name", "lease_ttl"},
        ),
        (
            "Release",
            lambda: gateway.Release(
                admission_pb2.ReleaseRequest(name=bad_reservation, output_tokens=-1)
            ),
            {"name", "output_tokens"},
        ),
        (
            "SuspendReservation",
            lambda: gateway.SuspendReservation(
                admission_pb2.SuspendReservationRequest(
                    name=bad_reservation, session_token_ids=[1, -1]
                )
            ),
            {"name", "session_token_ids"},
        ),
        (
            "ResumeReservation",
            lambda: gateway.ResumeReservation(
                admission_pb2.ResumeReservationRequest(
                    name=bad_reservation, wait_timeout=Duration(seconds=-1)
                )
            ),
            {"name", "wait_timeout"},
        ),
        (
            "ReleaseBlocks",
            lambda: gateway.ReleaseBlocks(admission_pb2.ReleaseBlocksRequest(name=bad_reservation)),
            {"name", "handles"},
        ),
        (
            "UpdateTenant",
            lambda: admin.UpdateTenant(
                admin_pb2.UpdateTenantRequest(
                    tenant=pb.Tenant(name="acme", weight=0),
                    update_mask=FieldMask(paths=["weight", "colour"]),
                )
            ),
            {"tenant.name", "update_mask", "tenant.weight"},
        ),
        (
            "PinPrefix",
            lambda: admin.PinPrefix(
                admin_pb2.PinPrefixRequest(
                    parent="teams/acme", pin_id="p", instance="instances/gpu-0", token_ids=[-1]
                )
            ),
            {"parent", "token_ids"},
        ),
        (
            "ListPins",
            lambda: admin.ListPins(admin_pb2.ListPinsRequest(parent="teams/acme", page_size=-1)),
            {"parent", "page_size"},
        ),
        (
            "ListTenants",
            lambda: admin.ListTenants(
                admin_pb2.ListTenantsRequest(page_size=-1, page_token="nope")
            ),
            {"page_size", "page_token"},
        ),
        (
            "ListBlocks",
            lambda: admin.ListBlocks(
                admin_pb2.ListBlocksRequest(
                    parent="gpu-0",
                    tenant="acme",
                    page_token=pagination.next_token(["x"], 1),
                    state=9,  # type: ignore[arg-type]
                )
            ),
            {"parent", "tenant", "page_token", "state"},
        ),
        (
            "CreateReclaimJob",
            lambda: admin.CreateReclaimJob(
                admin_pb2.CreateReclaimJobRequest(
                    instance="gpu-0",
                    tenant="acme",
                    target_blocks=-5,
                    max_tier=pb.RECLAIM_TIER_FREE,
                    min_tier=pb.RECLAIM_TIER_EVICT,
                    request_id="r/1",
                )
            ),
            {"instance", "tenant", "target_blocks", "min_tier", "request_id"},
        ),
        (
            "ListReclaimJobs",
            lambda: admin.ListReclaimJobs(
                admin_pb2.ListReclaimJobsRequest(instance="gpu-0", page_token="nope")
            ),
            {"instance", "page_token"},
        ),
        (
            "ListAuditEvents",
            lambda: admin.ListAuditEvents(
                admin_pb2.ListAuditEventsRequest(
                    principal=LONG, page_token=pagination.next_token(["x"], 1)
                )
            ),
            {"principal", "page_token"},
        ),
        (
            "ExportUsage",
            lambda: billing.ExportUsage(
                billing_pb2.ExportUsageRequest(
                    start_time=Timestamp(seconds=-(2**62)),
                    end_time=half_past,
                    tenant="acme",
                    instance="gpu-0",
                )
            ),
            {"start_time", "end_time", "tenant", "instance"},
        ),
        (
            "GetUsageSummary",
            lambda: billing.GetUsageSummary(
                billing_pb2.GetUsageSummaryRequest(
                    start_time=half_past, end_time=Timestamp(), tenant="acme"
                )
            ),
            {"start_time", "end_time", "tenant"},
        ),
    ]


async def test_a_request_with_several_faults_is_told_all_of_them_at_once(
    channel: grpc.aio.Channel,
    admin: admin_pb2_grpc.AdminServiceAsyncStub,
    gateway: admission_pb2_grpc.AdmissionServiceAsyncStub,
    fleet: None,
    engine: AsyncEngine,
) -> None:
    billing = billing_pb2_grpc.BillingServiceStub(channel)
    for method, send, fields in _faulty_requests(admin, gateway, billing):
        before = await snapshot(engine)
        call = send()
        if isinstance(call, AsyncIterable):  # a server stream: refused before its first record
            error = await refused(anext(aiter(call)))
        else:
            error = await refused(call)
        assert (error.code, error.reason) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_REQUEST",
        ), method
        assert set(violations(error)) == fields, method
        assert await snapshot(engine) == before, method
