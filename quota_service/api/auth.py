"""Authentication, authorisation and the audit log, in one interceptor in front of the servicers.

Every kvquota RPC is authenticated (`authorization: Bearer kvq_…`), then authorised from the
method and the tenant its request names, before the servicer runs: a caller learns nothing about
whether another tenant's resources exist. Administrative actions (AdminService calls other than
Get/List) are written to the audit log with their outcome, refusals included. Health and reflection
stay open, for load balancers and grpcurl."""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import grpc

from quota_service import logs
from quota_service.api.error_status import (
    REQUEST_ID_KEY,
    Behavior,
    Metadata,
    Request,
    Response,
    StreamBehavior,
    WrappingInterceptor,
    answered_with,
    call_metadata,
    echoed,
    metadata_value,
)
from quota_service.core import access, names
from quota_service.core.access import ANONYMOUS, ApiKey, AuditEvent, Principal, Role
from quota_service.core.errors import ServedElsewhere
from quota_service.store.access import ApiKeys, AuditLog

log = logging.getLogger(__name__)

PACKAGE = "/kvquota.v1."
ADMISSION = f"{PACKAGE}AdmissionService/"
ADMIN = f"{PACKAGE}AdminService/"
BILLING = f"{PACKAGE}BillingService/"

# The principal of the RPC being served (servicers read it, e.g. as a key's creator).
current_principal: ContextVar[Principal] = ContextVar("current_principal", default=ANONYMOUS)


# Each reads the tenant a request names, or None when its name is malformed: such a request names
# no tenant, and its servicer refuses it (with every other fault it has) before reading anything.


def _admit_tenant(request: Any) -> str | None:
    return names.parse_child(request.tenant, "tenants", "tenant")[0]


def _reservation_tenant(request: Any) -> str | None:
    key = names.parse_reservation(request.name)[0]
    return None if key is None else key[0]


def _named_tenant(request: Any) -> str | None:
    return names.parse_child(request.name, "tenants", "name")[0]


def _filtered_tenant(request: Any) -> str | None:
    # Without a tenant filter the range covers every tenant: an admin's question only.
    return names.parse_child(request.tenant, "tenants", "tenant")[0] if request.tenant else ""


@dataclass(frozen=True, slots=True)
class Rule:
    """Roles besides ADMIN that may call a method, for the tenant its request names."""

    roles: frozenset[Role]
    tenant_of: Callable[[Any], str | None]


_GATEWAY = frozenset({Role.GATEWAY})
_READERS = frozenset({Role.GATEWAY, Role.TENANT})
_TENANT = frozenset({Role.TENANT})
# Every kvquota method not named here is for admins only.
RULES: dict[str, Rule] = {
    f"{ADMISSION}Admit": Rule(_GATEWAY, _admit_tenant),
    **{
        f"{ADMISSION}{method}": Rule(_GATEWAY, _reservation_tenant)
        for method in (
            "RenewLease",
            "Release",
            "Cancel",
            "ReleaseBlocks",
            "SuspendReservation",
            "ResumeReservation",
        )
    },
    f"{ADMISSION}GetReservation": Rule(_READERS, _reservation_tenant),
    f"{ADMISSION}WatchReservation": Rule(_READERS, _reservation_tenant),
    f"{ADMIN}GetTenant": Rule(_READERS, _named_tenant),
    f"{ADMIN}GetTenantUsage": Rule(_READERS, _named_tenant),
    f"{BILLING}ExportUsage": Rule(_TENANT, _filtered_tenant),
    f"{BILLING}GetUsageSummary": Rule(_TENANT, _filtered_tenant),
}


