"""Admits queued requests when blocks come back: on every replica, a `released:{instance}`
notification starts a dispatch pass on that instance (the instance's lock makes passes
exclusive, so each queued request is admitted exactly once, by whichever replica gets there).
Passes for one instance are coalesced: a notification during a pass runs one more after it."""

from __future__ import annotations

import asyncio
import logging

from quota_service.owner.owners import OwnedLedger

log = logging.getLogger(__name__)


class Dispatcher:
    def __init__(self, ledger: OwnedLedger) -> None:
        self._ledger = ledger
        self._running: dict[str, asyncio.Task[None]] = {}
        self._again: set[str] = set()

    def on_notification(self, kind: str, subject: str) -> None:
        if kind != "released":
            return
        if subject in self._running:
            self._again.add(subject)
        else:
            self._running[subject] = asyncio.create_task(self._passes(subject))

    async def _passes(self, instance: str) -> None:
        try:
            while True:
                self._again.discard(instance)
                try:
                    admitted = await self._ledger.dispatch(instance)
                    if admitted:
                        log.debug("dispatched %d on %s", admitted, instance)
                except Exception:
                    log.warning("dispatch on %s failed; the sweep retries", instance, exc_info=True)
                if instance not in self._again:
                    return
        finally:
            del self._running[instance]

    async def stop(self) -> None:
        for task in list(self._running.values()):
            task.cancel()
        await asyncio.gather(*self._running.values(), return_exceptions=True)
