"""The processes a stress run drives and breaks: a private PostgreSQL (restartable without touching
anyone else's), kvquota servers and simulated engines, each on fixed ports so that a restarted
one is found where it was."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import psycopg

READY_TIMEOUT_SECONDS = 60.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Postgres:
    """An embedded PostgreSQL (the `pgserver` binaries) under `root`, with one database."""

    def __init__(self, root: Path, database: str) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # pgserver warns when XDG_RUNTIME_DIR is unset
            import pgserver

        self._pgdata = (root / "pgdata").resolve()
        self._server = pgserver.get_server(self._pgdata, cleanup_mode="stop")
        with psycopg.connect(self._server.get_uri("postgres"), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{database}"')
        self.url = str(self._server.get_uri(database))

    def crash_and_restart(self) -> None:
        """`pg_ctl restart -m immediate`: every backend dies as in a crash, the server recovers
        from its WAL and comes back with the same options."""
        from pgserver import _commands

        _commands.pg_ctl(
            ["-w", "-m", "immediate", "restart"],
            pgdata=self._pgdata,
            user=self._server.system_user,
            timeout=READY_TIMEOUT_SECONDS,
        )


@dataclass
class Process:
    """A child process that can be killed and started again with the same command."""

    name: str
    command: list[str]
    env: dict[str, str]
    ready_line: str
    log: Path
    popen: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def start(self) -> None:
        with self.log.open("ab") as log:
            self.popen = subprocess.Popen(
                self.command, env=self.env, stdout=subprocess.PIPE, stderr=log
            )
        assert self.popen.stdout is not None
        deadline = time.monotonic() + READY_TIMEOUT_SECONDS
        while time.monotonic() < deadline:
            line = self.popen.stdout.readline().decode()
            if self.ready_line in line:
                return
            if not line and self.popen.poll() is not None:
                break
        raise RuntimeError(f"{self.name} did not start; see {self.log}")

    def kill(self) -> None:
        """SIGKILL: no shutdown, no cleanup, as when a machine dies."""
        if self.popen is not None and self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()

    def stop(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()
        if self.popen is not None and self.popen.stdout is not None:
            self.popen.stdout.close()


def kvquota_server(name: str, database_url: str, port: int, logs: Path) -> Process:
    env = {
        **os.environ,
        "KVQUOTA_DATABASE_URL": database_url,
        "KVQUOTA_GRPC_LISTEN": f"127.0.0.1:{port}",
        "KVQUOTA_METRICS_LISTEN": "127.0.0.1:0",
        "KVQUOTA_AUTH_REQUIRED": "true",
        "KVQUOTA_REAPER_INTERVAL_SECONDS": "0.5",
        "KVQUOTA_SHUTDOWN_GRACE_SECONDS": "5",
        "KVQUOTA_DB_POOL_SIZE": "5",
        "KVQUOTA_LOG_LEVEL": "WARNING",
    }
    command = [sys.executable, "-m", "quota_service.cli", "serve"]
    return Process(name, command, env, "serving gRPC", logs / f"{name}.log")


@dataclass(frozen=True)
class EnginePorts:
    http: int
    events: int
    replay: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http}"


def simulated_engine(name: str, ports: EnginePorts, blocks: int, logs: Path) -> Process:
    command = [
        sys.executable,
        "-m",
        "stress.engine",
        "--port",
        str(ports.http),
        "--events-port",
        str(ports.events),
        "--replay-port",
        str(ports.replay),
        "--blocks",
        str(blocks),
    ]
    return Process(name, command, dict(os.environ), "simulated engine on", logs / f"{name}.log")
