"""Driving the hot path as gateways do: Admit, then Release, over gRPC, from this process (the
server runs in others). Closed loop: N clients each as fast as answers come back. Open loop:
arrivals at a fixed mean rate (Poisson), each Admit timed from its scheduled arrival, so a slow
server cannot slow the load down and hide its own latency (no coordinated omission)."""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import grpc
from google.protobuf.duration_pb2 import Duration

from kvquota.v1 import admin_pb2, admin_pb2_grpc, admission_pb2, admission_pb2_grpc
from kvquota.v1 import resources_pb2 as pb
from quota_service.core.geometry import blocks_for_request

T = TypeVar("T")

BLOCK_SIZE = 16
BIG = 10**12
# Open-loop arrivals beyond this many unanswered are dropped (and counted), not queued here.
MAX_IN_FLIGHT = 2000


@dataclass(frozen=True)
class Shape:
    """One request: 1280 prompt + 256 output tokens = 96 blocks of 16. With a shared prefix, the
    prompt's token ids are sent: its first `prefix_tokens` are the same for every request of a
    tenant, the rest unique to the request (so those blocks are new, and cached once released)."""

    prompt_tokens: int = 1280
    output_tokens: int = 256
    prefix_tokens: int = 0

    @property
    def blocks(self) -> int:
        return blocks_for_request(self.prompt_tokens, self.output_tokens, 1, BLOCK_SIZE)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (nearest rank); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def say(message: str, end: str = "\n") -> None:
    """Progress, on stderr."""
    print(message, end=end, file=sys.stderr, flush=True)


class Gateway:
    """gRPC channels to the servers, calls spread over them round-robin by client, with the API
    key (when there is one) in every call's metadata."""

    def __init__(self, addresses: Sequence[str], token: str | None = None) -> None:
        self._channels = [grpc.aio.insecure_channel(a) for a in addresses]
        self.metadata: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {token}"),) if token else ()
        )
        self._admission = [admission_pb2_grpc.AdmissionServiceStub(c) for c in self._channels]
        self.admin = admin_pb2_grpc.AdminServiceStub(self._channels[0])

    def admission(self, client: int) -> admission_pb2_grpc.AdmissionServiceAsyncStub:
        return self._admission[client % len(self._admission)]

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()

    async def __aenter__(self) -> Gateway:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def with_ticker(label: str, work: Awaitable[T]) -> T:
    """Await `work`, saying every few seconds how long it has taken."""
    began = time.perf_counter()

    async def tick() -> None:
        while True:
            await asyncio.sleep(5)
            say(f"  {label}: {time.perf_counter() - began:.0f} s…")

    ticker = asyncio.create_task(tick())
    try:
        return await work
    finally:
        ticker.cancel()


async def register_instance(
    gateway: Gateway, instance: str, slots: int, max_model_len: int = 32_768
) -> float:
    """An instance of `slots` block slots (one row each); returns the seconds it took."""
    say(f"registering instances/{instance} with {slots:,} block slots")
    began = time.perf_counter()
    request = admin_pb2.RegisterInstanceRequest(
        instance_id=instance,
        block_size=BLOCK_SIZE,
        max_model_len=max_model_len,
        num_gpu_blocks=slots,
    )
    call = gateway.admin.RegisterInstance(request, metadata=gateway.metadata, timeout=3600)
    await with_ticker(f"registering {slots:,} slots", call)
    return time.perf_counter() - began


async def create_tenants(
    gateway: Gateway, tenants: Sequence[str], weights: Sequence[int] | None = None
) -> None:
    """Tenants with quotas nothing in the benchmarks reaches."""
    quota = pb.TenantQuota(
        max_blocks=BIG,
        max_tokens_in_flight=BIG,
        max_queued_requests=100_000,
        max_pinned_blocks=BIG,
        max_cpu_tier_bytes=BIG,
    )
    for i, tenant in enumerate(tenants):
        weight = weights[i] if weights else 1
        await gateway.admin.CreateTenant(
            admin_pb2.CreateTenantRequest(
                tenant_id=tenant, tenant=pb.Tenant(quota=quota, weight=weight)
            ),
            metadata=gateway.metadata,
        )


_PREFIXES: dict[int, list[int]] = {}
_SEQUENCE = itertools.count()


