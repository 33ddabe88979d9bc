"""The API at its edges (issue 20): payloads that do not parse, values far too long, and the
answers a gateway can act on without reading messages."""

from __future__ import annotations

import logging

import grpc
import pytest
from google.protobuf.descriptor import MethodDescriptor
from google.rpc import error_details_pb2

from kvquota.v1 import admin_pb2, admission_pb2, billing_pb2
from tests.integration.grpc_helpers import rich_error

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
