"""The blocking client: the asyncio client's behaviour, every call run on one event loop in a
background thread that all blocking clients of the process share (and with it their channels).
So both clients retry, fail over, renew and release the same way, from the same code.

`on_lost` callbacks run in that thread: they should only signal the request's own thread
(set an event, close a stream), never block.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Sequence
from types import TracebackType
from typing import Any, TypeVar, cast

from kvquota.client.aio import AsyncKvquotaClient
from kvquota.client.channels import Tls
from kvquota.client.reservations import (
    END_TIMEOUT_SECONDS,
    OnLost,
    Reservation,
    ReservationScope,
)
from kvquota.client.retrying import DEFAULT_RETRY, RetryPolicy
from kvquota.v1 import admin_pb2_grpc, admission_pb2, admission_pb2_grpc, billing_pb2_grpc

T = TypeVar("T")

_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def _io_loop() -> asyncio.AbstractEventLoop:
    """The process's event loop for blocking clients, started on first use."""
    global _loop
    with _loop_lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            thread = threading.Thread(target=_loop.run_forever, name="kvquota-client", daemon=True)
            thread.start()
        return _loop


def _run(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run on the client's loop and wait; interrupted (KeyboardInterrupt), the call is
    cancelled there too."""
    future = asyncio.run_coroutine_threadsafe(coroutine, _io_loop())
    try:
        return future.result()
    except BaseException:
        future.cancel()
        raise


def _blocking_iterator(stream: AsyncIterator[T]) -> Iterator[T]:
    async def next_item() -> tuple[bool, T | None]:
        try:
            return True, await anext(stream)
        except StopAsyncIteration:
            return False, None

    while True:
        more, item = _run(next_item())
        if not more:
            return
        yield cast(T, item)


class _BlockingRpcs:
    """Stands in for one service's generated blocking stub, over the asyncio client's."""

    def __init__(self, rpcs: object) -> None:
        self._rpcs = rpcs

    def __getattr__(self, method: str) -> Callable[..., Any]:
        def call(
            request: object,
            *,
            timeout: float | None = None,
            metadata: Sequence[tuple[str, str | bytes]] | None = None,
        ) -> Any:
            answer = getattr(self._rpcs, method)(request, timeout=timeout, metadata=metadata)
            if asyncio.iscoroutine(answer):
                return _run(answer)
            return _blocking_iterator(answer)

        return call


class BlockingReservationScope:
    """`with client.reservation(request) as held:` (see kvquota.client.reservations)."""

    def __init__(self, scope: ReservationScope) -> None:
        self._scope = scope

    def __enter__(self) -> Reservation:
        return _run(self._scope.__aenter__())

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        _run(self._scope.__aexit__(exc_type, exc, traceback))


class KvquotaClient:
    """The blocking client; the same arguments and surface as AsyncKvquotaClient."""

    def __init__(
        self,
        addresses: str | Sequence[str],
        *,
        api_key: str | None = None,
        tls: Tls | None = None,
        retry: RetryPolicy = DEFAULT_RETRY,
    ) -> None:
        self._client = AsyncKvquotaClient(addresses, api_key=api_key, tls=tls, retry=retry)

    @property
    def admission(self) -> admission_pb2_grpc.AdmissionServiceStub:
        return cast(admission_pb2_grpc.AdmissionServiceStub, _BlockingRpcs(self._client.admission))

    @property
    def admin(self) -> admin_pb2_grpc.AdminServiceStub:
        return cast(admin_pb2_grpc.AdminServiceStub, _BlockingRpcs(self._client.admin))

    @property
    def billing(self) -> billing_pb2_grpc.BillingServiceStub:
        return cast(billing_pb2_grpc.BillingServiceStub, _BlockingRpcs(self._client.billing))

    def reservation(
        self,
        request: admission_pb2.AdmitRequest,
        *,
        on_lost: OnLost | None = None,
        end_timeout_seconds: float = END_TIMEOUT_SECONDS,
    ) -> BlockingReservationScope:
        return BlockingReservationScope(
            self._client.reservation(
                request, on_lost=on_lost, end_timeout_seconds=end_timeout_seconds
            )
        )

    def close(self) -> None:
        _run(self._client.close())

    def __enter__(self) -> KvquotaClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
