"""What the benchmarks share: a throwaway database on the configured PostgreSQL (or 127.0.0.1:5432,
or an embedded one), migrated, with kvquota server processes serving it; the resident memory and
CPU time of processes; and a description of the machine."""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
import tempfile
import threading
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import psycopg
from sqlalchemy import make_url

from quota_service.store import embedded, migrate

ADDRESS = re.compile(r"serving gRPC on (\S+)")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def server_url() -> str:
    """The PostgreSQL server the benchmarks use (its maintenance database)."""
    configured = os.environ.get("KVQUOTA_DATABASE_URL")
    if configured:
        return configured
    try:
        url = "postgresql://postgres@127.0.0.1:5432/postgres"
        psycopg.connect(url, connect_timeout=2).close()
        return url
    except psycopg.OperationalError:
        return embedded.start(Path(tempfile.mkdtemp(prefix="kvquota-bench-")))


def with_database(url: str, database: str) -> str:
    return make_url(url).set(database=database).render_as_string(hide_password=False)


@contextmanager
def scratch_database(root: str, prefix: str = "kvq_bench") -> Iterator[str]:
    """An empty database on the server of `root`, dropped afterwards; yields its URL."""
    database = f"{prefix}_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(root, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{database}"')
    try:
        yield with_database(root, database)
    finally:
        with psycopg.connect(root, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')


@contextmanager
def throwaway_database(root: str | None = None) -> Iterator[str]:
    """A migrated throwaway database; yields its URL."""
    with scratch_database(root or server_url()) as url:
        migrate.upgrade(url)
        yield url


@dataclass(frozen=True)
class Server:
    """One `kvquota serve` process."""

    address: str  # gRPC host:port
    process: subprocess.Popen[str]

    @property
    def pid(self) -> int:
        return self.process.pid


@contextmanager
def server(
    database_url: str,
    env: Mapping[str, str] | None = None,
    wrapper: Sequence[str] = (),
    source: Path | None = None,
) -> Iterator[Server]:
    """A `kvquota serve` process on the database, stopped (SIGTERM) afterwards. Authentication
    is off unless KVQUOTA_AUTH_REQUIRED (in `env` or this process's environment) says otherwise.
    `wrapper` runs it under another program (valgrind); `source` from another checkout."""
    environment = {
        **os.environ,
        "KVQUOTA_DATABASE_URL": database_url,
        "KVQUOTA_GRPC_LISTEN": "127.0.0.1:0",
        "KVQUOTA_METRICS_LISTEN": "127.0.0.1:0",
        "KVQUOTA_AUTH_REQUIRED": os.environ.get("KVQUOTA_AUTH_REQUIRED", "false"),
        **(env or {}),
    }
    with _serving(["quota_service.cli", "serve"], environment, wrapper, source) as running:
        yield running


@contextmanager
def grpc_floor(wrapper: Sequence[str] = ()) -> Iterator[Server]:
    """The bare gRPC floor (bench/grpc_floor.py) in a process of its own, stopped afterwards."""
    with _serving(["bench.grpc_floor"], dict(os.environ), wrapper, None) as running:
        yield running


@contextmanager
def _serving(
    module: Sequence[str],
    env: Mapping[str, str],
    wrapper: Sequence[str],
    source: Path | None,
) -> Iterator[Server]:
    """`python -m module` until it says where it serves; stopped (SIGTERM) afterwards."""
    if source is not None:
        env = {**env, "PYTHONPATH": str(source)}
    process = subprocess.Popen(
        [*wrapper, sys.executable, "-m", *module],
        env=env,
        cwd=source,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert process.stdout is not None
        address = next((m.group(1) for line in process.stdout if (m := ADDRESS.search(line))), None)
        if address is None:
            raise RuntimeError(f"{module[0]} exited ({process.wait()}) before serving")
        # Keep reading what it prints, so that a full pipe never blocks it.
        threading.Thread(target=process.stdout.read, daemon=True).start()
        yield Server(address, process)
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextmanager
def servers(
    database_url: str, count: int, env: Mapping[str, str] | None = None
) -> Iterator[list[Server]]:
    """`count` server processes on the same database."""
    with ExitStack() as stack:
        yield [stack.enter_context(server(database_url, env)) for _ in range(count)]


@dataclass(frozen=True)
class Served:
    database_url: str  # the throwaway database
    address: str  # the server's gRPC host:port
    server: subprocess.Popen[str]


@contextmanager
def throwaway_server() -> Iterator[Served]:
    """A migrated throwaway database and a server on it; both gone afterwards."""
    with throwaway_database() as url, server(url) as running:
        yield Served(url, running.address, running.process)


def _status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} for process {pid}")


def peak_rss_mib(pid: int) -> float:
    """A live process's peak resident memory (VmHWM)."""
    return _status_kib(pid, "VmHWM") / 1024


def rss_mib(pid: int) -> float:
    """A live process's resident memory now (VmRSS)."""
    return _status_kib(pid, "VmRSS") / 1024


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time a process has used so far (0 when it is gone or unreadable)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    # After the command: state is field 3, utime and stime are fields 14 and 15.
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def machine(database_url: str) -> dict[str, str]:
    """What the figures were measured on."""
    cpu = "unknown"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    memory = "unknown"
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        total_kib = int(meminfo.read_text().split("MemTotal:", 1)[1].split()[0])
        memory = f"{total_kib / 2**20:.1f} GiB"
    os_name = platform.platform()
    release = Path("/etc/os-release")
    if release.exists():
        pretty = re.search(r'^PRETTY_NAME="?([^"\n]*)', release.read_text(), re.M)
        if pretty:
            os_name = f"{pretty.group(1)} (Linux {platform.release()})"
    with psycopg.connect(database_url) as conn:
        row = conn.execute("SHOW server_version").fetchone()
        settings: dict[str, str] = dict(
            conn.execute(
                "SELECT name, setting FROM pg_settings WHERE name IN ("
                "'shared_buffers', 'synchronous_commit', 'fsync', 'max_connections', "
                "'autovacuum')"
            ).fetchall()
        )
    shared_buffers_mib = int(settings.get("shared_buffers", "0")) * 8 // 1024
    return {
        "cpu": cpu,
        "cores": str(os.cpu_count()),
        "memory": memory,
        "os": os_name,
        "postgresql": f"{row[0] if row else '?'} (shared_buffers {shared_buffers_mib} MiB, "
        f"fsync {settings.get('fsync')}, synchronous_commit "
        f"{settings.get('synchronous_commit')}, autovacuum {settings.get('autovacuum')})",
        "python": platform.python_version(),
    }
