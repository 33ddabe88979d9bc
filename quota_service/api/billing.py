"""BillingService: closed hours of usage, streamed for export and added up for a summary."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Any

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from kvquota.v1 import billing_pb2 as pb
from kvquota.v1 import billing_pb2_grpc
from quota_service.api import convert
from quota_service.core.errors import FieldViolation, invalid_request
from quota_service.core.metering import HOUR_US, BilledHour, UsageTotals
from quota_service.core.names import instance_id, instance_name, tenant_id, tenant_name
from quota_service.store.usage import UsageBook

Context = grpc.aio.ServicerContext[Any, Any]


def _hour_range(start: Timestamp, end: Timestamp) -> tuple[datetime, datetime]:
    """[start, end) in whole hours; refused otherwise."""
    first, last = convert.instant(start, "start_time"), convert.instant(end, "end_time")
    violations = []
    for field, value in (("start_time", start), ("end_time", end)):
        if value.ToMicroseconds() % HOUR_US:
            violations.append(FieldViolation(field, "must be a whole hour (UTC)"))
    if last <= first:
        violations.append(FieldViolation("end_time", "must be after start_time"))
    if violations:
        raise invalid_request(violations)
    return first, last


def _timestamp(micros: int) -> Timestamp:
    stamp = Timestamp()
    stamp.FromMicroseconds(micros)
    return stamp


def _record(
    totals: UsageTotals, start: Timestamp, end: Timestamp, tenant: str, instance: str | None
) -> pb.UsageRecord:
    counts = totals.counts
    return pb.UsageRecord(
        hour_start=start,
        hour_end=end,
        tenant=tenant_name(tenant),
        instance=instance_name(instance) if instance else "",
        gpu_block_seconds=float(totals.gpu_block_seconds),
        fair_share_block_seconds=float(totals.fair_share_block_seconds),
        pinned_block_seconds=float(totals.pinned_block_seconds),
        gpu_gib_hours=float(totals.gpu_gib_hours),
        fair_share_gib_hours=float(totals.fair_share_gib_hours),
        cpu_gib_hours=float(totals.cpu_gib_hours),
        tokens_reserved=counts.tokens_reserved,
        output_tokens=counts.output_tokens,
        requests_admitted=counts.admitted,
        requests_queued=counts.queued,
        requests_refused=counts.refused,
        blocks_reclaimed=counts.reclaimed,
        requests_shadow_refused=counts.shadow_refused,
    )


def usage_record(hour: BilledHour) -> pb.UsageRecord:
    totals = UsageTotals()
    totals.add(hour)
    usage = hour.usage
    start, end = _timestamp(usage.hour_start_us), _timestamp(usage.hour_start_us + HOUR_US)
    return _record(totals, start, end, usage.tenant, usage.instance)


class BillingServicer(billing_pb2_grpc.BillingServiceServicer):
    def __init__(self, book: UsageBook) -> None:
        self._book = book

    async def ExportUsage(
        self, request: pb.ExportUsageRequest, context: Context
    ) -> AsyncIterator[pb.UsageRecord]:
        start, end = _hour_range(request.start_time, request.end_time)
        tenant = tenant_id(request.tenant, "tenant") if request.tenant else None
        instance = instance_id(request.instance, "instance") if request.instance else None
        async for hour in self._book.hours(start, end, tenant, instance):
            yield usage_record(hour)

    async def GetUsageSummary(
        self, request: pb.GetUsageSummaryRequest, context: Context
    ) -> pb.UsageSummary:
        start, end = _hour_range(request.start_time, request.end_time)
        tenant = tenant_id(request.tenant, "tenant") if request.tenant else None
        totals: dict[str, UsageTotals] = defaultdict(UsageTotals)
        async for hour in self._book.hours(start, end, tenant, None):
            totals[hour.usage.tenant].add(hour)
        return pb.UsageSummary(
            start_time=request.start_time,
            end_time=request.end_time,
            tenants=[
                _record(totals[t], request.start_time, request.end_time, t, None)
                for t in sorted(totals)
            ],
        )
