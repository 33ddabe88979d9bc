"""Billing: closed hours over gRPC (ExportUsage, GetUsageSummary) and `kvquota usage export`,
whose output is the same bytes however often a closed range is exported."""

from __future__ import annotations

import asyncio
import csv
import io
from datetime import timedelta
from pathlib import Path

import grpc
import pyarrow.parquet as pq
import pytest
from google.protobuf.timestamp_pb2 import Timestamp
from sqlalchemy.ext.asyncio import AsyncEngine

from kvquota.v1 import billing_pb2, billing_pb2_grpc
from quota_service.api import server
from quota_service.cli import main as cli_main
from quota_service.config import Settings
from quota_service.store.usage import UsageRollup
from tests.integration.grpc_helpers import refused
from tests.integration.test_usage_rollup import HOUR, shared_prompt_timeline


def stamp(hours: float) -> Timestamp:
    value = Timestamp()
    value.FromDatetime(HOUR + timedelta(hours=hours))
    return value


async def test_closed_hours_export_over_grpc_and_the_cli_identically(
    engine: AsyncEngine,
    owned: server.HotPath,
    settings: Settings,
    database_url: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    await shared_prompt_timeline(engine, owned)
    assert await UsageRollup(engine).close_due(HOUR + timedelta(hours=2), timedelta(0)) == 1
    running = await server.start(settings, database_url)
    address = f"127.0.0.1:{running.port}"
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            billing = billing_pb2_grpc.BillingServiceStub(channel)
            request = billing_pb2.ExportUsageRequest(start_time=stamp(0), end_time=stamp(1))
            records = [r async for r in billing.ExportUsage(request)]
            assert [
                (r.tenant, r.gpu_block_seconds, r.fair_share_block_seconds) for r in records
            ] == [
                ("tenants/acme", 360.0, 285.0),
                ("tenants/bolt", 200.0, 125.0),
            ]
            acme = records[0]
            # add_instance registers no geometry: no bytes per block, so no GiB-hours.
            assert (acme.gpu_gib_hours, acme.requests_admitted, acme.tokens_reserved) == (0, 1, 64)
            only_bolt = billing_pb2.ExportUsageRequest(
                start_time=stamp(0), end_time=stamp(24), tenant="tenants/bolt"
            )
            assert [r.tenant async for r in billing.ExportUsage(only_bolt)] == ["tenants/bolt"]
            summary = await billing.GetUsageSummary(
                billing_pb2.GetUsageSummaryRequest(start_time=stamp(-1), end_time=stamp(3))
            )
            assert [(t.tenant, t.fair_share_block_seconds) for t in summary.tenants] == [
                ("tenants/acme", 285.0),
                ("tenants/bolt", 125.0),
            ]
            ragged = await refused(
                billing.GetUsageSummary(
                    billing_pb2.GetUsageSummaryRequest(start_time=stamp(0.5), end_time=stamp(1))
                )
            )
            assert (ragged.code, ragged.reason) == (
                grpc.StatusCode.INVALID_ARGUMENT,
                "INVALID_REQUEST",
            )

        window = ["--from", "2026-11-29T10:00Z", "--to", "2026-11-29T11:00Z", "--server", address]
        outputs = {}
        for kind in ("csv", "jsonl", "parquet"):
            for attempt in range(2):
                out = tmp_path / f"usage-{attempt}.{kind}"
                command = ["usage", "export", *window, "--format", kind, "--output", str(out)]
                assert await asyncio.to_thread(cli_main, command) == 0
                outputs[kind, attempt] = out.read_bytes()
            assert outputs[kind, 0] == outputs[kind, 1]  # a closed range: the same bytes
        assert "100% 2 records" in capsys.readouterr().err
        rows = list(csv.DictReader(io.StringIO(outputs["csv", 0].decode())))
        fair = {
            r["SubAccountId"]: r["ConsumedQuantity"]
            for r in rows
            if r["SkuId"] == "gpu-kv-fair-share-block-seconds"
        }
        assert fair == {"tenants/acme": "285.000000", "tenants/bolt": "125.000000"}
        assert {r["ChargePeriodStart"] for r in rows} == {"2026-11-29T10:00:00Z"}
        table = pq.read_table(io.BytesIO(outputs["parquet", 0]))
        assert table.num_rows == len(rows)
        assert await asyncio.to_thread(cli_main, ["usage", "summary", *window]) == 0
        assert "tenants/acme" in capsys.readouterr().out
    finally:
        await running.stop(0)
