"""Ends reservations whose lease ran out (reason LEASE_EXPIRED) and gives their blocks back.
Every replica runs it; SKIP LOCKED in the ledger keeps them from doing the same row twice."""

from __future__ import annotations

import asyncio
import logging
from contextlib import suppress

from quota_service.store.ledger import Ledger

log = logging.getLogger(__name__)


async def reap_once(ledger: Ledger, batch_size: int) -> int:
    """Reap until nothing is left that has expired; returns how many ended."""
    total = 0
    while True:
        ended = await ledger.reap_expired(batch_size)
        total += ended
        if ended < batch_size:
            return total


async def run(
    ledger: Ledger, interval_seconds: float, batch_size: int, stop: asyncio.Event
) -> None:
    while not stop.is_set():
        try:
            ended = await reap_once(ledger, batch_size)
            if ended:
                log.info("lease reaper ended %d expired reservations", ended)
        except Exception:
            # The database may be restarting; the next sweep tries again.
            log.warning("lease reaper sweep failed", exc_info=True)
        with suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval_seconds)
