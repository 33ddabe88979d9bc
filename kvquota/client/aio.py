"""The asyncio client: every RPC of the three services, typed as the generated stubs type them,
called with the caller's credentials and request id, retried as kvquota says (retrying.py), and
failed over between the addresses it was given."""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, cast

import grpc
from google.protobuf.message import Message

from kvquota.client.channels import Tls, shared_channels
from kvquota.client.errors import from_rpc_error
from kvquota.client.reservations import (
    END_TIMEOUT_SECONDS,
    REQUEST_ID_KEY,
    OnLost,
    ReservationScope,
)
from kvquota.client.retrying import DEFAULT_RETRY, RetryPolicy, next_retry
from kvquota.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    admission_pb2,
    admission_pb2_grpc,
    billing_pb2,
    billing_pb2_grpc,
)

# The request id calls made in this context carry as x-request-id, unless their metadata names
# one: a gateway sets it to its own incoming request's id, so kvquota's logs and audit say
# which request a call was made for. Unset: each call gets a new one.
current_request_id: ContextVar[str | None] = ContextVar("kvquota_request_id", default=None)

Metadata = Sequence[tuple[str, str | bytes]]

_SERVER_STREAMING = frozenset(
    method.name
    for module in (admission_pb2, admin_pb2, billing_pb2)
    for service in module.DESCRIPTOR.services_by_name.values()
    for method in service.methods
    if method.server_streaming
)


@dataclass(frozen=True, slots=True)
class _Stubs:
    admission: admission_pb2_grpc.AdmissionServiceAsyncStub
    admin: admin_pb2_grpc.AdminServiceAsyncStub
    billing: billing_pb2_grpc.BillingServiceAsyncStub


class _Rpcs:
    """Stands in for one service's generated stub: each attribute is one of its methods, called
    as the stub's are (`await rpcs.Admit(request, timeout=..., metadata=...)`, `async for` over
    a server stream) through the client."""

    def __init__(self, client: AsyncKvquotaClient, service: str) -> None:
        self._client = client
        self._service = service

    def __getattr__(self, method: str) -> Callable[..., Any]:
        def call(
            request: Message, *, timeout: float | None = None, metadata: Metadata | None = None
        ) -> Awaitable[Any] | AsyncIterator[Any]:
            # Resolved here, in the caller's context (the sync client runs the call elsewhere).
            sent = self._client._metadata(metadata)
            if method in _SERVER_STREAMING:
                return self._client._stream(self._service, method, request, timeout, sent)
            return self._client._unary(self._service, method, request, timeout, sent)

        return call


class AsyncKvquotaClient:
    """A client of kvquota servers for one asyncio event loop.

    `addresses`: one `host:port`, or several replicas of one deployment, tried in order when
    one cannot answer. `api_key` is sent as `authorization: Bearer`; `tls` turns on TLS (and
    mutual TLS with a client certificate). `retry` is the budget of each call.
    """

    def __init__(
        self,
        addresses: str | Sequence[str],
        *,
        api_key: str | None = None,
        tls: Tls | None = None,
        retry: RetryPolicy = DEFAULT_RETRY,
        rng: random.Random | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._addresses = [addresses] if isinstance(addresses, str) else list(addresses)
        if not self._addresses:
            raise ValueError("give at least one address")
        self._auth = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self._tls = tls
        self._retry = retry
        self._rng = rng or random.Random()
        # Waits between attempts (replaceable to observe them).
        self._sleep = sleep
        self._preferred = 0
        self._stubs: dict[str, _Stubs] = {}

    @property
    def admission(self) -> admission_pb2_grpc.AdmissionServiceAsyncStub:
        return cast("admission_pb2_grpc.AdmissionServiceAsyncStub", _Rpcs(self, "admission"))

    @property
    def admin(self) -> admin_pb2_grpc.AdminServiceAsyncStub:
        return cast("admin_pb2_grpc.AdminServiceAsyncStub", _Rpcs(self, "admin"))

    @property
    def billing(self) -> billing_pb2_grpc.BillingServiceAsyncStub:
        return cast("billing_pb2_grpc.BillingServiceAsyncStub", _Rpcs(self, "billing"))

    def reservation(
        self,
        request: admission_pb2.AdmitRequest,
        *,
        on_lost: OnLost | None = None,
        end_timeout_seconds: float = END_TIMEOUT_SECONDS,
    ) -> ReservationScope:
        """`async with client.reservation(request) as held:` admits (waiting in the queue up to
        request.wait_timeout), keeps the lease alive, and releases or cancels at the end (see
        kvquota.client.reservations)."""
        return ReservationScope(self, request, on_lost, end_timeout_seconds)

    async def close(self) -> None:
        for address in self._stubs:
            await shared_channels.release(address, self._tls)
        self._stubs.clear()

    async def __aenter__(self) -> AsyncKvquotaClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def _metadata(self, given: Metadata | None) -> tuple[tuple[str, str | bytes], ...]:
        sent = tuple(given or ())
        if not any(key == REQUEST_ID_KEY for key, _ in sent):
            sent += ((REQUEST_ID_KEY, current_request_id.get() or uuid.uuid4().hex),)
        return (*self._auth, *sent)

    def _stubs_at(self, address: str) -> _Stubs:
        stubs = self._stubs.get(address)
        if stubs is None:
            channel = shared_channels.acquire(address, self._tls)
            stubs = _Stubs(
                admission_pb2_grpc.AdmissionServiceStub(channel),
                admin_pb2_grpc.AdminServiceStub(channel),
                billing_pb2_grpc.BillingServiceStub(channel),
            )
            self._stubs[address] = stubs
        return stubs

    async def _unary(
        self,
        service: str,
        method: str,
        request: Message,
        attempt_timeout: float | None,
        metadata: Metadata,
    ) -> Any:
        started = time.monotonic()
        attempt = 0
        while True:
            attempt += 1
            index = self._preferred
            rpc = getattr(getattr(self._stubs_at(self._addresses[index]), service), method)
            try:
                return await rpc(request, timeout=attempt_timeout, metadata=metadata)
            except grpc.aio.AioRpcError as failure:
                error = from_rpc_error(failure)
                elapsed = time.monotonic() - started
                retry = next_retry(error, method, attempt, elapsed, self._retry, self._rng)
                if retry is None:
                    raise error from failure
            if retry.fail_over and self._preferred == index:
                # Calls that failed on the same server together move on once, to the next.
                self._preferred = (index + 1) % len(self._addresses)
            await self._sleep(retry.delay_seconds)

    async def _stream(
        self,
        service: str,
        method: str,
        request: Message,
        attempt_timeout: float | None,
        metadata: Metadata,
    ) -> AsyncIterator[Any]:
        """A server stream from the preferred address; not retried (a watch or an export is
        started again by its caller, from where it stands)."""
        stubs = self._stubs_at(self._addresses[self._preferred])
        rpc = getattr(getattr(stubs, service), method)
        try:
            async for item in rpc(request, timeout=attempt_timeout, metadata=metadata):
                yield item
        except grpc.aio.AioRpcError as failure:
            raise from_rpc_error(failure) from failure
