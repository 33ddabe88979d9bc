"""Reading kvquota's rich errors the way a gateway does."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from google.protobuf.message import Message
from google.rpc import error_details_pb2, status_pb2

from kvquota.v1 import admission_pb2, admission_pb2_grpc, error_reason_pb2
from kvquota.v1 import resources_pb2 as pb

STATUS_DETAILS_KEY = "grpc-status-details-bin"
RETRY_PUSHBACK_KEY = "grpc-retry-pushback-ms"


def free_port() -> int:
    """A loopback port free now, for a server that must be started on a known address."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


GIB = 1024**3


@dataclass
class RichError:
    code: grpc.StatusCode
    reason: str
    domain: str
    metadata: dict[str, str]
    details: dict[str, Message] = field(default_factory=dict)


def rich_error(error: grpc.aio.AioRpcError) -> RichError:
    trailers = dict(error.trailing_metadata() or ())
    raw = trailers[STATUS_DETAILS_KEY]
    status = status_pb2.Status.FromString(raw)
    assert status.code == error.code().value[0]
    details: dict[str, Message] = {}
    info = error_details_pb2.ErrorInfo()
    for packed in status.details:
        for kind in (
            error_details_pb2.ErrorInfo,
            error_details_pb2.BadRequest,
            error_details_pb2.QuotaFailure,
            error_details_pb2.RetryInfo,
        ):
            if packed.Is(kind.DESCRIPTOR):
                message = kind()
                packed.Unpack(message)
                details[kind.DESCRIPTOR.name] = message
                if isinstance(message, error_details_pb2.ErrorInfo):
                    info = message
    # Every refusal with a retry delay carries it twice: RetryInfo, and the pushback that gRPC's
    # own retry policy follows.
    retry = details.get("RetryInfo")
    pushback = trailers.get(RETRY_PUSHBACK_KEY)
    if isinstance(retry, error_details_pb2.RetryInfo):
        assert pushback == str(retry.retry_delay.ToMilliseconds())
    else:
        assert pushback is None
    check_vocabulary(error.code(), info)
    return RichError(error.code(), info.reason, info.domain, dict(info.metadata), details)


def check_vocabulary(code: grpc.StatusCode, info: error_details_pb2.ErrorInfo) -> None:
    """Every error is one kvquota.v1.ErrorReason documents: its code, and only its metadata."""
    value = error_reason_pb2.ErrorReason.DESCRIPTOR.values_by_name.get(info.reason)
    assert value is not None, f"{info.reason!r} is no ErrorReason"
    documented = value.GetOptions().Extensions[error_reason_pb2.error_mapping]
    assert code.value[0] == documented.code, info.reason
    assert set(info.metadata) <= set(documented.metadata_keys), info


async def refused(call: Awaitable[Any]) -> RichError:
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await call
    rich = rich_error(error.value)
    assert rich.domain == "kvquota"
    return rich


def quota(max_blocks: int = 10**6, max_tokens: int = 10**9) -> pb.TenantQuota:
    return pb.TenantQuota(
        max_blocks=max_blocks,
        max_tokens_in_flight=max_tokens,
        max_queued_requests=10,
        max_pinned_blocks=10,
        max_cpu_tier_bytes=GIB,
    )


def admit(
    request_id: str, prompt: int, output: int, tenant: str = "acme", **extra: Any
) -> admission_pb2.AdmitRequest:
    return admission_pb2.AdmitRequest(
        tenant=f"tenants/{tenant}",
        request_id=request_id,
        instance="instances/gpu-0",
        prompt_tokens=prompt,
        max_output_tokens=output,
        **extra,
    )


async def until_queued(
    gateway: admission_pb2_grpc.AdmissionServiceAsyncStub, name: str, seconds: float = 30
) -> None:
    """Wait until the reservation `name` is queued: an Admit with a wait budget, sent and not
    answered yet, has reached the server (the bound only stops a broken test)."""
    request = admission_pb2.GetReservationRequest(name=name)
    async with asyncio.timeout(seconds):
        while True:
            try:
                if (await gateway.GetReservation(request)).state == pb.RESERVATION_STATE_QUEUED:
                    return
            except grpc.aio.AioRpcError as error:  # its Admit has not arrived yet
                if error.code() != grpc.StatusCode.NOT_FOUND:
                    raise
            await asyncio.sleep(0.05)
