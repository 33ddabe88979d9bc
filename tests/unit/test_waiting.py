"""Waiters: a shutting-down server wakes every waiting caller for a last read."""

from __future__ import annotations

import asyncio

from quota_service.api.waiting import Waiters

NEVER = 3600.0  # no poll and no budget runs out within a test


async def test_close_wakes_every_waiter_and_keeps_later_ones_from_waiting() -> None:
    waiters = Waiters(poll_seconds=NEVER)
    waiting = [asyncio.ensure_future(waiters.next_change(f"acme/r{i}", NEVER)) for i in range(3)]
    await asyncio.sleep(0)
    assert not any(w.done() for w in waiting)
    assert not waiters.closed
    waiters.close()
    async with asyncio.timeout(10):  # a guard: without close they would wait an hour
        await asyncio.gather(*waiting)
        await waiters.next_change("acme/late", NEVER)
    assert waiters.closed
