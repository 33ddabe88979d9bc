"""`make stress`: gateway clients and an operator drive two kvquota servers, several simulated
engines and a private PostgreSQL with random operations for a while, and faults are injected
every so often: a server killed with SIGKILL and restarted, PostgreSQL crashed and restarted, an
engine killed and restarted. DESIGN.md's invariants (their SQL forms) are checked during the run
and after each fault; at the end, nothing the service acknowledged may be lost, no answer may be
INTERNAL, and every closed hour of usage must export twice to identical bytes.

    python -m stress --duration 60 --fault-interval 30        # the CI form
    python -m stress --duration 600 --fault-interval 30       # the long form (docs/reliability.md)
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import grpc
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from kvquota.v1 import admin_pb2, admin_pb2_grpc
from quota_service.cli.formatting import table_lines
from quota_service.core import access, catalog
from quota_service.core.access import Role
from quota_service.core.invariants import violations
from quota_service.core.model import EngineEndpoints, TenantQuota
from quota_service.store import migrate
from quota_service.store.access import ApiKeys
from quota_service.store.catalog import Catalog
from quota_service.store.database import connect
from quota_service.store.invariants import check_record
from quota_service.store.usage import UsageRollup
from stress.cluster import (
    EnginePorts,
    Postgres,
    Process,
    free_port,
    kvquota_server,
    simulated_engine,
)
from stress.workload import Client, Operator, Tally

BLOCK_SIZE = 16
ENGINE_BLOCKS = 256
SETTLE_SECONDS = 3.0
CHECK_INTERVAL_SECONDS = 5.0
JOB_FINISH_SECONDS = 60.0
GIB = 1024**3


@dataclass
class Fault:
    at: float
    kind: str
    target: str
    recovered_seconds: float
    violations: int


@dataclass
class Report:
    seconds: float = 0.0
    faults: list[Fault] = field(default_factory=list)
    checks: int = 0
    checks_skipped: int = 0
    violations: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    not_ended: list[str] = field(default_factory=list)
    unrecovered: list[str] = field(default_factory=list)
    usage_hours: int = 0
    usage_rows: int = 0
    usage_identical: bool = False
    unfinished_jobs: list[str] = field(default_factory=list)
    reservations: dict[str, int] = field(default_factory=dict)

    def failed(self, tally: Tally) -> bool:
        return bool(
            self.violations
            or self.lost
            or self.not_ended
            or self.unrecovered
            or self.unfinished_jobs
            or tally.idempotency
            or tally.bugs
            or not self.usage_identical
        )


class Cluster:
    def __init__(self, root: Path, instances: int, servers: int) -> None:
        self.logs = root / "logs"
        self.logs.mkdir(parents=True)
        self.postgres = Postgres(root, "kvquota_stress")
        migrate.upgrade(self.postgres.url)
        self.engine_ports = {
            f"gpu-{i}": EnginePorts(free_port(), free_port(), free_port()) for i in range(instances)
        }
        self.engines = {
            name: simulated_engine(name, ports, ENGINE_BLOCKS, self.logs)
            for name, ports in self.engine_ports.items()
        }
        self.server_ports = [free_port() for _ in range(servers)]
        self.servers = [
            kvquota_server(f"server-{i}", self.postgres.url, port, self.logs)
            for i, port in enumerate(self.server_ports)
        ]

    @property
    def addresses(self) -> list[str]:
        return [f"127.0.0.1:{port}" for port in self.server_ports]

    def start(self) -> None:
        for process in [*self.engines.values(), *self.servers]:
            process.start()

    def stop(self) -> None:
        for process in [*self.servers, *self.engines.values()]:
            process.stop()


async def seed(
    cluster: Cluster, tenants: int, clients: int
) -> tuple[str, list[list[str]], list[str]]:
    """Instances, tenants and keys: the admin's, and a gateway key per client for its tenants
    (neighbouring clients share some)."""
    engine = connect(cluster.postgres.url, pool_size=1)
    try:
        store = Catalog(engine)
        for name, ports in cluster.engine_ports.items():
            endpoints = EngineEndpoints(
                ports.url, f"tcp://127.0.0.1:{ports.events}", f"tcp://127.0.0.1:{ports.replay}"
            )
            spec = catalog.instance_spec(
                name, "simulated", None, BLOCK_SIZE, 4096, None, ENGINE_BLOCKS, engine=endpoints
            )
            await store.register_instance(spec)
        names = [f"t{i}" for i in range(tenants)]
        for name in names:
            # Quotas that bind now and then, so refusals and queueing happen too.
            quota = TenantQuota(ENGINE_BLOCKS // 2, 20_000, 16, 64, GIB)
            await store.create_tenant(name, name, 1 + names.index(name) % 3, quota)
        keys = ApiKeys(engine)
        _, admin = await keys.create("stress-operator", Role.ADMIN, [], access.BOOTSTRAP)
        bindings = [
            [names[(i + j) % tenants] for j in range(max(2, tenants // clients + 1))]
            for i in range(clients)
        ]
        gateway_keys = [
            (await keys.create(f"stress-gw-{i}", Role.GATEWAY, b, access.BOOTSTRAP))[1]
            for i, b in enumerate(bindings)
        ]
        return admin, bindings, gateway_keys
    finally:
        await engine.dispose()


class Stress:
    def __init__(self, args: argparse.Namespace, cluster: Cluster) -> None:
        self.args = args
        self.cluster = cluster
        self.rng = random.Random(args.seed)
        self.tally = Tally()
        self.report = Report()
        self.started = time.monotonic()
        self.db = connect(cluster.postgres.url, pool_size=1)

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    async def check(self) -> int:
        """The invariants, once; a check the database could not answer (it is restarting) is
        counted as skipped, not passed."""
        try:
            found = violations(await check_record(self.db))
        except DBAPIError:
            await self.db.dispose()
            self.report.checks_skipped += 1
            return 0
        self.report.checks += 1
        for violation in found:
            self.report.violations.append(f"t={self.elapsed():.0f}s {violation}")
        return len(found)

    async def drive(self, client: Client, until: float) -> None:
        while time.monotonic() < until:
            await client.step()
            await asyncio.sleep(self.rng.uniform(0, 0.05))

    async def checker(self, until: float) -> None:
        while time.monotonic() < until:
            await asyncio.sleep(CHECK_INTERVAL_SECONDS)
            await self.check()

    async def faults(self, until: float) -> None:
        if self.args.fault_interval <= 0:
            return
        kinds = ["server", "postgres", "engine"]
        index = self.rng.randrange(len(kinds))
        while True:
            wait = self.args.fault_interval * self.rng.uniform(0.7, 1.3)
            if time.monotonic() + wait + SETTLE_SECONDS >= until:
                return
            await asyncio.sleep(wait)
            kind = kinds[index % len(kinds)]
            index += 1
            began = time.monotonic()
            target = await asyncio.to_thread(self.inject, kind)
            recovered = time.monotonic() - began
            await asyncio.sleep(SETTLE_SECONDS)
            found = await self.check()
            fault = Fault(round(began - self.started, 1), kind, target, round(recovered, 1), found)
            self.report.faults.append(fault)
            print(
                f"  t={fault.at:.0f}s {kind} fault on {target}: back in {fault.recovered_seconds}s,"
                f" {found} violations",
                file=sys.stderr,
                flush=True,
            )

    def inject(self, kind: str) -> str:
        """One fault and its repair (blocking: run in a thread)."""
        if kind == "postgres":
            self.cluster.postgres.crash_and_restart()
            return "postgres"
        processes: list[Process] = (
            self.cluster.servers if kind == "server" else list(self.cluster.engines.values())
        )
        victim = self.rng.choice(processes)
        victim.kill()
        time.sleep(self.rng.uniform(0.5, 2.0))
        victim.start()
        return victim.name

    async def progress(self, until: float) -> None:
        while time.monotonic() < until:
            await asyncio.sleep(10)
            ops = sum(self.tally.ops.values())
            print(
                f"  t={self.elapsed():.0f}s/{self.args.duration}s: {ops} operations, "
                f"{len(self.report.faults)} faults, {self.report.checks} checks, "
                f"{len(self.report.violations)} violations",
                file=sys.stderr,
                flush=True,
            )

    async def run(self, admin: str, bindings: list[list[str]], gateway_keys: list[str]) -> None:
        addresses = self.cluster.addresses
        engines = {name: ports.url for name, ports in self.cluster.engine_ports.items()}
        clients = [
            Client(
                f"c{i}",
                addresses,
                key,
                tenants,
                engines,
                self.tally,
                random.Random(self.rng.random()),
            )
            for i, (key, tenants) in enumerate(zip(gateway_keys, bindings, strict=True))
        ]
        operator = Operator(
            "op",
            addresses,
            admin,
            sorted({t for b in bindings for t in b}),
            engines,
            self.tally,
            random.Random(self.rng.random()),
        )
        until = time.monotonic() + self.args.duration
        try:
            await asyncio.gather(
                *(self.drive(c, until) for c in [*clients, operator]),
                self.checker(until),
                self.faults(until),
                self.progress(until),
            )
        finally:
            for client in [*clients, operator]:
                await client.close()
        self.report.seconds = round(self.elapsed(), 1)
        await self.recovered(admin)
        await asyncio.sleep(SETTLE_SECONDS)
        await self.check()
        await self.nothing_lost()
        await self.jobs_finish()
        await self.usage_exports(admin)

    async def recovered(self, admin: str) -> None:
        """Every server answers again (after a fault, within a minute)."""
        for address in self.cluster.addresses:
            deadline = time.monotonic() + 60
            async with grpc.aio.insecure_channel(address) as channel:
                stub = admin_pb2_grpc.AdminServiceStub(channel)
                while True:
                    try:
                        await stub.ListTenants(
                            admin_pb2.ListTenantsRequest(page_size=1),
                            metadata=(("authorization", f"Bearer {admin}"),),
                            timeout=5,
                        )
                        break
                    except grpc.aio.AioRpcError:
                        if time.monotonic() > deadline:
                            self.report.unrecovered.append(address)
                            break
                        await asyncio.sleep(1)

    async def nothing_lost(self) -> None:
        """Every reservation the service acknowledged exists, live or ended with a reason, and
        every one it said it ended is ended (its tenant offboarded or not)."""
        async with self.db.connect() as conn:
            rows = await conn.execute(
                text("SELECT tenant, request_id, state, end_reason FROM reservations")
            )
            found = {f"tenants/{r.tenant}/reservations/{r.request_id}": r for r in rows}
            counts = await conn.execute(
                text(
                    "SELECT state || coalesce('/' || end_reason, '') AS what, count(*) AS n "
                    "FROM reservations GROUP BY 1 ORDER BY 1"
                )
            )
            self.report.reservations = {r.what: r.n for r in counts}
        self.report.lost = sorted(self.tally.admitted - set(found))
        self.report.not_ended = sorted(
            name for name in self.tally.ended if name in found and found[name].state != "ENDED"
        )

    async def jobs_finish(self) -> None:
        """Invariant 7's reclaim half: every job left running by a fault is resumed to its end."""
        query = text(
            "SELECT job_id FROM reclaim_jobs WHERE NOT dry_run AND state IN ('PLANNED', 'RUNNING')"
        )
        deadline = time.monotonic() + JOB_FINISH_SECONDS
        while True:
            async with self.db.connect() as conn:
                open_jobs = [str(j) for j in (await conn.execute(query)).scalars()]
            if not open_jobs or time.monotonic() > deadline:
                self.report.unfinished_jobs = open_jobs
                return
            await asyncio.sleep(1)

    async def usage_exports(self, admin: str) -> None:
        """Close every hour of the run (a throwaway database: closing the current hour early is
        harmless), then export them twice through the CLI and compare the bytes."""
        now = datetime.now(UTC)
        await UsageRollup(self.db).close_due(now + timedelta(hours=2), timedelta(0))
        async with self.db.connect() as conn:
            hours = await conn.execute(text("SELECT count(*) FROM usage_closed_hours"))
            self.report.usage_hours = int(hours.scalar_one())
        start = (now - timedelta(seconds=self.report.seconds + 60)).replace(
            minute=0, second=0, microsecond=0
        )
        end = now.replace(minute=0, second=0, microsecond=0) + timedelta(hours=2)
        digests = []
        for attempt in range(2):
            out = self.cluster.logs / f"usage-{attempt}.csv"
            command = [
                sys.executable,
                "-m",
                "quota_service.cli",
                "usage",
                "export",
                "--from",
                start.isoformat(),
                "--to",
                end.isoformat(),
                "--format",
                "csv",
                "--output",
                str(out),
                "--server",
                self.cluster.addresses[attempt % len(self.cluster.addresses)],
                "--api-key",
                admin,
            ]
            await asyncio.to_thread(
                subprocess.run, command, check=True, capture_output=True, timeout=300
            )
            digests.append(hashlib.sha256(out.read_bytes()).hexdigest())
            self.report.usage_rows = len(out.read_text().splitlines()) - 1
        self.report.usage_identical = digests[0] == digests[1] and self.report.usage_rows > 0


