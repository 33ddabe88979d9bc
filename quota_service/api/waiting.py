"""Callers waiting on a reservation's next change: a queued Admit, WatchReservation.

Every replica hears every `changed:` notification and wakes its own waiters; because a
notification can be lost, a waiter also re-reads the reservation every `poll_seconds`.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from contextlib import suppress


class Waiters:
    def __init__(self, poll_seconds: float) -> None:
        self._poll_seconds = poll_seconds
        self._events: defaultdict[str, set[asyncio.Event]] = defaultdict(set)

    def on_notification(self, kind: str, subject: str) -> None:
        if kind == "changed":
            for event in self._events.get(subject, ()):
                event.set()

    async def next_change(self, key: str, at_most_seconds: float) -> None:
        """Return after `key` ("tenant/request_id") changed, or after at most
        min(at_most_seconds, poll_seconds): the caller re-reads either way."""
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
