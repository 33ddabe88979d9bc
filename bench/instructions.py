"""Instructions a server executes per Admit+Release, counted by valgrind's callgrind, beside the
bare gRPC floor's: a figure the machine's other load does not move, for comparing two versions of
the hot path. (CPU seconds per pair moved by a third between runs of the same code on a shared
machine; under callgrind the same code counts within a percent or two, and beside other heavy
processes a few percent more, the floor's count too: compare versions in alternate runs.)

- `kvquota serve` starts under callgrind with counting off. The load generator (this process)
  registers an instance of 8,192 slots and four tenants, warms up, turns counting on
  (`callgrind_control -i on`), runs --clients closed-loop clients of --pairs Admit+Release pairs
  each (96-block requests, without a prefix unless --prefix), turns counting off and has the
  counts dumped.
- The bare gRPC floor (bench/grpc_floor.py), the same way.

The counts are of user-space instructions, in every thread of the process; what the kernel does
for its system calls is not in them, nor is PostgreSQL's work, nor the server's work on timers
(its maintenance sweep), which under callgrind's pace would be counted tens of times per pair.
Operations share commits as they do at that many clients under callgrind's pace, which is not
the pace of a real run.

    python -m bench.instructions [--clients 8] [--pairs 40] [--prefix 0] [--source DIR] [--json]

--source serves from another checkout (a git worktree of the commit to compare with); the load
generator and the floor are this checkout's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import harness, load
from bench.load import Gateway, Shape, say
from kvquota.v1 import admission_pb2
from quota_service import event_loop
from quota_service.config import load_settings

INSTANCE = "count"
TENANTS = ["t0", "t1", "t2", "t3"]
# Pairs per client before counting starts: connections made, caches and prepared statements warm.
WARM_PAIRS = 5
# Under callgrind a call takes tens of times longer: no owner's lease may lapse meanwhile, and
# the work done on a timer (the maintenance sweep, the metrics' refresh, once a second of wall
# time) waits past the count: it would otherwise be counted tens of times over per pair (0.75M
# instructions of 4.87M a pair, where it is thousands in a real run).
SERVER_ENV = {
    "KVQUOTA_OWNER_LEASE_SECONDS": "600",
    "KVQUOTA_REAPER_INTERVAL_SECONDS": "600",
    "KVQUOTA_METRICS_REFRESH_SECONDS": "600",
    "KVQUOTA_AUTH_REQUIRED": "false",
}


def _under_callgrind(out: Path) -> list[str]:
    return ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}"]


def _control(pid: int, *arguments: str) -> None:
    subprocess.run(["callgrind_control", *arguments, str(pid)], check=True, capture_output=True)


def _counted(out: Path) -> int:
    """The instructions in every dump of a run so far (each holds those since the one before)."""
    total = 0
    for dump in out.parent.glob(f"{out.name}*"):
        for line in dump.read_text(errors="replace").splitlines():
            if line.startswith("totals:"):
                total += int(line.split()[1])
    return total


async def _pairs(gateway: Gateway, clients: int, pairs: int, prefix: int, tag: str) -> None:
    stub = gateway.admission(0)

    shape = Shape(prefix_tokens=prefix)

    async def client(c: int) -> None:
        tenant = TENANTS[c % len(TENANTS)]
        for i in range(pairs):
            request = load.admit_request(shape, tenant, f"{tag}-{c}-{i}", INSTANCE)
            admitted = await stub.Admit(request, timeout=600)
            release = admission_pb2.ReleaseRequest(name=admitted.reservation.name)
            await stub.Release(release, timeout=600)

    await asyncio.gather(*(client(c) for c in range(clients)))


async def _count(
    server: harness.Server, out: Path, args: argparse.Namespace, setup: bool
) -> dict[str, float]:
    """Count one server's instructions over the pairs, after a warm-up."""
    async with Gateway([server.address]) as gateway:
        if setup:
            await load.register_instance(gateway, INSTANCE, 8192)
            await load.create_tenants(gateway, TENANTS)
        await _pairs(gateway, args.clients, WARM_PAIRS, args.prefix, "warm")
        _control(server.pid, "-i", "on")
        began = time.perf_counter()
        counting = _pairs(gateway, args.clients, args.pairs, args.prefix, "counted")
        await load.with_ticker("counting", counting)
        seconds = time.perf_counter() - began
        _control(server.pid, "-i", "off")
        _control(server.pid, "-d")
    pairs = args.clients * args.pairs
    return {"instructions_per_pair": _counted(out) / pairs, "pairs": pairs, "seconds": seconds}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise SystemExit("bench.instructions needs valgrind (callgrind and callgrind_control)")
    loop = load_settings().event_loop
    with tempfile.TemporaryDirectory(prefix="kvq-callgrind-") as scratch:
        served_out, floor_out = Path(scratch) / "served", Path(scratch) / "floor"
        say(f"kvquota serve under callgrind: {args.clients} clients x {args.pairs} pairs")
        with (
            harness.throwaway_database() as url,
            harness.server(url, SERVER_ENV, _under_callgrind(served_out), args.source) as server,
        ):
            served = event_loop.run(_count(server, served_out, args, setup=True), loop)
        say("the bare gRPC floor under callgrind, the same load")
        with harness.grpc_floor(_under_callgrind(floor_out)) as floor:
            bare = event_loop.run(_count(floor, floor_out, args, setup=False), loop)
    return {
        "clients": args.clients,
        "pairs_per_client": args.pairs,
        "prefix_tokens": args.prefix,
        "source": str(args.source or "."),
        "server": served,
        "floor": bare,
        "server_of_floor": served["instructions_per_pair"] / bare["instructions_per_pair"],
    }


def table(result: dict[str, Any]) -> str:
    kind = f"{result['prefix_tokens']}-token prefix" if result["prefix_tokens"] else "no prefix"
    lines = [
        f"Instructions per Admit+Release (callgrind; {result['clients']} clients x "
        f"{result['pairs_per_client']} pairs, {kind}; server from {result['source']})",
        "",
        f"{'':24} {'M instructions/pair':>20} {'pairs':>7} {'seconds counted':>16}",
    ]
    for label, key in (("kvquota serve", "server"), ("bare gRPC floor", "floor")):
        row = result[key]
        lines.append(
            f"{label:24} {row['instructions_per_pair'] / 1e6:>20.3f} {row['pairs']:>7} "
            f"{row['seconds']:>16.1f}"
        )
    lines.append(f"{'kvquota / floor':24} {result['server_of_floor']:>20.2f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--pairs", type=int, default=40, help="per client")
    parser.add_argument("--prefix", type=int, default=0, help="shared prefix tokens")
    parser.add_argument("--source", type=Path, help="serve from this checkout")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = measure(args)
    print(json.dumps(result, indent=2) if args.json else table(result))


if __name__ == "__main__":
    main()
