"""The error model on the wire: one interceptor turns domain errors into `google.rpc.Status`
with ErrorInfo and the details that fit (BadRequest, QuotaFailure, RetryInfo), so servicers hold
no try/except ladders. Anything unexpected becomes INTERNAL without leaking its text."""

from __future__ import annotations

import asyncio
import inspect
import logging
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextvars import ContextVar
from typing import Any, TypeVar

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2

from quota_service import logs
from quota_service.core.errors import Code, KvQuotaError, ServedElsewhere
from quota_service.core.reasons import Reason
from quota_service.store.database import unavailable_error

log = logging.getLogger(__name__)

DOMAIN = "kvquota"
STATUS_DETAILS_KEY = "grpc-status-details-bin"
# gRPC's own retry policy waits this long before its next attempt (gRFC A6), so a stock client
# follows the computed delay too.
RETRY_PUSHBACK_KEY = "grpc-retry-pushback-ms"
# The caller's request id, or one the server made, echoed back.
REQUEST_ID_KEY = "x-request-id"
# The code label of a call this replica forwarded to the one serving its instance.
FORWARDED = "FORWARDED"


def _pack(message: Any) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


def rich_status(error: KvQuotaError) -> tuple[grpc.StatusCode, status_pb2.Status]:
    code = grpc.StatusCode[error.code.value]
    details = [
        _pack(
            error_details_pb2.ErrorInfo(
                reason=error.reason, domain=DOMAIN, metadata=dict(error.metadata)
            )
        )
    ]
    if error.field_violations:
        details.append(
            _pack(
                error_details_pb2.BadRequest(
                    field_violations=[
                        error_details_pb2.BadRequest.FieldViolation(
                            field=v.field, description=v.description
                        )
                        for v in error.field_violations
                    ]
                )
            )
        )
    if error.quota_violations:
        details.append(
            _pack(
                error_details_pb2.QuotaFailure(
                    violations=[
                        error_details_pb2.QuotaFailure.Violation(
                            subject=v.subject, description=v.description
                        )
                        for v in error.quota_violations
                    ]
                )
            )
        )
    delay_ms = retry_delay_ms(error)
    if delay_ms is not None:
        info = error_details_pb2.RetryInfo()
        info.retry_delay.FromMilliseconds(delay_ms)
        details.append(_pack(info))
    status = status_pb2.Status(code=code.value[0], message=error.message, details=details)
    return code, status


def retry_delay_ms(error: KvQuotaError) -> int | None:
    """The retry delay in whole milliseconds (the pushback header's unit), so that RetryInfo and
    the header say exactly the same."""
    if error.retry_delay_seconds is None:
        return None
    return round(error.retry_delay_seconds * 1000)


def trailers(error: KvQuotaError, status: status_pb2.Status) -> tuple[tuple[str, str | bytes], ...]:
    """What a refusal's trailing metadata carries: the rich status, the pushback whenever it
    has a retry delay, and the call's request id once it has one (`echoed`)."""
    rich: tuple[tuple[str, str | bytes], ...] = ((STATUS_DETAILS_KEY, status.SerializeToString()),)
    delay_ms = retry_delay_ms(error)
    if delay_ms is not None:
        rich = (*rich, (RETRY_PUSHBACK_KEY, str(delay_ms)))
    return (*rich, *echoed())


def echoed() -> tuple[tuple[str, str], ...]:
    """The call's request id as its trailing metadata carries it back (none before the call
    was given one: a payload refused before it was read)."""
    rid = logs.request_id.get()
    return ((REQUEST_ID_KEY, rid),) if rid else ()


async def abort(context: grpc.aio.ServicerContext[Any, Any], error: KvQuotaError) -> None:
    """End the call with `error` as a rich status (raises, as context.abort does)."""
    code, status = rich_status(error)
    await context.abort(code, status.message, trailing_metadata=trailers(error, status))


def domain_error(exc: Exception, method: str) -> KvQuotaError:
    if isinstance(exc, KvQuotaError):
        return exc
    unavailable = unavailable_error(exc)
    if unavailable is not None:
        return unavailable
    log.exception("unexpected error in %s", method)
    return KvQuotaError(Reason.INTERNAL, "internal error")


