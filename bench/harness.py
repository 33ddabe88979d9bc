"""What the benchmarks share: a throwaway database on the configured PostgreSQL (or 127.0.0.1:5432,
or an embedded one), migrated, with a kvquota server process serving it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psycopg
from sqlalchemy import make_url

from quota_service.store import embedded, migrate

ADDRESS = re.compile(r"serving gRPC on (\S+)")


def server_url() -> str:
    configured = os.environ.get("KVQUOTA_DATABASE_URL")
    if configured:
        return configured
    try:
        url = "postgresql://postgres@127.0.0.1:5432/postgres"
        psycopg.connect(url, connect_timeout=2).close()
        return url
    except psycopg.OperationalError:
        return embedded.start(Path(tempfile.mkdtemp(prefix="kvquota-bench-")))


@dataclass(frozen=True)
class Served:
    database_url: str  # the throwaway database
    address: str  # the server's gRPC host:port
    server: subprocess.Popen[str]


@contextmanager
def throwaway_server() -> Iterator[Served]:
    """A migrated throwaway database and a server on it; both gone afterwards."""
    root = server_url()
    database = f"kvq_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(root, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{database}"')
    url = make_url(root).set(database=database).render_as_string(hide_password=False)
    server = None
    try:
        migrate.upgrade(url)
        env = {
            **os.environ,
            "KVQUOTA_DATABASE_URL": url,
            "KVQUOTA_GRPC_LISTEN": "127.0.0.1:0",
            "KVQUOTA_METRICS_LISTEN": "127.0.0.1:0",
            "KVQUOTA_AUTH_REQUIRED": os.environ.get("KVQUOTA_AUTH_REQUIRED", "false"),
        }
        server = subprocess.Popen(
            [sys.executable, "-m", "quota_service.cli", "serve"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert server.stdout is not None
        address = next(m.group(1) for line in server.stdout if (m := ADDRESS.search(line)))
        yield Served(url, address, server)
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)
        with psycopg.connect(root, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
