"""Who may call what: API keys, the principals they stand for, and their roles.

A key is `kvq_{key_id}_{secret}`. The key id is public (it names the key, `apiKeys/{key_id}`, in
listings and the audit log); the secret has 256 bits of entropy and only its SHA-256 is kept."""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum

from quota_service.core.errors import FieldViolation, KvQuotaError, invalid_request
from quota_service.core.reasons import Reason

KEY_PREFIX = "kvq_"
_TOKEN = re.compile(r"kvq_([0-9a-f]{16})_([A-Za-z0-9_-]{43})")
KEY_ID_BYTES = 8
SECRET_BYTES = 32


class Role(StrEnum):
    ADMIN = "ADMIN"
    # Calls the AdmissionService for the tenants its key is bound to.
    GATEWAY = "GATEWAY"
    # Reads its own tenant, reservations and usage.
    TENANT = "TENANT"


@dataclass(frozen=True, slots=True)
class Principal:
    name: str
    role: Role
    tenants: frozenset[str]

    def acts_for(self, tenant: str) -> bool:
        return self.role is Role.ADMIN or tenant in self.tenants


# Every call while authentication is turned off (development only).
ANONYMOUS = Principal("anonymous", Role.ADMIN, frozenset())
# Keys created straight in the database, before any admin key exists.
BOOTSTRAP = "bootstrap"


@dataclass(frozen=True, slots=True)
class ApiKey:
    key_id: str
    display_name: str
    role: Role
    tenants: tuple[str, ...]
    creator: str
    created_at: datetime
    revoked_at: datetime | None

    @property
    def name(self) -> str:
        return key_name(self.key_id)

    @property
    def principal(self) -> Principal:
        return Principal(self.name, self.role, frozenset(self.tenants))


@dataclass(frozen=True, slots=True)
class AuditEvent:
    """An administrative action or an attempt at one (`at` is set by the database)."""

    at: datetime | None
    principal: str
    method: str
    resource: str
    request_id: str
    code: str


@dataclass(frozen=True, slots=True)
class NewSecret:
    key_id: str
    token: str
    digest: bytes


def key_name(key_id: str) -> str:
    return f"apiKeys/{key_id}"


def new_secret() -> NewSecret:
    key_id = secrets.token_hex(KEY_ID_BYTES)
    secret = secrets.token_urlsafe(SECRET_BYTES)
    return NewSecret(key_id, f"{KEY_PREFIX}{key_id}_{secret}", digest(secret))


def digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


def parse_token(token: str) -> tuple[str, str] | None:
    """(key id, secret) of a well-formed key, else None."""
    match = _TOKEN.fullmatch(token)
    return None if match is None else (match[1], match[2])


def matches(secret: str, stored_digest: bytes) -> bool:
    return hmac.compare_digest(digest(secret), stored_digest)


def check_binding(role: Role, tenants: list[str]) -> None:
    """A gateway acts for one tenant or more, a tenant key for exactly one, an admin for all."""
    expected = {Role.ADMIN: "none", Role.GATEWAY: "at least one", Role.TENANT: "exactly one"}
    count = len(tenants)
    fits = {Role.ADMIN: count == 0, Role.GATEWAY: count >= 1, Role.TENANT: count == 1}[role]
    if not fits:
        raise invalid_request(
            [FieldViolation("tenants", f"a {role.value} key is bound to {expected[role]} tenant")]
        )


def unauthenticated(message: str) -> KvQuotaError:
    return KvQuotaError(Reason.UNAUTHENTICATED, message)


def permission_denied(principal: Principal, method: str) -> KvQuotaError:
    # Says neither whether the resource exists nor which tenants the key reaches.
    return KvQuotaError(
        Reason.PERMISSION_DENIED,
        f"{principal.name} ({principal.role.value}) may not call {method} on this resource",
    )
