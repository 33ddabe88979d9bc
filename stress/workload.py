"""The load of a stress run: gateway clients admitting, running on the simulated engines,
releasing, cancelling, giving single blocks back, renewing, suspending and resuming; and an
operator pinning, reclaiming, rotating salts and offboarding tenants. Every answer is tallied by
its status code, and what the service acknowledged is remembered, to check that nothing is lost."""

from __future__ import annotations

import asyncio
import random
import zlib
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
import httpx
from google.protobuf.duration_pb2 import Duration
from google.rpc import error_details_pb2, status_pb2

from kvquota.v1 import admin_pb2, admin_pb2_grpc, admission_pb2, admission_pb2_grpc
from kvquota.v1 import resources_pb2 as pb
from quota_service.api.error_status import STATUS_DETAILS_KEY

CALL_TIMEOUT_SECONDS = 10.0
REMEMBERED = 32
PREFIX_TOKENS = 64
# Codes that are a bug whenever they appear.
BUGS = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
T = TypeVar("T")


@dataclass
class Tally:
    ops: Counter[tuple[str, str]] = field(default_factory=Counter)
    # Refusals by code and ErrorInfo reason.
    reasons: Counter[tuple[str, str]] = field(default_factory=Counter)
    # Broken promises of DESIGN.md's invariant 5 (idempotency), as seen by the callers.
    idempotency: list[str] = field(default_factory=list)
    # Reservation names the service said it admitted, and those it said it ended.
    admitted: set[str] = field(default_factory=set)
    ended: set[str] = field(default_factory=set)
    offboarded: set[str] = field(default_factory=set)

    @property
    def bugs(self) -> int:
        return sum(n for (_, code), n in self.ops.items() if grpc.StatusCode[code] in BUGS)


def _reason(error: grpc.aio.AioRpcError) -> str:
    raw = dict(error.trailing_metadata() or ()).get(STATUS_DETAILS_KEY)
    if not isinstance(raw, bytes):
        return "-"
    for detail in status_pb2.Status.FromString(raw).details:
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            return str(info.reason)
    return "-"


@dataclass
class Live:
    name: str
    tenant: str
    instance: str
    prompt: list[int]
    handles: list[pb.BlockHandle]
    suspended: bool = False


