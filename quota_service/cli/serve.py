"""`kvquota serve` and `kvquota migrate`: run the server, bring the database's schema up to date."""

from __future__ import annotations

import argparse
from dataclasses import replace

from quota_service.cli.command import AddParser
from quota_service.cli.connection import database_url
from quota_service.config import Settings


def add_parsers(add_parser: AddParser) -> None:
    serve = add_parser("serve", help="serve gRPC (embedded PostgreSQL when no URL set)")
    serve.add_argument("--listen", help="host:port, overrides KVQUOTA_GRPC_LISTEN")
    serve.add_argument("--migrate", action="store_true", help="apply migrations first")
    serve.add_argument("--demo", action="store_true", help="seed a demo instance and tenants")
    serve.set_defaults(run=run_serve)
    add_parser("migrate", help="apply database migrations").set_defaults(run=run_migrate)


def run_serve(args: argparse.Namespace, settings: Settings) -> int:
    from quota_service import demo, event_loop
    from quota_service.api import server
    from quota_service.store import access, migrate

    if args.listen:
        settings = replace(settings, grpc_listen=args.listen)
    url = database_url(settings)
    if args.migrate:
        migrate.upgrade(url)

    async def run() -> None:
        host = None
        if args.demo:
            host, endpoints = await demo.start_simulated_host()
            await demo.seed(url, endpoints)
            if settings.auth_required:
                _, token = await access.create_bootstrap_key(url, "demo-admin")
                # Local development only: a production key is never printed by a server.
                print(f"kvquota demo admin key: export KVQUOTA_API_KEY={token}", flush=True)
        try:
            await server.serve(settings, url)
        finally:
            if host is not None:
                await host.close()

    event_loop.run(run(), settings.event_loop)
    return 0


def run_migrate(args: argparse.Namespace, settings: Settings) -> int:
    from quota_service.store import migrate

    migrate.upgrade(database_url(settings))
    print("database is at the newest migration")
    return 0
