"""RPC metrics: one interceptor times every RPC by method and status code, and counts the answers
to admissions (Admit, ResumeReservation) by outcome and reason.

It sits inside ErrorInterceptor (server.py lists it right after), so it sees what the servicers
raise before it becomes a status: a KvQuotaError's code and reason; anything else is INTERNAL,
or UNAVAILABLE when the database cannot be reached. It never logs: ErrorInterceptor does.
Only the registered unary-unary and unary-stream methods are measured (a server stream until it
ends); unknown method names never become label values.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextvars import ContextVar
from dataclasses import dataclass

import grpc

from kvquota.v1 import admission_pb2, resources_pb2
from quota_service.api.error_status import (
    FORWARDED,
    Behavior,
    Request,
    Response,
    StreamBehavior,
    WrappingInterceptor,
    answered_with,
    responses,
)
from quota_service.core.errors import Code
from quota_service.metrics import ServiceMetrics

_ADMISSION_SERVICE = admission_pb2.DESCRIPTOR.services_by_name["AdmissionService"].full_name
# The methods whose answers count as admissions, by full gRPC method name.
ADMISSION_METHODS = {
    f"/{_ADMISSION_SERVICE}/{name}": name for name in ("Admit", "ResumeReservation")
}

ADMITTED = "admitted"
QUEUED = "queued"  # admitted after waiting in the instance's queue
REFUSED = "refused"
ABANDONED = "abandoned"  # the caller went away before its answer
# Admitted in its tenant's shadow mode where kvquota would have refused it (the reason label
# says why it would have).
SHADOW_ADMITTED = "shadow_admitted"


# Each reservation state's outcome label: its name, unprefixed, in lower case.
_OUTCOMES = {
    value: name.removeprefix("RESERVATION_STATE_").lower()
    for name, value in resources_pb2.ReservationState.items()
}


@dataclass
class CallNotes:
    """What the servicer tells the interceptor about the call it is answering."""

    queued: bool = False


call_notes: ContextVar[CallNotes | None] = ContextVar("kvquota_rpc_call", default=None)


def note_queued() -> None:
    """The current call waits in an instance's queue: admitted, its outcome is `queued`."""
    call = call_notes.get()
    if call is not None:
        call.queued = True


def admission_outcome(response: object, call: CallNotes) -> tuple[str, str]:
    """admitted, queued (admitted after a wait), shadow_admitted with the reason it would have
    been refused for, or the state a repeated request found; and the reason label."""
    reservation = (
        response.reservation if isinstance(response, admission_pb2.AdmitResponse) else response
    )
    if not isinstance(reservation, resources_pb2.Reservation):
        return "unknown", ""
    outcome = _OUTCOMES[reservation.state]
    if outcome == ADMITTED and reservation.shadow_refusal:
        return SHADOW_ADMITTED, reservation.shadow_refusal
    return (QUEUED if outcome == ADMITTED and call.queued else outcome), ""


class MetricsInterceptor(WrappingInterceptor):
    def __init__(self, metrics: ServiceMetrics) -> None:
        self._metrics = metrics

    def unary(
        self, behavior: Behavior[Request, Response], full_method: str
    ) -> Behavior[Request, Response]:
        service, method = full_method.lstrip("/").rsplit("/", 1)
        admission = full_method in ADMISSION_METHODS

        async def timed(
            request: Request, context: grpc.aio.ServicerContext[Request, Response]
        ) -> Response:
            call = CallNotes()
            token = call_notes.set(call)
            started = time.perf_counter()
            code, reason, outcome = Code.INTERNAL.value, "", REFUSED
            try:
                response = await behavior(request, context)
                code, (outcome, reason) = "OK", admission_outcome(response, call)
                return response
            except BaseException as exc:
                code, reason = answered_with(exc, context)
                if isinstance(exc, asyncio.CancelledError):
                    outcome = ABANDONED
                raise
            finally:
                call_notes.reset(token)
                self._metrics.observe_rpc(service, method, code, time.perf_counter() - started)
                # A forwarded admission is counted by the replica that decides it.
                if admission and code != FORWARDED:
                    self._metrics.count_admission(method, outcome, reason)

        return timed

    def stream(
        self, behavior: StreamBehavior[Request, Response], full_method: str
    ) -> StreamBehavior[Request, Response]:
        service, method = full_method.lstrip("/").rsplit("/", 1)

        async def timed(
            request: Request, context: grpc.aio.ServicerContext[Request, Response]
        ) -> AsyncIterator[Response]:
            started = time.perf_counter()
            code = "OK"
            try:
                # grpc's health Watch writes through the context instead of yielding.
                async for item in responses(behavior, request, context):
                    yield item
            except BaseException as exc:
                code, _ = answered_with(exc, context)
                raise
            finally:
                self._metrics.observe_rpc(service, method, code, time.perf_counter() - started)

        return timed
