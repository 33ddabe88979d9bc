"""Operators' reads of the pools, answered from the instances' owners (the record keeps no row
per block): blocks page by page, and what a tenant holds on each instance."""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncEngine

from quota_service.core.instance_machine import InstanceMachine
from quota_service.core.machine_comparison import Difference
from quota_service.core.model import Block, BlockState, InstanceUsage, ReservationState
from quota_service.core.pagination import Page
from quota_service.owner.owned_check import differences_from_record
from quota_service.owner.owners import Owners
from quota_service.store.inspection import RecordedUsage


class OwnedInspection(RecordedUsage):
    def __init__(self, engine: AsyncEngine, owners: Owners) -> None:
        super().__init__(engine)
        self._owners = owners

    async def list_blocks(
        self, instance: str, tenant: str | None, state: BlockState | None, page: Page
    ) -> list[Block]:
        first = int(page.after) + 1 if page.after else 0

        def blocks(machine: InstanceMachine, now: float) -> list[Block]:
            pool = machine.pool
            here = machine.tenants.get(tenant) if tenant is not None else None
            found: list[Block] = []
            for block in range(first, pool.capacity):
                if len(found) == page.size:
                    break
                slot_state = BlockState(pool.state(block))
                if (state is not None and slot_state is not state) or (
                    tenant is not None
                    and (here is None or not machine.holdings.holds(here.holder, block))
                ):
                    continue
                digest = pool.content_hash(block)
                found.append(
                    Block(
                        instance=instance,
                        block_id=block,
                        generation=pool.generation(block),
                        state=slot_state,
                        ref_count=pool.ref_count(block),
                        pin_count=pool.pin_count(block),
                        content_hash=digest,
                        hash_scope=machine.scopes[pool.scope_id(block)] if digest else None,
                        tier="GPU",
                        last_used_at=None,
                    )
                )
            return found

        return await self._owners.run(instance, blocks)

    async def tenant_usage(self, tenant: str) -> list[InstanceUsage]:
        """From the machines served here, and the record of the other instances (exact for
        all they acknowledged)."""
        served = self._owners.served()
        found = await self.recorded_tenant_usage(tenant, [o.instance for o in served])
        for owner in served:

            def usage(machine: InstanceMachine, now: float) -> InstanceUsage | None:
                here = machine.tenants.get(tenant)
                live = [
                    r
                    for r in machine.reservations.values()
                    if r.key[0] == tenant and r.state is ReservationState.ADMITTED
                ]
                if (here is None or not here.blocks) and not live:
                    return None
                held = machine.held(tenant)
                pool = machine.pool
                return InstanceUsage(
                    machine.spec.instance,
                    len(held),
                    len(here.pinned) if here is not None else 0,
                    sum(1 for b, entries in held.items() if pool.ref_count(b) > entries),
                    len(live),
                    sum(r.tokens for r in live),
                )

            one = await self._owners.run(owner.instance, usage)
            if one is not None:
                found.append(one)
        return sorted(found, key=lambda u: u.instance)

    async def check_instance(self, instance: str) -> tuple[int, list[Difference]]:
        return await differences_from_record(self._owners, instance)
