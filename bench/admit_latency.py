"""A quick look at the hot path: Admit latency and Admit+Release pairs per second.

Starts one kvquota server process on a throwaway database (KVQUOTA_DATABASE_URL's server, else
127.0.0.1:5432, else an embedded PostgreSQL), then this process drives it with concurrent gRPC
clients doing Admit then Release of 1536-token requests (96 blocks at 16 tokens per block), on
pools of each --capacity, without and with a shared prompt prefix (--prefix-tokens).
Prints a table, or JSON with --json. The full suite (pgbench reference, every scenario of the
issue, min/median/max over runs, docs/benchmarks.md) is `python -m bench.suite`.
"""

from __future__ import annotations

import argparse
import asyncio
import json

from bench.harness import throwaway_server
from bench.load import (
    Gateway,
    Shape,
    closed_loop,
    create_tenants,
    percentile,
    register_instance,
    say,
)

TENANTS = ["t0", "t1", "t2", "t3"]


async def measure(address: str, args: argparse.Namespace) -> list[dict[str, object]]:
    results: list[dict[str, object]] = []
    async with Gateway([address]) as gateway:
        for capacity in args.capacity:
            await register_instance(gateway, f"bench-{capacity}", capacity)
        await create_tenants(gateway, TENANTS)
        for capacity in args.capacity:
            for prefix in args.prefix_tokens:
                for concurrency in args.concurrency:
                    say(
                        f"{capacity} slots, {prefix}-token shared prefix, "
                        f"concurrency {concurrency}, {args.seconds:g} s"
                    )
                    run = await closed_loop(
                        gateway,
                        f"bench-{capacity}",
                        TENANTS,
                        Shape(prefix_tokens=prefix),
                        concurrency,
                        args.seconds,
                    )
                    if run.first_refusal:
                        say(f"first refusal: {run.first_refusal}")
                    results.append(
                        {
                            "pool_slots": capacity,
                            "prefix_tokens": prefix,
                            "concurrency": concurrency,
                            "seconds": round(run.seconds, 2),
                            "pairs_per_second": round(run.pairs_per_second, 1),
                            "admit_p50_ms": round(percentile(run.admit_ms, 50), 2),
                            "admit_p99_ms": round(percentile(run.admit_ms, 99), 2),
                            "refused": sum(run.refused.values()),
                        }
                    )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--capacity", type=int, nargs="+", default=[1000, 1_000_000])
    parser.add_argument("--prefix-tokens", type=int, nargs="+", default=[0, 1024])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    with throwaway_server() as served:
        results = asyncio.run(measure(served.address, args))
    if args.json:
        print(json.dumps(results, indent=2))
        return
    columns = list(results[0])
    print("  ".join(f"{c:>16}" for c in columns))
    for row in results:
        print("  ".join(f"{row[c]!s:>16}" for c in columns))


if __name__ == "__main__":
    main()
