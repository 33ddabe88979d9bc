"""Property-based stateful test of the in-memory instance state machine against the reference model
(the rules are tests/model/rules.py), each instance its own machine, with what the owners' shell
will do done here: the catalog's tenant settings pushed to every machine, a tenant's holdings on
the other instances given for its fleet-wide quota, a repeated request id sent to the machine that
holds it, and a pin id kept unique across instances. After every step every slot and tenant must
match the model, each machine's counters must agree with a recount of its slots, tables and pins
(invariants 1-4), and a machine recovered from each one's image must equal it (invariant 8;
after the steps tests/examples.py says, and after the last)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import replace

from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from quota_service.core.admission import AdmitRequest
from quota_service.core.block_pool import ContentColumns
from quota_service.core.block_table import BlockHandle
from quota_service.core.instance_machine import Elsewhere, InstanceMachine, TenantSettings
from quota_service.core.model import AdmitParams, EndReason, InstanceSpec, TenantState
from quota_service.core.pins import pin_id_reused
from tests.examples import examples
from tests.model.rules import (
    BS,
    INSTANCES,
    NAMESPACE,
    SHARED,
    TENANTS,
    LedgerRules,
    SlotRow,
    TenantRow,
)
from tests.unit.machine_fixtures import (
    SlotRecord,
    check_recovery,
    recount,
    shares_held,
    slot_records,
    slot_rows,
)

NOW = 1_700_000_000.0


def record_slot_changes(
    recorded: dict[int, SlotRecord], held: ContentColumns, dropped: Iterable[int]
) -> None:
    """Bring a record of slot contents (slot: contents) up to date with what `drain_dirty`
    gave, in order: a checkpoint followed by its deltas is the pool's contents now."""
    for slot in slot_records(held):
        recorded[slot[0]] = slot
    for block in dropped:
        recorded.pop(block, None)


class MachinesVersusModel(LedgerRules):
    def __init__(self) -> None:
        super().__init__()
        limits = self.model.limits
        self.machines = {
            name: InstanceMachine(InstanceSpec(name, "m", None, BS, blocks, 8192), limits)
            for name, blocks in INSTANCES.items()
        }
        # Each machine's slot contents as the journal records them, from its changes.
        self.recorded: dict[str, dict[int, SlotRecord]] = {name: {} for name in INSTANCES}
        # Tenants' own salts and the namespace's, as the fleet was built with them.
        self.salts: dict[str, str] = {}
        self.namespace_salt = ""
        # Per instance, each tenant's blocks by share as the metered changes add them up.
        self.metered: dict[str, dict[str, Counter[int]]] = {}

    def build_fleet(self) -> tuple[dict[str, str], str]:
        self.salts = salts = {name: f"salt-{name}" for name in TENANTS}
        self.namespace_salt = namespace_salt = f"salt-{NAMESPACE}"
        for name, quota in TENANTS.items():
            salt, scope = (
                (namespace_salt, f"namespaces/{NAMESPACE}")
                if name in SHARED
                else (salts[name], f"tenants/{name}")
            )
            self._publish(TenantSettings(name, TenantState.ACTIVE, quota, 1, salt, scope))
        return salts, namespace_salt

    def _publish(self, settings: TenantSettings) -> None:
        for machine in self.machines.values():
            machine.set_tenant(settings)

    def _elsewhere(self, tenant: str | None, instance: str) -> Elsewhere:
        if tenant is None:
            return Elsewhere()
        others = [m.tenants[tenant] for name, m in self.machines.items() if name != instance]
        return Elsewhere(
            sum(h.blocks for h in others),
            sum(h.tokens for h in others),
            sum(len(h.pinned) for h in others),
        )

    def _holding(self, tenant: str, request_id: str) -> InstanceMachine | None:
        key = (tenant, request_id)
        for machine in self.machines.values():
            if key in machine.reservations or key in machine.ended:
                return machine
        return None

    def apply_admit(self, params: AdmitParams, ids: Sequence[int]) -> Sequence[BlockHandle]:
        machine = self._holding(params.tenant, params.request_id) or self.machines[params.instance]
        request = AdmitRequest(params, tuple(ids), 0.0, None)
        elsewhere = self._elsewhere(params.tenant, machine.spec.instance)
        return machine.admit(request, NOW, elsewhere).snapshot().block_table

    def apply_end(self, tenant: str, request_id: str, reason: EndReason) -> None:
        machine = self._holding(tenant, request_id)
        assert machine is not None
        machine.end(tenant, request_id, reason, NOW + 1)

    def apply_release_blocks(
        self, tenant: str, request_id: str, handles: Sequence[BlockHandle]
    ) -> None:
        machine = self._holding(tenant, request_id)
        assert machine is not None
        machine.release_blocks(tenant, request_id, handles, NOW)

    def apply_pin(self, owner: str, pin_id: str, instance: str, tokens: Sequence[int]) -> None:
        if any((owner, pin_id) in m.pins for n, m in self.machines.items() if n != instance):
            raise pin_id_reused(owner, pin_id)
        collection, owner_id = owner.split("/", 1)
        tenant = owner_id if collection == "tenants" else None
        machine = self.machines[instance]
        if tenant is not None:
            settings = machine.tenants[tenant].settings
            salt, scope = settings.salt, settings.scope
        else:
            salt, scope = self.namespace_salt, owner
        elsewhere = self._elsewhere(tenant, instance)
        machine.pin(owner, pin_id, tokens, salt, scope, tenant, NOW, elsewhere)

    def apply_unpin(self, owner: str, pin_id: str) -> None:
        for machine in self.machines.values():
            machine.unpin(owner, pin_id, NOW)

    def apply_offboard(self, tenant: str) -> None:
        settings = next(iter(self.machines.values())).tenants[tenant].settings
        self._publish(replace(settings, state=TenantState.DELETING))
        for machine in self.machines.values():
            machine.offboard(tenant, NOW)
        own = replace(
            settings, state=TenantState.DELETED, salt=self.salts[tenant], scope=f"tenants/{tenant}"
        )
        self._publish(own)

    def check_record(self, name: str, machine: InstanceMachine, thorough: bool) -> None:
        """What the journal would keep of the machine rebuilds it exactly (if `thorough`), and
        the usage it would meter adds up to what each tenant holds, by how many tenants share
        each block."""
        changes = machine.drain_changes()
        record_slot_changes(self.recorded[name], changes.slots, changes.dropped_slots)
        if thorough:
            check_recovery(machine, self.recorded[name])
        metered = self.metered.setdefault(name, {})
        for tenant, usage in changes.usage.items():
            metered.setdefault(tenant, Counter()).update(usage.blocks)
        assert {t: +c for t, c in metered.items() if +c} == shares_held(machine)

    def observed(self, thorough: bool) -> tuple[list[SlotRow], list[TenantRow]]:
        slots: list[SlotRow] = []
        for name in sorted(self.machines):
            machine = self.machines[name]
            slots += [(name, *row) for row in slot_rows(machine)]
            recount(machine)
            self.check_record(name, machine, thorough)
        tenants: list[TenantRow] = []
        for tenant in sorted(TENANTS):
            holdings = [m.tenants[tenant] for m in self.machines.values()]
            tenants.append(
                (
                    tenant,
                    sum(h.blocks for h in holdings),
                    sum(len(h.pinned) for h in holdings),
                    sum(h.tokens for h in holdings),
                )
            )
        return slots, tenants


def test_machines_match_the_reference_model() -> None:
    run_state_machine_as_test(
        MachinesVersusModel,
        settings=settings(
            max_examples=examples(60),
            stateful_step_count=60,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
