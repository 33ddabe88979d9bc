"""A Python client for gateways: `KvquotaClient` (blocking) and `AsyncKvquotaClient` (asyncio),
with the same surface. See docs/client.md."""

from kvquota.client.aio import AsyncKvquotaClient, current_request_id
from kvquota.client.channels import Tls
from kvquota.client.errors import (
    Conflict,
    DeadlineExceeded,
    FieldViolation,
    Forbidden,
    Internal,
    InvalidRequest,
    KvquotaError,
    NotFound,
    Preempted,
    QuotaExceeded,
    QuotaViolation,
    RequestCancelled,
    ReservationEnded,
    ServerUnavailable,
    Unauthenticated,
    Unavailable,
)
from kvquota.client.reservations import Reservation
from kvquota.client.retrying import NO_RETRIES, RetryPolicy
from kvquota.client.sync import KvquotaClient

__all__ = [
    "NO_RETRIES",
    "AsyncKvquotaClient",
    "Conflict",
    "DeadlineExceeded",
    "FieldViolation",
    "Forbidden",
    "Internal",
    "InvalidRequest",
    "KvquotaClient",
    "KvquotaError",
    "NotFound",
    "Preempted",
    "QuotaExceeded",
    "QuotaViolation",
    "RequestCancelled",
    "Reservation",
    "ReservationEnded",
    "RetryPolicy",
    "ServerUnavailable",
    "Tls",
    "Unauthenticated",
    "Unavailable",
    "current_request_id",
]
