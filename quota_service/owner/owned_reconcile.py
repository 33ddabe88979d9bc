"""The engine followed by the instances' owners: a batch of KV events is applied to the
instance's machine (core/instance_machine.py says how copies, evictions and drift are counted)
in the owner's batch that records the event batch's sequence number, so a batch is applied
exactly once; a resynchronisation forgets what the engine held the same way, after an engine
restart once the reservations it was running ended (ENGINE_RESTARTED: the engine lost their
work). Only GPU-medium events speak of the instance's pool."""

from __future__ import annotations

import logging

from sqlalchemy.ext.asyncio import AsyncEngine

from quota_service.core.instance_machine import EngineReport, InstanceMachine
from quota_service.core.kv_events import EventBatch
from quota_service.core.model import EndReason
from quota_service.owner.owners import OwnedLedger, Owners
from quota_service.store.reconcile import APPLIED, RESYNCED, EngineRecord

log = logging.getLogger(__name__)


class OwnedReconciler(EngineRecord):
    def __init__(self, engine: AsyncEngine, ledger: OwnedLedger, owners: Owners) -> None:
        super().__init__(engine)
        self._ledger = ledger
        self._owners = owners

    async def followed_engines(self) -> list[tuple[str, str, str | None, str | None]]:
        """Only the engines of the instances served here: their owner applies their events."""
        served = {owner.instance for owner in self._owners.served()}
        return [found for found in await super().followed_engines() if found[0] in served]

    async def apply(self, instance: str, seq: int, batch: EventBatch) -> tuple[int, int]:
        """Apply one batch in order, in one owner's batch; returns (blocks freed, drift seen)."""

        def apply(machine: InstanceMachine, now: float) -> EngineReport:
            return machine.apply_engine_events(batch)

        keys = {"instance": instance, "seq": seq}
        report = await self._owners.run(instance, apply, lambda _: [(APPLIED, keys)])
        return report.freed, report.drift

    async def resynchronise(self, instance: str, seq: int, *, restarted: bool) -> int:
        """Forget what the engine held, from batch `seq` on. After a restart the reservations
        that were running on it end first (their blocks come back), then every cached block is
        freed. Returns how many reservations ended."""
        lost: list[tuple[str, str]] = []
        if restarted:
            lost = await self.live_on_instance(instance)
            for tenant, request_id in lost:
                await self._ledger.end(tenant, request_id, EndReason.ENGINE_RESTARTED)
            if lost:
                log.warning("engine of %s restarted: %d reservations ended", instance, len(lost))
        keys = {"instance": instance, "seq": seq}
        await self._owners.run(
            instance, lambda m, now: m.engine_forgotten(), lambda _: [(RESYNCED, keys)]
        )
        return len(lost)