def answered_with(
    exc: BaseException, context: grpc.aio.ServicerContext[Any, Any]
) -> tuple[str, str]:
    """The status code name and reason the call ends with because of `exc` (FORWARDED: it is
    answered by the replica it was forwarded to)."""
    if isinstance(exc, ServedElsewhere):
        return FORWARDED, ""
    if isinstance(exc, KvQuotaError):
        return exc.code.value, exc.reason
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        return Code.CANCELLED.value, ""
    if isinstance(exc, grpc.aio.AbortError):  # a servicer that aborted by itself (health)
        code = context.code()
        return (code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"), ""
    unavailable = unavailable_error(exc)
    if unavailable is not None:
        return unavailable.code.value, unavailable.reason
    return Code.INTERNAL.value, Reason.INTERNAL


# A call's metadata, as invocation_metadata() gives it.
Metadata = tuple[tuple[str, str | bytes], ...]

# The call being served and its metadata, once read (`call_metadata`).
_call_metadata: ContextVar[tuple[object, Metadata] | None] = ContextVar(
    "call_metadata", default=None
)


def call_metadata(context: grpc.aio.ServicerContext[Any, Any]) -> Metadata:
    """The call's metadata, read once a call: grpc builds it anew on every invocation_metadata()
    (~4 µs with a gateway's three keys), and more than one interceptor reads it. Kept with the
    call's context and given only for it: it carries the caller's credentials, which no other
    call may ever be served with (grpc runs each call in a task of its own, but this does not
    lean on it)."""
    read = _call_metadata.get()
    if read is not None and read[0] is context:
        return read[1]
    metadata = tuple(context.invocation_metadata() or ())
    _call_metadata.set((context, metadata))
    return metadata


def metadata_value(metadata: Sequence[tuple[str, str | bytes]], key: str) -> str | bytes | None:
    """The first value of `key` in a call's metadata (a plain loop: a generator expression
    costs about twice as much)."""
    for name, value in metadata:
        if name == key:
            return value
    return None


Request = TypeVar("Request")
Response = TypeVar("Response")
Behavior = Callable[[Request, grpc.aio.ServicerContext[Request, Response]], Awaitable[Response]]


def _guard(behavior: Behavior[Request, Response], method: str) -> Behavior[Request, Response]:
    async def guarded(
        request: Request, context: grpc.aio.ServicerContext[Request, Response]
    ) -> Response:
        try:
            return await behavior(request, context)
        except grpc.aio.AbortError:
            raise  # aborted already, with its status (a forwarded call's owner's)
        except Exception as exc:
            await abort(context, domain_error(exc, method))
            raise AssertionError("abort raises") from exc

    return guarded


StreamBehavior = Callable[
    [Request, grpc.aio.ServicerContext[Request, Response]], AsyncIterator[Response]
]


async def responses(
    behavior: StreamBehavior[Request, Response],
    request: Request,
    context: grpc.aio.ServicerContext[Request, Response],
) -> AsyncIterator[Response]:
    """What a server-streaming handler sends, however it is written: as an async generator
    (ours), or as a coroutine that calls context.write (grpc's health Watch), which an
    interceptor must await rather than iterate."""
    stream = behavior(request, context)
    if inspect.isawaitable(stream):
        await stream
        return
    async for item in stream:
        yield item


def _guard_stream(
    behavior: StreamBehavior[Request, Response], method: str
) -> StreamBehavior[Request, Response]:
    async def guarded(
        request: Request, context: grpc.aio.ServicerContext[Request, Response]
    ) -> AsyncIterator[Response]:
        try:
            async for item in responses(behavior, request, context):
                yield item
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await abort(context, domain_error(exc, method))

    return guarded


class WrappingInterceptor(ABC):
    """Wraps the behaviour of each unary-unary and server-streaming method it covers; the others
    (reflection's bidirectional stream) pass through as they are. Served through `Interceptors`,
    which composes them."""

    def covers(self, method: str) -> bool:
        return True

    def deserializer(self, parse: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
        """How the wrapped handler reads its request: as the handler it wraps does, unless an
        interceptor says otherwise (those outside it copy what it chose)."""
        return parse

    @abstractmethod
    def unary(
        self, behavior: Behavior[Request, Response], method: str
    ) -> Behavior[Request, Response]: ...

    @abstractmethod
    def stream(
        self, behavior: StreamBehavior[Request, Response], method: str
    ) -> StreamBehavior[Request, Response]: ...

    def wrap(
        self, handler: grpc.RpcMethodHandler[Request, Response], method: str
    ) -> grpc.RpcMethodHandler[Request, Response]:
        """The handler of a method as this interceptor answers it."""
        if not self.covers(method):
            return handler
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self.stream(handler.unary_stream, method),  # type: ignore[arg-type]
                request_deserializer=self.deserializer(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
        if handler.unary_unary is None:
            return handler
        return grpc.unary_unary_rpc_method_handler(
            self.unary(handler.unary_unary, method),  # type: ignore[arg-type]
            request_deserializer=self.deserializer(handler.request_deserializer),
            response_serializer=handler.response_serializer,
        )


class Interceptors(grpc.aio.ServerInterceptor):
    """Wrapping interceptors as one grpc interceptor, the first outermost. grpc asks each of a
    server's interceptors for every call's handler, each in a coroutine of its own and another
    of its own chaining (for five, 36,000 instructions an Admit+Release, 1% of the server's);
    asked once, this composes a method's handler once, for as long as the handler beneath is
    the same."""

    def __init__(self, wrapping: Sequence[WrappingInterceptor]) -> None:
        self._wrapping = list(reversed(wrapping))
        self._composed: dict[str, tuple[grpc.RpcMethodHandler[Any, Any], Any]] = {}

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Request, Response] | None]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Request, Response] | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        composed = self._composed.get(method)
        if composed is None or composed[0] is not handler:
            chosen = handler
            for interceptor in self._wrapping:
                chosen = interceptor.wrap(chosen, method)
            composed = self._composed[method] = (handler, chosen)
        return composed[1]


class ErrorInterceptor(WrappingInterceptor):
    def unary(
        self, behavior: Behavior[Request, Response], method: str
    ) -> Behavior[Request, Response]:
        return _guard(behavior, method)

    def stream(
        self, behavior: StreamBehavior[Request, Response], method: str
    ) -> StreamBehavior[Request, Response]:
        return _guard_stream(behavior, method)
