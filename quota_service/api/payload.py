"""Payloads that do not parse as their method's request: refused as INVALID_REQUEST.

A request deserializer that raises makes gRPC answer UNKNOWN, with the exception's class in the
message, and log a traceback at ERROR, for what is only a caller's mistake. So the deserializer
never raises: it hands a payload that does not parse on as an `UnparsedRequest`, and this
interceptor refuses that before anything reads it (authentication included: nothing in it can be
trusted). server.py lists it inside MetricsInterceptor, so such calls are measured like others.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from quota_service.api.errors import (
    Behavior,
    Request,
    Response,
    StreamBehavior,
    WrappingInterceptor,
    responses,
)
from quota_service.core.errors import FieldViolation, invalid_request

# The field a BadRequest names when the payload as a whole does not parse.
PAYLOAD_FIELD = "payload"


@dataclass(frozen=True, slots=True)
class UnparsedRequest:
    """A payload that is not a protobuf encoding of the method's request (truncated, corrupt,
    or a string field that is not UTF-8)."""


def _refusal(method: str) -> Exception:
    return invalid_request(
        [FieldViolation(PAYLOAD_FIELD, f"not a valid protobuf request for {method}")]
    )


class PayloadInterceptor(WrappingInterceptor):
    def deserializer(self, parse: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
        if parse is None:
            return None
        strict = parse

        def tolerant(raw: bytes) -> Any:
            try:
                return strict(raw)
            except DecodeError:
                return UnparsedRequest()

        return tolerant

    def unary(
        self, behavior: Behavior[Request, Response], method: str
    ) -> Behavior[Request, Response]:
        async def parsed(
            request: Request, context: grpc.aio.ServicerContext[Request, Response]
        ) -> Response:
            if isinstance(request, UnparsedRequest):
                raise _refusal(method)
            return await behavior(request, context)

        return parsed

    def stream(
        self, behavior: StreamBehavior[Request, Response], method: str
    ) -> StreamBehavior[Request, Response]:
        async def parsed(
            request: Request, context: grpc.aio.ServicerContext[Request, Response]
        ) -> AsyncIterator[Response]:
            if isinstance(request, UnparsedRequest):
                raise _refusal(method)
            async for item in responses(behavior, request, context):
                yield item

        return parsed
