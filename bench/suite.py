"""The benchmark suite: what the quota service costs on the hot path, measured against
the database's own limit (`pgbench -N`) on the same PostgreSQL server, in one run.

One throwaway database; --servers `kvquota serve` processes on it (API keys required unless
--auth off: the suite makes an admin key and sends it with every call); this process is the
load generator. Each of --runs runs measures:

- pgbench -N at each --concurrency on a throwaway database of the same server (best tps);
- Admit+Release of 1536-token requests (96 blocks of 16), closed loop at each --concurrency,
  without a prefix and with a shared 1024-token prefix (best pairs/s of each);
- Admit latency at half of that best, open loop (Poisson arrivals at the rate, each Admit timed
  from when it was due);
- Admit latency on a 1,000-slot pool and on a 1,000,000-slot pool, one client;
- a mix of tenants with weights 1, 1, 2, 4 contending for a 10-request instance with a wait
  budget: pairs/s, queue wait, each tenant's share;
- offboarding (DeleteTenant) of a tenant holding 100,000 blocks;
- with --auth both: the best concurrency again against servers without authentication;
- the servers' resident memory (VmRSS sampled, VmHWM at the end) and CPU per pair.
Then, once: a reclaim plan (CreateReclaimJob dry_run) over the 1,000,000-slot pool filled to 90%,
timed --runs times (at least 3); and, with --profile, a py-spy profile of a server under load
(bench/profile.py).

Prints a table (min / median / max over runs, each target met or not), or JSON with --json, and
writes --docs (docs/benchmarks.md). `--quick` is a smoke form: short, small, one run.

    python -m bench.suite [--runs 3] [--seconds 10] [--servers 1] [--auth both|on|off] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg

from bench import harness, load, profile, report
from bench.load import Gateway, LoadResult, Shape, percentile, say
from bench.pgbench import PgBench, pgbench_database
from kvquota.v1 import admin_pb2, admission_pb2
from kvquota.v1 import resources_pb2 as pb
from quota_service import event_loop
from quota_service.config import load_settings
from quota_service.store.access import create_bootstrap_key

TENANTS = ["t0", "t1", "t2", "t3"]
FLEET = 8
FLEET_TENANTS = [f"f{i}" for i in range(16)]
QUEUE_TENANTS = ["q0", "q1", "q2", "q3"]
QUEUE_WEIGHTS = [1, 1, 2, 4]
PREFIX_TOKENS = 1024
# Filling the big pool for the reclaim plan: sessions of 32,768 tokens (2,048 blocks).
FILL_PROMPT, FILL_OUTPUT = 32_752, 16


@dataclass(frozen=True)
class Sizes:
    small_pool: int
    big_pool: int
    offboard_blocks: int
    pgbench_scale: int
    # Slots of the throughput instance and of each fleet instance (room for two requests per
    # client is kept, whatever this says).
    throughput_pool: int


FULL = Sizes(
    small_pool=1_000,
    big_pool=1_000_000,
    offboard_blocks=100_000,
    pgbench_scale=10,
    throughput_pool=8_192,
)
QUICK = Sizes(
    small_pool=1_000,
    big_pool=20_000,
    offboard_blocks=1_920,
    pgbench_scale=1,
    throughput_pool=1_024,
)
# The queue mix runs at least this long: on a loaded machine the smoke form must still see
# requests admitted from the queue.
QUEUE_MIN_SECONDS = 2.0


@dataclass(frozen=True)
class Target:
    """A target of the issue: `figure`'s median compared with `limit`."""

    key: str
    text: str
    figure: str
    limit: float
    at_most: bool  # True: figure <= limit; False: figure >= limit


TARGETS = [
    Target(
        "throughput_of_floor",
        "Admit+Release pairs/s >= 0.6 x the bare gRPC floor's, no prefix",
        "of_grpc_floor_no_prefix",
        0.6,
        False,
    ),
    Target(
        "throughput_of_floor_prefix",
        "Admit+Release pairs/s >= 0.6 x the bare gRPC floor's, 1024-token shared prefix",
        "of_grpc_floor_prefix",
        0.6,
        False,
    ),
    Target(
        "throughput_no_prefix",
        "Admit+Release pairs/s >= 1,000, no prefix",
        "pairs_per_second_no_prefix",
        1000.0,
        False,
    ),
    Target(
        "throughput_prefix",
        "Admit+Release pairs/s >= 1,000, 1024-token shared prefix",
        "pairs_per_second_prefix",
        1000.0,
        False,
    ),
    Target(
        "server_cpu",
        "Server CPU per pair <= 2 x the bare gRPC floor's (no prefix)",
        "server_cpu_of_grpc_floor_no_prefix",
        2.0,
        True,
    ),
    Target(
        "postgres_cpu",
        "PostgreSQL CPU per pair <= 0.3 ms (no prefix)",
        "postgres_cpu_ms_per_pair_no_prefix",
        0.3,
        True,
    ),
    Target(
        "p50_one_client",
        "Admit p50 <= 2 ms with one client (1,000-slot pool)",
        "pool_small_admit_p50_ms",
        2.0,
        True,
    ),
    Target(
        "p99_half_load",
        "Admit p99 <= 10 ms at half of the best throughput (no prefix)",
        "half_no_prefix_admit_p99_ms",
        10.0,
        True,
    ),
    Target(
        "fleet",
        "Eight instances: pairs/s >= the one-instance figure",
        "fleet_of_one_instance",
        1.0,
        False,
    ),
    Target(
        "pool_size",
        "Admit latency (p50) with 1,000,000 slots <= 1.2 x with 1,000 slots",
        "pool_ratio_p50",
        1.2,
        True,
    ),
    Target(
        "offboarding",
        "Offboarding a tenant holding 100,000 blocks <= 2 s",
        "offboard_seconds",
        2.0,
        True,
    ),
    Target(
        "reclaim_plan",
        "Planning a reclaim over 1,000,000 blocks <= 0.2 s",
        "reclaim_plan_seconds",
        0.2,
        True,
    ),
    Target(
        "memory",
        "Server resident memory <= 300 MB with a 1,000,000-slot instance (peak VmHWM)",
        "server_peak_rss_mib",
        300 * 1e6 / 2**20,
        True,
    ),
]


