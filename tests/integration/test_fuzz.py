"""Property-based fuzzing of every RPC: requests built from the proto descriptors with extreme,
negative, zero, huge and malformed values, invalid names and other tenants' names, sent as an
admin and as a gateway of one tenant, and the same requests' bytes mutated (cut short, flipped,
spliced) so that most no longer parse. Every answer has a deliberate status code (never INTERNAL
or UNKNOWN), and a refused request changes nothing in the ledger.

Every method is fuzzed against one server and ledger (a server and a database each cost more
than a method's examples). KVQUOTA_FUZZ_EXAMPLES sets the examples per method (15 by default:
half a second each, the whole module under 20 s on two cores); `make stress` runs many more."""

from __future__ import annotations

import asyncio
import math
import os
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import grpc
import pytest
import pytest_asyncio
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from google.protobuf.duration_pb2 import Duration
from google.protobuf.field_mask_pb2 import FieldMask
from google.protobuf.message import Message
from google.protobuf.timestamp_pb2 import Timestamp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy.ext.asyncio import AsyncEngine

from kvquota.v1 import admin_pb2, admission_pb2, billing_pb2
from quota_service.api import server
from quota_service.config import Settings
from quota_service.core import access
from quota_service.core.access import Role
from quota_service.store.access import ApiKeys
from quota_service.store.database import connect
from tests.integration.ledger_fixtures import add_instance, add_tenant, snapshot

METHODS: list[MethodDescriptor] = [
    method
    for descriptor, name in (
        (admission_pb2.DESCRIPTOR, "AdmissionService"),
        (admin_pb2.DESCRIPTOR, "AdminService"),
        (billing_pb2.DESCRIPTOR, "BillingService"),
    )
    for method in descriptor.services_by_name[name].methods
]
# Every test here shares the module's server, so each runs in the module's event loop.
pytestmark = pytest.mark.asyncio(loop_scope="module")
EXAMPLES = int(os.environ.get("KVQUOTA_FUZZ_EXAMPLES", "15"))
# The client gives up on a call that is still working (a queued Admit, a watch) after this: that
# is not an answer of the server's, and the state it leaves is the work in progress.
CALL_TIMEOUT_SECONDS = 3.0
DELIBERATE = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.CANCELLED,
}

NAMES = [
    "tenants/acme",
    "tenants/globex",
    "tenants/nobody",
    "instances/gpu-0",
    "instances/gpu-9",
    "namespaces/shared",
    "tenants/acme/reservations/live",
    "tenants/globex/reservations/live",
    "tenants/acme/reservations/missing",
    "tenants/acme/pins/system",
    "reclaimJobs/1",
    "reclaimJobs/-1",
    "reclaimJobs/99999999999999999999999",
    "apiKeys/0123456789abcdef",
    "",
    "/",
    "tenants/",
    "tenants/ACME",
    "tenants/acme/",
    "tenants/acme/reservations/",
    "tenants/acme/reservations/a/b",
    "../../etc/passwd",
    "tenants/\x00",
    "tenants/é",
    "x" * 70,
    "tenants/" + "a" * 200,
    "tenants/acme/reservations/" + "r" * 129,
]
INT32 = [0, 1, -1, 2, 16, 2**31 - 1, -(2**31), 10**6]
INT64 = [*INT32, 2**63 - 1, -(2**63), 2**40]
DOUBLES = [0.0, -0.0, 1.0, -1.0, 0.5, 1e308, -1e308, math.inf, -math.inf, math.nan, 1e-320]


def _scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    kind = field.type
    if kind == FieldDescriptor.TYPE_STRING:
        return st.sampled_from(NAMES) | st.text(max_size=40)
    if kind == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=64)
    if kind == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if kind in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        if kind == FieldDescriptor.TYPE_FLOAT:
            return st.floats(width=32)
        return st.sampled_from(DOUBLES) | st.floats()
    if kind == FieldDescriptor.TYPE_ENUM:
        # Open enums: numbers this server has never heard of too.
        assert field.enum_type is not None
        return st.sampled_from([v.number for v in field.enum_type.values] + [-1, 99, 2**31 - 1])
    if kind in (FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_SINT64):
        return st.sampled_from(INT64) | st.integers(-(2**63), 2**63 - 1)
    if kind in (FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_FIXED32):
        return st.integers(0, 2**32 - 1)
    if kind in (FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_FIXED64):
        return st.integers(0, 2**64 - 1)
    return st.sampled_from(INT32) | st.integers(-(2**31), 2**31 - 1)


def _repeated_ints(field: FieldDescriptor) -> st.SearchStrategy[list[int]]:
    element = _scalar(field)
    # Token arrays: short, long, or far longer than any context (still under gRPC's limit).
    huge = st.integers(0, 2**31 - 1).map(lambda v: [v % 50_000] * 300_000)
    return st.lists(element, max_size=40) | st.lists(st.integers(0, 10), max_size=3000) | huge


