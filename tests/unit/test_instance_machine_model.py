"""Property-based stateful test of the in-memory instance state machine against the reference
model (tests/model): random admit / release / cancel / release-blocks / pin / unpin / offboard
sequences over four tenants (two isolated, two sharing a namespace) and two small instances, each
instance its own machine. After every step every slot must match the model (state, references,
pins, generation, contents), each tenant's holdings too, and each machine's counters must agree
with a recount of its slots, tables and pins (invariants 1-3); a machine recovered from each
one's image must equal it (invariant 8's "the owner's memory equals what the record derives")."""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from quota_service.config import Settings
from quota_service.core.admission import AdmitRequest
from quota_service.core.block_table import BlockHandle
from quota_service.core.errors import KvQuotaError
from quota_service.core.instance_machine import Elsewhere, InstanceMachine, TenantSettings
from quota_service.core.model import AdmitParams, EndReason, InstanceSpec, TenantState
from tests.model.ledger_model import Model, Slot, Tenant
from tests.unit.machine_fixtures import TENANT_QUOTAS, check_recovery, recount

BS = 16
INSTANCES = {"gpu-0": 24, "gpu-1": 40}
SHARED = ("t3", "t4")
SYSTEM_PROMPTS = [list(range(s * 1000, s * 1000 + length)) for s, length in enumerate((32, 48, 40))]
OWNERS = ("tenants/t1", "tenants/t2", "tenants/t3", "namespaces/pub")
NOW = 1_700_000_000.0


class MachineVersusModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        limits = Settings().admission_limits
        self.model = Model(limits, BS)
        self.machines = {
            name: InstanceMachine(InstanceSpec(name, "m", None, BS, blocks, 8192), limits)
            for name, blocks in INSTANCES.items()
        }
        self.requests = 0
        self.offboarded = False

    @initialize()
    def fleet(self) -> None:
        self.model.namespaces["pub"] = "salt-pub"
        for name, quota in TENANT_QUOTAS.items():
            self.model.tenants[name] = Tenant(
                f"salt-{name}", quota, "pub" if name in SHARED else None
            )
            self._publish(name)
        self.model.slots = {name: [Slot() for _ in range(n)] for name, n in INSTANCES.items()}

    def _publish(self, tenant: str) -> None:
        """What the catalog tells every owner of a tenant."""
        model = self.model.tenants[tenant]
        salt, scope = (
            (self.model.namespaces[model.namespace], f"namespaces/{model.namespace}")
            if model.namespace
            else (model.salt, f"tenants/{tenant}")
        )
        for machine in self.machines.values():
            machine.set_tenant(TenantSettings(tenant, model.state, model.quota, 1, salt, scope))

    def _elsewhere(self, tenant: str | None, instance: str) -> Elsewhere:
        """The tenant's holdings on the other instances: what its fleet-wide totals add."""
        if tenant is None:
            return Elsewhere()
        others = [m.tenants[tenant] for name, m in self.machines.items() if name != instance]
        return Elsewhere(
            sum(len(h.held) for h in others),
            sum(h.tokens for h in others),
            sum(len(h.pinned) for h in others),
        )

    def _owner_of(self, tenant: str, request_id: str) -> InstanceMachine:
        holder = self.model.reservations[(tenant, request_id)]
        return self.machines[holder.instance]

    @rule(
        tenant=st.sampled_from(sorted(TENANT_QUOTAS)),
        instance=st.sampled_from(sorted(INSTANCES)),
        system=st.integers(0, len(SYSTEM_PROMPTS) - 1),
        suffix=st.integers(0, 40),
        output=st.integers(1, 40),
        n=st.integers(1, 2),
        with_ids=st.booleans(),
        reuse=st.sampled_from((False, False, False, False, True)),
    )
    def admit(
        self,
        tenant: str,
        instance: str,
        system: int,
        suffix: int,
        output: int,
        n: int,
        with_ids: bool,
        reuse: bool,
    ) -> None:
        mine = [rid for (t, rid) in self.model.reservations if t == tenant]
        if reuse and mine:
            request_id = mine[-1]
            # A request id lives with its reservation's instance (the shell routes a repeat).
            instance = self.model.reservations[(tenant, request_id)].instance
        else:
            self.requests += 1
            request_id = f"r{self.requests}"
        tokens = SYSTEM_PROMPTS[system] + [90_000 + self.requests + i for i in range(suffix)]
        params = AdmitParams(tenant, request_id, instance, len(tokens), output, n, 0)
        ids = tokens if with_ids else []
        expected = self.model.admit(params, ids)
        machine = self.machines[instance]
        try:
            record = machine.admit(
                AdmitRequest(params, tuple(ids), 0.0, None), NOW, self._elsewhere(tenant, instance)
            )
        except KvQuotaError as refusal:
            assert refusal.reason == expected
            return
        assert expected is None
        model = self.model.reservations[(tenant, request_id)]
        if model.live:
            live = [BlockHandle(e.block_id, e.generation) for e in model.entries if not e.released]
            assert list(record.snapshot().block_table) == live

    @rule(data=st.data(), cancel=st.booleans())
    def end(self, data: st.DataObject, cancel: bool) -> None:
        if not self.model.reservations:
            return
        tenant, request_id = data.draw(st.sampled_from(sorted(self.model.reservations)))
        reason = EndReason.CANCELLED if cancel else EndReason.RELEASED
        self._owner_of(tenant, request_id).end(tenant, request_id, reason, NOW + 1)
        self.model.end(tenant, request_id)

    @rule(data=st.data(), stale=st.booleans())
    def release_blocks(self, data: st.DataObject, stale: bool) -> None:
        live = sorted(k for k, h in self.model.reservations.items() if h.live)
        if not live:
            return
        tenant, request_id = data.draw(st.sampled_from(live))
        entries = self.model.reservations[(tenant, request_id)].entries
        chosen = data.draw(st.lists(st.sampled_from(entries), min_size=1, max_size=3))
        handles = [BlockHandle(e.block_id, e.generation + (1 if stale else 0)) for e in chosen]
        expected = self.model.release_blocks(tenant, request_id, handles)
        machine = self._owner_of(tenant, request_id)
        try:
            machine.release_blocks(tenant, request_id, handles, NOW)
        except KvQuotaError as refusal:
            assert refusal.reason == expected
            return
        assert expected is None

    @rule(
        owner=st.sampled_from(OWNERS),
        pin_id=st.sampled_from(("a", "b")),
        system=st.integers(0, len(SYSTEM_PROMPTS) - 1),
        instance=st.sampled_from(sorted(INSTANCES)),
    )
    def pin(self, owner: str, pin_id: str, system: int, instance: str) -> None:
        collection, owner_id = owner.split("/", 1)
        tenant = owner_id if collection == "tenants" else None
        if tenant is not None and self.model.tenants[tenant].state is not TenantState.ACTIVE:
            return  # an offboarded tenant's pins are refused before any block work
        tokens = SYSTEM_PROMPTS[system]
        expected = self.model.pin(owner, pin_id, instance, tokens)
        elsewhere_pin = any(
            (owner, pin_id) in m.pins for name, m in self.machines.items() if name != instance
        )
        if elsewhere_pin:
            # A pin id names one pin fleet-wide: the shell refuses it before any owner sees it.
            assert expected == "PIN_ID_REUSED"
            return
        if tenant is not None:
            model = self.model.tenants[tenant]
            salt, scope = self._salt(tenant)
        else:
            salt, scope = self.model.namespaces[owner_id], owner
        try:
            self.machines[instance].pin(
                owner, pin_id, tokens, salt, scope, tenant, NOW, self._elsewhere(tenant, instance)
            )
        except KvQuotaError as refusal:
            assert refusal.reason == expected
            return
        assert expected is None, model if tenant else owner

    def _salt(self, tenant: str) -> tuple[str, str]:
        model = self.model.tenants[tenant]
        if model.namespace:
            return self.model.namespaces[model.namespace], f"namespaces/{model.namespace}"
        return model.salt, f"tenants/{tenant}"

    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        if not self.model.pins:
            return
        owner, pin_id = data.draw(st.sampled_from(sorted(self.model.pins)))
        for machine in self.machines.values():
            machine.unpin(owner, pin_id, NOW)
        self.model.unpin(owner, pin_id)

    @precondition(lambda self: self.requests >= 20 and not self.offboarded)
    @rule(tenant=st.sampled_from(("t1", "t2", "t4")))
    def offboard(self, tenant: str) -> None:
        """Once a run, after some history: it ends a tenant for the rest of the run."""
        self.offboarded = True
        self.model.tenants[tenant].state = TenantState.DELETING
        self._publish(tenant)
        for machine in self.machines.values():
            machine.offboard(tenant, NOW)
        self.model.offboard(tenant)
        self._publish(tenant)

    @invariant()
    def matches_the_model(self) -> None:
        if not self.model.slots:
            return
        for name, machine in self.machines.items():
            pool = machine.pool
            found = [
                (
                    pool.state(b),
                    pool.ref_count(b),
                    pool.pin_count(b),
                    pool.generation(b),
                    pool.content_hash(b),
                )
                for b in range(pool.capacity)
            ]
            expected = [
                (s.state, s.ref_count, s.pin_count, s.generation, s.content_hash)
                for s in self.model.slots[name]
            ]
            assert found == expected, name
            assert pool.counts() == dict(Counter(s.state for s in self.model.slots[name])) | {
                state: 0
                for state in ("FREE", "CACHED", "IN_USE", "PINNED")
                if state not in {s.state for s in self.model.slots[name]}
            }
            recount(machine)
            check_recovery(machine)
        for tenant in TENANT_QUOTAS:
            holdings = [m.tenants[tenant] for m in self.machines.values()]
            found_tenant = (
                sum(len(h.held) for h in holdings),
                sum(len(h.pinned) for h in holdings),
                sum(h.tokens for h in holdings),
            )
            assert found_tenant == (*self.model.tenant_blocks(tenant), self.model.tokens(tenant))


def test_machine_matches_the_reference_model() -> None:
    run_state_machine_as_test(
        MachineVersusModel,
        settings=settings(
            max_examples=60,
            stateful_step_count=60,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
