"""Stand-ins for an engine's HTTP side in integration tests (the real vLLM side is in
tests/engines): a port nothing listens on, and an endpoint that records aborts."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # nothing listens there once it is closed


@asynccontextmanager
async def abort_endpoint(
    on_abort: Callable[[list[str]], Awaitable[None]],
) -> AsyncIterator[str]:
    """An HTTP endpoint that answers POST /abort_requests as vLLM does (200, whatever the ids)
    after handing the ids to `on_abort`; yields its base URL."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while head := await reader.readuntil(b"\r\n\r\n"):
            request_line, *header_lines = head.decode().split("\r\n")
            headers = dict(line.lower().split(":", 1) for line in header_lines if line)
            body = json.loads(await reader.readexactly(int(headers["content-length"])))
            assert request_line.startswith("POST /abort_requests ")
            await on_abort(body["request_ids"])
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
            await writer.drain()

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await serve(reader, writer)
        except asyncio.IncompleteReadError:
            pass  # the client closed its connection
        finally:
            writer.close()

    server = await asyncio.start_server(connection, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        await server.wait_closed()
