"""An HTTP proxy in front of an LMCache coordinator and its MP server's admin API, for the
tests that need a kvquota process stopped at an exact point of a COMPRESS step: right after
LMCache demoted a session (the MP server's `DELETE /cache/objects` answered) and before the
ledger heard of it. kvquota finds an MP server through the coordinator's membership, so the
proxy names itself there as the server's admin address; everything passes through unchanged
but the one demotion it is armed to hold, whose answer never reaches the caller.

A minimal HTTP/1.1 (a request with a Content-Length body, one answer, then the connection
closes), which is all kvquota's and LMCache's clients need here."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx

# Headers the proxy sets itself, never copied from either side.
HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "transfer-encoding",
    "content-length",
    "content-encoding",  # httpx hands the body over decoded
    "host",
}


@dataclass
class DemotionHold:
    """Armed: demotions are applied by LMCache, then their answers are held (`demoted` is set
    at the first) until `released`."""

    armed: bool = False
    demoted: asyncio.Event = field(default_factory=asyncio.Event)
    released: asyncio.Event = field(default_factory=asyncio.Event)


class LmcacheProxy:
    def __init__(self, coordinator_url: str, instance_id: str) -> None:
        self._coordinator_url = coordinator_url
        self._instance_id = instance_id
        self._server_url = ""  # the MP server's admin API, from the coordinator's membership
        self._client = httpx.AsyncClient(timeout=30)
        self._listeners: list[asyncio.Server] = []
        self.hold = DemotionHold()
        self.url = ""
        self._server_port = 0

    async def start(self) -> None:
        coordinator = await asyncio.start_server(self._coordinator_side, "127.0.0.1", 0)
        server = await asyncio.start_server(self._server_side, "127.0.0.1", 0)
        self._listeners = [coordinator, server]
        self.url = f"http://127.0.0.1:{coordinator.sockets[0].getsockname()[1]}"
        self._server_port = int(server.sockets[0].getsockname()[1])
        members = (await self._client.get(f"{self._coordinator_url}/instances")).json()
        member = next(m for m in members["instances"] if m["instance_id"] == self._instance_id)
        self._server_url = f"http://{member['ip']}:{member['http_port']}"

    async def close(self) -> None:
        self.hold.released.set()
        for listener in self._listeners:
            listener.close()
            await listener.wait_closed()
        await self._client.aclose()

    async def _coordinator_side(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        async with _closing(writer):
            method, path, headers, body = await _request(reader)
            response = await self._forward(self._coordinator_url, method, path, headers, body)
            content = response.content
            if method == "GET" and path.split("?")[0] == "/instances":
                members = response.json()
                for member in members["instances"]:
                    if member["instance_id"] == self._instance_id:
                        member["ip"], member["http_port"] = "127.0.0.1", self._server_port
                content = json.dumps(members).encode()
            await _answer(writer, response, content)

    async def _server_side(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        async with _closing(writer):
            method, path, headers, body = await _request(reader)
            response = await self._forward(self._server_url, method, path, headers, body)
            if (method, path) == ("DELETE", "/cache/objects") and self.hold.armed:
                # Its retries too, until released: the caller never hears that LMCache did it.
                self.hold.demoted.set()
                await self.hold.released.wait()
                return
            await _answer(writer, response, response.content)

    async def _forward(
        self, base: str, method: str, path: str, headers: dict[str, str], body: bytes
    ) -> httpx.Response:
        kept = {k: v for k, v in headers.items() if k not in HOP_BY_HOP}
        return await self._client.request(method, base + path, headers=kept, content=body)


async def _request(reader: asyncio.StreamReader) -> tuple[str, str, dict[str, str], bytes]:
    method, path, _ = (await reader.readline()).decode().split(" ", 2)
    headers: dict[str, str] = {}
    while (line := (await reader.readline()).decode().strip()) != "":
        name, value = line.split(":", 1)
        headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return method, path, headers, body


@contextlib.asynccontextmanager
async def _closing(writer: asyncio.StreamWriter) -> AsyncIterator[None]:
    """One exchange, then the connection closes, whatever happened: a caller that went away
    (killed, or gave up) is no error of the proxy's."""
    try:
        yield
    except (ConnectionError, ValueError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def _answer(writer: asyncio.StreamWriter, response: httpx.Response, content: bytes) -> None:
    head = [f"HTTP/1.1 {response.status_code} {response.reason_phrase}"]
    head += [f"{k}: {v}" for k, v in response.headers.items() if k.lower() not in HOP_BY_HOP]
    head += [f"Content-Length: {len(content)}", "Connection: close", "", ""]
    writer.write("\r\n".join(head).encode() + content)
    with contextlib.suppress(ConnectionError):
        await writer.drain()