def messages(descriptor: Descriptor, depth: int = 0) -> st.SearchStrategy[Message]:
    cls = message_factory.GetMessageClass(descriptor)
    if descriptor.full_name in ("google.protobuf.Timestamp", "google.protobuf.Duration"):
        extreme = st.sampled_from([0, 1, -1, 2**40, -(2**40), 2**63 - 1, -(2**63)])
        seconds = extreme | st.integers(-(10**12), 10**12)
        nanos = st.sampled_from([0, 1, -1, 999_999_999, 10**9, -(10**9), 2**31 - 1])
        # The well-known types' own classes (typed), which the factory's `cls` is.
        timed = Timestamp if descriptor.full_name == "google.protobuf.Timestamp" else Duration
        return st.builds(lambda s, n: timed(seconds=s, nanos=n), seconds, nanos)
    if descriptor.full_name == "google.protobuf.FieldMask":
        return st.builds(
            lambda p: FieldMask(paths=p), st.lists(st.sampled_from(["quota", "x", "", "a.b"]))
        )
    values: dict[str, st.SearchStrategy[Any]] = {}
    for field in descriptor.fields:
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            continue  # no request carries a map
        if field.message_type is not None:
            if depth >= 2:
                continue
            inner = messages(field.message_type, depth + 1)
            values[field.name] = st.lists(inner, max_size=3) if _is_repeated(field) else inner
        elif _is_repeated(field):
            if field.type == FieldDescriptor.TYPE_STRING:
                values[field.name] = st.lists(_scalar(field), max_size=5)
            else:
                values[field.name] = _repeated_ints(field)
        else:
            values[field.name] = _scalar(field)
    present = st.fixed_dictionaries({}, optional=values)

    def build(chosen: dict[str, Any]) -> Message:
        message = cls()
        for name, value in chosen.items():
            field = descriptor.fields_by_name[name]
            if field.containing_oneof is not None and message.WhichOneof(
                field.containing_oneof.name
            ):
                continue
            target = getattr(message, name)
            if _is_repeated(field):
                if field.message_type is not None:
                    for item in value:
                        target.add().CopyFrom(item)
                else:
                    target.extend(value)
            elif field.message_type is not None:
                target.CopyFrom(value)
            else:
                setattr(message, name, value)
        return message

    return present.map(build)


def _is_repeated(field: FieldDescriptor) -> bool:
    return bool(field.is_repeated)


def mutated(raw: bytes) -> st.SearchStrategy[bytes]:
    """A request's bytes cut short, with bytes flipped, dropped or inserted, or spliced."""
    at = st.integers(0, len(raw))
    return st.one_of(
        at.map(lambda i: raw[:i]),
        st.builds(lambda i, b: raw[:i] + bytes([b]) + raw[i + 1 :], at, st.integers(0, 255)),
        st.builds(lambda i, n: raw[:i] + raw[i + n :], at, st.integers(1, 8)),
        st.builds(lambda i, junk: raw[:i] + junk + raw[i:], at, st.binary(min_size=1, max_size=8)),
        st.builds(lambda i, j: raw[:i] + raw[j:] + raw[i:j], at, at),
    )


def _as_is(raw: bytes) -> bytes:
    return raw


