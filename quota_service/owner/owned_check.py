"""Invariant 8 asked of an owner: its live machine against the one the record rebuilds (as a
new owner would rebuild it, without claiming the instance).

The machine runs ahead of the record by whatever the batch being gathered or written holds,
so the two are compared at a moment when the machine holds nothing unwritten: the record is
read after what the machine held was committed, and the comparison counts only when no batch
was written, or was waiting to be, from then until it ran. Under steady traffic that moment
may take a few tries; without one, the instance is too busy to check (INSTANCE_BUSY)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from functools import partial

from quota_service.core.errors import KvQuotaError
from quota_service.core.instance_machine import InstanceMachine, TenantSettings
from quota_service.core.machine_comparison import Difference, machine_differences
from quota_service.core.reasons import Reason
from quota_service.owner.owners import Owners
from quota_service.store.journal import RecordedInstance

# Tries at a moment between batches, and the pause between two.
SETTLE_ATTEMPTS = 40
SETTLE_PAUSE_SECONDS = 0.05


def _unchanged(machine: InstanceMachine, now: float) -> None:
    """An operation that changes nothing: applied, it waits for what the machine holds now."""


def _compare(
    epoch: int,
    recorded: RecordedInstance,
    catalog: Sequence[TenantSettings],
    machine: InstanceMachine,
    now: float,
) -> list[Difference]:
    """What the machine (of an owner at `epoch`) holds differently from the record."""
    # The machine's view of its tenants may be newer than the catalog's (offboarding).
    settings = {one.tenant: one for one in catalog}
    settings.update({name: here.settings for name, here in machine.tenants.items()})
    # Free slots' generations are not compared: any floor will do.
    rebuilt = InstanceMachine.recover(
        machine.spec,
        machine.limits,
        settings.values(),
        recorded.image,
        recorded.generation_floor,
        machine.queue_policy,
        machine.state,
    )
    found = machine_differences(machine, rebuilt)
    if recorded.epoch != epoch:
        found.insert(0, Difference("owner's epoch", str(epoch), str(recorded.epoch)))
    return found


async def differences_from_record(owners: Owners, instance: str) -> tuple[int, list[Difference]]:
    """The epoch of this replica's owner of the instance, and what its machine holds
    differently from the record."""
    # Served elsewhere, the call is forwarded to its owner (ServedElsewhere); not served by
    # any replica, it is taken over here first.
    owner = await owners.owner(instance)
    journal = owners.journal
    for _ in range(SETTLE_ATTEMPTS):
        await owner.apply(_unchanged)
        batches = owner.stats.batches
        recorded = await journal.read(instance)
        catalog = await journal.tenants()

        found = await owner.apply(partial(_compare, owner.epoch, recorded, catalog))
        # No batch committed since the record was read, and none was pending when the
        # comparison ran (apply would have waited for it): the record is what the machine holds.
        if owner.stats.batches == batches:
            return owner.epoch, found
        await asyncio.sleep(SETTLE_PAUSE_SECONDS)
    name = f"instances/{instance}"
    raise KvQuotaError(
        Reason.INSTANCE_BUSY,
        f"{name} was never between batches in {SETTLE_ATTEMPTS} tries; retry later",
        metadata={"name": name},
        retry_delay_seconds=1.0,
    )
