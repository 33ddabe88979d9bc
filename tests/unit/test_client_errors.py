"""Refusals decoded from their rich status into the client's exceptions, each with the HTTP
status and headers of the README's error table."""

from __future__ import annotations

import grpc
import pytest

from kvquota.client import errors
from quota_service.api.error_status import rich_status, trailers
from quota_service.core.errors import Code, FieldViolation, KvQuotaError, QuotaViolation
from quota_service.core.reasons import Reason

# (reason, gRPC code, HTTP status, with a retry delay: retry-after, exception class)
TABLE = [
    ("INVALID_REQUEST", Code.INVALID_ARGUMENT, 400, False, errors.InvalidRequest),
    ("CONTEXT_LENGTH_EXCEEDED", Code.INVALID_ARGUMENT, 400, False, errors.InvalidRequest),
    ("REQUEST_EXCEEDS_CAPACITY", Code.FAILED_PRECONDITION, 400, False, errors.InvalidRequest),
    ("TENANT_QUOTA_EXCEEDED", Code.RESOURCE_EXHAUSTED, 429, True, errors.QuotaExceeded),
    ("INSTANCE_OVERLOADED", Code.UNAVAILABLE, 503, True, errors.Unavailable),
    ("QUEUE_FULL", Code.UNAVAILABLE, 503, True, errors.Unavailable),
    ("DATABASE_UNAVAILABLE", Code.UNAVAILABLE, 503, True, errors.ServerUnavailable),
    ("SERVER_SHUTTING_DOWN", Code.UNAVAILABLE, 503, True, errors.ServerUnavailable),
    ("QUEUE_TIMEOUT", Code.DEADLINE_EXCEEDED, 503, True, errors.Unavailable),
    ("RESERVATION_CANCELLED", Code.CANCELLED, 499, False, errors.RequestCancelled),
    ("REQUEST_ID_REUSED", Code.ALREADY_EXISTS, 409, False, errors.Conflict),
    ("TENANT_ALREADY_EXISTS", Code.ALREADY_EXISTS, 409, False, errors.Conflict),
    ("PIN_ID_REUSED", Code.ALREADY_EXISTS, 409, False, errors.Conflict),
    ("LEASE_EXPIRED", Code.FAILED_PRECONDITION, 409, False, errors.ReservationEnded),
    ("RESERVATION_ENDED", Code.FAILED_PRECONDITION, 409, False, errors.ReservationEnded),
    ("STALE_BLOCK_HANDLE", Code.FAILED_PRECONDITION, 409, False, errors.ReservationEnded),
    ("TENANT_SUSPENDED", Code.FAILED_PRECONDITION, 403, False, errors.Forbidden),
    ("INSTANCE_DRAINING", Code.FAILED_PRECONDITION, 503, False, errors.Unavailable),
    ("PREEMPTED", Code.ABORTED, 503, False, errors.Preempted),
    ("TENANT_OFFBOARDED", Code.FAILED_PRECONDITION, 409, False, errors.Conflict),
    ("ENGINE_UNREACHABLE", Code.UNAVAILABLE, 503, False, errors.Unavailable),
    ("INSTANCE_NOT_FOUND", Code.NOT_FOUND, 404, False, errors.NotFound),
    ("UNAUTHENTICATED", Code.UNAUTHENTICATED, 401, False, errors.Unauthenticated),
    ("PERMISSION_DENIED", Code.PERMISSION_DENIED, 403, False, errors.Forbidden),
]


def decoded(error: KvQuotaError) -> errors.KvquotaError:
    """As the server sends it (api/error_status.py) and the client reads it."""
    code, status = rich_status(error)
    return errors.from_status(code, status.message, trailers(error, status))


@pytest.mark.parametrize(("reason", "code", "http", "retry_after", "kind"), TABLE)
def test_each_reason_maps_as_the_error_table_says(
    reason: str, code: Code, http: int, retry_after: bool, kind: type[errors.KvquotaError]
) -> None:
    delay = 2.4 if retry_after else None
    error = KvQuotaError(Reason(reason), "refused", retry_delay_seconds=delay)
    assert error.code is code
    refusal = decoded(error)
    assert type(refusal) is kind
    assert (refusal.reason, refusal.http_status) == (reason, http)
    assert refusal.headers == ({"retry-after": "3"} if retry_after else {})


def test_every_detail_is_decoded() -> None:
    refusal = decoded(
        KvQuotaError(
            Reason.TENANT_QUOTA_EXCEEDED,
            "over quota",
            metadata={"tenant": "acme"},
            field_violations=(FieldViolation("n", "too big"),),
            quota_violations=(QuotaViolation("tenants/acme", "blocks"),),
            retry_delay_seconds=0.25,
        )
    )
    assert (refusal.code, refusal.message) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "over quota")
    assert refusal.metadata == {"tenant": "acme"}
    assert refusal.field_violations == (errors.FieldViolation("n", "too big"),)
    assert refusal.quota_violations == (errors.QuotaViolation("tenants/acme", "blocks"),)
    assert refusal.retry_delay_seconds == 0.25
    assert refusal.headers == {"retry-after": "1"}  # never earlier than asked


def test_a_failure_without_kvquotas_status_is_classed_by_its_code() -> None:
    lost = errors.from_status(grpc.StatusCode.UNAVAILABLE, "connection refused", ())
    assert type(lost) is errors.ServerUnavailable
    assert (lost.reason, lost.http_status, lost.headers) == ("", 503, {})
    late = errors.from_status(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline", ())
    assert (type(late), late.http_status) == (errors.DeadlineExceeded, 504)
