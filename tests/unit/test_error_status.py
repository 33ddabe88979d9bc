"""Domain errors on the wire: the rich status a gateway decodes, and what it never sees."""

from __future__ import annotations

from typing import Any

import grpc
import psycopg
import pytest
from google.rpc import error_details_pb2
from sqlalchemy.exc import OperationalError

from quota_service.api.error_status import call_metadata, domain_error, rich_status, trailers
from quota_service.core.errors import Code, FieldViolation, KvQuotaError, QuotaViolation
from quota_service.core.reasons import Reason


def test_rich_status_carries_every_detail() -> None:
    error = KvQuotaError(
        Reason.TENANT_QUOTA_EXCEEDED,
        "over quota",
        metadata={"tenant": "acme"},
        field_violations=(FieldViolation("n", "too big"),),
        quota_violations=(QuotaViolation("tenants/acme", "blocks"),),
        retry_delay_seconds=2.25,
    )
    code, status = rich_status(error)
    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (status.code, status.message) == (8, "over quota")
    info, bad, quota, retry = (
        error_details_pb2.ErrorInfo(),
        error_details_pb2.BadRequest(),
        error_details_pb2.QuotaFailure(),
        error_details_pb2.RetryInfo(),
    )
    for packed, message in zip(status.details, (info, bad, quota, retry), strict=True):
        assert packed.Unpack(message)
    assert (info.reason, info.domain, dict(info.metadata)) == (
        "TENANT_QUOTA_EXCEEDED",
        "kvquota",
        {"tenant": "acme"},
    )
    assert bad.field_violations[0].field == "n"
    assert quota.violations[0].subject == "tenants/acme"
    assert retry.retry_delay.ToNanoseconds() == 2_250_000_000
    sent = dict(trailers(error, status))
    assert sent["grpc-retry-pushback-ms"] == "2250"
    assert sent["grpc-status-details-bin"] == status.SerializeToString()


def test_retry_delay_is_whole_milliseconds_in_both_places() -> None:
    error = KvQuotaError(Reason.QUEUE_FULL, "full", retry_delay_seconds=0.12345)
    _, status = rich_status(error)
    retry = error_details_pb2.RetryInfo()
    assert status.details[-1].Unpack(retry)
    assert retry.retry_delay.ToMilliseconds() == 123
    assert dict(trailers(error, status))["grpc-retry-pushback-ms"] == "123"


def test_no_pushback_without_a_retry_delay() -> None:
    error = KvQuotaError(Reason.REQUEST_ID_REUSED, "reused")
    _, status = rich_status(error)
    assert "grpc-retry-pushback-ms" not in dict(trailers(error, status))


def test_unexpected_errors_hide_their_text(caplog: pytest.LogCaptureFixture) -> None:
    error = domain_error(RuntimeError("secret salt abc"), "/kvquota.v1.AdmissionService/Admit")
    assert (error.code, error.reason, error.message) == (
        Code.INTERNAL,
        "INTERNAL",
        "internal error",
    )
    assert "unexpected error" in caplog.text


def test_lost_database_is_unavailable() -> None:
    lost = OperationalError("SELECT 1", {}, psycopg.OperationalError("connection refused"))
    error = domain_error(lost, "/kvquota.v1.AdmissionService/Admit")
    assert (error.code, error.reason) == (Code.UNAVAILABLE, "DATABASE_UNAVAILABLE")
    assert error.retry_delay_seconds is not None


class _Call:
    """What call_metadata reads of a servicer context: its metadata, counting the reads."""

    def __init__(self, *metadata: tuple[str, str]) -> None:
        self.metadata, self.reads = metadata, 0

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        self.reads += 1
        return self.metadata


def test_a_calls_metadata_is_read_once_and_given_to_that_call_alone() -> None:
    first = _Call(("authorization", "Bearer one"))
    second = _Call(("authorization", "Bearer two"))
    context: Any = first
    assert call_metadata(context) == call_metadata(context) == first.metadata
    assert first.reads == 1
    # Another call served in the same context (were grpc to reuse a task) reads its own: never
    # the credentials of the one before.
    context = second
    assert call_metadata(context) == second.metadata and second.reads == 1
