"""Payloads that do not parse as their method's request, or whose text PostgreSQL could not
store (a NUL character): refused as INVALID_REQUEST.

A request deserializer that raises makes gRPC answer UNKNOWN, with the exception's class in the
message, and log a traceback at ERROR, for what is only a caller's mistake. So the deserializer
never raises: it hands a payload that does not parse on as an `UnparsedRequest`, and one with a
NUL in its text as a `NulRequest`, and this interceptor refuses those before anything reads them
(authentication included: nothing in them can be trusted). server.py lists it inside
MetricsInterceptor, so such calls are measured like others.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message

from quota_service.api.error_status import (
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


@dataclass(frozen=True, slots=True)
class NulRequest:
    """A request with text PostgreSQL could not store: its string fields that hold a NUL."""

    violations: list[FieldViolation]


def _refusal(method: str) -> Exception:
    return invalid_request(
        [FieldViolation(PAYLOAD_FIELD, f"not a valid protobuf request for {method}")]
    )


def nul_violations(message: Message, prefix: str = "") -> list[FieldViolation]:
    """The string fields, at any depth, that hold a NUL character: valid UTF-8 and valid
    protobuf, but text PostgreSQL cannot hold, so a filter or name with one would fail deep in
    the ledger as INTERNAL instead of being refused here."""
    found = []
    for field, value in message.ListFields():
        if field.type != field.TYPE_STRING and field.message_type is None:
            continue  # token ids and other numbers: nothing to look at, however many
        path = f"{prefix}{field.name}"
        values = value if field.is_repeated else [value]
        for index, item in enumerate(values):
            where = f"{path}[{index}]" if field.is_repeated else path
            if isinstance(item, str) and "\0" in item:
                found.append(FieldViolation(where, "must not contain a NUL character"))
            elif isinstance(item, Message):
                found += nul_violations(item, f"{where}.")
    return found


def _check(request: object, method: str) -> None:
    if isinstance(request, UnparsedRequest):
        raise _refusal(method)
    if isinstance(request, NulRequest):
        raise invalid_request(request.violations)


class PayloadInterceptor(WrappingInterceptor):
    def deserializer(self, parse: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
        if parse is None:
            return None
        strict = parse

        def tolerant(raw: bytes) -> Any:
            try:
                request = strict(raw)
            except DecodeError:
                return UnparsedRequest()
            # A NUL in a string field is a NUL byte in the payload (UTF-8 has no other encoding
            # of it), so nearly every request, without one, has none to look for. Other fields
            # hold NUL bytes too (a token id 0, an empty message): such a request is walked.
            if b"\0" in raw and isinstance(request, Message):
                violations = nul_violations(request)
                if violations:
                    return NulRequest(violations)
            return request

        return tolerant

    def unary(
        self, behavior: Behavior[Request, Response], method: str
    ) -> Behavior[Request, Response]:
        async def parsed(
            request: Request, context: grpc.aio.ServicerContext[Request, Response]
        ) -> Response:
            _check(request, method)
            return await behavior(request, context)

        return parsed

    def stream(
        self, behavior: StreamBehavior[Request, Response], method: str
    ) -> StreamBehavior[Request, Response]:
        async def parsed(
            request: Request, context: grpc.aio.ServicerContext[Request, Response]
        ) -> AsyncIterator[Response]:
            _check(request, method)
            async for item in responses(behavior, request, context):
                yield item

        return parsed
