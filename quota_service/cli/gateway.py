"""`kvquota gateway envoy`: kvquota inside a gateway, as Envoy's external processor."""

from __future__ import annotations

import argparse
import asyncio
import sys

from quota_service.cli.command import AddParser
from quota_service.config import Settings


def add_parsers(add_parser: AddParser) -> None:
    gateway = add_parser("gateway", help="run kvquota inside a gateway")
    gateway_commands = gateway.add_subparsers(dest="action", required=True)
    envoy = gateway_commands.add_parser(
        "envoy", help="an Envoy external processor (needs the `gateways` extra)"
    )
    envoy.add_argument(
        "--config", help="the gateway's TOML file (default: $KVQUOTA_GATEWAY_CONFIG)"
    )
    envoy.set_defaults(run=run_envoy)


def run_envoy(args: argparse.Namespace, settings: Settings) -> int:
    # The gateways' dependencies (Envoy's protos, transformers) are an extra, not the server's.
    from kvquota.gateways import config
    from kvquota.gateways.ext_proc import processor

    try:
        gateway_config = config.load(args.config)
    except config.ConfigError as exc:
        print(f"kvquota: bad gateway configuration: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(processor.serve(gateway_config))
    except config.ConfigError as exc:
        print(f"kvquota: bad gateway configuration: {exc}", file=sys.stderr)
        return 2
    return 0
