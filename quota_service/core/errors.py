"""Domain errors: each has a reason from kvquota.v1.ErrorReason, and the reason its status code,
so servicers never translate by hand and a reason never travels with two codes.

The status names are gRPC's (the api layer maps them by name); core stays free of gRPC imports.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from quota_service.core.reasons import STATUS_CODES, Reason


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


# How much of a caller's value an error repeats: enough to recognise it, never enough to push a
# status past what a client accepts in trailers (gRPC's default metadata limit is 8 KiB, and a
# client over it sees RESOURCE_EXHAUSTED, which a gateway would answer as 429).
MAX_QUOTED_CHARACTERS = 40


def quoted(value: str) -> str:
    """A caller's value as an error message quotes it: short ones whole, long ones cut."""
    if len(value) <= MAX_QUOTED_CHARACTERS:
        return repr(value)
    return f"{value[:MAX_QUOTED_CHARACTERS]!r}... ({len(value)} characters)"


@dataclass(frozen=True, slots=True)
class FieldViolation:
    field: str
    description: str


@dataclass(frozen=True, slots=True)
class QuotaViolation:
    subject: str
    description: str


class ServedElsewhere(Exception):
    """The instance a call is for is served by another replica (the api layer forwards the call
    there): not a refusal, so the caller never sees it."""

    def __init__(self, instance: str, address: str) -> None:
        super().__init__(f"instances/{instance} is served at {address}")
        self.instance = instance
        self.address = address


@dataclass(eq=False)
class KvQuotaError(Exception):
    """A refusal the caller can act on: code says what to do next, reason says why."""

    reason: Reason
    message: str
    metadata: Mapping[str, str] = field(default_factory=dict)
    field_violations: tuple[FieldViolation, ...] = ()
    quota_violations: tuple[QuotaViolation, ...] = ()
    retry_delay_seconds: float | None = None

    def __post_init__(self) -> None:
        super().__init__(self.message)

    @property
    def code(self) -> Code:
        return Code(STATUS_CODES[self.reason])

    def __str__(self) -> str:
        return f"{self.reason}: {self.message}"


# A request with more violations is told the first ones (each a few dozen characters at most):
# its status stays well inside a client's metadata limit. The message sums up fewer still.
MAX_FIELD_VIOLATIONS = 20
SUMMARISED_VIOLATIONS = 3


def invalid_request(violations: list[FieldViolation]) -> KvQuotaError:
    summary = "; ".join(f"{v.field}: {v.description}" for v in violations[:SUMMARISED_VIOLATIONS])
    if len(violations) > SUMMARISED_VIOLATIONS:
        summary += f"; and {len(violations) - SUMMARISED_VIOLATIONS} more"
    return KvQuotaError(
        Reason.INVALID_REQUEST,
        f"invalid request: {summary}",
        field_violations=tuple(violations[:MAX_FIELD_VIOLATIONS]),
    )


def refuse_invalid(violations: Iterable[FieldViolation | None]) -> None:
    """Raise INVALID_REQUEST naming every violation given, if there is one (None is a check that
    passed): a request's checks all run first, so its caller hears of every fault at once."""
    found = [v for v in violations if v is not None]
    if found:
        raise invalid_request(found)


def not_found(reason: Reason, name: str) -> KvQuotaError:
    """`reason` is one of the *_NOT_FOUND reasons."""
    return KvQuotaError(reason, f"{name} does not exist", metadata={"name": name})


def already_exists(reason: Reason, name: str) -> KvQuotaError:
    """`reason` is one of the *_ALREADY_EXISTS reasons."""
    return KvQuotaError(reason, f"{name} already exists", metadata={"name": name})


def preempted(name: str) -> KvQuotaError:
    return KvQuotaError(
        Reason.PREEMPTED,
        f"{name} was preempted to reclaim KV memory; admit the request again",
        metadata={"name": name},
    )