def print_report(report: Report, tally: Tally) -> None:
    ops = sorted({op for op, _ in tally.ops})
    codes = sorted({code for _, code in tally.ops})
    rows: list[dict[str, object]] = [
        {"operation": op, **{code: tally.ops.get((op, code), 0) for code in codes}} for op in ops
    ]
    print(f"stress run: {report.seconds}s, {sum(tally.ops.values())} operations")
    print("\n".join(table_lines(rows)))
    print()
    faults: list[dict[str, object]] = [
        {
            "at": f"{f.at}s",
            "fault": f.kind,
            "target": f.target,
            "back in": f"{f.recovered_seconds}s",
            "violations after": f.violations,
        }
        for f in report.faults
    ]
    print(f"faults injected: {len(report.faults)}")
    if faults:
        print("\n".join(table_lines(faults)))
    print()
    skipped = report.checks_skipped
    print(f"invariant checks: {report.checks} (skipped while the database was down: {skipped})")
    print(f"violations: {len(report.violations)}")
    for violation in report.violations[:20]:
        print(f"  {violation}")
    refusals: list[dict[str, object]] = [
        {"code": code, "reason": reason, "count": n}
        for (code, reason), n in sorted(tally.reasons.items())
    ]
    print("refusals by reason:")
    print("\n".join(table_lines(refusals)))
    print()
    print(f"INTERNAL or UNKNOWN answers: {tally.bugs}")
    print(f"idempotency broken (invariant 5): {len(tally.idempotency)} {tally.idempotency[:5]}")
    print(f"reclaim jobs left unfinished (invariant 7): {report.unfinished_jobs}")
    print(f"acknowledged reservations lost: {len(report.lost)} {report.lost[:5]}")
    print(f"acknowledged ends not ended: {len(report.not_ended)} {report.not_ended[:5]}")
    print(f"servers that did not recover: {report.unrecovered}")
    print(f"reservations by state: {report.reservations}")
    print(
        f"usage: {report.usage_hours} hours closed, {report.usage_rows} rows exported, "
        f"two exports identical: {report.usage_identical}"
    )
    print("RESULT:", "FAILED" if report.failed(tally) else "PASSED")


