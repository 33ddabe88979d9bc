"""`make run`'s path: with no KVQUOTA_DATABASE_URL the server starts an embedded PostgreSQL,
migrates it, seeds the demo data and serves; SIGTERM stops both."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from quota_service.cli import main as cli_main
from tests import processes

ADDRESS = re.compile(r"serving gRPC on (\S+)")
METRICS = re.compile(r"serving metrics on (\S+)")
DEMO_KEY = re.compile(r"KVQUOTA_API_KEY=(\S+)")


def test_serve_on_embedded_postgres(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVQUOTA_")}
    env |= {
        "KVQUOTA_DATA_DIR": str(tmp_path / "state"),
        "KVQUOTA_GRPC_LISTEN": "127.0.0.1:0",
        "KVQUOTA_METRICS_LISTEN": "127.0.0.1:0",
    }
    process = processes.popen(
        [sys.executable, "-m", "quota_service.cli", "serve", "--migrate", "--demo"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    assert process.stdout is not None
    try:
        # Authentication is on in the demo too: it prints an admin key to call with.
        key = next(m.group(1) for line in process.stdout if (m := DEMO_KEY.search(line)))
        address = next(m.group(1) for line in process.stdout if (m := ADDRESS.search(line)))
        metrics = next(m.group(1) for line in process.stdout if (m := METRICS.search(line)))
        scraped = httpx.get(metrics, timeout=5).text
        assert (
            'kvquota_instance_blocks{engine_instance="demo-simulated",state="free"} 512.0'
            in scraped
        )
        assert (tmp_path / "state" / "pgdata" / "PG_VERSION").exists()
        assert cli_main(["tenants", "--server", address]) == 1
        assert "UNAUTHENTICATED" in capsys.readouterr().err
        server = ["--server", address, "--api-key", key]
        assert cli_main(["tenants", *server, "--json"]) == 0
        names = [t["name"] for t in json.loads(capsys.readouterr().out)]
        assert names == ["tenants/acme", "tenants/globex"]
        assert cli_main(["instances", *server]) == 0
        header, *rows = capsys.readouterr().out.splitlines()
        assert header.split()[:2] == ["NAME", "STATE"]
        assert [r.split()[:2] for r in rows] == [
            ["instances/demo-llama3-8b", "ACTIVE"],
            ["instances/demo-simulated", "ACTIVE"],
        ]
        # The demo's engine is a simulated vLLM host, which kvquota follows like a real one.
        assert cli_main(["instances", *server, "--json"]) == 0
        simulated = json.loads(capsys.readouterr().out)[1]
        engine_url = simulated["engine"]["url"]
        assert httpx.get(f"{engine_url}/health", timeout=5).status_code == 200
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
        process.stdout.close()
    assert not _postgres_running(tmp_path / "state" / "pgdata")


def _postgres_running(pgdata: Path) -> bool:
    """Whether a postgres process still serves pgdata (the server must stop it on exit)."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(pgdata) in cmdline.read_text():
                return True
        except OSError:
            continue
    return False
