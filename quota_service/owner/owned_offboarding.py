"""Offboarding with the tenant's holdings in its instances' owners: what it will free is counted
from their machines, its reservations end through them, and its own cached blocks are dropped
there. The order and the engine aborts are the ledger's (store/offboarding.py)."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy.ext.asyncio import AsyncEngine

from quota_service.core.block_pool import NO_SCOPE
from quota_service.core.instance_machine import InstanceMachine
from quota_service.core.model import EndReason
from quota_service.owner.owners import OwnedLedger, Owners
from quota_service.store.offboarding import (
    FINISH_COUNTED,
    RESERVATION_BATCH,
    START_COUNTED,
    EngineAborts,
    Offboarding,
    OffboardingReport,
)
from quota_service.store.pins import Pins


class OwnedOffboarding(Offboarding):
    def __init__(
        self,
        engine: AsyncEngine,
        ledger: OwnedLedger,
        pins: Pins,
        aborts: EngineAborts,
        owners: Owners,
        reservation_batch: int = RESERVATION_BATCH,
    ) -> None:
        super().__init__(engine, ledger, pins, aborts, reservation_batch)
        self._owned = ledger
        self._owners = owners

    async def _instances_here(self) -> list[str]:
        await self._owners.take_over_unowned()
        return [owner.instance for owner in self._owners.served()]

    async def _start(self, tenant: str, scope: str) -> None:
        here = await self._instances_here()
        counted = await self.recorded_elsewhere(tenant, scope, here)
        del counted["left_over"]
        for owner in self._owners.served():
            machine = owner.machine
            pool = machine.pool
            held = machine.tenants.get(tenant)
            if held is not None:
                private = (NO_SCOPE, machine.scope_id(scope))
                for block, entries in held.held.items():
                    exclusive = pool.ref_count(block) == entries and pool.scope_id(block) in private
                    counted["freed"] += exclusive
                    counted["shared"] += not exclusive
                    counted["pinned_by_others"] += pool.pin_count(block) > held.pinned.get(block, 0)
            counted["freed"] += machine.cached_in_scope(scope)
        await self._mark_deleting(tenant, scope, START_COUNTED, counted)
        await self._owners.tenant_changed(tenant)

    async def _end_batch(self, instance: str, tenant: str, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            await self._owned.end(tenant, request_id, EndReason.TENANT_DELETED)

    async def _free_own_cache(self, tenant: str, scope: str) -> None:
        def free(machine: InstanceMachine, now: float) -> int:
            return machine.free_cached(machine.pool.capacity, scope)

        for owner in self._owners.served():
            await self._owners.run(owner.instance, free)

    async def _finish(self, tenant: str, scope: str) -> OffboardingReport:
        """Finished once nothing of the tenant is left here or, as recorded, elsewhere (the
        replicas serving those instances finish their part in their maintenance sweeps)."""
        served = self._owners.served()
        elsewhere = await self.recorded_elsewhere(tenant, scope, [o.instance for o in served])
        nothing_held = (
            not elsewhere["left_over"]
            and all(not (here := o.machine.tenants.get(tenant)) or not here.held for o in served)
            and not any(o.machine.cached_in_scope(scope) for o in served)
        )
        report = await self._mark_deleted(
            tenant, scope, FINISH_COUNTED, {"nothing_held": nothing_held}
        )
        await self._owners.tenant_changed(tenant)
        return report