@dataclass
class Point:
    """One closed-loop load point."""

    prefix_tokens: int
    concurrency: int
    pairs_per_second: float
    admit_p50_ms: float
    admit_p99_ms: float
    release_p50_ms: float
    refused: int
    server_cpu_ms_per_pair: float
    postgres_cpu_ms_per_pair: float
    driver_cpu_ms_per_pair: float
    # The servers' PostgreSQL connections: how many were in each state, on average.
    connections: dict[str, float] = field(default_factory=dict)
    # Admits and Releases per write transaction PostgreSQL gave an id to (group commit).
    operations_per_commit: float = math.nan

    @classmethod
    def of(
        cls,
        prefix: int,
        concurrency: int,
        result: LoadResult,
        server_seconds: float,
        postgres_seconds: float,
        connections: dict[str, float],
        write_transactions: int = 0,
    ) -> Point:
        """A closed loop's result, with the CPU seconds its servers and PostgreSQL spent and
        the write transactions PostgreSQL committed meanwhile."""
        pairs = max(result.pairs, 1)
        # CPU is counted over the warm-up too (a little more than the counted pairs did).
        spanned = (result.seconds + 0.5) / result.seconds if result.seconds else 1.0
        return cls(
            prefix,
            concurrency,
            result.pairs_per_second,
            percentile(result.admit_ms, 50),
            percentile(result.admit_ms, 99),
            percentile(result.release_ms, 50),
            sum(result.refused.values()),
            server_seconds * 1000 / pairs / spanned,
            postgres_seconds * 1000 / pairs / spanned,
            result.driver_cpu_seconds * 1000 / pairs / spanned,
            connections,
            2 * pairs * spanned / write_transactions if write_transactions else math.nan,
        )


@dataclass
class Run:
    figures: dict[str, float] = field(default_factory=dict)
    points: list[Point] = field(default_factory=list)
    pgbench: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


