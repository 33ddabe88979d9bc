"""Pins served by the instances' owners: a pin takes and gives back slots in its instance's
machine, and is journaled with the batch that made it (with what the CPU tier must pin too)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

from sqlalchemy.ext.asyncio import AsyncEngine

from quota_service.core import pins
from quota_service.core.errors import KvQuotaError, not_found
from quota_service.core.instance_machine import NOWHERE_ELSE, InstanceMachine, PinRecord
from quota_service.core.model import Pin, PinState
from quota_service.core.reasons import Reason
from quota_service.owner.owners import Owners
from quota_service.store.pins import RecordedPins


def _pin(record: PinRecord, instance: str, state: PinState) -> Pin:
    live = state is PinState.ACTIVE
    return Pin(
        owner=record.owner,
        pin_id=record.pin_id,
        instance=instance,
        prompt_tokens=record.prompt_tokens,
        pinned_blocks=len(record.table.blocks),
        state=state,
        created_at=datetime.fromtimestamp(record.created_at, UTC),
        blocks=record.table.handles() if live else (),
    )


class OwnedPins(RecordedPins):
    def __init__(self, engine: AsyncEngine, owners: Owners) -> None:
        super().__init__(engine)
        self._owners = owners
        self._journal = owners.journal

    async def pin(self, owner: str, pin_id: str, instance: str, token_ids: Sequence[int]) -> Pin:
        """Pin the full blocks of token_ids on the instance for owner (tenants/{t} or
        namespaces/{n}). The same pin again returns it; another prefix under its id, or the id
        active on another instance, is refused."""
        collection, owner_id = owner.split("/", 1)
        tenant = owner_id if collection == "tenants" else None
        if await self._active_elsewhere(owner, pin_id, instance):
            raise pins.pin_id_reused(owner, pin_id)
        namespace_salt = None
        if tenant is None:
            namespace_salt = await self._journal.namespace_salt(owner_id)
            if namespace_salt is None:
                raise not_found(Reason.NAMESPACE_NOT_FOUND, owner)
        owners = self._owners

        def pin(machine: InstanceMachine, now: float) -> Pin:
            elsewhere = NOWHERE_ELSE
            if tenant is not None:
                here = machine.tenants.get(tenant)
                if here is None:
                    raise not_found(Reason.TENANT_NOT_FOUND, owner)
                salt, scope = here.settings.salt, here.settings.scope
                elsewhere = owners.elsewhere(tenant, instance)
            else:
                assert namespace_salt is not None
                salt, scope = namespace_salt, owner
            made = machine.pin(owner, pin_id, token_ids, salt, scope, tenant, now, elsewhere)
            return _pin(made, instance, PinState.ACTIVE)

        try:
            return await owners.run(instance, pin)
        except KvQuotaError as failed:
            # Its batch failed: because the id was pinned on another instance meanwhile (the
            # journal refuses to replace an active pin there), when the record says so now.
            if failed.reason is Reason.INSTANCE_MOVING and await self._active_elsewhere(
                owner, pin_id, instance
            ):
                raise pins.pin_id_reused(owner, pin_id) from failed
            raise

    async def _active_elsewhere(self, owner: str, pin_id: str, instance: str) -> bool:
        recorded = await self._journal.recorded_pin(owner, pin_id)
        return (
            recorded is not None
            and recorded.state is PinState.ACTIVE
            and recorded.instance != instance
        )

    async def unpin(self, owner: str, pin_id: str) -> Pin:
        """Release a pin's blocks (they stay cached until evicted). Idempotent."""
        recorded = await self._journal.recorded_pin(owner, pin_id)
        if recorded is None:
            raise not_found(Reason.PIN_NOT_FOUND, f"{owner}/pins/{pin_id}")
        if recorded.state is PinState.REMOVED:
            return recorded

        def unpin(machine: InstanceMachine, now: float) -> Pin | None:
            removed = machine.unpin(owner, pin_id, now)
            return None if removed is None else _pin(removed, recorded.instance, PinState.REMOVED)

        removed = await self._owners.run(recorded.instance, unpin)
        if removed is not None:
            return removed
        # Removed meanwhile by another call: the record says how it ended.
        after = await self._journal.recorded_pin(owner, pin_id)
        assert after is not None
        return after
