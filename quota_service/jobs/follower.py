"""Following the engines: for each instance with KV-event endpoints, exactly one replica
subscribes to its events and has the instance's owner apply them to its machine
(owner/owned_reconcile.py).

Ownership is a PostgreSQL advisory lock held on a connection of its own: it is released the
moment that replica dies, and another one takes over, resuming after the last batch applied (the
engine's replay buffer fills the gap, or the instance is resynchronised from empty). A ledger that
never followed this engine starts from empty too: it cannot know what the engine cached before.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import suppress

import httpx
import psycopg

from quota_service.core.errors import KvQuotaError, ServedElsewhere
from quota_service.engine.vllm.http import MetricsError, VllmHttp
from quota_service.engine.vllm.subscriber import Received, Subscriber
from quota_service.metrics import ServiceMetrics
from quota_service.owner.owned_reconcile import OwnedReconciler
from quota_service.store.ownership import owned

log = logging.getLogger(__name__)

RETRY_SECONDS = 2.0
# How often the follower reads the engine's load (vllm:num_requests_running).
LOAD_CHECK_SECONDS = 5.0


class Followers:
    """Keeps one follower task per followed instance (new instances are picked up by `scan`)."""

    def __init__(
        self,
        database_url: str,
        reconciler: OwnedReconciler,
        load_check_seconds: float = LOAD_CHECK_SECONDS,
        metrics: ServiceMetrics | None = None,
    ) -> None:
        self._database_url = database_url
        self._reconciler = reconciler
        self._load_check_seconds = load_check_seconds
        self._metrics = metrics or ServiceMetrics()
        self._tasks: dict[str, asyncio.Task[None]] = {}

    async def scan(self) -> int:
        """Start following instances not followed yet, and stop following those no longer to
        be followed here (their owner moved); returns how many were started."""
        started = 0
        followed = await self._reconciler.followed_engines()
        for instance, events, replay, url in followed:
            if instance not in self._tasks or self._tasks[instance].done():
                follow = self._follow(instance, events, replay, url)
                self._tasks[instance] = asyncio.create_task(follow)
                started += 1
        kept = {found[0] for found in followed}
        for instance in [i for i in self._tasks if i not in kept]:
            self._tasks.pop(instance).cancel()
        return started

    async def stop(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        for task in self._tasks.values():
            with suppress(asyncio.CancelledError):
                await task

    async def _follow(
        self, instance: str, events: str, replay: str | None, url: str | None
    ) -> None:
        while True:
            try:
                async with owned(self._database_url, f"kvquota-follow:{instance}") as mine:
                    if mine:
                        log.info("following the engine of %s at %s", instance, events)
                        load = asyncio.create_task(self._watch_load(instance, url))
                        try:
                            await self._apply_stream(instance, events, replay)
                        finally:
                            load.cancel()
            except (psycopg.Error, OSError, KvQuotaError, ServedElsewhere):
                # The database, or the instance's owner here, went away meanwhile.
                log.warning("following %s failed; retrying", instance, exc_info=True)
            await asyncio.sleep(RETRY_SECONDS)

    async def _watch_load(self, instance: str, url: str | None) -> None:
        """Record what the engine says it runs, to compare with the live reservations."""
        if url is None:
            return
        http = VllmHttp(url)
        try:
            while True:
                try:
                    metrics = await http.metrics()
                    await self._reconciler.record_engine_load(instance, metrics.requests_running)
                except (httpx.HTTPError, MetricsError) as exc:
                    log.info("reading the load of %s failed: %s", instance, exc)
                await asyncio.sleep(self._load_check_seconds)
        finally:
            await http.close()

    async def _apply_stream(self, instance: str, events: str, replay: str | None) -> None:
        last = await self._reconciler.last_applied(instance)
        subscriber = Subscriber(events, replay)
        try:
            if last is None:
                await self._reconciler.resynchronise(instance, -1, restarted=False)
            else:
                subscriber.expected = last + 1
            async for item in subscriber.items():
                if isinstance(item, Received):
                    await self._reconciler.apply(instance, item.seq, item.batch)
                    # How far the ledger trails the engine (batch timestamps are its wall clock).
                    self._metrics.observe_event_batch(instance, item.batch.ts, time.time())
                else:
                    log.warning("resynchronising %s: %s", instance, item.reason)
                    await self._reconciler.resynchronise(
                        instance, item.seq - 1, restarted=item.restarted
                    )
        finally:
            subscriber.close()
