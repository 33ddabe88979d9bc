"""Who may call what: API keys, the principals they stand for, and their roles.

A key is `kvq_{key_id}_{secret}`. The key id is public (it names the key, `apiKeys/{key_id}`, in
listings and the audit log); the secret has 256 bits of entropy and only its SHA-256 is kept."""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum

from quota_service.core.errors import FieldViolation, KvQuotaError, invalid_request
from quota_service.core.names import check_resource_id, parse_child
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


# A gateway serving more tenants than this gets more keys.
MAX_KEY_TENANTS = 100


def binding_violation(role: Role, tenants: Sequence[str]) -> FieldViolation | None:
    """A gateway acts for one tenant or more (at most MAX_KEY_TENANTS), a tenant key for exactly
    one, an admin for all."""
    expected = {Role.ADMIN: "none", Role.GATEWAY: "at least one", Role.TENANT: "exactly one"}
    count = len(tenants)
    fits = {
        Role.ADMIN: count == 0,
        Role.GATEWAY: 1 <= count <= MAX_KEY_TENANTS,
        Role.TENANT: count == 1,
    }[role]
    if fits:
        return None
    if count > MAX_KEY_TENANTS:
        return FieldViolation("tenants", f"at most {MAX_KEY_TENANTS} tenants")
    return FieldViolation("tenants", f"a {role.value} key is bound to {expected[role]} tenant")


def check_binding(role: Role, tenants: Sequence[str]) -> None:
    violation = binding_violation(role, tenants)
    if violation:
        raise invalid_request([violation])


def new_key_tenants(display_name: str, role: Role | None, tenant_names: Sequence[str]) -> list[str]:
    """The tenants (ids) a new key is bound to; or every violation of its request at once."""
    violation = check_resource_id(display_name, "display_name")
    violations = [violation] if violation else []
    if role is None:
        violations.append(FieldViolation("role", "must be ADMIN, GATEWAY or TENANT"))
    tenants = []
    for index, name in enumerate(tenant_names[:MAX_KEY_TENANTS]):
        tenant, violation = parse_child(name, "tenants", f"tenants[{index}]")
        if violation:
            violations.append(violation)
        elif tenant is not None:
            tenants.append(tenant)
    binding = binding_violation(role, tenant_names) if role is not None else None
    if binding:
        violations.append(binding)
    if violations:
        raise invalid_request(violations)
    return tenants


def unauthenticated(message: str) -> KvQuotaError:
    return KvQuotaError(Reason.UNAUTHENTICATED, message)


def permission_denied(principal: Principal, method: str) -> KvQuotaError:
    # Says neither whether the resource exists nor which tenants the key reaches.
    return KvQuotaError(
        Reason.PERMISSION_DENIED,
        f"{principal.name} ({principal.role.value}) may not call {method} on this resource",
    )
