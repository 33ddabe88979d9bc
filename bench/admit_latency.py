"""First reading of the hot path: Admit latency and Admit+Release pairs per second.

Starts one kvquota server process on a throwaway database (KVQUOTA_DATABASE_URL's server, else
127.0.0.1:5432, else an embedded PostgreSQL), then this process drives it with concurrent gRPC
clients doing Admit then Release of 1536-token requests (96 blocks at 16 tokens per block), on
pools of each --capacity, without and with a shared prompt prefix (--prefix-tokens).
Prints a table, or JSON with --json. The full benchmark suite (pgbench reference, scenarios)
belongs to a later issue.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

import grpc

from bench.harness import throwaway_server
from kvquota.v1 import admin_pb2, admin_pb2_grpc, admission_pb2, admission_pb2_grpc
from kvquota.v1 import resources_pb2 as pb


async def setup(address: str, capacities: list[int]) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        admin = admin_pb2_grpc.AdminServiceStub(channel)
        for capacity in capacities:
            print(f"registering an instance of {capacity} slots", file=sys.stderr)
            await admin.RegisterInstance(
                admin_pb2.RegisterInstanceRequest(
                    instance_id=f"bench-{capacity}",
                    block_size=16,
                    max_model_len=8192,
                    num_gpu_blocks=capacity,
                ),
                timeout=600,
            )
        big = 10**12
        quota = pb.TenantQuota(
            max_blocks=big,
            max_tokens_in_flight=big,
            max_queued_requests=1,
            max_pinned_blocks=1,
            max_cpu_tier_bytes=1,
        )
        for t in range(4):
            await admin.CreateTenant(
                admin_pb2.CreateTenantRequest(tenant_id=f"t{t}", tenant=pb.Tenant(quota=quota))
            )


async def drive(
    address: str, capacity: int, prefix_tokens: int, concurrency: int, seconds: float
) -> dict[str, float]:
    latencies: list[float] = []
    pairs = 0
    refused = 0
    deadline = time.perf_counter() + seconds
    async with grpc.aio.insecure_channel(address) as channel:
        stub = admission_pb2_grpc.AdmissionServiceStub(channel)

        async def client(c: int) -> None:
            nonlocal pairs, refused
            i = 0
            while time.perf_counter() < deadline:
                i += 1
                # 1536 tokens = 96 blocks of 16: 1024 of prompt, 512 of output.
                request = admission_pb2.AdmitRequest(
                    tenant=f"tenants/t{c % 4}",
                    request_id=f"{capacity}-{prefix_tokens}-{concurrency}-c{c}-{i}",
                    instance=f"instances/bench-{capacity}",
                    prompt_tokens=1024,
                    max_output_tokens=512,
                )
                if prefix_tokens:
                    suffix = [100_000 + c * 1000 + i % 1000] * (1024 - prefix_tokens)
                    request.prompt_token_ids.extend([*range(prefix_tokens), *suffix])
                start = time.perf_counter()
                try:
                    admitted = await stub.Admit(request)
                except grpc.aio.AioRpcError as error:
                    refused += 1
                    if refused == 1:
                        print(f"first refusal: {error.details()}", file=sys.stderr)
                    continue
                latencies.append(time.perf_counter() - start)
                await stub.Release(admission_pb2.ReleaseRequest(name=admitted.reservation.name))
                pairs += 1

        async def progress() -> None:
            while time.perf_counter() < deadline:
                await asyncio.sleep(1)
                print(f"\r  {pairs} pairs…", end="", file=sys.stderr, flush=True)
            print(file=sys.stderr)

        began = time.perf_counter()
        await asyncio.gather(progress(), *(client(c) for c in range(concurrency)))
        elapsed = time.perf_counter() - began
    if len(latencies) < 2:
        raise SystemExit(f"nothing was admitted ({refused} refused): see the first refusal above")
    quantiles = statistics.quantiles(latencies, n=100)
    return {
        "pool_slots": capacity,
        "prefix_tokens": prefix_tokens,
        "concurrency": concurrency,
        "seconds": round(elapsed, 2),
        "pairs_per_second": round(pairs / elapsed, 1),
        "admit_p50_ms": round(quantiles[49] * 1000, 2),
        "admit_p99_ms": round(quantiles[98] * 1000, 2),
        "refused": refused,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--capacity", type=int, nargs="+", default=[1000, 1_000_000])
    parser.add_argument("--prefix-tokens", type=int, nargs="+", default=[0, 1024])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    results = []
    with throwaway_server() as served:
        asyncio.run(setup(served.address, args.capacity))
        for capacity in args.capacity:
            for prefix in args.prefix_tokens:
                for concurrency in args.concurrency:
                    print(
                        f"{capacity} slots, {prefix}-token shared prefix, "
                        f"concurrency {concurrency}, {args.seconds:g} s",
                        file=sys.stderr,
                    )
                    run = drive(served.address, capacity, prefix, concurrency, args.seconds)
                    results.append(asyncio.run(run))
    if args.json:
        print(json.dumps(results, indent=2))
        return
    columns = list(results[0])
    print("  ".join(f"{c:>16}" for c in columns))
    for row in results:
        print("  ".join(f"{row[c]!s:>16}" for c in columns))


if __name__ == "__main__":
    main()