def authorize(principal: Principal, method: str, request: Any) -> None:
    if principal.role is Role.ADMIN:
        return
    rule = RULES.get(method)
    if rule is None or principal.role not in rule.roles:
        raise access.permission_denied(principal, method.rsplit("/", 1)[-1])
    tenant = rule.tenant_of(request)
    # A malformed name goes on to be refused as such (INVALID_ARGUMENT), with the request's other
    # faults: that says nothing about other tenants.
    if tenant is not None and not principal.acts_for(tenant):
        raise access.permission_denied(principal, method.rsplit("/", 1)[-1])


def audited(method: str) -> bool:
    short = method.removeprefix(ADMIN)
    # Reads are not audited: gets, lists and checks (admins' only, as every method RULES does
    # not name).
    return short != method and not short.startswith(("Get", "List", "Check"))


def _resource(request: Any, response: Any) -> str:
    for field in ("name", "parent", "instance", "tenant"):
        value = getattr(request, field, "")
        if isinstance(value, str) and value:
            return value
    for field, collection in (
        ("tenant_id", "tenants"),
        ("instance_id", "instances"),
        ("namespace_id", "namespaces"),
    ):
        value = getattr(request, field, "")
        if value:
            return f"{collection}/{value}"
    # Creates without a chosen id name their resource in the answer.
    for answer in (response, getattr(response, "api_key", None)):
        value = getattr(answer, "name", "")
        if isinstance(value, str) and value:
            return value
    return ""


class Authenticator:
    """Resolves bearer keys to principals, caching verified keys for `cache_seconds`: the hot path
    pays no database round trip, and a revocation reaches every replica within that period."""

    def __init__(self, keys: ApiKeys, required: bool, cache_seconds: float) -> None:
        self._keys = keys
        self._required = required
        self._cache_seconds = cache_seconds
        # Key id: when it was verified, its principal, and its secret's digest.
        self._cache: dict[str, tuple[float, Principal, bytes]] = {}
        # Key id: the secret that last matched its digest, compared as it is on later calls
        # (a digest per call was ~1% of a server's CPU); dropped with the key's cache entry.
        self._matched: dict[str, str] = {}
        # Keys being read from the database now, by id.
        self._reading: dict[str, asyncio.Future[tuple[ApiKey, bytes] | None]] = {}

    async def principal(self, metadata: Sequence[tuple[str, str | bytes]]) -> Principal:
        if not self._required:
            return ANONYMOUS
        header = metadata_value(metadata, "authorization")
        if not isinstance(header, str) or not header:
            raise access.unauthenticated("missing `authorization: Bearer <API key>` metadata")
        scheme, _, token = header.partition(" ")
        parsed = access.parse_token(token.strip()) if scheme.lower() == "bearer" else None
        if parsed is None:
            # Never the header itself: a mistyped key is still mostly a key.
            log.warning("refused a call: malformed authorization metadata")
            raise access.unauthenticated("authorization metadata must be `Bearer <API key>`")
        key_id, secret = parsed
        now = time.monotonic()
        cached = self._cache.get(key_id)
        if cached is None or now - cached[0] > self._cache_seconds:
            found = await self._verified(key_id)
            self._matched.pop(key_id, None)
            if found is None:
                self._cache.pop(key_id, None)
                log.warning("refused a call: apiKeys/%s is unknown or revoked", key_id)
                raise access.unauthenticated("unknown or revoked API key")
            key, digest = found
            cached = (now, key.principal, digest)
            self._cache[key_id] = cached
        matched = self._matched.get(key_id)
        if matched is None or not hmac.compare_digest(secret, matched):
            if not access.matches(secret, cached[2]):
                log.warning("refused a call: wrong secret for apiKeys/%s", key_id)
                raise access.unauthenticated("unknown or revoked API key")
            self._matched[key_id] = secret
        return cached[1]

    async def _verified(self, key_id: str) -> tuple[ApiKey, bytes] | None:
        """The key as the database has it now. The calls that find its cache entry lapsed
        together (every caller of a busy gateway, each time it lapses) share one read, rather
        than each taking a pooled connection."""
        reading = self._reading.get(key_id)
        if reading is None:
            reading = self._reading[key_id] = asyncio.ensure_future(self._keys.verified(key_id))
            reading.add_done_callback(lambda done: self._read(key_id, done))
        return await asyncio.shield(reading)

    def _read(self, key_id: str, done: asyncio.Future[tuple[ApiKey, bytes] | None]) -> None:
        del self._reading[key_id]
        if not done.cancelled():
            done.exception()  # its callers may all have gone away: then no one reads it


