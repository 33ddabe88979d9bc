"""The `kvquota` command: serve, migrate, and operators' views over gRPC (tables, or --json)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import grpc

from quota_service import logs
from quota_service.cli import (
    audit,
    check,
    gateway,
    instance,
    keys,
    listing,
    plan,
    reclaim,
    serve,
    top,
    usage,
)
from quota_service.cli.command import Run
from quota_service.config import SettingsError, load_settings

# In the order `kvquota --help` lists them.
COMMAND_MODULES = (
    serve,
    listing,
    top,
    instance,
    reclaim,
    plan,
    usage,
    keys,
    gateway,
    audit,
    check,
)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvquota", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    for module in COMMAND_MODULES:
        module.add_parsers(commands.add_parser)
    args = parser.parse_args(argv)
    try:
        settings = load_settings()
    except SettingsError as exc:
        print(f"kvquota: bad settings: {exc}", file=sys.stderr)
        return 2
    logs.configure(settings.log_level.upper(), settings.log_format)
    run: Run = args.run
    try:
        return run(args, settings)
    except grpc.RpcError as exc:
        print(f"kvquota: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
