"""Any replica answers any call: one for an instance another replica serves (`ServedElsewhere`,
raised before anything was done here) is forwarded once to that replica over the same API, with
the caller's metadata (its API key and request id), the call's remaining deadline, and a mark
that it was forwarded, so the owner answers it itself or says the instance is moving (never
forwarding it on). The owner's answer, or its status with every detail, goes back as it is.

server.py lists this interceptor outside MetricsInterceptor and AccessInterceptor: a call is
authenticated before it is forwarded (and again by the owner), and measured where it is served.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
from google.protobuf import descriptor_pool, message_factory

from kvquota.v1 import admission_pb2
from quota_service.api.auth import PACKAGE
from quota_service.api.error_status import (
    Behavior,
    Request,
    Response,
    StreamBehavior,
    WrappingInterceptor,
    call_metadata,
    metadata_value,
    responses,
)
from quota_service.api.waiting import Waiters
from quota_service.core import queueing
from quota_service.core.errors import KvQuotaError, ServedElsewhere
from quota_service.core.names import reservation_name
from quota_service.core.reasons import Reason
from quota_service.owner.owners import Owners, forwarded_call

log = logging.getLogger(__name__)

T = TypeVar("T")

FORWARDED_BY_KEY = "kvquota-forwarded-by"
_ADMISSION = admission_pb2.DESCRIPTOR.services_by_name["AdmissionService"].full_name
ADMIT = f"/{_ADMISSION}/Admit"
CANCEL = f"/{_ADMISSION}/Cancel"


def _admitted_name(request: Any) -> str:
    return reservation_name(request.tenant.removeprefix("tenants/"), request.request_id)


def _named(request: Any) -> str:
    return str(request.name)


# The calls that may wait at the owner (a queued Admit, a resume waiting for GPU blocks, a
# watch), and the reservation each is about.
WAITS: dict[str, Callable[[Any], str]] = {
    ADMIT: _admitted_name,
    f"/{_ADMISSION}/ResumeReservation": _named,
    f"/{_ADMISSION}/WatchReservation": _named,
}
# What a caller is told to wait when the replica serving its instance does not answer: about the
# time another one takes to notice its lease lapsed and take the instance over.
RETRY_AFTER_LOST_OWNER_SECONDS = 1.0
# Metadata the transport sets for each hop, never copied onto the next.
_HOP_KEYS = frozenset({"user-agent", "te", "content-type", "grpc-accept-encoding", "grpc-timeout"})


def _passed_on(metadata: tuple[tuple[str, str | bytes], ...], name: str) -> list[Any]:
    kept = [
        (key, value)
        for key, value in metadata
        if not key.startswith(":") and key not in _HOP_KEYS and key != FORWARDED_BY_KEY
    ]
    return [*kept, (FORWARDED_BY_KEY, name)]


def _response_class(method: str) -> Callable[[bytes], Any]:
    """How a method's response is read, from the generated descriptors."""
    service, name = method.lstrip("/").rsplit("/", 1)
    found = descriptor_pool.Default().FindMethodByName(f"{service}.{name}")
    return message_factory.GetMessageClass(found.output_type).FromString


def _serialize(message: Any) -> bytes:
    return bytes(message.SerializeToString())


def _transport_failure(failed: grpc.aio.AioRpcError) -> bool:
    """The owner could not be reached (or went away mid-call), rather than answered."""
    if failed.code() is not grpc.StatusCode.UNAVAILABLE:
        return False
    return not any(key == "grpc-status-details-bin" for key, _ in failed.trailing_metadata() or ())


