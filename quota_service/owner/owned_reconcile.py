"""The engine followed by the instances' owners: a batch of KV events is applied to the
instance's machine (core/instance_machine.py says how copies, evictions and drift are counted)
in the owner's batch that records the event batch's sequence number, so a batch is applied
exactly once; a resynchronisation forgets what the engine held the same way."""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncEngine

from quota_service.core.instance_machine import EngineReport, InstanceMachine
from quota_service.core.kv_events import EventBatch
from quota_service.owner.owners import OwnedLedger, Owners
from quota_service.store.reconcile import APPLIED, RESYNCED, Reconciler


class OwnedReconciler(Reconciler):
    def __init__(self, engine: AsyncEngine, ledger: OwnedLedger, owners: Owners) -> None:
        super().__init__(engine, ledger)
        self._owners = owners

    async def followed_engines(self) -> list[tuple[str, str, str | None, str | None]]:
        """Only the engines of the instances served here: their owner applies their events."""
        served = {owner.instance for owner in self._owners.served()}
        return [found for found in await super().followed_engines() if found[0] in served]

    async def apply(self, instance: str, seq: int, batch: EventBatch) -> tuple[int, int]:
        def apply(machine: InstanceMachine, now: float) -> EngineReport:
            return machine.apply_engine_events(batch)

        keys = {"instance": instance, "seq": seq}
        report = await self._owners.run(instance, apply, lambda _: [(APPLIED, keys)])
        return report.freed, report.drift

    async def _forget_engine(self, instance: str, seq: int) -> None:
        keys = {"instance": instance, "seq": seq}
        await self._owners.run(
            instance, lambda m, now: m.engine_forgotten(), lambda _: [(RESYNCED, keys)]
        )
