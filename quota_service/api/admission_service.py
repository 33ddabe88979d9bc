"""AdmissionService: what the gateway calls around every LLM request."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import grpc

from kvquota.v1 import admission_pb2 as pb
from kvquota.v1 import admission_pb2_grpc, resources_pb2
from quota_service.api import convert, observability
from quota_service.api.waiting import Waiters
from quota_service.core import admission, block_table, queueing
from quota_service.core.block_table import BlockHandle
from quota_service.core.errors import FieldViolation, KvQuotaError, preempted, refuse_invalid
from quota_service.core.model import EndReason, Reservation, ReservationState
from quota_service.core.names import parse_reservation, reservation_key, reservation_name
from quota_service.core.reasons import Reason
from quota_service.enforcement.cpu_tier_mirror import CpuTierMirror
from quota_service.enforcement.termination import Termination
from quota_service.metrics import ServiceMetrics
from quota_service.owner.owners import OwnedLedger, forwarded_call
from quota_service.store.catalog import Catalog

Context = grpc.aio.ServicerContext[Any, Any]


def checked_key(name: str, *violations: FieldViolation | None) -> tuple[str, str]:
    """A reservation's (tenant, request_id), from its name; refused, if anything is wrong, with
    every other fault of the request (`violations`; None is a check that passed)."""
    key, found = parse_reservation(name)
    refuse_invalid([*found, *violations])
    assert key is not None
    return key


class AdmissionServicer(admission_pb2_grpc.AdmissionServiceServicer):
    def __init__(
        self,
        ledger: OwnedLedger,
        waiters: Waiters,
        termination: Termination,
        cpu_tier: CpuTierMirror,
        metrics: ServiceMetrics,
        catalog: Catalog,
    ) -> None:
        self._ledger = ledger
        self._catalog = catalog
        self._waiters = waiters
        self._termination = termination
        self._cpu_tier = cpu_tier
        self._metrics = metrics

    async def Admit(self, request: pb.AdmitRequest, context: Context) -> pb.AdmitResponse:
        admit, address = convert.admit_request(request, self._ledger.limits)
        if address is not None:
            instance = await self._catalog.instance_at(address)
            admit = replace(admit, params=replace(admit.params, instance=instance))
        reservation, salt = await self._ledger.admit(admit)
        if reservation.state is ReservationState.QUEUED:
            try:
                reservation = await self._queue_wait(reservation, admit.wait_timeout_seconds)
            except asyncio.CancelledError:
                # The caller went away: its request leaves the queue (or, admitted just now,
                # gives its blocks back), whatever becomes of this task. Not so when the server
                # cut the call at the end of its shutdown grace: the caller retries elsewhere.
                # Nor when the call was forwarded here: the replica it came through may have
                # died, and the caller retries; one whose caller left cancels it (forwarding).
                if not self._waiters.closed and not forwarded_call.get():
                    await asyncio.shield(self._abandon(reservation))
                raise
        response = pb.AdmitResponse(cache_salt=salt)
        convert.fill_reservation(response.reservation, reservation)
        return response

    async def _queue_wait(self, reservation: Reservation, budget_seconds: float) -> Reservation:
        """`_until_admitted`, measured: the one place a caller waits in a queue (a queued Admit,
        a resume waiting for GPU blocks), so the wait is observed once however it ends."""
        observability.note_queued()
        started = time.monotonic()
        result = "error"
        try:
            answer = await self._until_admitted(reservation, budget_seconds)
            # A resumed session whose wait ran out is back in the CPU tier, not admitted.
            result = "timeout" if answer.offloaded_bytes is not None else "admitted"
            return answer
        except KvQuotaError as refused:
            result = "timeout" if refused.reason is Reason.QUEUE_TIMEOUT else "refused"
            raise
        except asyncio.CancelledError:
            result = "abandoned"
            raise
        finally:
            waited = time.monotonic() - started
            self._metrics.observe_queue_wait(reservation.instance, result, waited)

    async def _until_admitted(self, reservation: Reservation, budget_seconds: float) -> Reservation:
        """Wait while it is queued; a timeout or a cancellation ends the wait with an error."""
        tenant, request_id = reservation.tenant, reservation.request_id
        key = f"{tenant}/{request_id}"
        deadline = time.monotonic() + budget_seconds
        while reservation.state is ReservationState.QUEUED:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                reservation, delay = await self._ledger.stop_waiting(
                    tenant, request_id, EndReason.QUEUE_TIMEOUT
                )
                if reservation.state is ReservationState.ADMITTED:
                    return reservation  # admitted at the last moment
                if reservation.state is ReservationState.ENDED:
                    raise queueing.queue_timeout(
                        reservation_name(tenant, request_id), budget_seconds, delay
                    )
                # Still queued: its instance moved, and its new owner ends it at the same
                # deadline (or admits it first); its verdict is what the caller gets.
                remaining = math.inf
            if self._waiters.closed:
                # This server is going away: the caller asks another one with the same request
                # id, and the request keeps its place in the shared queue meanwhile.
                raise queueing.shutting_down(
                    reservation_name(tenant, request_id), self._ledger.min_retry_delay_seconds
                )
            await self._waiters.next_change(key, remaining)
            reservation = await self._ledger.follow(tenant, request_id)
        if reservation.state is ReservationState.ENDED:
            if reservation.end_reason is EndReason.QUEUE_TIMEOUT:
                raise queueing.queue_timeout(
                    reservation_name(tenant, request_id),
                    budget_seconds,
                    self._ledger.min_retry_delay_seconds,
                )
            raise queueing.cancelled(reservation_name(tenant, request_id))
        return reservation

    async def _abandon(self, reservation: Reservation) -> None:
        tenant, request_id = reservation.tenant, reservation.request_id
        current, _ = await self._ledger.stop_waiting(tenant, request_id, EndReason.CANCELLED)
        if current.state is ReservationState.ADMITTED:
            await self._termination.end(tenant, request_id, EndReason.CANCELLED)

    async def WatchReservation(
        self, request: pb.WatchReservationRequest, context: Context
    ) -> AsyncIterator[resources_pb2.Reservation]:
        tenant, request_id = reservation_key(request.name)
        key = f"{tenant}/{request_id}"
        last: tuple[object, ...] | None = None
        # Served by the instance's owner (forwarded there if it is elsewhere); once the stream
        # began, answered here to its end.
        current = await self._ledger.get(tenant, request_id)
        while True:
            seen = (current.state, current.end_reason, current.queue_position)
            if seen != last:
                yield convert.reservation(current)
                last = seen
            if current.end_reason is EndReason.PREEMPTED:
                # The stream ends as the error table says, after the caller saw the end.
                raise preempted(request.name)
            if current.state is ReservationState.ENDED:
                return
            if self._waiters.closed:
                raise queueing.shutting_down(request.name, self._ledger.min_retry_delay_seconds)
            await self._waiters.next_change(key, math.inf)
            current = await self._ledger.follow(tenant, request_id)

    async def RenewLease(
        self, request: pb.RenewLeaseRequest, context: Context
    ) -> resources_pb2.Reservation:
        found: list[FieldViolation] = []
        ttl = convert.lease_ttl(request, found)
        ttl_violation = admission.check_lease_ttl(ttl, self._ledger.limits)
        tenant, request_id = checked_key(request.name, *found, ttl_violation)
        return convert.reservation(await self._ledger.renew(tenant, request_id, ttl))

    async def Release(
        self, request: pb.ReleaseRequest, context: Context
    ) -> resources_pb2.Reservation:
        tenant, request_id = checked_key(
            request.name, admission.check_output_tokens(request.output_tokens)
        )
        ended = await self._ledger.end(
            tenant, request_id, EndReason.RELEASED, request.output_tokens
        )
        return convert.reservation(ended)

    async def Cancel(
        self, request: pb.CancelRequest, context: Context
    ) -> resources_pb2.Reservation:
        tenant, request_id = reservation_key(request.name)
        ended = await self._termination.end(tenant, request_id, EndReason.CANCELLED)
        return convert.reservation(ended)

    async def GetReservation(
        self, request: pb.GetReservationRequest, context: Context
    ) -> resources_pb2.Reservation:
        tenant, request_id = reservation_key(request.name)
        return convert.reservation(await self._ledger.get(tenant, request_id))

    async def SuspendReservation(
        self, request: pb.SuspendReservationRequest, context: Context
    ) -> resources_pb2.Reservation:
        tenant, request_id = checked_key(
            request.name, *admission.session_token_violations(request.session_token_ids)
        )
        suspended = await self._ledger.suspend(tenant, request_id, request.session_token_ids)
        return convert.reservation(suspended)

    async def ResumeReservation(
        self, request: pb.ResumeReservationRequest, context: Context
    ) -> resources_pb2.Reservation:
        found: list[FieldViolation] = []
        wait = convert.seconds(request.wait_timeout, "wait_timeout", found)
        wait_violation = None if wait is None else admission.check_wait_timeout(wait)
        tenant, request_id = checked_key(request.name, *found, wait_violation)
        assert wait is not None
        current = await self._ledger.get(tenant, request_id)
        if current.offloaded_bytes is not None:
            # Its session comes back into the CPU tier's L1 while it waits for GPU blocks.
            await self._cpu_tier.prefetch_session(tenant, request_id)
        resumed = await self._ledger.resume(tenant, request_id, wait)
        if resumed.state is ReservationState.QUEUED:
            # A caller that goes away leaves it queued: it is admitted, or its wait runs out
            # and it goes back to the CPU tier. The session is not cancelled with the call.
            resumed = await self._queue_wait(resumed, wait)
            if resumed.offloaded_bytes is not None:  # its wait ran out: back in the CPU tier
                raise queueing.queue_timeout(
                    request.name, wait, self._ledger.min_retry_delay_seconds
                )
        return convert.reservation(resumed)

    async def ReleaseBlocks(
        self, request: pb.ReleaseBlocksRequest, context: Context
    ) -> resources_pb2.Reservation:
        handles = [BlockHandle(h.block_id, h.generation) for h in request.handles]
        tenant, request_id = checked_key(request.name, block_table.release_violation(handles))
        return convert.reservation(await self._ledger.release_blocks(tenant, request_id, handles))
