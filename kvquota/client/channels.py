"""Channels to kvquota servers, shared: every client in a process that talks to the same address
with the same credentials uses one channel (one HTTP/2 connection) per event loop, opened on
first use and closed when its last client closes. gRPC channels are cheap to call on concurrently
and expensive to open; a gateway must not open one per request.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import grpc

# Pings keep idle connections through NATs and load balancers and find dead ones within ~40 s;
# the server permits pings this often (api/server.py).
KEEPALIVE_OPTIONS = (
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
)
# As the server's: a 128k-token prompt's ids fit.
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
# gRPC's own retries would replay calls behind this client's back; it retries itself.
CHANNEL_OPTIONS = (
    *KEEPALIVE_OPTIONS,
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.enable_retries", 0),
)


@dataclass(frozen=True, slots=True)
class Tls:
    """TLS to the servers (PEM): the CA their certificates are signed by (None: the system's
    roots) and, for mutual TLS, this client's certificate chain and private key."""

    ca: bytes | None = None
    certificate_chain: bytes | None = None
    private_key: bytes | None = None

    @classmethod
    def from_files(
        cls, ca: str | None = None, certificate: str | None = None, key: str | None = None
    ) -> Tls:
        def read(path: str | None) -> bytes | None:
            return Path(path).read_bytes() if path else None

        return cls(read(ca), read(certificate), read(key))

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.ca, self.private_key, self.certificate_chain)


_Key = tuple[asyncio.AbstractEventLoop, str, Tls | None]


class SharedChannels:
    """Channels by (event loop, address, TLS), each counted by the clients using it."""

    def __init__(self) -> None:
        self._channels: dict[_Key, tuple[grpc.aio.Channel, int]] = {}

    def acquire(self, address: str, tls: Tls | None) -> grpc.aio.Channel:
        key = (asyncio.get_running_loop(), address, tls)
        channel, users = self._channels.get(key) or (self._open(address, tls), 0)
        self._channels[key] = (channel, users + 1)
        return channel

    async def release(self, address: str, tls: Tls | None) -> None:
        key = (asyncio.get_running_loop(), address, tls)
        channel, users = self._channels[key]
        if users > 1:
            self._channels[key] = (channel, users - 1)
            return
        del self._channels[key]
        await channel.close()

    @staticmethod
    def _open(address: str, tls: Tls | None) -> grpc.aio.Channel:
        if tls is None:
            return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        return grpc.aio.secure_channel(address, tls.credentials(), options=CHANNEL_OPTIONS)


shared_channels = SharedChannels()
