"""API keys, roles and the audit log, through a real server on a real database.

The authorisation matrix calls every RPC of every service as every role, for the caller's own
tenant, another tenant that exists and one that does not: a cell the roles allow answers exactly
as it does for an admin, any other cell is PERMISSION_DENIED, whether or not the thing exists."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import grpc
import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor import MethodDescriptor
from google.protobuf.message import Message
from google.protobuf.timestamp_pb2 import Timestamp
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from kvquota.v1 import admin_pb2, admin_pb2_grpc, admission_pb2, admission_pb2_grpc, billing_pb2
from kvquota.v1 import resources_pb2 as pb
from quota_service.api import server
from quota_service.cli import main as cli_main
from quota_service.config import Settings
from quota_service.core import access
from quota_service.core.access import Role
from quota_service.store.access import ApiKeys, create_bootstrap_key
from tests.integration.grpc_helpers import refused
from tests.integration.ledger_fixtures import add_instance, add_tenant

SERVICES = [
    f.services_by_name[s]
    for f, s in (
        (admission_pb2.DESCRIPTOR, "AdmissionService"),
        (admin_pb2.DESCRIPTOR, "AdminService"),
        (billing_pb2.DESCRIPTOR, "BillingService"),
    )
]
# Besides admins, who may call what for its own tenant (every other cell is refused).
GATEWAY_MAY = {
    "Admit",
    "RenewLease",
    "Release",
    "Cancel",
    "ReleaseBlocks",
    "SuspendReservation",
    "ResumeReservation",
    "GetReservation",
    "WatchReservation",
    "GetTenant",
    "GetTenantUsage",
}
TENANT_MAY = {
    "GetReservation",
    "WatchReservation",
    "GetTenant",
    "GetTenantUsage",
    "ExportUsage",
    "GetUsageSummary",
}
OWN, OTHER, MISSING = "acme", "globex", "initech"


def admit_request(tenant: str) -> admission_pb2.AdmitRequest:
    return admission_pb2.AdmitRequest(
        tenant=f"tenants/{tenant}",
        request_id="live",
        instance="instances/gpu-0",
        prompt_tokens=32,
        max_output_tokens=16,
    )


def tenant_request(method: str, tenant: str) -> Message | None:
    """A request of a tenant-scoped method about `tenant`, harmless to repeat: it reads, repeats
    an idempotent call, or names a reservation that does not exist."""
    live = f"tenants/{tenant}/reservations/live"
    missing = f"tenants/{tenant}/reservations/missing"
    start, end = Timestamp(seconds=0), Timestamp(seconds=3600)
    requests: dict[str, Message] = {
        "Admit": admit_request(tenant),
        "RenewLease": admission_pb2.RenewLeaseRequest(name=live),
        "GetReservation": admission_pb2.GetReservationRequest(name=live),
        "Release": admission_pb2.ReleaseRequest(name=missing),
        "Cancel": admission_pb2.CancelRequest(name=missing),
        "ReleaseBlocks": admission_pb2.ReleaseBlocksRequest(name=missing),
        "SuspendReservation": admission_pb2.SuspendReservationRequest(name=missing),
        "ResumeReservation": admission_pb2.ResumeReservationRequest(name=missing),
        "WatchReservation": admission_pb2.WatchReservationRequest(name=missing),
        "GetTenant": admin_pb2.GetTenantRequest(name=f"tenants/{tenant}"),
        "GetTenantUsage": admin_pb2.GetTenantUsageRequest(name=f"tenants/{tenant}"),
        "ExportUsage": billing_pb2.ExportUsageRequest(
            tenant=f"tenants/{tenant}", start_time=start, end_time=end
        ),
        "GetUsageSummary": billing_pb2.GetUsageSummaryRequest(
            tenant=f"tenants/{tenant}", start_time=start, end_time=end
        ),
    }
    return requests.get(method)


async def call(
    channel: grpc.aio.Channel, method: MethodDescriptor, request: Message, key: str | None
) -> grpc.StatusCode:
    path = f"/{method.containing_service.full_name}/{method.name}"
    output = message_factory.GetMessageClass(method.output_type)
    metadata = () if key is None else (("authorization", f"Bearer {key}"),)
    try:
        if method.server_streaming:
            stream = channel.unary_stream(path, type(request).SerializeToString, output.FromString)(
                request, metadata=metadata, timeout=10
            )
            async for _ in stream:
                pass
        else:
            await channel.unary_unary(path, type(request).SerializeToString, output.FromString)(
                request, metadata=metadata, timeout=10
            )
    except grpc.aio.AioRpcError as error:
        return error.code()
    return grpc.StatusCode.OK


@pytest.fixture
async def secured(
    engine: AsyncEngine, database_url: str, settings: Settings
) -> AsyncIterator[tuple[grpc.aio.Channel, dict[str, str]]]:
    await add_instance(engine)
    for tenant in (OWN, OTHER):
        await add_tenant(engine, tenant)
    keys = ApiKeys(engine)
    tokens = {
        "admin": (await keys.create("ops", Role.ADMIN, [], access.BOOTSTRAP))[1],
        "gateway": (await keys.create("gw", Role.GATEWAY, [OWN], access.BOOTSTRAP))[1],
        "tenant": (await keys.create("acme-ro", Role.TENANT, [OWN], access.BOOTSTRAP))[1],
    }
    running = await server.start(
        replace(settings, auth_required=True, auth_cache_seconds=0.05), database_url
    )
    async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
        admit = admission_pb2_grpc.AdmissionServiceStub(channel).Admit
        for tenant in (OWN, OTHER):
            await admit(
                admit_request(tenant), metadata=(("authorization", f"Bearer {tokens['admin']}"),)
            )
        yield channel, tokens
    await running.stop(0)


def allowed(role: str, method: str, target: str) -> bool:
    if role == "admin":
        return True
    may = GATEWAY_MAY if role == "gateway" else TENANT_MAY
    return method in may and target == OWN


async def test_authorisation_matrix(
    secured: tuple[grpc.aio.Channel, dict[str, str]], engine: AsyncEngine
) -> None:
    channel, tokens = secured
    cells = 0
    for service in SERVICES:
        for method in service.methods:
            targets = [OWN, OTHER, MISSING] if tenant_request(method.name, OWN) else [OWN]
            for target in targets:
                request = tenant_request(method.name, target)
                if request is None:
                    # Admin-only: an empty request is harmless (refused as malformed, or a
                    # read), and for everyone else it must not even get that far.
                    request = message_factory.GetMessageClass(method.input_type)()
                as_admin = await call(channel, method, request, tokens["admin"])
                assert as_admin not in (
                    grpc.StatusCode.UNAUTHENTICATED,
                    grpc.StatusCode.PERMISSION_DENIED,
                    grpc.StatusCode.INTERNAL,
                    grpc.StatusCode.UNKNOWN,
                ), method.name
                for role in ("gateway", "tenant"):
                    expected = (
                        as_admin
                        if allowed(role, method.name, target)
                        else grpc.StatusCode.PERMISSION_DENIED
                    )
                    got = await call(channel, method, request, tokens[role])
                    assert got == expected, (method.name, role, target)
                    cells += 1
    assert cells > 80
    # No cell of the matrix changed what the other tenant holds.
    async with engine.connect() as conn:
        states: dict[str, str] = dict(
            (await conn.execute(text("SELECT tenant, state FROM reservations"))).all()
        )
    assert states == {OWN: "ADMITTED", OTHER: "ADMITTED"}


async def test_no_or_bad_credentials_are_unauthenticated(
    secured: tuple[grpc.aio.Channel, dict[str, str]], engine: AsyncEngine
) -> None:
    channel, tokens = secured
    key_id, _ = access.parse_token(tokens["gateway"]) or ("", "")
    wrong_secret = f"kvq_{key_id}_{'A' * 43}"
    for service in SERVICES:
        for method in service.methods:
            request = (
                tenant_request(method.name, OWN)
                or message_factory.GetMessageClass(method.input_type)()
            )
            for key in (None, "", "not-a-key", wrong_secret):
                got = await call(channel, method, request, key)
                assert got == grpc.StatusCode.UNAUTHENTICATED, (method.name, key)
    # Health stays open to load balancers.
    health: Any = health_pb2_grpc.HealthStub(channel)
    reply = await health.Check(health_pb2.HealthCheckRequest())
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_a_gateway_gets_only_its_own_tenants_salt(
    secured: tuple[grpc.aio.Channel, dict[str, str]], engine: AsyncEngine
) -> None:
    channel, tokens = secured
    async with engine.connect() as conn:
        salts: dict[str, str] = dict(
            (await conn.execute(text("SELECT tenant, cache_salt FROM tenants"))).all()
        )
    admit = admission_pb2_grpc.AdmissionServiceStub(channel).Admit
    gateway = (("authorization", f"Bearer {tokens['gateway']}"),)
    own = await admit(admit_request(OWN), metadata=gateway)
    assert own.cache_salt == salts[OWN]
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await admit(admit_request(OTHER), metadata=gateway)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert salts[OTHER] not in str(refused.value.details())


async def test_a_malformed_name_is_refused_with_every_fault_of_its_request(
    secured: tuple[grpc.aio.Channel, dict[str, str]], engine: AsyncEngine
) -> None:
    """A name that does not parse names no tenant: a gateway hears of it with the rest of what
    is wrong, as an admin does, not of it alone (and a tenant it may not act for stays
    PERMISSION_DENIED however its request is malformed)."""
    channel, tokens = secured
    stub = admission_pb2_grpc.AdmissionServiceStub(channel)
    gateway = (("authorization", f"Bearer {tokens['gateway']}"),)
    faulty = admission_pb2.AdmitRequest(
        tenant=OWN, request_id="r", instance="instances/gpu-0", prompt_tokens=0
    )
    release = admission_pb2.ReleaseRequest(name=f"tenants/{OWN}/r", output_tokens=-1)
    for call, fields in (
        (stub.Admit(faulty, metadata=gateway), {"tenant", "prompt_tokens", "max_output_tokens"}),
        (stub.Release(release, metadata=gateway), {"name", "output_tokens"}),
    ):
        error = await refused(call)
        assert (error.code, error.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST")
        bad = error.details["BadRequest"]
        assert isinstance(bad, error_details_pb2.BadRequest)
        assert {v.field for v in bad.field_violations} == fields
    other = admission_pb2.ReleaseRequest(
        name=f"tenants/{OTHER}/reservations/live", output_tokens=-1
    )
    denied = await refused(stub.Release(other, metadata=gateway))
    assert denied.code == grpc.StatusCode.PERMISSION_DENIED


async def test_keys_are_stored_hashed_shown_once_and_revocable(
    secured: tuple[grpc.aio.Channel, dict[str, str]], engine: AsyncEngine
) -> None:
    channel, tokens = secured
    admin = admin_pb2_grpc.AdminServiceStub(channel)
    as_admin = (("authorization", f"Bearer {tokens['admin']}"),)
    created = await admin.CreateApiKey(
        admin_pb2.CreateApiKeyRequest(
            display_name="gw-2", role=pb.ROLE_GATEWAY, tenants=["tenants/acme", "tenants/globex"]
        ),
        metadata=as_admin,
    )
    token = created.secret
    key_id, secret = access.parse_token(token) or ("", "")
    assert created.api_key.name == f"apiKeys/{key_id}"
    assert created.api_key.creator.startswith("apiKeys/")
    async with engine.connect() as conn:
        stored = (
            await conn.execute(text("SELECT * FROM api_keys WHERE key_id = :k"), {"k": key_id})
        ).one()
    assert secret not in str(tuple(stored)) and stored.secret_sha256 == access.digest(secret)
    listed = await admin.ListApiKeys(admin_pb2.ListApiKeysRequest(), metadata=as_admin)
    assert created.api_key in listed.api_keys
    assert secret not in str(listed)

    tenant = admin_pb2.GetTenantRequest(name="tenants/globex")
    await admin.GetTenant(tenant, metadata=(("authorization", f"Bearer {token}"),))
    await admin.RevokeApiKey(
        admin_pb2.RevokeApiKeyRequest(name=created.api_key.name), metadata=as_admin
    )
    # Revocation takes effect within the auth cache period (50 ms here).
    await asyncio.sleep(0.1)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await admin.GetTenant(tenant, metadata=(("authorization", f"Bearer {token}"),))
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED

    bad = [
        admin_pb2.CreateApiKeyRequest(display_name="t", role=pb.ROLE_TENANT),
        admin_pb2.CreateApiKeyRequest(
            display_name="a", role=pb.ROLE_ADMIN, tenants=["tenants/acme"]
        ),
        admin_pb2.CreateApiKeyRequest(display_name="Bad Name", role=pb.ROLE_ADMIN),
        admin_pb2.CreateApiKeyRequest(display_name="r", role=pb.ROLE_UNSPECIFIED),
    ]
    for request in bad:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await admin.CreateApiKey(request, metadata=as_admin)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    unknown = admin_pb2.CreateApiKeyRequest(
        display_name="gw-3", role=pb.ROLE_GATEWAY, tenants=["tenants/initech"]
    )
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await admin.CreateApiKey(unknown, metadata=as_admin)
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND


async def test_admin_actions_are_audited_with_principal_and_request_id(
    secured: tuple[grpc.aio.Channel, dict[str, str]],
) -> None:
    channel, tokens = secured
    admin = admin_pb2_grpc.AdminServiceStub(channel)

    def caller(role: str, request_id: str) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {tokens[role]}"), ("x-request-id", request_id))

    suspend = admin_pb2.SuspendTenantRequest(name="tenants/globex")
    await admin.SuspendTenant(suspend, metadata=caller("admin", "req-suspend"))
    with pytest.raises(grpc.aio.AioRpcError):
        await admin.ResumeTenant(
            admin_pb2.ResumeTenantRequest(name="tenants/globex"),
            metadata=caller("gateway", "req-x"),
        )
    # Reads are not audited.
    await admin.GetTenant(
        admin_pb2.GetTenantRequest(name="tenants/globex"), metadata=caller("admin", "r")
    )
    events = (
        await admin.ListAuditEvents(
            admin_pb2.ListAuditEventsRequest(), metadata=caller("admin", "list")
        )
    ).audit_events
    admin_key = f"apiKeys/{(access.parse_token(tokens['admin']) or ('', ''))[0]}"
    gateway_key = f"apiKeys/{(access.parse_token(tokens['gateway']) or ('', ''))[0]}"
    seen = [(e.principal, e.method, e.resource, e.request_id, e.code) for e in events]
    assert seen == [
        (gateway_key, "ResumeTenant", "tenants/globex", "req-x", "PERMISSION_DENIED"),
        (admin_key, "SuspendTenant", "tenants/globex", "req-suspend", "OK"),
    ]
    only_admin = await admin.ListAuditEvents(
        admin_pb2.ListAuditEventsRequest(principal=admin_key), metadata=caller("admin", "l2")
    )
    assert [e.method for e in only_admin.audit_events] == ["SuspendTenant"]
    # The server answers with the request id it used, in the answer's trailers, a refusal's
    # and a forwarded call's too; one it made itself when the caller gave none.
    call = admin.GetTenant(
        admin_pb2.GetTenantRequest(name="tenants/acme"), metadata=caller("admin", "req-echo")
    )
    await call
    assert ("x-request-id", "req-echo") in tuple(await call.trailing_metadata())
    refused = admin.GetTenant(
        admin_pb2.GetTenantRequest(name="tenants/nobody"), metadata=caller("admin", "req-404")
    )
    with pytest.raises(grpc.aio.AioRpcError) as missing:
        await refused
    assert missing.value.code() is grpc.StatusCode.NOT_FOUND
    assert ("x-request-id", "req-404") in tuple(missing.value.trailing_metadata() or ())
    made = admin.GetTenant(
        admin_pb2.GetTenantRequest(name="tenants/acme"),
        metadata=(("authorization", f"Bearer {tokens['admin']}"),),
    )
    await made
    (made_id,) = [v for k, v in await made.trailing_metadata() if k == "x-request-id"]
    assert isinstance(made_id, str) and len(made_id) == 32


async def test_cli_keys_and_audit(
    engine: AsyncEngine,
    database_url: str,
    settings: Settings,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    await add_tenant(engine, OWN)
    monkeypatch.setenv("KVQUOTA_DATABASE_URL", database_url)
    assert await asyncio.to_thread(cli_main, ["keys", "bootstrap", "first-admin"]) == 0
    token = capsys.readouterr().out.strip()
    assert access.parse_token(token) is not None
    running = await server.start(replace(settings, auth_required=True), database_url)
    try:

        def cli(*args: str) -> tuple[int, str]:
            code = cli_main([*args, "--server", f"127.0.0.1:{running.port}", "--api-key", token])
            return code, capsys.readouterr().out

        code, out = await asyncio.to_thread(
            cli, "keys", "create", "gw-eu", "--role", "gateway", "--tenant", OWN
        )
        assert code == 0
        header, row, secret = out.splitlines()
        assert header.split()[:2] == ["NAME", "DISPLAY"] and "GATEWAY" in row
        assert access.parse_token(secret) is not None
        code, out = await asyncio.to_thread(cli, "keys", "list", "--json")
        listed = {k["displayName"]: k for k in json.loads(out)}
        assert set(listed) == {"first-admin", "gw-eu"} and secret not in out
        code, out = await asyncio.to_thread(cli, "keys", "revoke", listed["gw-eu"]["name"])
        assert code == 0 and "GATEWAY" in out
        code, out = await asyncio.to_thread(cli, "audit", "--json")
        methods = [(e["principal"], e["method"]) for e in json.loads(out)]
        admin_key = listed["first-admin"]["name"]
        assert methods == [
            (admin_key, "RevokeApiKey"),
            (admin_key, "CreateApiKey"),
            ("bootstrap", "CreateApiKey"),
        ]
    finally:
        await running.stop(0)


def test_a_key_is_well_formed_and_checked_in_constant_time() -> None:
    made = access.new_secret()
    parsed = access.parse_token(made.token)
    assert parsed is not None and parsed[0] == made.key_id
    assert access.matches(parsed[1], made.digest)
    assert not access.matches(parsed[1][:-1] + "x", made.digest)
    assert access.parse_token(made.token + "x") is None


async def test_bootstrap_key(database_url: str, engine: AsyncEngine) -> None:
    key, token = await create_bootstrap_key(database_url, "root")
    assert key.role is Role.ADMIN and key.creator == access.BOOTSTRAP
    assert access.parse_token(token) is not None
