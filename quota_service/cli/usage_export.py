"""Usage records as FinOps FOCUS-style rows (one row per record and metric), written as CSV,
JSON lines or Parquet, a batch at a time. The rows follow the records' order and every quantity
has a fixed format, so exporting the same closed range twice gives the same bytes."""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from decimal import Decimal
from typing import IO, Any, Protocol

from google.protobuf.timestamp_pb2 import Timestamp

from kvquota.v1 import billing_pb2

COLUMNS = (
    "ChargePeriodStart",
    "ChargePeriodEnd",
    "ServiceName",
    "ChargeCategory",
    "SubAccountId",
    "ResourceId",
    "SkuId",
    "ChargeDescription",
    "ConsumedQuantity",
    "ConsumedUnit",
)
FORMATS = ("csv", "jsonl", "parquet")
PARQUET_ROWS_PER_GROUP = 10_000
QUANTITY = Decimal("0.000001")

# (SkuId, description, unit, field of UsageRecord) for the scalar metrics.
_METRICS = (
    ("gpu-kv-block-seconds", "GPU KV blocks held", "block-seconds", "gpu_block_seconds"),
    (
        "gpu-kv-fair-share-block-seconds",
        "GPU KV blocks held, shared blocks split between their holders",
        "block-seconds",
        "fair_share_block_seconds",
    ),
    (
        "gpu-kv-pinned-block-seconds",
        "GPU KV blocks pinned",
        "block-seconds",
        "pinned_block_seconds",
    ),
    ("gpu-kv-gib-hours", "GPU KV memory held", "GiB-hours", "gpu_gib_hours"),
    (
        "gpu-kv-fair-share-gib-hours",
        "GPU KV memory held, shared blocks split between their holders",
        "GiB-hours",
        "fair_share_gib_hours",
    ),
    ("cpu-tier-gib-hours", "KV memory held in the CPU tier", "GiB-hours", "cpu_gib_hours"),
    ("compressed-gib-hours", "KV memory held compressed", "GiB-hours", "compressed_gib_hours"),
    ("tokens-reserved", "Tokens reserved at admission", "tokens", "tokens_reserved"),
    ("output-tokens", "Output tokens reported at release", "tokens", "output_tokens"),
    ("requests-admitted", "Requests admitted", "requests", "requests_admitted"),
    ("requests-queued", "Requests queued", "requests", "requests_queued"),
)


def _quantity(value: float | int) -> str:
    if isinstance(value, int):
        return str(value)
    return str(Decimal(repr(value)).quantize(QUANTITY))


def _iso(stamp: Timestamp) -> str:
    return stamp.ToJsonString()


def focus_rows(record: billing_pb2.UsageRecord) -> Iterator[tuple[str, ...]]:
    """The record's non-zero metrics, one row each, in a fixed order."""
    period = (_iso(record.hour_start), _iso(record.hour_end), "kvquota", "Usage")
    owner = (record.tenant, record.instance)
    for sku, description, unit, field in _METRICS:
        value = getattr(record, field)
        if value:
            yield (*period, *owner, sku, description, _quantity(value), unit)
    for reason, count in sorted(record.requests_refused.items()):
        description = f"Requests refused: {reason}"
        yield (*period, *owner, f"requests-refused-{reason}", description, str(count), "requests")
    for reason, count in sorted(record.requests_shadow_refused.items()):
        sku = f"requests-shadow-refused-{reason}"
        description = f"Requests admitted in shadow mode that {reason} would have refused"
        yield (*period, *owner, sku, description, str(count), "requests")
    for tier, blocks in sorted(record.blocks_reclaimed.items()):
        description = f"Blocks reclaimed by {tier}"
        yield (*period, *owner, f"blocks-reclaimed-{tier}", description, str(blocks), "blocks")


class Writer(Protocol):
    def write(self, rows: list[tuple[str, ...]]) -> None: ...
    def close(self) -> None: ...


class CsvWriter:
    def __init__(self, out: IO[bytes]) -> None:
        self._text = _TextOut(out)
        self._csv = csv.writer(self._text, lineterminator="\n")
        self._csv.writerow(COLUMNS)

    def write(self, rows: list[tuple[str, ...]]) -> None:
        self._csv.writerows(rows)

    def close(self) -> None:
        self._text.flush()


class JsonLinesWriter:
    def __init__(self, out: IO[bytes]) -> None:
        self._out = out

    def write(self, rows: list[tuple[str, ...]]) -> None:
        for row in rows:
            line = dict(zip(COLUMNS, row, strict=True))
            self._out.write(json.dumps(line, separators=(",", ":")).encode() + b"\n")

    def close(self) -> None:
        self._out.flush()


class ParquetWriter:
    def __init__(self, out: IO[bytes]) -> None:
        # pyarrow is loaded only for Parquet: it triples the CLI's resident memory.
        import pyarrow as pa
        import pyarrow.parquet as pq

        self._pa: Any = pa
        self._schema = pa.schema(
            [
                (column, pa.decimal128(38, 6) if column == "ConsumedQuantity" else pa.string())
                for column in COLUMNS
            ]
        )
        self._writer = pq.ParquetWriter(out, self._schema)
        self._pending: list[tuple[str, ...]] = []

    def write(self, rows: list[tuple[str, ...]]) -> None:
        self._pending.extend(rows)
        while len(self._pending) >= PARQUET_ROWS_PER_GROUP:
            self._flush(self._pending[:PARQUET_ROWS_PER_GROUP])
            del self._pending[:PARQUET_ROWS_PER_GROUP]

    def _flush(self, rows: list[tuple[str, ...]]) -> None:
        columns = list(zip(*rows, strict=True))
        arrays = [
            self._pa.array(
                [Decimal(v) for v in values] if name == "ConsumedQuantity" else list(values),
                type=self._schema.field(name).type,
            )
            for name, values in zip(COLUMNS, columns, strict=True)
        ]
        self._writer.write_table(self._pa.Table.from_arrays(arrays, schema=self._schema))

    def close(self) -> None:
        if self._pending:
            self._flush(self._pending)
        self._writer.close()


def writer(kind: str, out: IO[bytes]) -> Writer:
    if kind == "csv":
        return CsvWriter(out)
    if kind == "jsonl":
        return JsonLinesWriter(out)
    return ParquetWriter(out)


class _TextOut:
    """csv writes text; the export is bytes (UTF-8)."""

    def __init__(self, out: IO[bytes]) -> None:
        self._out = out

    def write(self, text: str) -> int:
        return self._out.write(text.encode())

    def flush(self) -> None:
        self._out.flush()
