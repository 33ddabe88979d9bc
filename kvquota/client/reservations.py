"""One call around each LLM request: `reservation(...)` admits, keeps the lease alive while the
block runs, and gives the blocks back however the block ends.

- Normal exit: Release, with the output tokens the caller recorded on the handle.
- An exception, or the task cancelled (the client went away): Cancel, which also aborts the
  request in the engine when kvquota follows it.
- Either runs even while the surrounding task is being cancelled, shielded, within
  `end_timeout_seconds`; should it fail, the lease is the backstop.
- The lease is renewed in the background every third of its TTL. A renewal refused because the
  reservation is gone (LEASE_EXPIRED, PREEMPTED, RESERVATION_ENDED, RECLAIMED) marks it lost and
  calls `on_lost`, so the gateway can stop the stream; renewing stops there.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from datetime import datetime
from types import TracebackType
from typing import TYPE_CHECKING

from kvquota.client.errors import KvquotaError
from kvquota.v1 import admission_pb2, resources_pb2

if TYPE_CHECKING:
    from kvquota.client.aio import AsyncKvquotaClient

log = logging.getLogger(__name__)

LOST_REASONS = frozenset({"LEASE_EXPIRED", "PREEMPTED", "RESERVATION_ENDED", "RECLAIMED"})
# Release or Cancel at the end of a block gets this long, retries included.
END_TIMEOUT_SECONDS = 5.0
REQUEST_ID_KEY = "x-request-id"

# Releases and Cancels that outlive a cancelled block: referenced until they finish.
_ending: set[asyncio.Task[None]] = set()


class Reservation:
    """An admitted request, as the block sees it: what to pass to vLLM (`cache_salt`,
    `request_id`), what it holds, and `output_tokens` for the caller to set before the block
    ends (reported at Release, for metering)."""

    def __init__(self, admitted: admission_pb2.AdmitResponse) -> None:
        self.cache_salt = admitted.cache_salt
        self.current = admitted.reservation
        self.output_tokens = 0
        # Why it was lost, once a renewal was refused because it is gone.
        self.lost: KvquotaError | None = None

    @property
    def name(self) -> str:
        return self.current.name

    @property
    def request_id(self) -> str:
        return self.current.request_id

    @property
    def instance(self) -> str:
        return self.current.instance

    @property
    def block_table(self) -> tuple[resources_pb2.BlockHandle, ...]:
        return tuple(self.current.block_table)

    @property
    def prefix_hit_blocks(self) -> int:
        return self.current.prefix_hit_blocks

    @property
    def lease_expire_time(self) -> datetime:
        return self.current.lease_expire_time.ToDatetime()

    @property
    def renew_interval_seconds(self) -> float:
        return self.current.lease_ttl.ToTimedelta().total_seconds() / 3


OnLost = Callable[[Reservation, KvquotaError], None]


class ReservationScope:
    """`async with client.reservation(request) as held:` (see the module's docstring)."""

    def __init__(
        self,
        client: AsyncKvquotaClient,
        request: admission_pb2.AdmitRequest,
        on_lost: OnLost | None,
        end_timeout_seconds: float,
    ) -> None:
        self._client = client
        self._request = request
        self._on_lost = on_lost
        self._end_timeout_seconds = end_timeout_seconds
        self._metadata = ((REQUEST_ID_KEY, request.request_id),)
        self._held: Reservation | None = None
        self._renewal: asyncio.Task[None] | None = None

    @property
    def _name(self) -> str:
        return f"{self._request.tenant}/reservations/{self._request.request_id}"

    async def __aenter__(self) -> Reservation:
        admission = self._client.admission
        try:
            admitted = await admission.Admit(self._request, metadata=self._metadata)
        except asyncio.CancelledError:
            # The answer may have been on its way: whatever the server admitted or queued
            # under this request id ends now rather than at its lease's expiry.
            cancel = admission_pb2.CancelRequest(name=self._name)
            await self._end(admission.Cancel(cancel, metadata=self._metadata))
            raise
        self._held = Reservation(admitted)
        self._renewal = asyncio.create_task(self._renew(self._held))
        return self._held

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        assert self._held is not None and self._renewal is not None
        self._renewal.cancel()
        admission = self._client.admission
        if exc_type is None:
            release = admission_pb2.ReleaseRequest(
                name=self._held.name, output_tokens=self._held.output_tokens
            )
            await self._end(admission.Release(release, metadata=self._metadata))
        else:
            cancel = admission_pb2.CancelRequest(name=self._held.name)
            await self._end(admission.Cancel(cancel, metadata=self._metadata))

    async def _end(self, call: Awaitable[object]) -> None:
        """Run a Release or Cancel to its end even if this task is cancelled meanwhile."""
        ending = asyncio.create_task(self._bounded(call))
        _ending.add(ending)
        ending.add_done_callback(_ending.discard)
        await asyncio.shield(ending)

    async def _bounded(self, call: Awaitable[object]) -> None:
        try:
            await asyncio.wait_for(call, self._end_timeout_seconds)
        except (KvquotaError, TimeoutError) as failure:
            # The lease ends it anyway; the gateway's answer to its own client stands.
            log.warning("could not end %s (%s): its lease will", self._name, failure)

    async def _renew(self, held: Reservation) -> None:
        renew = admission_pb2.RenewLeaseRequest(name=held.name)
        while True:
            await asyncio.sleep(held.renew_interval_seconds)
            try:
                held.current = await self._client.admission.RenewLease(
                    renew, metadata=self._metadata
                )
            except KvquotaError as refused:
                if refused.reason in LOST_REASONS:
                    self._lose(held, refused)
                    return
                log.warning("could not renew %s (%s): trying again", held.name, refused)

    def _lose(self, held: Reservation, why: KvquotaError) -> None:
        held.lost = why
        if self._on_lost is None:
            return
        try:
            self._on_lost(held, why)
        except Exception:
            log.exception("the on_lost callback of %s failed", held.name)
