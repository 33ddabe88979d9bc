"""What limits the hot path: the ledger's own code, in this process, against the benchmark's
database, through a TCP proxy that counts what the client sends (round trips), with each SQL
statement timed and, once, run under EXPLAIN ANALYZE (inside a savepoint that is rolled back, so
the plan is the one for the real state and the state is left as it was); the reclaim planner's
time split between its snapshot (SQL) and its plan (Python); and, with py-spy installed, where a
server process spends its CPU under load.
"""

from __future__ import annotations

import asyncio
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import TextClause, event, make_url
from sqlalchemy.ext.asyncio import AsyncEngine

from bench.harness import cpu_seconds
from quota_service.config import Settings
from quota_service.core import reclaim as reclaim_core
from quota_service.core.admission import AdmitRequest
from quota_service.core.model import AdmitParams, EndReason
from quota_service.store import blocks, catalog, ledger, offboarding, pins, reclaim
from quota_service.store.database import connect

_STATEMENT_MODULES = (ledger, blocks, offboarding, reclaim, catalog, pins)
_ACTUAL = re.compile(r"actual time=([0-9.]+)\.\.([0-9.]+) rows=(\d+) loops=(\d+)")


class _Counting(asyncio.Protocol):
    """One proxied connection: bytes both ways, and how many times the client sent something
    after the server had answered (a round trip)."""

    def __init__(self, proxy: RoundTripProxy) -> None:
        self._proxy = proxy
        self._client: asyncio.Transport | None = None
        self._server: asyncio.Transport | None = None
        self._pending: list[bytes] = []
        self._answered = True

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._client = transport
        asyncio.get_running_loop().create_task(self._connect())

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        upstream = _Upstream(self)
        transport, _ = await loop.create_connection(
            lambda: upstream, self._proxy.host, self._proxy.port
        )
        self._server = transport
        for data in self._pending:
            transport.write(data)
        self._pending.clear()

    def data_received(self, data: bytes) -> None:
        if self._answered:
            self._proxy.round_trips += 1
            self._answered = False
        if self._server is None:
            self._pending.append(data)
        else:
            self._server.write(data)

    def answer(self, data: bytes) -> None:
        self._answered = True
        if self._client is not None:
            self._client.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._server is not None:
            self._server.close()

    def upstream_lost(self) -> None:
        if self._client is not None:
            self._client.close()