class Client:
    """One caller: a key, a set of tenants, channels to every server (it moves on to the next
    server when one is unavailable), and what it holds."""

    def __init__(
        self,
        name: str,
        addresses: list[str],
        key: str,
        tenants: list[str],
        engines: dict[str, str],
        tally: Tally,
        rng: random.Random,
    ) -> None:
        self.name = name
        self._channels = [grpc.aio.insecure_channel(a) for a in addresses]
        self._current = rng.randrange(len(self._channels))
        self._metadata = (("authorization", f"Bearer {key}"),)
        self.tenants = tenants
        self.engines = engines
        self.tally = tally
        self.rng = rng
        self.live: list[Live] = []
        # Recent admissions, to send again (invariant 5).
        self.sent: list[tuple[admission_pb2.AdmitRequest, pb.Reservation]] = []
        self.released: list[tuple[str, int]] = []
        # Reservations a suspend was sent for: a reclaim may offload them, and a resume from the
        # CPU tier admits them again (a new admit_time).
        self.suspended_ever: set[str] = set()
        self._sequence = 0
        self.unreachable = False
        self.last_refusal: str | None = None  # the reason of the last call that failed
        self._http = httpx.AsyncClient(timeout=30)
        self._running: set[asyncio.Task[None]] = set()

    def _admission(self) -> admission_pb2_grpc.AdmissionServiceAsyncStub:
        return admission_pb2_grpc.AdmissionServiceStub(self._channels[self._current])

    def _admin(self) -> admin_pb2_grpc.AdminServiceAsyncStub:
        return admin_pb2_grpc.AdminServiceStub(self._channels[self._current])

    async def call(self, op: str, rpc: Callable[..., Awaitable[T]], request: Any) -> T | None:
        try:
            answer = await rpc(request, metadata=self._metadata, timeout=CALL_TIMEOUT_SECONDS)
        except grpc.aio.AioRpcError as error:
            reason = self.last_refusal = _reason(error)
            self.tally.ops[(op, error.code().name)] += 1
            self.tally.reasons[(error.code().name, reason)] += 1
            # The server or its database is down (not a refusal like INSTANCE_OVERLOADED): try
            # the next server from now on.
            self.unreachable = error.code() is grpc.StatusCode.UNAVAILABLE and reason in (
                "-",
                "DATABASE_UNAVAILABLE",
            )
            if self.unreachable:
                self._current = (self._current + 1) % len(self._channels)
            return None
        self.tally.ops[(op, "OK")] += 1
        return answer

    def _next(self) -> int:
        self._sequence += 1
        return self._sequence

    def _request_id(self) -> str:
        return f"{self.name}-{self._next()}"

    def prompt(self, tenant: str) -> list[int]:
        # A few shared prefixes per tenant, then a tail of its own.
        head = self.rng.randrange(4) * 10_000 + zlib.crc32(tenant.encode()) % 1000
        prefix = list(range(head, head + PREFIX_TOKENS))
        return prefix + [self.rng.randrange(50_000) for _ in range(self.rng.randrange(0, 200))]

    async def admit(self, tenant: str) -> None:
        instance = self.rng.choice(list(self.engines))
        prompt = self.prompt(tenant)
        wait = Duration()
        if self.rng.random() < 0.4:
            wait.FromMilliseconds(self.rng.randrange(200, 2000))
        request = admission_pb2.AdmitRequest(
            tenant=f"tenants/{tenant}",
            request_id=self._request_id(),
            instance=f"instances/{instance}",
            prompt_tokens=len(prompt),
            max_output_tokens=self.rng.randrange(8, 64),
            n=2 if self.rng.random() < 0.1 else 1,
            priority=self.rng.randrange(3),
            prompt_token_ids=prompt,
            wait_timeout=wait,
            lease_ttl=Duration(seconds=self.rng.randrange(5, 30)),
        )
        answer = await self.call("admit", self._admission().Admit, request)
        if answer is None and self.unreachable:
            # What a gateway does when it cannot tell whether the admission happened: the same
            # request again, on the next server; the ledger must not admit it twice.
            answer = await self.call("admit_retry", self._admission().Admit, request)
        if answer is None:
            return
        reservation = answer.reservation
        self.sent.append((request, reservation))
        del self.sent[:-REMEMBERED]
        self.tally.admitted.add(reservation.name)
        live = Live(reservation.name, tenant, instance, prompt, list(reservation.block_table))
        if self.rng.random() < 0.5:
            task = asyncio.create_task(self._run(live, answer.cache_salt, request))
            self._running.add(task)
            task.add_done_callback(self._running.discard)
        else:
            self.live.append(live)

    async def _run(self, live: Live, salt: str, request: admission_pb2.AdmitRequest) -> None:
        """What a gateway does with an admitted request: run it on the engine, then release."""
        body = {
            "model": "simulated",
            "prompt": live.prompt,
            "max_tokens": request.max_output_tokens,
            "request_id": request.request_id,
            "cache_salt": salt,
        }
        output = 0
        try:
            reply = await self._http.post(
                f"{self.engines[live.instance]}/v1/completions", json=body
            )
            output = int(reply.json()["usage"]["completion_tokens"])
        except (httpx.HTTPError, ValueError, KeyError):
            pass  # the engine died under it: release all the same
        await self.release(live, output)

    async def release(self, live: Live, output: int = 0) -> None:
        request = admission_pb2.ReleaseRequest(name=live.name, output_tokens=output)
        answer = await self.call("release", self._admission().Release, request)
        if answer is not None:
            self.tally.ended.add(live.name)
            self.released.append((live.name, answer.output_tokens))
            del self.released[:-REMEMBERED]

    async def repeat(self) -> None:
        """Invariant 5 from outside: an Admit sent again returns the same reservation, a
        Release sent again (with other figures) changes nothing."""
        admission = self._admission()
        if self.sent and self.rng.random() < 0.5:
            request, first = self.rng.choice(self.sent)
            again = await self.call("admit_again", admission.Admit, request)
            if again is None and self.last_refusal == "REQUEST_ID_REUSED":
                self.tally.idempotency.append(f"{first.name} sent again was refused as reused")
            # The same reservation: admitted at the same moment (its name alone is made of the
            # request's own tenant and request_id).
            if (
                again is not None
                and first.name not in self.suspended_ever
                and again.reservation.admit_time != first.admit_time
            ):
                self.tally.idempotency.append(f"{first.name} admitted again, anew")
        elif self.released:
            name, output = self.rng.choice(self.released)
            release = admission_pb2.ReleaseRequest(name=name, output_tokens=output + 7)
            ended = await self.call("release_again", admission.Release, release)
            if ended is not None and ended.output_tokens != output:
                self.tally.idempotency.append(
                    f"{name} released again: output {output} became {ended.output_tokens}"
                )

    def _take(self) -> Live | None:
        if not self.live:
            return None
        return self.live.pop(self.rng.randrange(len(self.live)))

    async def step(self) -> None:
        """One random operation."""
        roll = self.rng.random()
        tenant = self.rng.choice(self.tenants)
        if roll < 0.05:
            await self.repeat()
            return
        if roll < 0.45 or not self.live:
            await self.admit(tenant)
            return
        live = self._take()
        assert live is not None
        admission = self._admission()
        if roll < 0.6:
            await self.release(live, self.rng.randrange(64))
        elif roll < 0.67:
            request = admission_pb2.CancelRequest(name=live.name)
            if await self.call("cancel", admission.Cancel, request) is not None:
                self.tally.ended.add(live.name)
        elif roll < 0.75 and len(live.handles) > 2:
            tail = live.handles[-self.rng.randrange(1, 3) :]
            request_blocks = admission_pb2.ReleaseBlocksRequest(name=live.name, handles=tail)
            if await self.call("release_blocks", admission.ReleaseBlocks, request_blocks):
                live.handles = live.handles[: -len(tail)]
            self.live.append(live)
        elif roll < 0.83:
            renew = admission_pb2.RenewLeaseRequest(name=live.name, lease_ttl=Duration(seconds=20))
            await self.call("renew", admission.RenewLease, renew)
            self.live.append(live)
        elif not live.suspended:
            suspend = admission_pb2.SuspendReservationRequest(
                name=live.name, session_token_ids=live.prompt
            )
            self.suspended_ever.add(live.name)
            if await self.call("suspend", admission.SuspendReservation, suspend):
                live.suspended = True
            self.live.append(live)
        else:
            resume = admission_pb2.ResumeReservationRequest(
                name=live.name, wait_timeout=Duration(seconds=1)
            )
            if await self.call("resume", admission.ResumeReservation, resume):
                live.suspended = False
            self.live.append(live)

    async def close(self) -> None:
        for task in list(self._running):
            task.cancel()
        await asyncio.gather(*self._running, return_exceptions=True)
        await self._http.aclose()
        for channel in self._channels:
            await channel.close()


