"""kvquota's refusals as exceptions: one hierarchy decoded from the `google.rpc.Status` every
refusal carries (ErrorInfo's reason and metadata, RetryInfo's delay, BadRequest's field
violations, QuotaFailure's violations), with a class per family of reasons. Each knows the HTTP
status a gateway answers its own client with, and the headers to send (`retry-after`), as the
README's error table says.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import grpc
from google.rpc import error_details_pb2, status_pb2

STATUS_DETAILS_KEY = "grpc-status-details-bin"


@dataclass(frozen=True, slots=True)
class FieldViolation:
    field: str
    description: str


@dataclass(frozen=True, slots=True)
class QuotaViolation:
    subject: str
    description: str


class KvquotaError(Exception):
    """A failed call: `code` says what to do next, `reason` (ErrorInfo's, empty when the call
    never reached kvquota's error model, e.g. a lost connection) says why."""

    http_status = 500

    def __init__(
        self,
        code: grpc.StatusCode,
        reason: str,
        message: str,
        metadata: dict[str, str] | None = None,
        retry_delay_seconds: float | None = None,
        field_violations: tuple[FieldViolation, ...] = (),
        quota_violations: tuple[QuotaViolation, ...] = (),
    ) -> None:
        super().__init__(f"{reason or code.name}: {message}")
        self.code = code
        self.reason = reason
        self.message = message
        self.metadata = metadata or {}
        self.retry_delay_seconds = retry_delay_seconds
        self.field_violations = field_violations
        self.quota_violations = quota_violations

    @property
    def headers(self) -> dict[str, str]:
        """HTTP headers for the gateway's answer: `retry-after` (whole seconds, rounded up so a
        client never comes back early) whenever kvquota computed a retry delay."""
        if self.retry_delay_seconds is None:
            return {}
        return {"retry-after": str(max(1, math.ceil(self.retry_delay_seconds)))}


class InvalidRequest(KvquotaError):
    """The request can never succeed as it is (INVALID_REQUEST, CONTEXT_LENGTH_EXCEEDED,
    REQUEST_EXCEEDS_CAPACITY)."""

    http_status = 400


class Unauthenticated(KvquotaError):
    http_status = 401


class Forbidden(KvquotaError):
    """Not allowed (PERMISSION_DENIED), or the tenant admits nothing now (TENANT_SUSPENDED)."""

    http_status = 403


class NotFound(KvquotaError):
    http_status = 404


class Conflict(KvquotaError):
    """The request clashes with what exists (REQUEST_ID_REUSED, *_ALREADY_EXISTS, PIN_ID_REUSED,
    TENANT_OFFBOARDED)."""

    http_status = 409


class ReservationEnded(Conflict):
    """The reservation is not live any more (LEASE_EXPIRED, RESERVATION_ENDED,
    STALE_BLOCK_HANDLE)."""


class QuotaExceeded(KvquotaError):
    """TENANT_QUOTA_EXCEEDED: over its quota now; retry after the delay."""

    http_status = 429


class RequestCancelled(KvquotaError):
    """RESERVATION_CANCELLED: a waiting Admit whose request was cancelled."""

    http_status = 499


class Unavailable(KvquotaError):
    """Busy or not serving now (INSTANCE_OVERLOADED, QUEUE_FULL, QUEUE_TIMEOUT,
    INSTANCE_DRAINING, ENGINE_UNREACHABLE)."""

    http_status = 503


class ServerUnavailable(Unavailable):
    """This server cannot answer (SERVER_SHUTTING_DOWN, DATABASE_UNAVAILABLE, or no answer at
    all): another replica may."""


class Preempted(Unavailable):
    """PREEMPTED or RECLAIMED: a reclaim took the blocks while the request ran; admit it
    again."""


class Internal(KvquotaError):
    http_status = 500


class DeadlineExceeded(KvquotaError):
    """The caller's own deadline passed before an answer."""

    http_status = 504


_BY_REASON: dict[str, type[KvquotaError]] = {
    **dict.fromkeys(
        ("INVALID_REQUEST", "CONTEXT_LENGTH_EXCEEDED", "REQUEST_EXCEEDS_CAPACITY"), InvalidRequest
    ),
    "TENANT_SUSPENDED": Forbidden,
    **dict.fromkeys(
        (
            "REQUEST_ID_REUSED",
            "TENANT_ALREADY_EXISTS",
            "INSTANCE_ALREADY_EXISTS",
            "PIN_ID_REUSED",
            "TENANT_OFFBOARDED",
        ),
        Conflict,
    ),
    **dict.fromkeys(("LEASE_EXPIRED", "RESERVATION_ENDED", "STALE_BLOCK_HANDLE"), ReservationEnded),
    "TENANT_QUOTA_EXCEEDED": QuotaExceeded,
    "RESERVATION_CANCELLED": RequestCancelled,
    **dict.fromkeys(
        (
            "INSTANCE_OVERLOADED",
            "QUEUE_FULL",
            "QUEUE_TIMEOUT",
            "INSTANCE_DRAINING",
            "ENGINE_UNREACHABLE",
        ),
        Unavailable,
    ),
    **dict.fromkeys(("SERVER_SHUTTING_DOWN", "DATABASE_UNAVAILABLE"), ServerUnavailable),
    **dict.fromkeys(("PREEMPTED", "RECLAIMED"), Preempted),
}

# Without a kvquota reason (auth, NOT_FOUND of an unknown method, transport failures).
_BY_CODE: dict[grpc.StatusCode, type[KvquotaError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: Forbidden,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.ALREADY_EXISTS: Conflict,
    grpc.StatusCode.RESOURCE_EXHAUSTED: QuotaExceeded,
    grpc.StatusCode.CANCELLED: RequestCancelled,
    grpc.StatusCode.UNAVAILABLE: ServerUnavailable,
    grpc.StatusCode.ABORTED: Preempted,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
}


def from_status(
    code: grpc.StatusCode, message: str, trailing_metadata: tuple[tuple[str, str | bytes], ...]
) -> KvquotaError:
    """The exception for a call that ended with `code`, decoding the rich status when the
    trailers carry one."""
    raw = dict(trailing_metadata).get(STATUS_DETAILS_KEY)
    reason, metadata, delay = "", {}, None
    fields: list[FieldViolation] = []
    quotas: list[QuotaViolation] = []
    if isinstance(raw, bytes):
        status = status_pb2.Status.FromString(raw)
        message = status.message or message
        for packed in status.details:
            if packed.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                packed.Unpack(info)
                reason, metadata = info.reason, dict(info.metadata)
            elif packed.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
                retry = error_details_pb2.RetryInfo()
                packed.Unpack(retry)
                delay = retry.retry_delay.ToNanoseconds() / 1e9
            elif packed.Is(error_details_pb2.BadRequest.DESCRIPTOR):
                bad = error_details_pb2.BadRequest()
                packed.Unpack(bad)
                fields += [FieldViolation(v.field, v.description) for v in bad.field_violations]
            elif packed.Is(error_details_pb2.QuotaFailure.DESCRIPTOR):
                failure = error_details_pb2.QuotaFailure()
                packed.Unpack(failure)
                quotas += [QuotaViolation(v.subject, v.description) for v in failure.violations]
    kind = _BY_REASON.get(reason) or _BY_CODE.get(code, Internal)
    return kind(code, reason, message, metadata, delay, tuple(fields), tuple(quotas))


def from_rpc_error(error: grpc.aio.AioRpcError) -> KvquotaError:
    return from_status(error.code(), error.details() or "", tuple(error.trailing_metadata() or ()))