class _Upstream(asyncio.Protocol):
    def __init__(self, downstream: _Counting) -> None:
        self._downstream = downstream

    def data_received(self, data: bytes) -> None:
        self._downstream.answer(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self._downstream.upstream_lost()


class RoundTripProxy:
    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.round_trips = 0


@asynccontextmanager
async def proxied(url: str) -> Any:
    """(URL through a counting proxy, the proxy); the URL as it is when PostgreSQL is not reached
    over TCP."""
    parsed = make_url(url)
    if not parsed.host or parsed.host.startswith("/"):
        yield url, None
        return
    proxy = RoundTripProxy(parsed.host, parsed.port or 5432)
    loop = asyncio.get_running_loop()
    listening = await loop.create_server(lambda: _Counting(proxy), "127.0.0.1", 0)
    port = listening.sockets[0].getsockname()[1]
    try:
        yield parsed.set(host="127.0.0.1", port=port).render_as_string(hide_password=False), proxy
    finally:
        listening.close()


def _statement_names(engine: AsyncEngine) -> dict[str, str]:
    """SQL as the driver receives it -> the name of the constant it comes from."""
    names = {}
    for module in _STATEMENT_MODULES:
        for name, value in vars(module).items():
            if isinstance(value, TextClause):
                compiled = str(value.compile(dialect=engine.dialect))
                names[_normal(compiled)] = f"{module.__name__.rsplit('.', 1)[-1]}.{name}"
            elif isinstance(value, dict):
                for key, clause in value.items():
                    if isinstance(clause, TextClause):
                        compiled = str(clause.compile(dialect=engine.dialect))
                        label = f"{module.__name__.rsplit('.', 1)[-1]}.{name}[{key}]"
                        names[_normal(compiled)] = label
    return names


def _normal(sql: str) -> str:
    return " ".join(sql.split())


@dataclass
class StatementCost:
    calls: int = 0
    seconds: float = 0.0
    backend_cpu_seconds: float = 0.0


@dataclass
class Operation:
    """One kind of operation (Admit, Release), measured over many."""

    count: int = 0
    round_trips: int = 0
    transactions: int = 0
    statements: dict[str, StatementCost] = field(default_factory=dict)
    seconds: float = 0.0
    backend_cpu_seconds: float = 0.0
    plans: dict[str, str] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        n = max(self.count, 1)
        return {
            "operations": self.count,
            "mean_ms": round(self.seconds / n * 1000, 2),
            # 0 when the backend is not on this machine (or not readable).
            "postgres_cpu_ms": round(self.backend_cpu_seconds / n * 1000, 2),
            "round_trips": round(self.round_trips / n, 2),
            "transactions": round(self.transactions / n, 2),
            "statements": [
                {
                    "statement": name,
                    "per_operation": round(cost.calls / n, 2),
                    "mean_ms": round(cost.seconds / max(cost.calls, 1) * 1000, 3),
                    "postgres_cpu_ms": round(
                        cost.backend_cpu_seconds / max(cost.calls, 1) * 1000, 2
                    ),
                }
                for name, cost in sorted(self.statements.items(), key=lambda kv: -kv[1].seconds)
            ],
            "explain": {name: plan_summary(plan) for name, plan in self.plans.items()},
            "plans": self.plans,
        }


class _Instrument:
    """Statement timings into the current Operation; EXPLAIN ANALYZE when armed."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.names = _statement_names(engine)
        self.current: Operation | None = None
        self.explain = False
        self.backend = 0  # the PostgreSQL backend's pid, for its CPU time (0: not read)
        self._started: dict[int, tuple[float, float]] = {}
        sync = engine.sync_engine
        event.listen(sync, "before_cursor_execute", self._before)
        event.listen(sync, "after_cursor_execute", self._after)
        event.listen(sync, "begin", self._begin)

    def name(self, statement: str) -> str:
        normal = _normal(statement)
        return self.names.get(normal) or normal[:60]

    def _before(
        self, conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, many: bool
    ) -> None:
        if self.explain and self.current is not None:
            name = self.name(statement)
            cursor.execute("SAVEPOINT kvq_bench_explain")
            cursor.execute("EXPLAIN (ANALYZE, BUFFERS) " + statement, parameters)
            self.current.plans[name] = "\n".join(row[0] for row in cursor.fetchall())
            cursor.execute("ROLLBACK TO SAVEPOINT kvq_bench_explain")
        cpu = cpu_seconds(self.backend) if self.backend else 0.0
        self._started[id(cursor)] = (time.perf_counter(), cpu)

    def _after(
        self, conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, many: bool
    ) -> None:
        started = self._started.pop(id(cursor), None)
        if self.current is None or started is None or self.explain:
            return
        cost = self.current.statements.setdefault(self.name(statement), StatementCost())
        cost.calls += 1
        cost.seconds += time.perf_counter() - started[0]
        if self.backend:
            cost.backend_cpu_seconds += cpu_seconds(self.backend) - started[1]

    def _begin(self, conn: Any) -> None:
        if self.current is not None and not self.explain:
            self.current.transactions += 1


def plan_summary(plan: str, top: int = 8) -> list[str]:
    """The plan's costliest parts: each CTE's (and the main query's) actual time, slowest first
    (a CTE's time includes the CTEs it reads the first time it reads them), then the triggers
    and the totals."""
    parts = []
    plan_lines = plan.splitlines()
    for n, line in enumerate(plan_lines):
        stripped = line.strip()
        if n == 0 or (stripped.startswith("CTE ") and line.startswith("  CTE ")):
            name = "main query" if n == 0 else stripped
            node = plan_lines[0] if n == 0 else plan_lines[n + 1]
            match = _ACTUAL.search(node)
            if match:
                total = float(match.group(2)) * int(match.group(4))
                what = re.sub(r"\s*\(cost=.*$", "", node.strip().removeprefix("->").strip())
                parts.append((total, f"{name}: {total:.3f} ms ({what}, rows={match.group(3)})"))
    parts.sort(reverse=True)
    lines = [label for _, label in parts[:top]]
    lines += [
        line.strip()
        for line in plan_lines
        if line.startswith(("Trigger", "Planning Time", "Execution Time"))
    ]
    return lines


def _request(
    instance: str, tenant: str, request_id: str, prefix_tokens: int, unique: int
) -> AdmitRequest:
    token_ids: tuple[int, ...] = ()
    if prefix_tokens:
        token_ids = (*range(1, prefix_tokens + 1), *([unique] * (1280 - prefix_tokens)))
    return AdmitRequest(
        AdmitParams(tenant, request_id, instance, 1280, 256, 1, 0), token_ids, 0.0, None
    )


async def hot_path(
    database_url: str,
    instance: str,
    tenant: str,
    iterations: int = 50,
    plan_cache_mode: str | None = None,
    prefixes: tuple[int, ...] = (0, 1024),
) -> dict[str, Any]:
    """Admit and Release of the benchmark's requests through the ledger: round trips (client
    sends after an answer), transactions and statements per operation, each statement's mean
    time, the PostgreSQL backend's CPU per operation (when it runs on this machine), and one
    EXPLAIN ANALYZE of each statement (the last operation of each kind). `plan_cache_mode`
    (auto, force_generic_plan, force_custom_plan) is set on the connection when given."""
    settings = Settings()
    results: dict[str, Any] = {}
    if plan_cache_mode:
        parsed = make_url(database_url)
        options = {**parsed.query, "options": f"-c plan_cache_mode={plan_cache_mode}"}
        database_url = parsed.set(query=options).render_as_string(hide_password=False)
    async with proxied(database_url) as (url, proxy):
        engine = connect(url, pool_size=1)
        instrument = _Instrument(engine)
        book = ledger.Ledger(engine, settings.admission_limits, settings.queue_policy)
        try:
            async with engine.connect() as conn:
                backend = int((await conn.exec_driver_sql("SELECT pg_backend_pid()")).scalar_one())
            instrument.backend = backend if local_postgres(backend) else 0
            for prefix in prefixes:
                admit, release = Operation(), Operation()
                for i in range(iterations + 10 + 1):
                    measuring = i >= 10  # the first ten warm the pool and the prepared statements
                    instrument.explain = i == iterations + 10
                    request_id = f"profile-{prefix}-{i}-{time.monotonic_ns()}"
                    request = _request(instance, tenant, request_id, prefix, 5_000_000 + i)
                    for operation in (admit, release):
                        instrument.current = operation if measuring else None
                        before = proxy.round_trips if proxy else 0
                        cpu = cpu_seconds(instrument.backend)
                        began = time.perf_counter()
                        if operation is admit:
                            await book.admit(request)
                        else:
                            await book.end(tenant, request_id, EndReason.RELEASED, 1)
                        if measuring and not instrument.explain:
                            operation.count += 1
                            operation.seconds += time.perf_counter() - began
                            operation.round_trips += (proxy.round_trips if proxy else 0) - before
                            operation.backend_cpu_seconds += cpu_seconds(instrument.backend) - cpu
                instrument.current = None
                kind = "with_prefix" if prefix else "no_prefix"
                results[f"admit_{kind}"] = admit.summary()
                results[f"release_{kind}"] = release.summary()
        finally:
            await engine.dispose()
    results["round_trips_counted"] = proxy is not None
    results["plan_cache_mode"] = plan_cache_mode or "server default"
    return results


def local_postgres(pid: int) -> bool:
    """Whether `pid` is a PostgreSQL process of this machine (its CPU time can be read)."""
    try:
        return "postgres" in Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return False


async def ending(database_url: str, tenant: str, request_ids: list[str]) -> dict[str, Any]:
    """Ending reservations as offboarding does (one transaction each, TENANT_DELETED): time,
    round trips, statements, PostgreSQL CPU, and EXPLAIN ANALYZE of the last one."""
    settings = Settings()
    operation = Operation()
    async with proxied(database_url) as (url, proxy):
        engine = connect(url, pool_size=1)
        instrument = _Instrument(engine)
        book = ledger.Ledger(engine, settings.admission_limits, settings.queue_policy)
        try:
            async with engine.connect() as conn:
                backend = int((await conn.exec_driver_sql("SELECT pg_backend_pid()")).scalar_one())
            instrument.backend = backend if local_postgres(backend) else 0
            instrument.current = operation
            for n, request_id in enumerate(request_ids):
                instrument.explain = n == len(request_ids) - 1
                before = proxy.round_trips if proxy else 0
                cpu = cpu_seconds(instrument.backend)
                began = time.perf_counter()
                await book.end(tenant, request_id, EndReason.TENANT_DELETED)
                if not instrument.explain:
                    operation.count += 1
                    operation.seconds += time.perf_counter() - began
                    operation.round_trips += (proxy.round_trips if proxy else 0) - before
                    operation.backend_cpu_seconds += cpu_seconds(instrument.backend) - cpu
        finally:
            await engine.dispose()
    return operation.summary()


async def reclaim_split(database_url: str, instance: str, target_blocks: int) -> dict[str, Any]:
    """A reclaim plan's time: the snapshot (SQL, rows into Python objects) and the planner."""
    engine = connect(database_url, pool_size=1)
    try:
        began = time.perf_counter()
        snapshot = await reclaim.load_snapshot(engine, instance)
        loaded = time.perf_counter()
        target = reclaim_core.ReclaimTarget(target_blocks, reclaim_core.Tier.EVICT)
        planned = reclaim_core.plan(snapshot, target)
        done = time.perf_counter()
        jobs = reclaim.ReclaimJobs(engine)
        job = await jobs.create(f"profile-{time.monotonic_ns()}", instance, target, True)
        created = time.perf_counter()
        await jobs.get(job.job_id)
        fetched = time.perf_counter()
        async with engine.connect() as conn:
            plans = {}
            for name, clause in (
                ("_LIVE", reclaim._LIVE),
                ("_UNREFERENCED", reclaim._UNREFERENCED),
            ):
                compiled = str(clause.compile(dialect=engine.dialect))
                raw = await conn.exec_driver_sql(
                    "EXPLAIN (ANALYZE, BUFFERS) " + compiled, {"instance": instance}
                )
                plans[name] = "\n".join(row[0] for row in raw)
            await conn.rollback()
    finally:
        await engine.dispose()
    return {
        "snapshot_seconds": round(loaded - began, 3),
        "plan_seconds": round(done - loaded, 3),
        # ReclaimJobs.create: the same snapshot and plan, then the job and its steps stored,
        # then the job read back (`get`, timed alone as well).
        "create_seconds": round(created - done, 3),
        "get_seconds": round(fetched - created, 3),
        "cached_blocks": sum(c.blocks for c in snapshot.cached),
        "reservations": len(snapshot.reservations),
        "held_entries": sum(r.entries for r in snapshot.reservations),
        "planned_steps": len(planned.steps),
        "planned_blocks": planned.total_blocks,
        "explain": {name: plan_summary(plan) for name, plan in plans.items()},
        "plans": plans,
    }


def py_spy() -> str | None:
    """The py-spy binary, when installed (next to this Python, or on PATH)."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.is_file() else shutil.which("py-spy")


class PySpy:
    """`py-spy record` of a process from now until `stop`, in raw (collapsed stack) form."""

    def __init__(self, binary: str, pid: int, out: Path) -> None:
        self.out = out
        self.command = [
            binary,
            "record",
            "--pid",
            str(pid),
            "--rate",
            "200",
            "--format",
            "raw",
            "--nonblocking",
            "--output",
            str(out),
        ]
        self._process = subprocess.Popen(
            self.command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )

    def stop(self) -> dict[str, Any]:
        """Stop recording (py-spy writes its output on SIGINT) and summarise."""
        self._process.send_signal(signal.SIGINT)
        try:
            _, stderr = self._process.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            self._process.kill()
            return {"error": "py-spy did not stop"}
        if not self.out.exists():
            return {"error": stderr.strip()[-500:] or f"py-spy exited {self._process.returncode}"}
        summary = collapsed_summary(self.out.read_text())
        summary["command"] = shlex.join(["py-spy", *self.command[1:-1], "raw.txt"])
        return summary


# Areas whose share of the (busy) samples is reported even when they are not a frame's leaf.
LAYERS = (
    "quota_service/api",
    "quota_service/core",
    "quota_service/store",
    "quota_service/jobs",
    "sqlalchemy",
    "psycopg",
    "grpc",
    "google",
    "logging",
    "prometheus_client",
)


def _frame_area(frame: str) -> str:
    """Where a frame's code lives: a part of kvquota, a package, or a standard module (py-spy
    gives file names relative to their sys.path entry)."""
    match = re.search(r"\(([^)]*?)(?::\d+)?\)$", frame)
    path = match.group(1) if match else frame
    if "quota_service/" in path:
        part = path.split("quota_service/", 1)[1].split("/")[0]
        return "quota_service/" + part.removesuffix(".py")
    if "kvquota/v1" in path:
        return "kvquota/v1"
    if "grpc" in path:
        return "grpc"
    if "site-packages/" in path:
        path = path.split("site-packages/", 1)[1]
    return path.split("/")[0].removesuffix(".py")


def _waiting(frame: str) -> bool:
    """The event loop waiting for I/O (py-spy's --nonblocking sampling counts it as busy)."""
    return frame.startswith(("EpollSelector.select", "select (selectors"))


def collapsed_summary(raw: str, top: int = 15) -> dict[str, Any]:
    """Of the busy samples (not the event loop waiting in epoll): the top frames by own samples,
    the own samples by area, and the share of samples each layer is on the stack of."""
    own: Counter[str] = Counter()
    own_area: Counter[str] = Counter()
    layers: Counter[str] = Counter()
    busy = waiting = 0
    for line in raw.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = stack.split(";")
        if _waiting(frames[-1]):
            waiting += count
            continue
        busy += count
        own[frames[-1]] += count
        own_area[_frame_area(frames[-1])] += count
        for layer in {a for a in map(_frame_area, frames) if a.startswith(LAYERS)}:
            layers[layer] += count
    share = 100 / busy if busy else 0
    return {
        "busy_samples": busy,
        "epoll_wait_samples": waiting,
        "top_own": [(frame, round(n * share, 1)) for frame, n in own.most_common(top)],
        "own_by_area": [(a, round(n * share, 1)) for a, n in own_area.most_common(top)],
        "layers": [(a, round(n * share, 1)) for a, n in layers.most_common()],
    }
