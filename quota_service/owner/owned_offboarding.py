"""Offboarding a tenant (DeleteTenant) in its instances' owners: end its reservations, drop its
pins, free the cached blocks only its salt could ever match, and report what that did. What it
will free is counted from the owners' machines (and the record, for the instances other
replicas serve); reservations and pins end through the owners, and its own cached blocks are
dropped there. Every step is its own batch or transaction and the tenant's state (DELETING)
says where it is, so a crashed offboarding resumes by being called again, and calling it after
it finished changes nothing.

A reservation an engine may still be running ends only once that engine confirmed the abort, as
a cancelled one does: its blocks are not free before. When the engine does not answer, the abort
stays pending (the maintenance loop retries it, and gives the blocks back after the hard timeout)
and the tenant stays DELETING until the last one ended.

Each replica offboards on the instances it serves; the tenant becomes DELETED once neither
memory nor the record holds anything of it (each replica's maintenance sweep goes on with its
part, `resume_all`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Protocol

from sqlalchemy.ext.asyncio import AsyncEngine

from quota_service.core.block_pool import NO_SCOPE
from quota_service.core.instance_machine import InstanceMachine
from quota_service.core.model import EndReason
from quota_service.core.names import tenant_name
from quota_service.owner.owned_pins import OwnedPins
from quota_service.owner.owners import OwnedLedger, Owners
from quota_service.store.offboarding import (
    BATCH,
    RESERVATION_BATCH,
    OffboardingRecord,
    OffboardingReport,
)

log = logging.getLogger(__name__)

# How long a gateway may take, once admitted, to hand the request to the engine. An abort that
# reaches vLLM before the request does is ignored, and the gateway would then run it on blocks
# the owner had freed: a batch holding requests admitted more recently waits that long first.
FORWARDING_SECONDS = 1.0


class EngineAborts(Protocol):
    """How offboarding stops what an engine runs (enforcement.termination.Termination)."""

    async def abort(self, url: str, request_ids: Sequence[str]) -> bool:
        """True once the engine at `url` answered the abort of these requests."""
        ...


class OwnedOffboarding(OffboardingRecord):
    def __init__(
        self,
        engine: AsyncEngine,
        ledger: OwnedLedger,
        pins: OwnedPins,
        aborts: EngineAborts,
        owners: Owners,
        reservation_batch: int = RESERVATION_BATCH,
    ) -> None:
        super().__init__(engine)
        self._ledger = ledger
        self._pins = pins
        self._aborts = aborts
        self._owners = owners
        self._reservation_batch = reservation_batch

    async def delete_tenant(self, tenant: str) -> OffboardingReport:
        scope = tenant_name(tenant)
        here = await self._instances_here()
        await self._start(tenant, scope, here)
        await self._end_reservations(tenant, here)
        while owned := await self._pins.active_of_tenant(tenant, BATCH, here):
            for owner, pin_id in owned:
                await self._pins.unpin(owner, pin_id)
        await self._free_own_cache(scope)
        report = await self._finish(tenant, scope)
        if report.finished:
            log.info("offboarded %s: %s", scope, report)
        else:
            log.info("offboarding %s waits for its engines' aborts: %s", scope, report)
        return report

    async def resume_all(self) -> int:
        """Go on with every offboarding a crash interrupted or an engine's abort held up;
        returns how many finished."""
        return sum(
            [(await self.delete_tenant(tenant)).finished for tenant in await self.deleting()]
        )

    async def _instances_here(self) -> list[str]:
        """The instances this replica offboards on: those it serves (and those nobody serves,
        which it takes over); the replicas that serve the others do their part."""
        await self._owners.take_over_unowned()
        return [owner.instance for owner in self._owners.served()]

    async def _start(self, tenant: str, scope: str, here: list[str]) -> None:
        """DELETING, with what offboarding will free counted as the tenant holds it now: a
        block is freed when only this tenant references it and its contents are private or
        under the tenant's own salt; otherwise others keep it (referenced, pinned, or cached
        for a namespace). `here`: the instances served here, taken over where unowned."""
        counted = await self.recorded_elsewhere(tenant, here)
        for owner in self._owners.served():
            machine = owner.machine
            pool = machine.pool
            held = machine.tenants.get(tenant)
            if held is not None:
                private = (NO_SCOPE, machine.scope_id(scope))
                for block, entries in machine.held(tenant).items():
                    exclusive = pool.ref_count(block) == entries and pool.scope_id(block) in private
                    counted["freed"] += exclusive
                    counted["shared"] += not exclusive
                    counted["pinned_by_others"] += pool.pin_count(block) > held.pinned.get(block, 0)
            counted["freed"] += machine.cached_in_scope(scope)
        await self.mark_deleting(
            tenant, counted["freed"], counted["shared"], counted["pinned_by_others"]
        )
        await self._owners.tenant_changed(tenant)

    async def _end_reservations(self, tenant: str, here: list[str]) -> None:
        """End every live reservation of the tenant. Queued ones leave the queue one by one
        (the queue limits keep them few); admitted ones end in batches per instance. The loop
        ends once a pass finds none: one the dispatcher admitted just before offboarding began
        is found by the next pass. Those left waiting for their engine's abort are not looked
        at again."""
        while True:
            queued, instances = await self.live_of_tenant(tenant, here)
            if not queued and not instances:
                return
            for request_id in queued:
                await self._ledger.end(tenant, request_id, EndReason.TENANT_DELETED)
            for instance, url in instances:
                await self._end_on_instance(instance, url, tenant)

    async def _end_on_instance(self, instance: str, url: str | None, tenant: str) -> None:
        """End the tenant's admitted reservations on the instance, a batch at a time; with an
        engine (at `url`), each batch after it confirmed the abort of those it may be running."""
        while True:
            batch = await self.next_batch(instance, tenant, self._reservation_batch)
            ending = [r.request_id for r in batch]
            running = [r for r in batch if r.running]
            if url is not None and running:
                youngest = min(r.admitted_seconds_ago for r in running)
                await asyncio.sleep(max(0.0, FORWARDING_SECONDS - youngest))
                aborting = [r.request_id for r in running]
                if not await self._aborts.abort(url, aborting):
                    await self._ledger.request_aborts(tenant, aborting, EndReason.TENANT_DELETED)
                    ending = [r.request_id for r in batch if not r.running]
            if ending:
                await self._end_batch(instance, tenant, ending)
            if len(batch) < self._reservation_batch:
                return

    async def _end_batch(self, instance: str, tenant: str, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            await self._ledger.end(tenant, request_id, EndReason.TENANT_DELETED)

    async def _free_own_cache(self, scope: str) -> None:
        """Drop the contents of every block cached under the tenant's salt, on the instances
        served here: nobody else could match them."""

        def free(machine: InstanceMachine, now: float) -> int:
            return machine.free_cached(machine.pool.capacity, scope)

        for owner in self._owners.served():
            await self._owners.run(owner.instance, free)

    async def _finish(self, tenant: str, scope: str) -> OffboardingReport:
        """Finished once nothing of the tenant is left here or, as recorded, elsewhere (the
        replicas serving those instances finish their part in their maintenance sweeps)."""
        served = self._owners.served()
        elsewhere = await self.recorded_elsewhere(tenant, [o.instance for o in served])
        nothing_held = (
            not elsewhere["left_over"]
            and all(not (here := o.machine.tenants.get(tenant)) or not here.blocks for o in served)
            and not any(o.machine.cached_in_scope(scope) for o in served)
        )
        report = await self.mark_deleted(tenant, nothing_held)
        await self._owners.tenant_changed(tenant)
        return report
