"""Admit names the engine by its address, as an endpoint picker gives it: vLLM's base URL or
host:port find the instance registered with that engine; an unknown address is refused."""

from __future__ import annotations

import grpc
import pytest

from kvquota.v1 import admin_pb2, admin_pb2_grpc, admission_pb2, admission_pb2_grpc
from kvquota.v1 import resources_pb2 as pb
from tests.integration.engine_stubs import closed_port
from tests.integration.grpc_helpers import quota, refused


@pytest.fixture
async def engine_port(admin: admin_pb2_grpc.AdminServiceAsyncStub) -> int:
    """gpu-0, registered with an engine URL (nothing listens there: Admit and Release never
    call the engine), and tenant acme."""
    port = closed_port()
    await admin.RegisterInstance(
        admin_pb2.RegisterInstanceRequest(
            instance_id="gpu-0",
            model="m",
            block_size=16,
            max_model_len=8192,
            num_gpu_blocks=64,
            engine=pb.EngineEndpoints(url=f"http://127.0.0.1:{port}/"),
        )
    )
    await admin.RegisterInstance(
        admin_pb2.RegisterInstanceRequest(
            instance_id="gpu-1", model="m", block_size=16, max_model_len=8192, num_gpu_blocks=64
        )
    )
    await admin.CreateTenant(
        admin_pb2.CreateTenantRequest(tenant_id="acme", tenant=pb.Tenant(quota=quota()))
    )
    return port


def by_address(request_id: str, address: str, instance: str = "") -> admission_pb2.AdmitRequest:
    return admission_pb2.AdmitRequest(
        tenant="tenants/acme",
        request_id=request_id,
        engine_address=address,
        instance=instance,
        prompt_tokens=32,
        max_output_tokens=16,
    )


async def test_admit_by_base_url_and_by_host_port(
    gateway: admission_pb2_grpc.AdmissionServiceAsyncStub, engine_port: int
) -> None:
    by_url = await gateway.Admit(by_address("by-url", f"http://127.0.0.1:{engine_port}"))
    assert by_url.reservation.instance == "instances/gpu-0"
    assert by_url.reservation.reserved_blocks == 3
    by_host_port = await gateway.Admit(by_address("by-host-port", f"127.0.0.1:{engine_port}"))
    assert by_host_port.reservation.instance == "instances/gpu-0"
    # A retry may name the engine either way: it is the same request.
    named = admission_pb2.AdmitRequest(
        tenant="tenants/acme",
        request_id="by-url",
        instance="instances/gpu-0",
        prompt_tokens=32,
        max_output_tokens=16,
    )
    assert await gateway.Admit(named) == by_url


async def test_unknown_or_malformed_addresses_are_refused(
    gateway: admission_pb2_grpc.AdmissionServiceAsyncStub, engine_port: int
) -> None:
    unknown = await refused(gateway.Admit(by_address("u", f"127.0.0.1:{engine_port + 1}")))
    assert (unknown.code, unknown.reason) == (grpc.StatusCode.NOT_FOUND, "INSTANCE_NOT_FOUND")
    assert unknown.metadata == {"engineAddress": f"127.0.0.1:{engine_port + 1}"}
    malformed = await refused(gateway.Admit(by_address("m", "gpu-0")))
    assert (malformed.code, malformed.reason) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_REQUEST",
    )
    both = await refused(
        gateway.Admit(by_address("b", f"127.0.0.1:{engine_port}", instance="instances/gpu-0"))
    )
    assert both.reason == "INVALID_REQUEST"