class Operator(Client):
    """The admin: pins and unpins, reclaims, rotates salts, and offboards tenants it made for
    the purpose (admitting work for them first, so that there is something to give back)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pins: list[str] = []

    async def step(self) -> None:
        admin = self._admin()
        roll = self.rng.random()
        instance = self.rng.choice(list(self.engines))
        if roll < 0.3:
            tenant = self.rng.choice(self.tenants)
            request = admin_pb2.PinPrefixRequest(
                parent=f"tenants/{tenant}",
                pin_id=f"p{self._next()}",
                instance=f"instances/{instance}",
                token_ids=self.prompt(tenant)[:PREFIX_TOKENS],
            )
            pin = await self.call("pin", admin.PinPrefix, request)
            if pin is not None:
                self.pins.append(pin.name)
        elif roll < 0.5 and self.pins:
            name = self.pins.pop(self.rng.randrange(len(self.pins)))
            await self.call("unpin", admin.UnpinPrefix, admin_pb2.UnpinPrefixRequest(name=name))
        elif roll < 0.8:
            tiers = [pb.RECLAIM_TIER_FREE, pb.RECLAIM_TIER_OFFLOAD, pb.RECLAIM_TIER_EVICT]
            request_job = admin_pb2.CreateReclaimJobRequest(
                instance=f"instances/{instance}",
                target_blocks=self.rng.randrange(4, 64),
                max_tier=self.rng.choice(tiers),
                dry_run=self.rng.random() < 0.3,
                request_id=self._request_id(),
            )
            await self.call("reclaim", admin.CreateReclaimJob, request_job)
        elif roll < 0.9:
            tenant = self.rng.choice(self.tenants)
            rotate = admin_pb2.RotateCacheSaltRequest(name=f"tenants/{tenant}")
            await self.call("rotate_salt", admin.RotateCacheSalt, rotate)
        else:
            await self.offboard()

    async def offboard(self) -> None:
        admin = self._admin()
        tenant = f"gone-{self._next()}"
        quota = pb.TenantQuota(
            max_blocks=256,
            max_tokens_in_flight=100_000,
            max_queued_requests=8,
            max_pinned_blocks=32,
            max_cpu_tier_bytes=0,
        )
        create = admin_pb2.CreateTenantRequest(tenant_id=tenant, tenant=pb.Tenant(quota=quota))
        if await self.call("create_tenant", admin.CreateTenant, create) is None:
            return
        for _ in range(3):
            await self.admit(tenant)
        self.live = [live for live in self.live if live.tenant != tenant]
        self.tally.offboarded.add(tenant)
        delete = admin_pb2.DeleteTenantRequest(name=f"tenants/{tenant}")
        await self.call("offboard", admin.DeleteTenant, delete)
