"""An embedded PostgreSQL for development (`make run` with no KVQUOTA_DATABASE_URL): the
`pgserver` package ships the server binaries, so nothing needs installing by hand."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import psycopg

log = logging.getLogger(__name__)

DATABASE = "kvquota"


def start(data_dir: Path) -> str:
    """Start (or reuse) the server under data_dir/pgdata; it stops when this process exits.
    Returns the URL of its `kvquota` database."""
    with warnings.catch_warnings():
        # pgserver warns at import when XDG_RUNTIME_DIR is unset (CI, containers); its fallback
        # under /tmp is what we want anyway.
        warnings.simplefilter("ignore")
        import pgserver

    # pgserver narrates every command it runs at INFO; a new user needs none of it unless
    # KVQUOTA_LOG_LEVEL=DEBUG asks for everything.
    narrator = logging.getLogger("pgserver")
    if not narrator.isEnabledFor(logging.DEBUG):
        narrator.setLevel(logging.WARNING)
    pgdata = (data_dir / "pgdata").resolve()
    pgdata.parent.mkdir(parents=True, exist_ok=True)
    server = pgserver.get_server(pgdata, cleanup_mode="stop")
    with psycopg.connect(server.get_uri("postgres"), autocommit=True) as conn:
        exists = conn.execute(
            "SELECT 1 FROM pg_database WHERE datname = %s", (DATABASE,)
        ).fetchone()
        if exists is None:
            conn.execute(f'CREATE DATABASE "{DATABASE}"')
    log.info("embedded PostgreSQL running in %s", pgdata)
    return str(server.get_uri(DATABASE))