async def call(
    channel: grpc.aio.Channel, method: MethodDescriptor, request: Message | bytes, token: str
) -> tuple[grpc.StatusCode, str]:
    """Send a request, or bytes as they are, and tell how the call ended."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    payload = request if isinstance(request, bytes) else request.SerializeToString()
    metadata = (("authorization", f"Bearer {token}"),)
    try:
        if method.server_streaming:
            stream = channel.unary_stream(path, _as_is, _as_is)
            async for _ in stream(payload, metadata=metadata, timeout=CALL_TIMEOUT_SECONDS):
                pass
        else:
            unary = channel.unary_unary(path, _as_is, _as_is)
            await unary(payload, metadata=metadata, timeout=CALL_TIMEOUT_SECONDS)
    except grpc.aio.AioRpcError as error:
        return error.code(), error.details() or ""
    return grpc.StatusCode.OK, ""


class Target:
    """A server on a seeded ledger, and the keys to call it with."""

    def __init__(self, channel: grpc.aio.Channel, engine: AsyncEngine, tokens: dict[str, str]):
        self.channel = channel
        self.engine = engine
        self.tokens = tokens
        self.loop = asyncio.get_running_loop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def target(module_database_url: str, settings: Settings) -> AsyncIterator[Target]:
    """One server and ledger for every method: each call is checked against the ledger as it
    was just before it, so what earlier calls left there is only more to fuzz against."""
    engine = connect(module_database_url)
    await add_instance(engine, blocks=64)
    for tenant in ("acme", "globex"):
        await add_tenant(engine, tenant)
    keys = ApiKeys(engine)
    tokens = {
        "admin": (await keys.create("ops", Role.ADMIN, [], access.BOOTSTRAP))[1],
        "gateway": (await keys.create("gw", Role.GATEWAY, ["acme"], access.BOOTSTRAP))[1],
    }
    # No background sweep while the fuzz runs: a call is judged by what changed in the record
    # around it, and the sweep would end leases, run reclaim steps and start jobs meanwhile
    # (what earlier calls left there).
    quiet = replace(
        settings,
        auth_required=True,
        reaper_interval_seconds=3600.0,
        reclaim_policy_max_tier="none",
    )
    running = await server.start(quiet, module_database_url)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
        for tenant in ("acme", "globex"):
            request = admission_pb2.AdmitRequest(
                tenant=f"tenants/{tenant}",
                request_id="live",
                instance="instances/gpu-0",
                prompt_tokens=32,
                max_output_tokens=16,
            )
            await call(channel, METHODS[0], request, tokens["admin"])
        yield Target(channel, engine, tokens)
    await running.stop(0)
    await engine.dispose()


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.name)
async def test_every_rpc_answers_deliberately_and_refusals_change_nothing(
    target: Target, method: MethodDescriptor
) -> None:
    failures: list[str] = []

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
    )
    @given(
        request=messages(method.input_type),
        role=st.sampled_from(["admin", "admin", "gateway"]),
        data=st.data(),
    )
    def fuzz(request: Message, role: str, data: st.DataObject) -> None:
        for sent in (request, data.draw(mutated(request.SerializeToString()))):
            future = asyncio.run_coroutine_threadsafe(one(sent, role), target.loop)
            failure = future.result()
            if failure:
                failures.append(failure)
                raise AssertionError(failure)

    async def one(request: Message | bytes, role: str) -> str:
        before = await snapshot(target.engine)
        code, details = await call(target.channel, method, request, target.tokens[role])
        if code not in DELIBERATE:
            return f"{method.name} as {role}: {code.name} {details!r} for {request!r:.300}"
        refused = code not in (grpc.StatusCode.OK, grpc.StatusCode.DEADLINE_EXCEEDED)
        if refused and await snapshot(target.engine) != before:
            return f"{method.name} as {role}: refused with {code.name} yet changed the ledger"
        return ""

    await asyncio.to_thread(fuzz)
    assert not failures


async def test_oversized_messages_are_refused(target: Target) -> None:
    request = admission_pb2.AdmitRequest(
        tenant="tenants/acme",
        request_id="huge",
        instance="instances/gpu-0",
        prompt_tokens=1,
        max_output_tokens=1,
        prompt_token_ids=[2**31 - 1] * (server.MAX_MESSAGE_BYTES // 4),
    )
    before = await snapshot(target.engine)
    code, _ = await call(target.channel, METHODS[0], request, target.tokens["admin"])
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert await snapshot(target.engine) == before


@pytest.mark.parametrize(
    ("seconds", "nanos"),
    [(2**63 - 1, 0), (-(2**63), 0), (0, 10**9), (1, -1), (315_576_000_001, 0)],
)
async def test_out_of_range_durations_and_timestamps_are_invalid(
    target: Target, seconds: int, nanos: int
) -> None:
    """Values protobuf itself would refuse to convert: each is INVALID_ARGUMENT, never INTERNAL."""
    duration = Duration(seconds=seconds, nanos=nanos)
    stamp = Timestamp(seconds=seconds, nanos=nanos)
    requests: dict[str, Message] = {
        "Admit": admission_pb2.AdmitRequest(
            tenant="tenants/acme",
            request_id="ttl",
            instance="instances/gpu-0",
            prompt_tokens=1,
            max_output_tokens=1,
            lease_ttl=duration,
        ),
        "RenewLease": admission_pb2.RenewLeaseRequest(
            name="tenants/acme/reservations/live", lease_ttl=duration
        ),
        "RegisterInstance": admin_pb2.RegisterInstanceRequest(
            instance_id="gpu-1", block_size=16, num_gpu_blocks=8, target_ttft=duration
        ),
        "ExportUsage": billing_pb2.ExportUsageRequest(start_time=stamp, end_time=stamp),
    }
    by_name = {m.name: m for m in METHODS}
    for name, request in requests.items():
        before = await snapshot(target.engine)
        code, _ = await call(target.channel, by_name[name], request, target.tokens["admin"])
        assert code == grpc.StatusCode.INVALID_ARGUMENT, name
        assert await snapshot(target.engine) == before
    wait = admission_pb2.AdmitRequest(
        tenant="tenants/acme",
        request_id="wait",
        instance="instances/gpu-0",
        prompt_tokens=1,
        max_output_tokens=1,
        wait_timeout=duration,
    )
    code, _ = await call(target.channel, by_name["Admit"], wait, target.tokens["admin"])
    assert code == grpc.StatusCode.INVALID_ARGUMENT