def admit_request(
    shape: Shape,
    tenant: str,
    request_id: str,
    instance: str,
    *,
    wait_seconds: float = 0.0,
    lease_seconds: float = 0.0,
) -> admission_pb2.AdmitRequest:
    request = admission_pb2.AdmitRequest(
        tenant=f"tenants/{tenant}",
        request_id=request_id,
        instance=f"instances/{instance}",
        prompt_tokens=shape.prompt_tokens,
        max_output_tokens=shape.output_tokens,
    )
    if shape.prefix_tokens:
        prefix = _PREFIXES.get(shape.prefix_tokens)
        if prefix is None:
            prefix = _PREFIXES[shape.prefix_tokens] = list(range(1, shape.prefix_tokens + 1))
        # The unique part: one token that differs in its first block makes every block after
        # it differ too (block hashes are chained).
        unique = 1_000_000 + next(_SEQUENCE)
        rest = shape.prompt_tokens - shape.prefix_tokens
        request.prompt_token_ids.extend(prefix)
        request.prompt_token_ids.extend([unique] * rest)
    if wait_seconds:
        request.wait_timeout.CopyFrom(_duration(wait_seconds))
    if lease_seconds:
        request.lease_ttl.CopyFrom(_duration(lease_seconds))
    return request


def _duration(seconds: float) -> Duration:
    whole = int(seconds)
    return Duration(seconds=whole, nanos=int((seconds - whole) * 1e9))


@dataclass
class LoadResult:
    """What one load run saw."""

    seconds: float = 0.0
    pairs: int = 0
    admit_ms: list[float] = field(default_factory=list)
    release_ms: list[float] = field(default_factory=list)
    # Admits that waited in the queue: their latency, which is their queue wait.
    queued_ms: list[float] = field(default_factory=list)
    refused: Counter[str] = field(default_factory=Counter)
    per_tenant: Counter[str] = field(default_factory=Counter)
    dropped: int = 0  # open loop: arrivals not sent, too many unanswered
    driver_cpu_seconds: float = 0.0
    first_refusal: str = ""

    @property
    def pairs_per_second(self) -> float:
        return self.pairs / self.seconds if self.seconds else 0.0


def _refusal(error: grpc.aio.AioRpcError) -> str:
    code = error.code()
    return code.name if code is not None else "UNKNOWN"


async def _pair(
    gateway: Gateway,
    client: int,
    request: admission_pb2.AdmitRequest,
    started: float,
    result: LoadResult,
    hold_seconds: float,
    counting: Callable[[], bool],
) -> None:
    """One Admit (timed from `started`), a hold, then its Release."""
    stub = gateway.admission(client)
    try:
        admitted = await stub.Admit(request, metadata=gateway.metadata, timeout=120)
    except grpc.aio.AioRpcError as error:
        if counting():
            result.refused[_refusal(error)] += 1
            if not result.first_refusal:
                result.first_refusal = f"{_refusal(error)}: {error.details()}"
        return
    admit_seconds = time.perf_counter() - started
    if hold_seconds:
        await asyncio.sleep(hold_seconds)
    released = time.perf_counter()
    release = admission_pb2.ReleaseRequest(name=admitted.reservation.name, output_tokens=1)
    await stub.Release(release, metadata=gateway.metadata, timeout=120)
    if counting():
        result.admit_ms.append(admit_seconds * 1000)
        result.release_ms.append((time.perf_counter() - released) * 1000)
        if admitted.reservation.HasField("queue_time"):
            result.queued_ms.append(admit_seconds * 1000)
        result.per_tenant[request.tenant.removeprefix("tenants/")] += 1
        result.pairs += 1


async def one_pair(gateway: Gateway, instance: str, tenant: str) -> None:
    """One Admit and its Release, each answered (a refusal raises): before the load point of a
    server that has just started, so that what it does once (its first connections, to
    PostgreSQL and to the other replicas) is not in the point. On a slow machine under other
    load a forwarding replica's first calls took the whole of a smoke form's point."""
    stub = gateway.admission(0)
    request = admit_request(Shape(), tenant, f"one-pair-{next(_SEQUENCE)}", instance)
    admitted = await stub.Admit(request, metadata=gateway.metadata, timeout=120)
    release = admission_pb2.ReleaseRequest(name=admitted.reservation.name)
    await stub.Release(release, metadata=gateway.metadata, timeout=120)


async def _progress(label: str, result: LoadResult, deadline: float) -> None:
    """The pairs so far, every second until the deadline and not past it: the load waits
    for this to end, and a smoke form's point lasts well under a second."""
    while (left := deadline - time.perf_counter()) > 0:
        await asyncio.sleep(min(1.0, left))
        say(f"\r  {label}: {result.pairs} pairs", end="")
    say("")


