"""The journal alone, in process against PostgreSQL: what its group commits cost PostgreSQL per
Admit+Release, and how long a new owner takes to recover a large instance, the whole way.

- Commits: owners served in this process (no gRPC), each of --clients looping Admit (96 blocks,
  no prompt ids, as the suite's no-prefix load) then Release on one of --instances instances;
  pairs/s, operations per commit (one commit may hold the batches of several instances), and
  the CPU of the PostgreSQL backends serving the database per pair, and this process's (the
  owners' and the journal's, with the clients' loop: a served pair's cost without gRPC).
- Recovery: a 1,000,000-slot instance with 100,000 cached blocks and 400 live reservations of 96
  blocks, recorded by its owner; another replica then takes it over as `take_over` does (reads
  the tenants, claims the instance and reads its record with `Journal.load`, rebuilds the
  machine), timed --runs times.

    python -m bench.journal [--clients 1 16 32] [--instances 1 8] [--seconds 3] [--runs 3]
        [--no-commits] [--no-recovery] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import psycopg

from bench import harness
from quota_service.config import Settings
from quota_service.core import catalog
from quota_service.core.admission import AdmitRequest
from quota_service.core.instance_machine import InstanceMachine
from quota_service.core.model import AdmitParams, EndReason, TenantQuota
from quota_service.core.queueing import QueuePolicy
from quota_service.owner.instance_owner import InstanceOwner, take_over
from quota_service.store import database
from quota_service.store.catalog import Catalog
from quota_service.store.journal import Journal

BLOCK_SIZE = 16
PROMPT_TOKENS = 1280
OUTPUT_TOKENS = 256
UNLIMITED = TenantQuota(10**9, 10**12, 10**6, 10**9, 0)
LIMITS = Settings().admission_limits
TENANT = "bench"
# The tenants of the commits' load, as the suite's fleet has them.
TENANTS = [f"t{i}" for i in range(16)]

Progress = Callable[[str], None]
# Request ids, unique across load points.
_SEQUENCE = itertools.count()


async def _add_instance(cat: Catalog, name: str, slots: int) -> None:
    await cat.register_instance(
        catalog.instance_spec(name, "bench-model", None, BLOCK_SIZE, 1 << 20, None, slots)
    )


async def _admit(
    owner: InstanceOwner, request_id: str, token_ids: tuple[int, ...] = (), tenant: str = TENANT
) -> None:
    params = AdmitParams(tenant, request_id, owner.instance, PROMPT_TOKENS, OUTPUT_TOKENS, 1, 0)
    wanted = AdmitRequest(params, token_ids, 0.0, None)
    await owner.apply(lambda m, now: m.admit(wanted, now))


async def _release(owner: InstanceOwner, request_id: str, tenant: str = TENANT) -> None:
    await owner.apply(lambda m, now: m.end(tenant, request_id, EndReason.RELEASED, now))


def _backend_cpu(url: str) -> dict[int, float]:
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pid FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        ).fetchall()
    found = {}
    for (pid,) in rows:
        try:
            found[int(pid)] = harness.cpu_seconds(int(pid))
        except OSError:
            continue
    return found


async def commit_point(
    url: str, journal: Journal, owners: Sequence[InstanceOwner], clients: int, seconds: float
) -> dict[str, float]:
    """Closed-loop Admit+Release pairs from `clients` clients spread over the owners."""
    pairs = 0
    stop_at = 0.0

    async def client(owner: InstanceOwner, tenant: str) -> None:
        nonlocal pairs
        while time.monotonic() < stop_at:
            request_id = f"p{next(_SEQUENCE)}"
            await _admit(owner, request_id, tenant=tenant)
            await _release(owner, request_id, tenant)
            pairs += 1

    # Warm the write connections (and their prepared statements) first.
    for owner in owners:
        warm = f"w{next(_SEQUENCE)}"
        await _admit(owner, warm, tenant=TENANTS[0])
        await _release(owner, warm, TENANTS[0])
    stop_at = time.monotonic() + seconds
    pairs = 0
    operations_before = sum(o.stats.operations for o in owners)
    commits_before = journal.stats.commits
    before_cpu = _backend_cpu(url)
    own_before = time.process_time()
    started = time.monotonic()
    await asyncio.gather(
        *(client(owners[i % len(owners)], TENANTS[i % len(TENANTS)]) for i in range(clients))
    )
    elapsed = time.monotonic() - started
    own = time.process_time() - own_before
    after_cpu = _backend_cpu(url)
    postgres = sum(cpu - before_cpu.get(pid, 0.0) for pid, cpu in after_cpu.items())
    operations = sum(o.stats.operations for o in owners) - operations_before
    commits = journal.stats.commits - commits_before
    return {
        "clients": clients,
        "instances": len(owners),
        "pairs_per_s": pairs / elapsed,
        "operations_per_commit": operations / max(commits, 1),
        "postgres_cpu_ms_per_pair": postgres * 1000 / max(pairs, 1),
        "owners_cpu_ms_per_pair": own * 1000 / max(pairs, 1),
    }


async def commits(
    url: str, clients: Sequence[int], instances: Sequence[int], seconds: float, progress: Progress
) -> list[dict[str, float]]:
    engine = database.connect(url)
    cat = Catalog(engine)
    for tenant in TENANTS:
        await cat.create_tenant(tenant, tenant, 1, UNLIMITED)
    points = []
    for count in instances:
        names = [f"commits-{count}-{i}" for i in range(count)]
        for name in names:
            await _add_instance(cat, name, 8192)
        journal = Journal(engine)
        owners = [
            await take_over(journal, cat, name, LIMITS, QueuePolicy(), "bench") for name in names
        ]
        for n in clients:
            progress(f"commits: {count} instance(s), {n} client(s)")
            point = await commit_point(url, journal, owners, n, seconds)
            progress(
                f"  {point['pairs_per_s']:.0f} pairs/s, {point['operations_per_commit']:.1f} "
                f"operations per commit, PostgreSQL "
                f"{point['postgres_cpu_ms_per_pair']:.3f} ms/pair, owners and journal "
                f"{point['owners_cpu_ms_per_pair']:.3f} ms/pair"
            )
            points.append(point)
        await journal.close()
    await engine.dispose()
    return points


async def recovery(url: str, runs: int, progress: Progress) -> dict[str, float]:
    """Seconds for a second replica to take over a recorded 1,000,000-slot instance."""
    engine = database.connect(url)
    cat = Catalog(engine)
    await cat.create_tenant(TENANT, "Bench", 1, UNLIMITED)
    progress("recovery: registering a 1,000,000-slot instance")
    await _add_instance(cat, "big", 1_000_000)
    journal = Journal(engine)
    owner = await take_over(journal, cat, "big", LIMITS, QueuePolicy(), "first")
    hashed = PROMPT_TOKENS // BLOCK_SIZE
    progress("recovery: caching 100,000 blocks, then admitting 400 reservations")

    async def cache(i: int) -> None:
        ids = tuple(range(i * PROMPT_TOKENS, (i + 1) * PROMPT_TOKENS))
        await _admit(owner, f"c{i}", ids)
        await _release(owner, f"c{i}")

    for start in range(0, 100_000 // hashed, 50):
        await asyncio.gather(*(cache(i) for i in range(start, min(start + 50, 100_000 // hashed))))
    await asyncio.gather(*(_admit(owner, f"l{i}") for i in range(400)))
    progress(f"recovery: recorded {owner.machine.pool.counts()} in {owner.stats.batches} batches")
    found = await cat.get_instance("big")
    seconds: list[float] = []
    reads: list[float] = []
    for run in range(runs):
        started = time.perf_counter()
        tenants = await journal.tenants()
        record = await journal.load("big", f"next-{run}", "", 0.0)
        read = time.perf_counter()
        InstanceMachine.recover(
            found.spec, LIMITS, tenants, record.image, record.generation_floor, QueuePolicy()
        )
        seconds.append(time.perf_counter() - started)
        reads.append(read - started)
        progress(
            f"recovery run {run + 1}/{runs}: {seconds[-1]:.3f} s "
            f"(reading the record {reads[-1]:.3f} s, rebuilding {seconds[-1] - reads[-1]:.3f} s)"
        )
    await journal.close()
    await engine.dispose()
    return {
        "min": min(seconds),
        "median": statistics.median(seconds),
        "max": max(seconds),
        "read_median": statistics.median(reads),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 16, 32])
    parser.add_argument("--instances", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--commits", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--recovery", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    result: dict[str, object] = {}
    with harness.throwaway_database() as url:
        if args.commits:
            result["commits"] = asyncio.run(
                commits(url, args.clients, args.instances, args.seconds, progress)
            )
        if args.recovery:
            result["recovery_s"] = asyncio.run(recovery(url, args.runs, progress))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
