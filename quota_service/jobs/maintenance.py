"""The background loop every replica runs: end lapsed leases and queue waits on the instances it
owns, abort their engines' requests, dispatch their queues, finish interrupted offboardings, run
reclaim steps, mirror the CPU tier, roll usage up. Each step is safe to run in several replicas
at once (each owner does its own instances' work; the rest is conditional updates, one
transaction per item, SKIP LOCKED), and a failing step is retried on the next sweep. The steps
that go over the same shared rows in every replica run in one replica at a time (an advisory
lock per step, tried): the others skip them that sweep instead of queueing on the same rows."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from contextlib import suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import NamedTuple

from sqlalchemy.ext.asyncio import AsyncEngine

from quota_service.config import Settings
from quota_service.enforcement.cpu_tier_mirror import CpuTierMirror
from quota_service.enforcement.termination import Termination
from quota_service.jobs.follower import Followers
from quota_service.jobs.reclaim_executor import ReclaimExecutor
from quota_service.jobs.reclaim_policy import ReclaimPolicy
from quota_service.metrics import LedgerMetrics
from quota_service.owner.owned_offboarding import OwnedOffboarding
from quota_service.owner.owners import OwnedLedger
from quota_service.store.database import reachable
from quota_service.store.ownership import exclusive
from quota_service.store.usage import UsageRollup

log = logging.getLogger(__name__)


class Step(NamedTuple):
    name: str
    run: Callable[[], Awaitable[int]]
    # It goes over work shared by every replica: one replica at a time runs it.
    one_replica: bool = False


@dataclass
class Maintenance:
    ledger: OwnedLedger
    offboarding: OwnedOffboarding
    termination: Termination
    followers: Followers
    metrics: LedgerMetrics
    reclaim: ReclaimExecutor
    policy: ReclaimPolicy
    cpu_tier: CpuTierMirror
    usage: UsageRollup
    settings: Settings
    ledger_db: AsyncEngine
    # Told after each check whether the ledger answers (health follows it).
    on_ledger: Callable[[bool], Awaitable[None]]
    _ledger_down: bool = field(default=False, init=False)

    async def reap_leases(self) -> int:
        """End reservations whose lease ran out (reason LEASE_EXPIRED), until none is left."""
        batch = self.settings.reaper_batch_size
        total = 0
        while True:
            ended = await self.ledger.reap_expired(batch)
            total += ended
            if ended < batch:
                return total

    async def close_usage_hours(self) -> int:
        grace = timedelta(seconds=self.settings.usage_close_grace_seconds)
        return await self.usage.close_due(datetime.now(UTC), grace)

    async def ledger_reachable(self) -> bool:
        """Check the ledger first: while it is down the sweep is skipped (every step would only
        fail), health says NOT_SERVING, and one warning is logged, not one per step."""
        up = await reachable(self.ledger_db)
        if up == self._ledger_down:
            if up:
                log.info("the ledger database answers again")
            else:
                log.warning("the ledger database cannot be reached; waiting for it")
        self._ledger_down = not up
        await self.on_ledger(up)
        return up

    def steps(self) -> tuple[Step, ...]:
        """The sweep's steps, by name, in order."""
        return (
            # Each replica does this work for the instances it owns.
            Step("lease reaper", self.reap_leases),
            Step("engine aborts", lambda: self.termination.sweep(self.settings.reaper_batch_size)),
            # Instances registered since the last sweep get their engine followed.
            Step("engine followers", self.followers.scan),
            # Dispatch also on a timer: a notification may have been lost.
            Step("dispatch sweep", self.ledger.dispatch_all),
            Step("offboarding", self.offboarding.resume_all),
            Step("reclaim policy", self.policy.sweep),
            Step("reclaim steps", lambda: self.reclaim.run_open(self.settings.reaper_batch_size)),
            # LMCache coordinators follow the ledger's quotas and pins; L1 fill is read.
            Step("cpu tier mirror", self.cpu_tier.mirror),
            Step("usage rollup", self.close_usage_hours),
            Step(
                "usage event purge",
                lambda: self.usage.purge_events(
                    self.settings.usage_event_retention_seconds, self.settings.reaper_batch_size
                ),
                one_replica=True,
            ),
            Step("metrics refresh", self.metrics.refresh),
        )

    async def sweep(self) -> None:
        if not await self.ledger_reachable():
            return
        for name, step, one_replica in self.steps():
            try:
                if one_replica:
                    async with exclusive(self.ledger_db, f"kvquota-sweep:{name}") as mine:
                        done = await step() if mine else 0
                else:
                    done = await step()
                if done:
                    log.info("%s: %d done", name, done)
            except Exception:
                # The database may be restarting; the next sweep tries again.
                log.warning("%s failed", name, exc_info=True)


async def run(maintenance: Maintenance, stop: asyncio.Event) -> None:
    while not stop.is_set():
        await maintenance.sweep()
        with suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), maintenance.settings.reaper_interval_seconds)
