"""Callers waiting on a reservation's next change: a queued Admit, WatchReservation.

Every replica hears every `changed:` notification and wakes its own waiters; because a
notification can be lost, a waiter also re-reads the reservation every `poll_seconds`.
When the server is about to end its shutdown grace, `close` wakes them all for a last read.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from contextlib import suppress


class Waiters:
    def __init__(self, poll_seconds: float) -> None:
        self._poll_seconds = poll_seconds
        self._events: defaultdict[str, set[asyncio.Event]] = defaultdict(set)
        self._closed = asyncio.Event()

    @property
    def closed(self) -> bool:
        """The server is shutting down: waiters answer their callers after one last read."""
        return self._closed.is_set()

    def close(self) -> None:
        """Wake every waiter now; from now on next_change returns at once."""
        self._closed.set()
        for events in self._events.values():
            for event in events:
                event.set()

    async def until_closed(self) -> None:
        """Return once close() was called (for callers waiting on another replica's answer)."""
        await self._closed.wait()

    def on_notification(self, kind: str, subject: str) -> None:
        if kind == "changed":
            for event in self._events.get(subject, ()):
                event.set()

    async def next_change(self, key: str, at_most_seconds: float) -> None:
        """Return after `key` ("tenant/request_id") changed, or after at most
        min(at_most_seconds, poll_seconds), or at once once closed: the caller re-reads
        either way."""
        if self.closed:
            return
        event = asyncio.Event()
        self._events[key].add(event)
        try:
            with suppress(TimeoutError):
                wait = max(0.0, min(at_most_seconds, self._poll_seconds))
                await asyncio.wait_for(event.wait(), wait)
        finally:
            self._events[key].discard(event)
            if not self._events[key]:
                del self._events[key]