class Watch:
    """Samples the servers' resident memory in the background, per phase."""

    def __init__(self, pids: Sequence[int]) -> None:
        self.pids = list(pids)
        self.phase = "setup"
        self.peaks: dict[str, float] = {}
        self._task: asyncio.Task[None] | None = None

    def sample(self) -> None:
        try:
            rss = max(harness.rss_mib(pid) for pid in self.pids)
        except (OSError, RuntimeError):
            return
        self.peaks[self.phase] = max(self.peaks.get(self.phase, 0.0), rss)

    async def _loop(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(0.25)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    def stop(self) -> None:
        if self._task:
            self._task.cancel()

    def peak_since(self, phases: Sequence[str]) -> float:
        return max((self.peaks.get(p, 0.0) for p in phases), default=0.0)

    def hwm(self) -> float:
        return max(harness.peak_rss_mib(pid) for pid in self.pids)


class CpuMeter:
    """CPU seconds of the servers and of the PostgreSQL backends serving this database."""

    def __init__(self, database_url: str, server_pids: Sequence[int]) -> None:
        self.url = database_url
        self._servers = list(server_pids)

    def _backends(self) -> list[int]:
        with psycopg.connect(self.url, autocommit=True) as conn:
            rows = conn.execute(
                "SELECT pid FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            ).fetchall()
        return [int(r[0]) for r in rows]

    def snapshot(self) -> tuple[float, dict[int, float]]:
        servers = sum(harness.cpu_seconds(pid) for pid in self._servers)
        return servers, {pid: harness.cpu_seconds(pid) for pid in self._backends()}

    def since(self, before: tuple[float, dict[int, float]]) -> tuple[float, float]:
        servers, backends = self.snapshot()
        postgres = sum(cpu - before[1].get(pid, 0.0) for pid, cpu in backends.items())
        return servers - before[0], postgres


def transaction_ids(database_url: str) -> int:
    """The next transaction id the cluster will hand out: how many write transactions began
    between two reads (read-only ones get none). The statistics views lag by up to a second."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        row = conn.execute("SELECT pg_snapshot_xmax(pg_current_snapshot())::text").fetchone()
    assert row is not None
    return int(row[0])


class Connections:
    """Samples what the servers' PostgreSQL connections are doing (pg_stat_activity), every
    50 ms: on CPU, waiting for a lock, for WAL, or for the server's next statement."""

    QUERY = """
        SELECT state, wait_event_type, wait_event FROM pg_stat_activity
        WHERE datname = current_database() AND backend_type = 'client backend'
          AND pid <> pg_backend_pid()
    """

    def __init__(self, database_url: str) -> None:
        self._url = database_url

    @staticmethod
    def _state(state: str | None, kind: str | None, event: str | None) -> str | None:
        if state == "idle":
            return None  # in the pool, or listening
        if state == "idle in transaction":
            return "in a transaction, waiting for the server's next statement"
        if state == "active" and kind is None:
            return "running a statement (on CPU or runnable)"
        return f"running a statement, waiting for {kind}:{event}"

    async def sample(self, stop: asyncio.Event) -> dict[str, float]:
        counts: dict[str, int] = {}
        samples = 0
        async with await psycopg.AsyncConnection.connect(self._url, autocommit=True) as conn:
            while not stop.is_set():
                rows = await (await conn.execute(self.QUERY)).fetchall()
                samples += 1
                for row in rows:
                    state = self._state(*row)
                    if state:
                        counts[state] = counts.get(state, 0) + 1
                with suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 0.05)
        ordered = sorted(counts.items(), key=lambda kv: -kv[1])
        return {k: round(v / max(samples, 1), 2) for k, v in ordered}


def _stats(values: Sequence[float]) -> dict[str, float]:
    finite = [v for v in values if not math.isnan(v)]
    if not finite:
        return {"min": math.nan, "median": math.nan, "max": math.nan, "n": 0}
    return {
        "min": min(finite),
        "median": statistics.median(finite),
        "max": max(finite),
        "n": len(finite),
    }


class Suite:
    def __init__(self, args: argparse.Namespace, sizes: Sizes) -> None:
        self.args = args
        self.sizes = sizes
        self.runs: list[Run] = []
        self.once: dict[str, list[float]] = {}
        self.extra: dict[str, Any] = {}
        self.token: str | None = None
        self.spied: harness.Server  # the server py-spy watches (the one admin calls go to)
        self.grpc_floor: harness.Server | None = None  # started by measure
        self.throughput_slots = 0  # the "tput" instance's, set by setup
        self.scratch = tempfile.mkdtemp(prefix="kvq-bench-")
        self.server_env: dict[str, str] = {}  # how main starts the servers

    # -- setup -----------------------------------------------------------------------------

    async def setup(self, gateway: Gateway) -> None:
        biggest = max(self.args.concurrency)
        throughput_slots = max(self.sizes.throughput_pool, 2 * biggest * Shape().blocks)
        await load.register_instance(gateway, "tput", throughput_slots)
        self.throughput_slots = throughput_slots
        await load.register_instance(gateway, "pool-small", self.sizes.small_pool)
        seconds = await load.register_instance(gateway, "pool-big", self.sizes.big_pool)
        self.extra["register_big_pool_seconds"] = round(seconds, 1)
        await load.register_instance(gateway, "queue", 10 * Shape().blocks)
        offboard_requests = math.ceil(self.sizes.offboard_blocks / Shape().blocks)
        offboard_slots = (offboard_requests + 1) * Shape().blocks
        await load.register_instance(gateway, "offboard", offboard_slots)
        for i in range(FLEET):
            await load.register_instance(gateway, f"fleet-{i}", throughput_slots)
        await load.create_tenants(gateway, TENANTS)
        await load.create_tenants(gateway, FLEET_TENANTS)
        await load.create_tenants(gateway, QUEUE_TENANTS, QUEUE_WEIGHTS)
        await load.create_tenants(gateway, [f"r{i}" for i in range(8)])

    # -- one run ---------------------------------------------------------------------------

    async def run(
        self,
        number: int,
        gateway: Gateway,
        pgbench: PgBench,
        meter: CpuMeter,
        watch: Watch,
        database_url: str,
    ) -> Run:
        args = self.args
        run = Run()
        f = run.figures
        say(f"== run {number + 1} of {args.runs}")

        watch.phase = f"run{number}-pgbench"
        best_tps = 0.0
        for clients in args.concurrency:
            reference = pgbench.run(clients, args.seconds)
            run.pgbench.append(asdict(reference))
            best_tps = max(best_tps, reference.tps)
        f["pgbench_tps"] = best_tps
        watch.phase = f"run{number}-grpc-floor"
        grpc_floor = await self.grpc_floor_point(number)
        f["grpc_floor_pairs_per_second"] = grpc_floor.pairs_per_second
        f["grpc_floor_server_cpu_ms_per_pair"] = grpc_floor.server_cpu_ms_per_pair

        for prefix, kind in ((0, "no_prefix"), (PREFIX_TOKENS, "prefix")):
            watch.phase = f"run{number}-{kind}"
            best: Point | None = None
            for concurrency in args.concurrency:
                point = await self.point(gateway, meter, prefix, concurrency, f"r{number}")
                run.points.append(point)
                if best is None or point.pairs_per_second > best.pairs_per_second:
                    best = point
            assert best is not None
            f[f"pairs_per_second_{kind}"] = best.pairs_per_second
            f[f"best_concurrency_{kind}"] = best.concurrency
            f[f"ratio_{kind}"] = best.pairs_per_second / best_tps if best_tps else math.nan
            f[f"of_grpc_floor_{kind}"] = best.pairs_per_second / grpc_floor.pairs_per_second
            f[f"server_cpu_of_grpc_floor_{kind}"] = (
                best.server_cpu_ms_per_pair / grpc_floor.server_cpu_ms_per_pair
            )
            f[f"server_cpu_ms_per_pair_{kind}"] = best.server_cpu_ms_per_pair
            f[f"postgres_cpu_ms_per_pair_{kind}"] = best.postgres_cpu_ms_per_pair
            f[f"driver_cpu_ms_per_pair_{kind}"] = best.driver_cpu_ms_per_pair
            most = [p for p in run.points if p.prefix_tokens == prefix][-1]
            f[f"operations_per_commit_{kind}"] = most.operations_per_commit

        watch.phase = f"run{number}-fleet"
        await self.fleet(gateway, meter, run, number)
        watch.phase = f"run{number}-forwarded"
        await self.forwarded(database_url, meter, run, number)

        for prefix, kind in ((0, "no_prefix"), (PREFIX_TOKENS, "prefix")):
            watch.phase = f"run{number}-half-{kind}"
            rate = f[f"pairs_per_second_{kind}"] / 2
            say(f"open loop at {rate:.1f} pairs/s (half the best), {kind}, {args.seconds:g} s")
            result = await load.open_loop(
                gateway,
                "tput",
                TENANTS,
                Shape(prefix_tokens=prefix),
                rate,
                args.seconds,
                label=f"half-{kind}-r{number}",
                seed=number + 1,
            )
            _refusals(run, f"half load {kind}", result)
            f[f"half_{kind}_rate"] = rate
            f[f"half_{kind}_achieved"] = result.pairs_per_second
            f[f"half_{kind}_admit_p50_ms"] = percentile(result.admit_ms, 50)
            f[f"half_{kind}_admit_p99_ms"] = percentile(result.admit_ms, 99)

        watch.phase = f"run{number}-pools"
        for instance, key in (("pool-small", "pool_small"), ("pool-big", "pool_big")):
            say(f"one client on instances/{instance}, {args.seconds:g} s")
            result = await load.closed_loop(
                gateway, instance, TENANTS, Shape(), 1, args.seconds, label=f"{key}-r{number}"
            )
            _refusals(run, instance, result)
            f[f"{key}_admit_p50_ms"] = percentile(result.admit_ms, 50)
            f[f"{key}_admit_p99_ms"] = percentile(result.admit_ms, 99)
        f["pool_ratio_p50"] = f["pool_big_admit_p50_ms"] / f["pool_small_admit_p50_ms"]
        f["pool_ratio_p99"] = f["pool_big_admit_p99_ms"] / f["pool_small_admit_p99_ms"]

        watch.phase = f"run{number}-queue"
        await self.queue_mix(gateway, run, number)

        watch.phase = f"run{number}-offboard"
        await self.offboarding(gateway, run, number, self.spied)

        if args.auth == "both":
            watch.phase = f"run{number}-auth-off"
            await self.auth_cost(gateway, database_url, run, number)

        f["server_rss_hot_path_mib"] = watch.peak_since(
            [p for p in watch.peaks if p.startswith(f"run{number}-")]
        )
        return run

    async def grpc_floor_point(self, number: int) -> Point:
        """The bare gRPC floor (bench/grpc_floor.py) under the same load generator: its best
        point over the sweep, without a prefix."""
        assert self.grpc_floor is not None
        best: Point | None = None
        # The smoke form measures the floor at its most clients only.
        sweep = self.args.concurrency[-1:] if self.args.quick else self.args.concurrency
        async with Gateway([self.grpc_floor.address]) as floor:
            for concurrency in sweep:
                say(f"gRPC floor: {concurrency} clients, {self.args.seconds:g} s")
                before = harness.cpu_seconds(self.grpc_floor.pid)
                result = await load.closed_loop(
                    floor,
                    "floor",
                    TENANTS,
                    Shape(),
                    concurrency,
                    self.args.seconds,
                    label=f"grpc-floor-c{concurrency}-r{number}",
                )
                server = harness.cpu_seconds(self.grpc_floor.pid) - before
                point = Point.of(0, concurrency, result, server, 0.0, {})
                if best is None or point.pairs_per_second > best.pairs_per_second:
                    best = point
        assert best is not None
        return best

    async def point(
        self, gateway: Gateway, meter: CpuMeter, prefix: int, concurrency: int, tag: str
    ) -> Point:
        kind = f"{prefix}-token prefix" if prefix else "no prefix"
        say(f"closed loop: {concurrency} clients, {kind}, {self.args.seconds:g} s")
        before = meter.snapshot()
        first_id = transaction_ids(meter.url)
        stop = asyncio.Event()
        sampling = asyncio.create_task(Connections(meter.url).sample(stop))
        result = await load.closed_loop(
            gateway,
            "tput",
            TENANTS,
            Shape(prefix_tokens=prefix),
            concurrency,
            self.args.seconds,
            label=f"c{concurrency}-p{prefix}-{tag}",
        )
        stop.set()
        connections = await sampling
        servers, postgres = meter.since(before)
        written = transaction_ids(meter.url) - first_id
        if result.first_refusal:
            say(f"  refused {sum(result.refused.values())}: {result.first_refusal}")
        return Point.of(prefix, concurrency, result, servers, postgres, connections, written)

    async def fleet(self, gateway: Gateway, meter: CpuMeter, run: Run, number: int) -> None:
        """The most clients of the sweep, no prefix, spread over FLEET instances and 16
        tenants (client c: instance c mod FLEET, tenant c mod 16): what one PostgreSQL gives a
        fleet when no instance or tenant row is shared by all the work."""
        clients = max(self.args.concurrency)
        say(f"fleet: {clients} clients over {FLEET} instances and 16 tenants, no prefix")
        before = meter.snapshot()
        result = await load.closed_loop(
            gateway,
            [f"fleet-{i}" for i in range(FLEET)],
            FLEET_TENANTS,
            Shape(),
            clients,
            self.args.seconds,
            label=f"fleet-r{number}",
        )
        servers, postgres = meter.since(before)
        _refusals(run, "fleet", result)
        pairs = max(result.pairs, 1)
        f = run.figures
        f["fleet_pairs_per_second"] = result.pairs_per_second
        f["fleet_ratio"] = result.pairs_per_second / f["pgbench_tps"]
        f["fleet_admit_p50_ms"] = percentile(result.admit_ms, 50)
        f["fleet_admit_p99_ms"] = percentile(result.admit_ms, 99)
        f["fleet_server_cpu_ms_per_pair"] = servers * 1000 / pairs
        f["fleet_postgres_cpu_ms_per_pair"] = postgres * 1000 / pairs
        f["fleet_of_one_instance"] = result.pairs_per_second / f["pairs_per_second_no_prefix"]

    async def forwarded(self, database_url: str, meter: CpuMeter, run: Run, number: int) -> None:
        """The most clients of the sweep, no prefix, all calling another replica, which does
        not own the instance and forwards each call once to the replica that does: what a
        forwarded call costs, beside the same load called straight at the owner."""
        clients = max(self.args.concurrency)
        say(f"forwarded: {clients} clients calling a replica that forwards to the owner")
        with harness.server(database_url, self.server_env) as forwarder:
            async with Gateway([forwarder.address], self.token) as via:
                await load.one_pair(via, "tput", TENANTS[0])
                before, forwarding = meter.snapshot(), harness.cpu_seconds(forwarder.pid)
                result = await load.closed_loop(
                    via,
                    "tput",
                    TENANTS,
                    Shape(),
                    clients,
                    self.args.seconds,
                    label=f"forwarded-r{number}",
                )
                forwarding = harness.cpu_seconds(forwarder.pid) - forwarding
                owning, postgres = meter.since(before)
        _refusals(run, "forwarded", result)
        point = Point.of(0, clients, result, owning, postgres, {})
        f = run.figures
        f["forwarded_pairs_per_second"] = point.pairs_per_second
        f["forwarded_admit_p50_ms"] = point.admit_p50_ms
        f["forwarded_admit_p99_ms"] = point.admit_p99_ms
        f["forwarded_owner_cpu_ms_per_pair"] = point.server_cpu_ms_per_pair
        spent = Point.of(0, clients, result, forwarding, 0.0, {})
        f["forwarding_cpu_ms_per_pair"] = spent.server_cpu_ms_per_pair

    async def queue_mix(self, gateway: Gateway, run: Run, number: int) -> None:
        """48 clients of four tenants (weights 1, 1, 2, 4) on an instance that holds 10 requests;
        each holds its reservation 50 ms (its generation), waiting up to 10 s in the queue.
        Twelve clients a tenant keep every tenant waiting with more requests than its share of
        the slots (weight 4's share is 5): fair queueing divides by weight only among tenants
        that are waiting. With six each, weight 4 often had none queued when a slot freed, and
        got 31% instead of 50%."""
        clients = 48
        seconds = max(self.args.seconds, QUEUE_MIN_SECONDS)
        say(f"queue mix: {clients} clients of 4 tenants, room for 10, {seconds:g} s")
        result = await load.closed_loop(
            gateway,
            "queue",
            QUEUE_TENANTS,
            Shape(),
            clients,
            seconds,
            label=f"queue-r{number}",
            hold_seconds=0.05,
            wait_seconds=10.0,
        )
        _refusals(run, "queue mix", result)
        f = run.figures
        f["queue_pairs_per_second"] = result.pairs_per_second
        f["queue_queued_percent"] = 100 * len(result.queued_ms) / max(result.pairs, 1)
        f["queue_wait_p50_ms"] = percentile(result.queued_ms, 50)
        f["queue_wait_p99_ms"] = percentile(result.queued_ms, 99)
        f["queue_timeouts"] = result.refused.get("DEADLINE_EXCEEDED", 0)
        total = max(sum(result.per_tenant.values()), 1)
        for tenant in QUEUE_TENANTS:
            f[f"queue_share_{tenant}_percent"] = 100 * result.per_tenant[tenant] / total

    async def offboarding(
        self, gateway: Gateway, run: Run, number: int, server: harness.Server
    ) -> None:
        shape = Shape()
        count = math.ceil(self.sizes.offboard_blocks / shape.blocks)
        tenant = f"off{number}"
        last = number == self.args.runs - 1
        say(f"offboarding: {tenant} admits {count:,} requests ({count * shape.blocks:,} blocks)")
        await load.create_tenants(gateway, [tenant])
        await load.hold(gateway, "offboard", tenant, shape, count, label=f"{tenant}-hold")
        usage = await gateway.admin.GetTenantUsage(
            admin_pb2.GetTenantUsageRequest(name=f"tenants/{tenant}"), metadata=gateway.metadata
        )
        held = usage.usage.blocks_in_use
        say(f"  DeleteTenant of {held:,} blocks")
        spying = self.start_spy(server) if last and self.args.py_spy else None
        began = time.perf_counter()
        deleted = await load.with_ticker(
            "DeleteTenant",
            gateway.admin.DeleteTenant(
                admin_pb2.DeleteTenantRequest(name=f"tenants/{tenant}"),
                metadata=gateway.metadata,
                timeout=3600,
            ),
        )
        run.figures["offboard_seconds"] = time.perf_counter() - began
        if spying:
            self.extra["py_spy_offboarding"] = await asyncio.to_thread(spying.stop)
        run.figures["offboard_blocks"] = held
        run.figures["offboard_freed_blocks"] = deleted.report.freed_blocks

    async def auth_cost(self, gateway: Gateway, database_url: str, run: Run, number: int) -> None:
        """The no-prefix best concurrency twice, back to back: against the servers (API keys
        required), then against servers on the same database that skip authentication, on an
        instance like "tput" that the first of their calls makes theirs."""
        concurrency = int(run.figures["best_concurrency_no_prefix"])
        say(f"authentication on, then off: {concurrency} clients, {self.args.seconds:g} s each")
        # Each run's servers without authentication serve an instance of their own: a call for
        # one that other servers own is forwarded there, and refused without a key.
        plain_instance = f"tput-plain-{number}"
        await load.register_instance(gateway, plain_instance, self.throughput_slots)
        env = {"KVQUOTA_AUTH_REQUIRED": "false"}
        with harness.servers(database_url, self.args.servers, env) as plain:
            async with Gateway([s.address for s in plain]) as without:
                for key, target, instance in (
                    ("auth", gateway, "tput"),
                    ("no_auth", without, plain_instance),
                ):
                    result = await load.closed_loop(
                        target,
                        instance,
                        TENANTS,
                        Shape(),
                        concurrency,
                        self.args.seconds,
                        label=f"{key}-r{number}",
                    )
                    _refusals(run, key.replace("_", " "), result)
                    run.figures[f"{key}_pairs_per_second"] = result.pairs_per_second
                    run.figures[f"{key}_admit_p50_ms"] = percentile(result.admit_ms, 50)

    # -- once ------------------------------------------------------------------------------

    async def reclaim_planning(self, gateway: Gateway, watch: Watch) -> None:
        """Fill the big pool (10% cached, 80% in live sessions, a quarter of them suspended),
        then time dry-run reclaim plans over it."""
        watch.phase = "reclaim-fill"
        slots = self.sizes.big_pool
        per_session = math.ceil((FILL_PROMPT + FILL_OUTPUT) / load.BLOCK_SIZE)
        cached_requests = max(1, slots // 10 // per_session)
        sessions = max(1, slots * 8 // 10 // per_session)
        say(
            f"reclaim: filling instances/pool-big: {cached_requests} sessions cached, "
            f"{sessions} live ({per_session:,} blocks each)"
        )
        began = time.perf_counter()
        cached_shape = Shape(FILL_PROMPT, FILL_OUTPUT, prefix_tokens=16)
        for i in range(cached_requests):
            request = load.admit_request(cached_shape, f"r{i % 8}", f"fill-cached-{i}", "pool-big")
            stub = gateway.admission(i)
            admitted = await stub.Admit(request, metadata=gateway.metadata, timeout=600)
            await stub.Release(
                admission_pb2.ReleaseRequest(name=admitted.reservation.name),
                metadata=gateway.metadata,
                timeout=600,
            )
        names: list[str] = []
        for tenant in range(8):
            count = sessions // 8 + (1 if tenant < sessions % 8 else 0)
            if count:
                names += await load.hold(
                    gateway,
                    "pool-big",
                    f"r{tenant}",
                    Shape(FILL_PROMPT, FILL_OUTPUT),
                    count,
                    concurrency=2,
                    label=f"fill-r{tenant}",
                )
        for name in names[::4]:
            await gateway.admission(0).SuspendReservation(
                admission_pb2.SuspendReservationRequest(name=name), metadata=gateway.metadata
            )
        self.extra["reclaim_fill_seconds"] = round(time.perf_counter() - began, 1)
        instance = await gateway.admin.GetInstance(
            admin_pb2.GetInstanceRequest(name="instances/pool-big"), metadata=gateway.metadata
        )
        self.extra["reclaim_pool"] = {
            "slots": instance.capacity_blocks,
            "in_use": instance.blocks_in_use,
            "cached": instance.cached_blocks,
            "free": instance.free_blocks,
            "live_sessions": len(names),
            "suspended_sessions": len(names[::4]),
        }
        watch.phase = "reclaim-plan"
        target = int(slots * 0.9)
        timings = []
        for i in range(max(3, self.args.runs)):
            say(f"  dry-run reclaim plan {i + 1}: target {target:,} blocks, up to EVICT")
            began = time.perf_counter()
            job = await gateway.admin.CreateReclaimJob(
                admin_pb2.CreateReclaimJobRequest(
                    instance="instances/pool-big",
                    target_blocks=target,
                    max_tier=pb.RECLAIM_TIER_EVICT,
                    dry_run=True,
                    request_id=f"plan-{i}-{time.monotonic_ns()}",
                ),
                metadata=gateway.metadata,
                timeout=600,
            )
            timings.append(time.perf_counter() - began)
            self.extra["reclaim_expected_blocks"] = job.expected_blocks
            self.extra["reclaim_steps"] = len(job.steps)
        self.once["reclaim_plan_seconds"] = timings
        watch.phase = "pool-big-in-use"
        for prefix, key in ((0, "pool_big_in_use"), (PREFIX_TOKENS, "pool_big_in_use_prefix")):
            kind = f"{prefix}-token prefix" if prefix else "no prefix"
            say(f"one client on instances/pool-big, 90% in use, {kind}, {self.args.seconds:g} s")
            result = await load.closed_loop(
                gateway,
                "pool-big",
                TENANTS,
                Shape(prefix_tokens=prefix),
                1,
                self.args.seconds,
                label=key,
            )
            self.once[f"{key}_admit_p50_ms"] = [percentile(result.admit_ms, 50)]
            self.once[f"{key}_admit_p99_ms"] = [percentile(result.admit_ms, 99)]

    def start_spy(self, server: harness.Server) -> profile.PySpy | None:
        binary = profile.py_spy()
        if binary is None:
            self.extra["py_spy"] = {"error": "py-spy is not installed (pip install py-spy)"}
            return None
        return profile.PySpy(binary, server.pid, Path(self.scratch) / f"{time.monotonic_ns()}.raw")

    async def spy(self, gateway: Gateway, server: harness.Server, concurrency: int) -> None:
        """py-spy on a server through a closed-loop point of the most clients, no prefix."""
        spying = self.start_spy(server)
        if spying is None:
            return
        seconds = self.args.seconds
        say(f"py-spy on server {server.pid}: {concurrency} clients, no prefix, {seconds:g} s")
        await load.closed_loop(
            gateway, "tput", TENANTS, Shape(), concurrency, seconds, label="py-spy"
        )
        self.extra["py_spy"] = await asyncio.to_thread(spying.stop)

    # -- results ---------------------------------------------------------------------------

    def figures(self) -> dict[str, dict[str, float]]:
        keys: dict[str, None] = {}
        for run in self.runs:
            keys.update(dict.fromkeys(run.figures))
        table = {k: _stats([r.figures[k] for r in self.runs if k in r.figures]) for k in keys}
        for key, values in self.once.items():
            table[key] = _stats(values)
        return table

    def verdicts(self, figures: dict[str, dict[str, float]]) -> list[dict[str, Any]]:
        verdicts = []
        for target in TARGETS:
            figure = figures.get(target.figure)
            if figure is None or figure["n"] == 0:
                verdicts.append({**asdict(target), "met": None, "median": math.nan})
                continue
            median = figure["median"]
            met = median <= target.limit if target.at_most else median >= target.limit
            verdicts.append(
                {
                    **asdict(target),
                    "min": figure["min"],
                    "median": median,
                    "max": figure["max"],
                    "met": met,
                    "of_limit": median / target.limit,
                }
            )
        return verdicts


def _refusals(run: Run, what: str, result: LoadResult) -> None:
    if result.refused:
        note = f"{what}: refused {dict(result.refused)} (first: {result.first_refusal})"
        run.notes.append(note)
        say(f"  {note}")
    if result.dropped:
        run.notes.append(f"{what}: {result.dropped} arrivals dropped (too many unanswered)")


@contextmanager
def _watching(pids: Sequence[int]) -> Iterator[Watch]:
    watch = Watch(pids)
    try:
        yield watch
    finally:
        watch.stop()


async def measure(suite: Suite, database_url: str, servers: list[harness.Server]) -> None:
    args = suite.args
    root = harness.server_url()
    suite.spied = servers[0]
    async with Gateway([s.address for s in servers], suite.token) as gateway:
        with _watching([s.pid for s in servers]) as watch, harness.grpc_floor() as floor:
            suite.grpc_floor = floor
            watch.start()
            await suite.setup(gateway)
            meter = CpuMeter(database_url, [s.pid for s in servers])
            with pgbench_database(root, suite.sizes.pgbench_scale) as pgbench:
                suite.extra["pgbench_init"] = " ".join(
                    [Path(pgbench.init_command[0]).name, *pgbench.init_command[1:]]
                )
                for number in range(args.runs):
                    suite.runs.append(
                        await suite.run(number, gateway, pgbench, meter, watch, database_url)
                    )
            await suite.reclaim_planning(gateway, watch)
            if args.py_spy:
                watch.phase = "py-spy"
                await suite.spy(gateway, servers[0], max(args.concurrency))
            watch.sample()
            suite.extra["server_vmhwm_mib"] = round(watch.hwm(), 1)
            suite.extra["rss_by_phase_mib"] = {k: round(v, 1) for k, v in watch.peaks.items()}
            suite.once["server_peak_rss_mib"] = [watch.hwm()]


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, help="runs of every figure (default 3; quick 1)")
    parser.add_argument("--seconds", type=float, help="per load point (default 10; quick 0.5)")
    parser.add_argument("--concurrency", type=int, nargs="+", help="default 1 4 16 32")
    parser.add_argument("--servers", type=int, default=1, help="kvquota server processes")
    parser.add_argument(
        "--auth",
        choices=["on", "off", "both"],
        help="API keys required by the servers; both: also the best point without (default "
        "both; on with --quick)",
    )
    parser.add_argument("--quick", action="store_true", help="smoke form: short, small, one run")
    parser.add_argument(
        "--profile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="round trips, EXPLAIN ANALYZE, reclaim split; py-spy of a server when installed",
    )
    parser.add_argument(
        "--py-spy",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="profile a server under load with py-spy, when installed (default: unless --quick)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--docs",
        help="write the report here ('' for none; default docs/benchmarks.md, none with --quick)",
    )
    args = parser.parse_args(argv)
    quick = args.quick
    args.runs = args.runs or (1 if quick else 3)
    args.seconds = args.seconds or (0.5 if quick else 10.0)
    args.concurrency = args.concurrency or ([1, 4] if quick else [1, 4, 16, 32])
    args.auth = args.auth or ("on" if quick else "both")
    if args.docs is None:
        args.docs = "" if quick else "docs/benchmarks.md"
    if args.py_spy is None:
        args.py_spy = args.profile and not quick
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse(argv)
    os.environ.setdefault("KVQUOTA_LOG_LEVEL", "WARNING")
    sizes = QUICK if args.quick else FULL
    suite = Suite(args, sizes)
    started = datetime.now(UTC)
    root = harness.server_url()
    env = {
        "KVQUOTA_AUTH_REQUIRED": "false" if args.auth == "off" else "true",
    }
    suite.server_env = env
    with harness.throwaway_database(root) as database_url:
        if args.auth != "off":
            _, suite.token = asyncio.run(create_bootstrap_key(database_url, "bench"))
        machine = harness.machine(database_url)
        say(f"starting {args.servers} server process(es), authentication {args.auth}")
        with harness.servers(database_url, args.servers, env) as servers:
            # The load generator on the servers' event loop: it shares the machine's two cores
            # with them and PostgreSQL, and every cycle it spends is one they do not get.
            event_loop.run(measure(suite, database_url, servers), load_settings().event_loop)
    shutil.rmtree(suite.scratch, ignore_errors=True)
    figures = suite.figures()
    verdicts = suite.verdicts(figures)
    document = {
        "date": started.isoformat(timespec="seconds"),
        "command": shlex.join(["python", "-m", "bench.suite", *(argv or sys.argv[1:])]),
        "settings": {
            "runs": args.runs,
            "seconds": args.seconds,
            "concurrency": args.concurrency,
            "servers": args.servers,
            "auth": args.auth,
            "quick": args.quick,
            "sizes": asdict(sizes),
            "db_pool_size": os.environ.get("KVQUOTA_DB_POOL_SIZE", "10 (default)"),
        },
        "machine": machine,
        "targets": verdicts,
        "figures": figures,
        "runs": [asdict(r) for r in suite.runs],
        "extra": suite.extra,
    }
    if args.docs:
        path = Path(args.docs)
        path.parent.mkdir(parents=True, exist_ok=True)
        report.write(path, document)
        say(f"wrote {path}")
    if args.json:
        print(json.dumps(_clean(document), indent=2, default=str))
    else:
        print(report.table(document))


def _clean(value: Any) -> Any:
    """JSON has no NaN: a figure that could not be measured is null."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


if __name__ == "__main__":
    main()
