"""Replicas wake each other through PostgreSQL's LISTEN/NOTIFY on one channel.

Statements send, in the same transaction as the change (delivered when it commits):
- `released:{instance}`: blocks came back on an instance with requests queued (dispatch them);
- `changed:{tenant}/{request_id}`: a reservation changed state (wake whoever waits on it).
Notifications can be lost while a listener reconnects, so every consumer also polls.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from contextlib import suppress

import psycopg
from sqlalchemy import make_url

log = logging.getLogger(__name__)

CHANNEL = "kvquota_events"
RECONNECT_SECONDS = 1.0

Handler = Callable[[str, str], None]


def libpq_url(database_url: str) -> str:
    """A SQLAlchemy URL as libpq (psycopg) takes it."""
    url = make_url(database_url)
    return url.set(drivername="postgresql").render_as_string(hide_password=False)


class Listener:
    """Delivers (kind, subject) of every notification to the subscribed handlers; reconnects
    after losing its connection."""

    def __init__(self, database_url: str) -> None:
        self._url = libpq_url(database_url)
        self._handlers: list[Handler] = []
        self._task: asyncio.Task[None] | None = None
        self.connected = asyncio.Event()

    def subscribe(self, handler: Handler) -> None:
        self._handlers.append(handler)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            try:
                async with await psycopg.AsyncConnection.connect(
                    self._url, autocommit=True
                ) as conn:
                    await conn.execute(f"LISTEN {CHANNEL}")
                    self.connected.set()
                    async for notify in conn.notifies():
                        kind, _, subject = notify.payload.partition(":")
                        for handler in self._handlers:
                            handler(kind, subject)
            except (psycopg.Error, OSError):
                self.connected.clear()
                log.warning("notification listener lost its connection; reconnecting")
                await asyncio.sleep(RECONNECT_SECONDS)
