"""`kvquota keys`: create, list and revoke API keys over gRPC (needs an admin key), and
`keys bootstrap`, the first admin key, written straight into the database."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from datetime import UTC

from kvquota.v1 import admin_pb2, admin_pb2_grpc, resources_pb2
from quota_service.cli.command import AddParser, add_json_option
from quota_service.cli.connection import add_server_options, channel, database_url, every_page
from quota_service.cli.formatting import as_dict, enum_name, print_json, print_rows
from quota_service.config import Settings

SECRET_SHOWN_ONCE = "the key (shown only this once; store it as a secret):"


def add_parsers(add_parser: AddParser) -> None:
    keys = add_parser("keys", help="API keys: create, list, revoke, bootstrap")
    key_commands = keys.add_subparsers(dest="action", required=True)
    create_key = key_commands.add_parser("create", help="a new key (its secret is shown once)")
    create_key.add_argument("name", help="a label, e.g. gateway-eu-1")
    create_key.add_argument("--role", required=True, choices=["admin", "gateway", "tenant"])
    create_key.add_argument(
        "--tenant",
        action="append",
        default=[],
        help="a tenant the key acts for (repeat for a gateway of several tenants)",
    )
    create_key.set_defaults(run=run_create)
    list_keys = key_commands.add_parser("list", help="the keys that work (--all: revoked too)")
    list_keys.add_argument("--all", action="store_true", help="also revoked keys")
    list_keys.set_defaults(run=run_list)
    revoke_key = key_commands.add_parser("revoke", help="stop a key working")
    revoke_key.add_argument("key", help="apiKeys/{id} or the id")
    revoke_key.set_defaults(run=run_revoke)
    for command in (create_key, list_keys, revoke_key):
        add_server_options(command)
        add_json_option(command)
    bootstrap = key_commands.add_parser(
        "bootstrap", help="the first admin key, written straight into the database"
    )
    bootstrap.add_argument("name", nargs="?", default="bootstrap-admin", help="a label")
    bootstrap.set_defaults(run=run_bootstrap)


def _key_row(k: resources_pb2.ApiKey) -> dict[str, object]:
    return {
        "name": k.name,
        "display name": k.display_name,
        "role": enum_name(k, "role"),
        "tenants": ",".join(t.removeprefix("tenants/") for t in k.tenants) or "-",
        "created": k.create_time.ToDatetime(UTC).isoformat(timespec="seconds"),
        "revoked": (
            k.revoke_time.ToDatetime(UTC).isoformat(timespec="seconds")
            if k.HasField("revoke_time")
            else "-"
        ),
        "creator": k.creator,
    }


def _show(keys: Sequence[resources_pb2.ApiKey], as_json: bool) -> None:
    if as_json:
        print_json([as_dict(k) for k in keys])
    else:
        print_rows([_key_row(k) for k in keys])


def run_create(args: argparse.Namespace, settings: Settings) -> int:
    request = admin_pb2.CreateApiKeyRequest(
        display_name=args.name,
        role=resources_pb2.Role.Value(f"ROLE_{args.role.upper()}"),
        tenants=[f"tenants/{t}" for t in args.tenant],
    )
    with channel(args) as chan:
        response = admin_pb2_grpc.AdminServiceStub(chan).CreateApiKey(request)
    if args.json:
        print_json(as_dict(response))
        return 0
    print_rows([_key_row(response.api_key)])
    print(SECRET_SHOWN_ONCE, file=sys.stderr)
    print(response.secret)
    return 0


def run_list(args: argparse.Namespace, settings: Settings) -> int:
    with channel(args) as chan:
        stub = admin_pb2_grpc.AdminServiceStub(chan)

        def page(token: str) -> tuple[Sequence[resources_pb2.ApiKey], str]:
            request = admin_pb2.ListApiKeysRequest(page_token=token, show_revoked=args.all)
            found = stub.ListApiKeys(request)
            return found.api_keys, found.next_page_token

        keys = every_page(page)
    _show(keys, args.json)
    return 0


def run_revoke(args: argparse.Namespace, settings: Settings) -> int:
    name = args.key if args.key.startswith("apiKeys/") else f"apiKeys/{args.key}"
    with channel(args) as chan:
        revoked = admin_pb2_grpc.AdminServiceStub(chan).RevokeApiKey(
            admin_pb2.RevokeApiKeyRequest(name=name)
        )
    _show([revoked], args.json)
    return 0


def run_bootstrap(args: argparse.Namespace, settings: Settings) -> int:
    """Whoever can reach the database is already trusted with everything."""
    from quota_service.store import access

    key, token = asyncio.run(access.create_bootstrap_key(database_url(settings), args.name))
    print(f"created apiKeys/{key.key_id} ({key.display_name}, ADMIN)", file=sys.stderr)
    print(SECRET_SHOWN_ONCE, file=sys.stderr)
    print(token)
    return 0
