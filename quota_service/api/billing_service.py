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
from quota_service.core.errors import FieldViolation, refuse_invalid
from quota_service.core.metering import HOUR_US, BilledHour, UsageTotals, hour_range_violations
from quota_service.core.names import instance_name, parse_filter, tenant_name
from quota_service.store.usage import UsageBook

Context = grpc.aio.ServicerContext[Any, Any]


def _query(
    request: pb.ExportUsageRequest | pb.GetUsageSummaryRequest, *more: FieldViolation | None
) -> tuple[datetime, datetime, str | None]:
    """[start, end) in whole hours and the tenant filter; refused, if anything is wrong, with
    the request's other faults (`more`; None is a check that passed)."""
    violations: list[FieldViolation] = []
    first = convert.instant(request.start_time, "start_time", violations)
    last = convert.instant(request.end_time, "end_time", violations)
    tenant, violation = parse_filter(request.tenant, "tenants", "tenant")
    refuse_invalid([*violations, *hour_range_violations(first, last), violation, *more])
    assert first is not None and last is not None
    return first, last, tenant


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
        compressed_gib_hours=float(totals.compressed_gib_hours),
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
        instance, violation = parse_filter(request.instance, "instances", "instance")
        start, end, tenant = _query(request, violation)
        async for hour in self._book.hours(start, end, tenant, instance):
            yield usage_record(hour)

    async def GetUsageSummary(
        self, request: pb.GetUsageSummaryRequest, context: Context
    ) -> pb.UsageSummary:
        start, end, tenant = _query(request)
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