class ForwardingInterceptor(WrappingInterceptor):
    def __init__(
        self,
        owners: Owners,
        credentials: grpc.ChannelCredentials | None,
        max_message_bytes: int,
        waiters: Waiters,
        retry_delay_seconds: float,
    ) -> None:
        self._owners = owners
        self._credentials = credentials
        self._waiters = waiters
        self._retry_delay_seconds = retry_delay_seconds
        self._options = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ]
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._cancelling: set[asyncio.Future[Any]] = set()

    def covers(self, method: str) -> bool:
        return method.startswith(PACKAGE)

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            if self._credentials is None:
                channel = grpc.aio.insecure_channel(address, options=self._options)
            else:
                channel = grpc.aio.secure_channel(address, self._credentials, self._options)
            self._channels[address] = channel
        return channel

    async def close(self) -> None:
        channels, self._channels = self._channels, {}
        for channel in channels.values():
            await channel.close()

    def _lost(self, elsewhere: ServedElsewhere) -> KvQuotaError:
        self._owners.forget_holder(elsewhere.instance)
        return KvQuotaError(
            Reason.INSTANCE_MOVING,
            f"instances/{elsewhere.instance}: the replica serving it does not answer; "
            "retry shortly",
            retry_delay_seconds=RETRY_AFTER_LOST_OWNER_SECONDS,
        )

    async def _before_handback(
        self, answer: Awaitable[T], method: str, request: Any, cut: Callable[[], object]
    ) -> T:
        """The owner's answer; but a wait (WAITS) still running when this server hands its
        waiting callers back, shortly before its shutdown grace ends, is answered as one
        waiting here is, SERVER_SHUTTING_DOWN, rather than cut off by the grace. The call to
        the owner is cut: the owner keeps a forwarded request's place, which a retry finds."""
        name_of = WAITS.get(method)
        if name_of is None:
            return await answer
        answering = asyncio.ensure_future(answer)
        closing = asyncio.ensure_future(self._waiters.until_closed())
        try:
            await asyncio.wait([answering, closing], return_when=asyncio.FIRST_COMPLETED)
        finally:
            closing.cancel()
            handed_back = not answering.done()
            if handed_back:
                cut()
                answering.cancel()
                # Whatever the cut call ends with is no one's to read.
                answering.add_done_callback(lambda done: done.cancelled() or done.exception())
        if handed_back:
            raise queueing.shutting_down(name_of(request), self._retry_delay_seconds)
        return answering.result()

    def _cancel_admit(self, address: str, request: Any, metadata: list[Any]) -> None:
        """The caller of a forwarded Admit went away. The owner keeps a forwarded Admit's place
        in its queue when the call is cut (the forwarding replica may have died, and the caller
        retry elsewhere), so it is told to cancel the request, as it would for its own caller."""
        name = _admitted_name(request)
        cancel: grpc.aio.UnaryUnaryMultiCallable[Any, Any] = self._channel(address).unary_unary(
            CANCEL, request_serializer=_serialize, response_deserializer=None
        )
        sent = asyncio.ensure_future(
            cancel(admission_pb2.CancelRequest(name=name), metadata=metadata, timeout=5.0)
        )
        self._cancelling.add(sent)
        sent.add_done_callback(self._cancelled)

    def _cancelled(self, sent: asyncio.Future[Any]) -> None:
        self._cancelling.discard(sent)
        if not sent.cancelled() and sent.exception() is not None:
            log.warning("cancelling a forwarded Admit failed: %s", sent.exception())

    def unary(
        self, behavior: Behavior[Request, Response], method: str
    ) -> Behavior[Request, Response]:
        read = _response_class(method)

        async def forwarding(
            request: Request, context: grpc.aio.ServicerContext[Request, Response]
        ) -> Response:
            metadata = call_metadata(context)
            forwarded_call.set(metadata_value(metadata, FORWARDED_BY_KEY) is not None)
            try:
                return await behavior(request, context)
            except ServedElsewhere as elsewhere:
                call = self._channel(elsewhere.address).unary_unary(
                    method, request_serializer=_serialize, response_deserializer=read
                )
                passed_on = _passed_on(metadata, self._owners.name)
                sent = call(request, metadata=passed_on, timeout=context.time_remaining())
                try:
                    answer: Response = await self._before_handback(
                        sent, method, request, sent.cancel
                    )
                except asyncio.CancelledError:
                    # Not when the server cut the call at the end of its shutdown grace: the
                    # caller retries elsewhere (as for a caller waiting here).
                    if method == ADMIT and not self._waiters.closed:
                        self._cancel_admit(elsewhere.address, request, passed_on)
                    raise
                except grpc.aio.AioRpcError as failed:
                    if _transport_failure(failed):
                        raise self._lost(elsewhere) from failed
                    await context.abort(
                        failed.code(),
                        failed.details() or "",
                        tuple(failed.trailing_metadata() or ()),
                    )
                    raise AssertionError("abort raises") from failed
                return answer

        return forwarding

    def stream(
        self, behavior: StreamBehavior[Request, Response], method: str
    ) -> StreamBehavior[Request, Response]:
        read = _response_class(method)

        async def forwarding(
            request: Request, context: grpc.aio.ServicerContext[Request, Response]
        ) -> AsyncIterator[Response]:
            metadata = call_metadata(context)
            forwarded_call.set(metadata_value(metadata, FORWARDED_BY_KEY) is not None)
            try:
                async for item in responses(behavior, request, context):
                    yield item
                return
            except ServedElsewhere as served_elsewhere:
                elsewhere = served_elsewhere
            call = self._channel(elsewhere.address).unary_stream(
                method, request_serializer=_serialize, response_deserializer=read
            )
            stream = call(
                request,
                metadata=_passed_on(metadata, self._owners.name),
                timeout=context.time_remaining(),
            )
            items = aiter(stream)
            try:
                while True:
                    try:
                        item = await self._before_handback(
                            anext(items), method, request, stream.cancel
                        )
                    except StopAsyncIteration:
                        break
                    yield item
            except grpc.aio.AioRpcError as failed:
                if _transport_failure(failed):
                    raise self._lost(elsewhere) from failed
                await context.abort(
                    failed.code(), failed.details() or "", tuple(failed.trailing_metadata() or ())
                )
            finally:
                stream.cancel()

        return forwarding