def warmup_seconds(seconds: float) -> float:
    """A closed loop's warm-up (connections made, the server's caches filled): half a second,
    or the load point's own length when that is shorter (the smoke form's points)."""
    return min(0.5, seconds)


async def closed_loop(
    gateway: Gateway,
    instance: str | Sequence[str],
    tenants: Sequence[str],
    shape: Shape,
    concurrency: int,
    seconds: float,
    *,
    label: str = "",
    hold_seconds: float = 0.0,
    wait_seconds: float = 0.0,
) -> LoadResult:
    """`concurrency` clients, each Admit then Release in a loop for `seconds` (after a warm-up
    whose calls are not counted); client c acts for tenant c mod len(tenants), on instance c mod
    len(instances) when several are given."""
    instances = [instance] if isinstance(instance, str) else list(instance)
    result = LoadResult()
    run = next(_SEQUENCE)
    began = time.perf_counter() + warmup_seconds(seconds)
    deadline = began + seconds

    def counting() -> bool:
        return began <= time.perf_counter() <= deadline

    async def client(c: int) -> None:
        tenant = tenants[c % len(tenants)]
        for i in itertools.count():
            now = time.perf_counter()
            if now >= deadline:
                return
            request_id = f"{label or 'closed'}-{run}-c{c}-{i}"
            on = instances[c % len(instances)]
            request = admit_request(shape, tenant, request_id, on, wait_seconds=wait_seconds)
            await _pair(gateway, c, request, now, result, hold_seconds, counting)

    cpu = time.process_time()
    await asyncio.gather(
        _progress(label or "closed loop", result, deadline),
        *(client(c) for c in range(concurrency)),
    )
    result.seconds = min(time.perf_counter(), deadline) - began
    result.driver_cpu_seconds = time.process_time() - cpu
    return result


async def open_loop(
    gateway: Gateway,
    instance: str,
    tenants: Sequence[str],
    shape: Shape,
    rate: float,
    seconds: float,
    *,
    label: str = "",
    seed: int = 1,
) -> LoadResult:
    """Admit+Release pairs arriving at `rate` per second on average (Poisson) for `seconds`;
    each Admit is timed from the moment it was due, however late this process sent it."""
    result = LoadResult()
    rng = random.Random(seed)
    run = next(_SEQUENCE)
    tasks: set[asyncio.Task[None]] = set()
    began = time.perf_counter()
    deadline = began + seconds
    cpu = time.process_time()
    progress = asyncio.create_task(_progress(label or "open loop", result, deadline))
    due = began
    for n in itertools.count():
        due += rng.expovariate(rate)
        if due >= deadline:
            break
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if len(tasks) >= MAX_IN_FLIGHT:
            result.dropped += 1
            continue
        tenant = tenants[n % len(tenants)]
        request = admit_request(shape, tenant, f"{label or 'open'}-{run}-{n}", instance)
        task = asyncio.create_task(_pair(gateway, n, request, due, result, 0.0, lambda: True))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    await progress
    if tasks:
        await asyncio.gather(*tasks)
    result.seconds = seconds
    result.driver_cpu_seconds = time.process_time() - cpu
    return result


async def hold(
    gateway: Gateway,
    instance: str,
    tenant: str,
    shape: Shape,
    count: int,
    *,
    concurrency: int = 8,
    label: str = "hold",
    lease_seconds: float = 3600.0,
) -> list[str]:
    """Admit `count` requests and keep them (long leases); returns their reservation names."""
    names: list[str] = []
    numbers = iter(range(count))
    began = time.perf_counter()

    async def client(c: int) -> None:
        for i in numbers:
            request = admit_request(
                shape, tenant, f"{label}-{i}", instance, lease_seconds=lease_seconds
            )
            admitted = await gateway.admission(c).Admit(
                request, metadata=gateway.metadata, timeout=600
            )
            names.append(admitted.reservation.name)

    async def progress() -> None:
        while len(names) < count:
            await asyncio.sleep(2)
            rate = len(names) / (time.perf_counter() - began)
            say(f"\r  {label}: {len(names):,} of {count:,} admitted ({rate:.0f}/s)", end="")

    ticker = asyncio.create_task(progress())
    try:
        await asyncio.gather(*(client(c) for c in range(concurrency)))
    finally:
        ticker.cancel()
        say(f"\r  {label}: {len(names):,} of {count:,} admitted")
    return names
