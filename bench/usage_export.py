"""Billing export at scale: `kvquota usage export` of N closed-hour records streams with bounded
memory. Fills a throwaway database's usage_hours with N records (1,000 tenants on one instance,
N / 1,000 hours), exports them as CSV through the server twice, and reports the time, the peak
resident memory of the exporting CLI and of the server, and whether both exports are the same
bytes. Run with several sizes to see that memory does not grow with N.

    python -m bench.usage_export --records 100000 1000000 [--json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg

from bench.harness import peak_rss_mib, throwaway_server

TENANTS = 1000
START = datetime(2026, 1, 1, tzinfo=UTC)

_FILL = """
    INSERT INTO usage_hours (
        hour, tenant, instance, block_us, pinned_block_us, cpu_byte_us, tokens_reserved,
        output_tokens, admitted, queued, refused, reclaimed, bytes_per_block, end_blocks,
        end_pinned, end_cpu_bytes)
    SELECT %(start)s + make_interval(hours => h), 'tenant-' || lpad(t::text, 4, '0'), 'gpu-0',
           jsonb_build_object('1', 3600000000 * (t %% 97 + 1), '2', 1800000000::bigint * (t %% 5)),
           3600000000 * (t %% 3), 0, 1536 * (t %% 7 + 1), 200 * (t %% 11), t %% 7 + 1, t %% 2,
           CASE WHEN t %% 13 = 0 THEN '{"TENANT_QUOTA_EXCEEDED": 1}'::jsonb ELSE '{}' END,
           '{}', 131072, '{}', 0, 0
    FROM generate_series(0, %(hours)s - 1) AS h, generate_series(0, %(tenants)s - 1) AS t
"""


def export(address: str, hours: int, out: Path) -> tuple[float, float]:
    """One CLI export; its wall time and peak RSS (MiB)."""
    end = START + timedelta(hours=hours)
    command = [
        sys.executable,
        "-m",
        "quota_service.cli",
        "usage",
        "export",
        "--from",
        START.isoformat(),
        "--to",
        end.isoformat(),
        "--format",
        "csv",
        "--output",
        str(out),
        "--server",
        address,
    ]
    began = time.perf_counter()
    cli = subprocess.Popen(command, stderr=subprocess.DEVNULL)  # not its progress bar
    # wait4 gives this child's own resource use (peak RSS in KiB), not the largest child's.
    _, status, usage = os.wait4(cli.pid, 0)
    cli.returncode = os.waitstatus_to_exitcode(status)
    if cli.returncode:
        raise subprocess.CalledProcessError(cli.returncode, command)
    return time.perf_counter() - began, usage.ru_maxrss / 1024


def digest(path: Path) -> str:
    """The file's SHA-256, read a MiB at a time."""
    sha = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(1 << 20):
            sha.update(chunk)
    return sha.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--records", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = []
    for records in args.records:
        hours = max(records // TENANTS, 1)
        with throwaway_server() as served, tempfile.TemporaryDirectory() as scratch:
            print(f"filling {hours * TENANTS:,} records", file=sys.stderr)
            with psycopg.connect(served.database_url, autocommit=True) as conn:
                conn.execute(_FILL, {"start": START, "hours": hours, "tenants": TENANTS})
            digests, times, client_rss = [], [], []
            for attempt in range(2):
                out = Path(scratch) / f"export-{attempt}.csv"
                seconds, rss = export(served.address, hours, out)
                times.append(seconds)
                client_rss.append(rss)
                digests.append(digest(out))
                size = out.stat().st_size
                out.unlink()
            results.append(
                {
                    "records": hours * TENANTS,
                    "seconds": round(min(times), 1),
                    "records/s": round(hours * TENANTS / min(times)),
                    "csv MiB": round(size / 2**20, 1),
                    "CLI peak RSS MiB": round(max(client_rss), 1),
                    "server peak RSS MiB": round(peak_rss_mib(served.server.pid), 1),
                    "same bytes": digests[0] == digests[1],
                }
            )
    if args.json:
        print(json.dumps(results, indent=2))
        return
    columns = list(results[0])
    print("  ".join(f"{c:>20}" for c in columns))
    for row in results:
        print("  ".join(f"{row[c]!s:>20}" for c in columns))


if __name__ == "__main__":
    os.environ.setdefault("KVQUOTA_LOG_LEVEL", "WARNING")
    main()
