"""Reading kvquota's rich errors the way a gateway does."""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc
from google.protobuf.message import Message
from google.rpc import error_details_pb2, status_pb2

STATUS_DETAILS_KEY = "grpc-status-details-bin"


@dataclass
class RichError:
    code: grpc.StatusCode
    reason: str
    domain: str
    metadata: dict[str, str]
    details: dict[str, Message] = field(default_factory=dict)


def rich_error(error: grpc.aio.AioRpcError) -> RichError:
    raw = dict(error.trailing_metadata() or ())[STATUS_DETAILS_KEY]
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
    return RichError(error.code(), info.reason, info.domain, dict(info.metadata), details)
