"""The database's own limit on this machine: `pgbench -N` (TPC-B-like, without the updates of the
two small tables that serialise it) against the same PostgreSQL server, on a throwaway database.

    python -m bench.pgbench --clients 1 4 16 32 --seconds 10
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import make_url

from bench.harness import scratch_database, server_url
from bench.load import say

TPS = re.compile(r"^tps = ([0-9.]+) \(without initial connection time\)", re.M)
LATENCY = re.compile(r"^latency average = ([0-9.]+) ms", re.M)
# About how many transactions a second one pgbench -N client runs here: what a run shorter
# than pgbench's one-second minimum asks of each client, per second of it.
SHORT_RUN_TPS_PER_CLIENT = 400


def binary() -> str:
    """pgbench: on PATH, else PostgreSQL's own directory, else the one `pgserver` ships."""
    found = shutil.which("pgbench")
    if found:
        return found
    candidates = sorted(Path("/usr/lib/postgresql").glob("*/bin/pgbench"), reverse=True)
    try:
        import pgserver  # the embedded PostgreSQL's binaries

        candidates.append(Path(pgserver.__file__).parent / "pginstall" / "bin" / "pgbench")
    except ImportError:
        pass
    for candidate in candidates:
        if candidate.is_file():
            return str(candidate)
    raise SystemExit("pgbench not found (PATH, /usr/lib/postgresql/*/bin, pgserver)")


def _connection(url: str) -> list[str]:
    """pgbench's connection options for a URL (libpq takes the password from PGPASSWORD)."""
    parsed = make_url(url)
    options = []
    # A Unix socket directory may come as ?host=/path (the embedded PostgreSQL's URLs).
    host = parsed.host or parsed.query.get("host")
    port = parsed.port or parsed.query.get("port")
    if host:
        options += ["-h", str(host)]
    if port:
        options += ["-p", str(port)]
    if parsed.username:
        options += ["-U", parsed.username]
    return [*options, str(parsed.database)]


def _env(url: str) -> dict[str, str]:
    password = make_url(url).password
    return {**os.environ, **({"PGPASSWORD": str(password)} if password else {})}


@dataclass(frozen=True)
class Reference:
    clients: int
    tps: float
    latency_ms: float
    command: str


class PgBench:
    """A pgbench database initialised once; `run` measures one client count."""

    def __init__(self, url: str, scale: int) -> None:
        self.url = url
        self.scale = scale
        self.binary = binary()
        self.init_command = self._command(["-i", "-q", "-s", str(scale)])

    def _command(self, options: list[str]) -> list[str]:
        return [self.binary, *options, *_connection(self.url)]

    def initialise(self) -> None:
        say(f"pgbench: initialising scale {self.scale}")
        subprocess.run(
            self.init_command, env=_env(self.url), check=True, capture_output=True, text=True
        )

    def run(self, clients: int, seconds: float) -> Reference:
        threads = max(1, min(clients, os.cpu_count() or 1))
        # pgbench runs whole seconds; a shorter run (the smoke form's) is a number of
        # transactions per client instead, about that long at a few hundred a second.
        length = (
            ["-T", str(round(seconds))]
            if seconds >= 1
            else ["-t", str(max(1, round(seconds * SHORT_RUN_TPS_PER_CLIENT)))]
        )
        command = self._command(["-N", "-c", str(clients), "-j", str(threads), *length])
        say(f"pgbench -N: {clients} clients, {seconds:g} s")
        return _measured(command, self.url, clients)


def _measured(command: list[str], url: str, clients: int) -> Reference:
    done = subprocess.run(command, env=_env(url), capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"pgbench failed ({done.returncode}): {done.stderr.strip()}")
    tps, latency = TPS.search(done.stdout), LATENCY.search(done.stdout)
    if tps is None or latency is None:
        raise RuntimeError(f"cannot read pgbench's output:\n{done.stdout}")
    return Reference(clients, float(tps.group(1)), float(latency.group(1)), _shown(command))


def _shown(command: list[str]) -> str:
    """The command line as it can be run again (the database name is a throwaway's)."""
    return shlex.join([Path(command[0]).name, *command[1:]])


@contextmanager
def pgbench_database(root: str, scale: int) -> Iterator[PgBench]:
    with scratch_database(root, "kvq_pgbench") as url:
        bench = PgBench(url, scale)
        bench.initialise()
        yield bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--scale", type=int, default=10)
    args = parser.parse_args()
    with pgbench_database(server_url(), args.scale) as bench:
        print(" ".join(bench.init_command))
        for clients in args.clients:
            result = bench.run(clients, args.seconds)
            print(f"{result.tps:10.1f} tps  {result.latency_ms:8.2f} ms  {result.command}")


if __name__ == "__main__":
    main()
