"""How commands reach kvquota: a gRPC channel to --server (TLS, the API key on every call), or
the database the settings name for the commands that work on it directly."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import grpc

from quota_service.config import Settings

T = TypeVar("T")


def database_url(settings: Settings) -> str:
    """KVQUOTA_DATABASE_URL, else the embedded PostgreSQL under the data directory (started
    when it is not running)."""
    if settings.database_url:
        return settings.database_url
    from quota_service.store import embedded

    return embedded.start(settings.data_dir)


def add_server_options(
    parser: argparse.ArgumentParser,
    default: str | None = "127.0.0.1:50051",
    help: str = "kvquota gRPC address",
) -> None:
    parser.add_argument("--server", default=default, help=help)
    parser.add_argument("--tls-ca", help="PEM of the CA the server's certificate is signed by")
    parser.add_argument("--tls-cert", help="this client's certificate (mutual TLS)")
    parser.add_argument("--tls-key", help="its private key")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("KVQUOTA_API_KEY", ""),
        help="the API key to call with (default: $KVQUOTA_API_KEY)",
    )


class BearerKey(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds `authorization: Bearer <key>` to every call."""

    def __init__(self, key: str) -> None:
        self._metadata = (("authorization", f"Bearer {key}"),)

    def _with_key(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return details._replace(metadata=(*(details.metadata or ()), *self._metadata))  # type: ignore[attr-defined,no-any-return]

    def intercept_unary_unary(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return continuation(self._with_key(details), request)

    def intercept_unary_stream(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return continuation(self._with_key(details), request)


def channel(args: argparse.Namespace) -> grpc.Channel:
    """A channel to --server: TLS when a CA is given (with a client certificate for mTLS), and
    the API key on every call."""
    if not args.tls_ca:
        transport = grpc.insecure_channel(args.server)
    else:
        key = Path(args.tls_key).read_bytes() if args.tls_key else None
        cert = Path(args.tls_cert).read_bytes() if args.tls_cert else None
        credentials = grpc.ssl_channel_credentials(Path(args.tls_ca).read_bytes(), key, cert)
        transport = grpc.secure_channel(args.server, credentials)
    if not args.api_key:
        return transport
    return grpc.intercept_channel(transport, BearerKey(args.api_key))


def every_page(page: Callable[[str], tuple[Sequence[T], str]]) -> list[T]:
    """Every item of a List: `page` takes a page token and gives a page and the next token."""
    items: list[T] = []
    token = ""
    while True:
        found, token = page(token)
        items.extend(found)
        if not token:
            return items
