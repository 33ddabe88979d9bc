"""Domain errors: each knows its status code and reason, so servicers never translate by hand.

The status names are gRPC's (the api layer maps them by name); core stays free of gRPC imports.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field


class Code(enum.Enum):
    """gRPC status codes used by kvquota, by their gRPC names."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    UNAVAILABLE = "UNAVAILABLE"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    NOT_FOUND = "NOT_FOUND"
    ABORTED = "ABORTED"
    INTERNAL = "INTERNAL"
    CANCELLED = "CANCELLED"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    PERMISSION_DENIED = "PERMISSION_DENIED"


@dataclass(frozen=True, slots=True)
class FieldViolation:
    field: str
    description: str


@dataclass(frozen=True, slots=True)
class QuotaViolation:
    subject: str
    description: str


@dataclass(eq=False)
class KvQuotaError(Exception):
    """A refusal the caller can act on: code says what to do next, reason says why."""

    code: Code
    reason: str
    message: str
    metadata: Mapping[str, str] = field(default_factory=dict)
    field_violations: tuple[FieldViolation, ...] = ()
    quota_violations: tuple[QuotaViolation, ...] = ()
    retry_delay_seconds: float | None = None

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def __str__(self) -> str:
        return f"{self.reason}: {self.message}"


def invalid_request(violations: list[FieldViolation]) -> KvQuotaError:
    summary = "; ".join(f"{v.field}: {v.description}" for v in violations)
    return KvQuotaError(
        Code.INVALID_ARGUMENT,
        "INVALID_REQUEST",
        f"invalid request: {summary}",
        field_violations=tuple(violations),
    )


def not_found(kind: str, name: str) -> KvQuotaError:
    return KvQuotaError(
        Code.NOT_FOUND,
        f"{kind.upper()}_NOT_FOUND",
        f"{name} does not exist",
        metadata={"name": name},
    )


def already_exists(kind: str, name: str) -> KvQuotaError:
    return KvQuotaError(
        Code.ALREADY_EXISTS,
        f"{kind.upper()}_ALREADY_EXISTS",
        f"{name} already exists",
        metadata={"name": name},
    )


def preempted(name: str) -> KvQuotaError:
    return KvQuotaError(
        Code.ABORTED,
        "PREEMPTED",
        f"{name} was preempted to reclaim KV memory; admit the request again",
        metadata={"name": name},
    )
