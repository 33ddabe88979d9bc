"""AdmissionService: what the gateway calls around every LLM request."""

from __future__ import annotations

from typing import Any

import grpc

from kvquota.v1 import admission_pb2 as pb
from kvquota.v1 import admission_pb2_grpc, resources_pb2
from quota_service.api import convert
from quota_service.core.block_table import BlockHandle
from quota_service.core.errors import FieldViolation, invalid_request
from quota_service.core.model import EndReason
from quota_service.core.names import reservation_key
from quota_service.store.ledger import Ledger

Context = grpc.aio.ServicerContext[Any, Any]


class AdmissionServicer(admission_pb2_grpc.AdmissionServiceServicer):
    def __init__(self, ledger: Ledger) -> None:
        self._ledger = ledger

    async def Admit(self, request: pb.AdmitRequest, context: Context) -> pb.AdmitResponse:
        reservation, salt = await self._ledger.admit(convert.admit_request(request))
        return pb.AdmitResponse(reservation=convert.reservation(reservation), cache_salt=salt)

    async def RenewLease(
        self, request: pb.RenewLeaseRequest, context: Context
    ) -> resources_pb2.Reservation:
        tenant, request_id = reservation_key(request.name)
        ttl = (
            request.lease_ttl.ToTimedelta().total_seconds()
            if request.HasField("lease_ttl")
            else None
        )
        return convert.reservation(await self._ledger.renew(tenant, request_id, ttl))

    async def Release(
        self, request: pb.ReleaseRequest, context: Context
    ) -> resources_pb2.Reservation:
        tenant, request_id = reservation_key(request.name)
        if request.output_tokens < 0:
            raise invalid_request([FieldViolation("output_tokens", "must not be negative")])
        ended = await self._ledger.end(
            tenant, request_id, EndReason.RELEASED, request.output_tokens
        )
        return convert.reservation(ended)

    async def Cancel(
        self, request: pb.CancelRequest, context: Context
    ) -> resources_pb2.Reservation:
        tenant, request_id = reservation_key(request.name)
        return convert.reservation(await self._ledger.end(tenant, request_id, EndReason.CANCELLED))

    async def GetReservation(
        self, request: pb.GetReservationRequest, context: Context
    ) -> resources_pb2.Reservation:
        tenant, request_id = reservation_key(request.name)
        return convert.reservation(await self._ledger.get(tenant, request_id))

    async def ReleaseBlocks(
        self, request: pb.ReleaseBlocksRequest, context: Context
    ) -> resources_pb2.Reservation:
        tenant, request_id = reservation_key(request.name)
        if not request.handles:
            raise invalid_request([FieldViolation("handles", "name at least one block handle")])
        handles = [BlockHandle(h.block_id, h.generation) for h in request.handles]
        return convert.reservation(await self._ledger.release_blocks(tenant, request_id, handles))