# The ids made here for calls that bring none: this process's random half and a count, 32 hex
# digits as a UUID's, unique across replicas and restarts. A uuid4 read the kernel's random
# source on every call.
_MADE_ID_PREFIX = secrets.token_hex(8)
_MADE_IDS = itertools.count()


def _request_id(metadata: Metadata) -> str:
    given = metadata_value(metadata, REQUEST_ID_KEY)
    if isinstance(given, str) and names.REQUEST_ID.fullmatch(given):
        return given
    return f"{_MADE_ID_PREFIX}{next(_MADE_IDS):016x}"


class AccessInterceptor(WrappingInterceptor):
    def __init__(self, authenticator: Authenticator, audit: AuditLog) -> None:
        self._authenticator = authenticator
        self._audit = audit

    def _identify(self, metadata: Metadata) -> None:
        """The call's request id (the caller's, or one made here), for its log lines and its
        answer (`echoed`)."""
        logs.request_id.set(_request_id(metadata))

    async def _authenticate(self, metadata: Metadata) -> Principal:
        principal = await self._authenticator.principal(metadata)
        current_principal.set(principal)
        return principal

    async def _record(
        self, principal: Principal, method: str, request: Any, response: Any, code: str
    ) -> None:
        event = AuditEvent(
            None,
            principal.name,
            method.removeprefix(ADMIN),
            _resource(request, response),
            logs.request_id.get(),
            code,
        )
        try:
            await self._audit.record(event)
        except Exception:
            # The action happened (or was refused) already; a lost audit row must be seen.
            log.exception("could not write the audit event of %s", method)

    def covers(self, method: str) -> bool:
        return method.startswith(PACKAGE)

    def unary(
        self, behavior: Behavior[Request, Response], method: str
    ) -> Behavior[Request, Response]:
        async def checked(
            request: Request, context: grpc.aio.ServicerContext[Request, Response]
        ) -> Response:
            metadata = call_metadata(context)
            # Back in the trailers: they go out with the answer, where headers of their own
            # would cost gRPC a batch of its own (~5% of a server's CPU under load). A refusal's
            # trailers carry it too (error_status.trailers).
            self._identify(metadata)
            context.set_trailing_metadata(echoed())
            return await self._checked(behavior, method, request, context, metadata)

        return checked

    async def _checked(
        self,
        behavior: Behavior[Request, Response],
        method: str,
        request: Request,
        context: grpc.aio.ServicerContext[Request, Response],
        metadata: Metadata,
    ) -> Response:
        principal = await self._authenticate(metadata)
        try:
            authorize(principal, method, request)
            response = await behavior(request, context)
        except ServedElsewhere:
            raise  # audited by the replica it is forwarded to
        except Exception as exc:
            if audited(method):
                code, _ = answered_with(exc, context)
                await self._record(principal, method, request, None, code)
            raise
        if audited(method):
            await self._record(principal, method, request, response, "OK")
        return response

    def stream(
        self, behavior: StreamBehavior[Request, Response], method: str
    ) -> StreamBehavior[Request, Response]:
        async def checked(
            request: Request, context: grpc.aio.ServicerContext[Request, Response]
        ) -> AsyncIterator[Response]:
            metadata = call_metadata(context)
            # A stream's trailers come at its end: its headers carry the id at once.
            self._identify(metadata)
            await context.send_initial_metadata(echoed())
            authorize(await self._authenticate(metadata), method, request)
            async for item in behavior(request, context):
                yield item

        return checked