async def main_async(args: argparse.Namespace) -> int:
    root = Path(tempfile.mkdtemp(prefix="kvquota-stress-"))
    print(f"stress: working in {root}", file=sys.stderr, flush=True)
    cluster = Cluster(root, args.instances, args.servers)
    stress = None
    try:
        cluster.start()
        admin, bindings, gateway_keys = await seed(cluster, args.tenants, args.clients)
        stress = Stress(args, cluster)
        await stress.run(admin, bindings, gateway_keys)
    finally:
        cluster.stop()
        if stress is not None:
            await stress.db.dispose()
    assert stress is not None
    if args.json:
        print(
            json.dumps(
                {
                    "report": stress.report.__dict__
                    | {"faults": [f.__dict__ for f in stress.report.faults]},
                    "operations": {f"{op}/{code}": n for (op, code), n in stress.tally.ops.items()},
                    "refusals": {f"{c}/{r}": n for (c, r), n in stress.tally.reasons.items()},
                    "idempotency": stress.tally.idempotency,
                    "bugs": stress.tally.bugs,
                },
                indent=2,
            )
        )
    else:
        print_report(stress.report, stress.tally)
    failed = stress.report.failed(stress.tally)
    if not failed and not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m stress",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--duration", type=float, default=60, help="seconds of load")
    parser.add_argument("--fault-interval", type=float, default=30, help="seconds; 0: no faults")
    parser.add_argument("--clients", type=int, default=4, help="gateway clients")
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--instances", type=int, default=3)
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--keep", action="store_true", help="keep the logs of a passing run")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    return asyncio.run(main_async(parser.parse_args()))
