"""What the request deserializer hands on: the request, or a payload to refuse before anything
reads it."""

from __future__ import annotations

from typing import Any

from google.protobuf.duration_pb2 import Duration
from google.protobuf.message import Message

from kvquota.v1 import admin_pb2, admission_pb2
from kvquota.v1 import resources_pb2 as pb
from quota_service.api.payload import NulRequest, PayloadInterceptor
from quota_service.core.errors import FieldViolation


def read(request: Message) -> Any:
    parse = PayloadInterceptor().deserializer(type(request).FromString)
    assert parse is not None
    return parse(request.SerializeToString())


def test_a_nul_in_text_is_found_at_any_depth() -> None:
    request = admin_pb2.CreateTenantRequest(tenant_id="g\0", tenant=pb.Tenant(display_name="G\0"))
    assert read(request) == NulRequest(
        [
            FieldViolation("tenant_id", "must not contain a NUL character"),
            FieldViolation("tenant.display_name", "must not contain a NUL character"),
        ]
    )


def test_nul_bytes_that_are_not_text_are_no_fault() -> None:
    # Token ids 0 and an empty message are NUL bytes in the payload.
    request = admission_pb2.AdmitRequest(
        tenant="tenants/acme", prompt_token_ids=[0, 7, 0], wait_timeout=Duration()
    )
    assert b"\0" in request.SerializeToString()
    assert read(request) == request
