"""The random operations the reference model is checked with, written once for every system that
keeps the ledger: admit / release / cancel / release-blocks / pin / unpin / offboard sequences
over four tenants (two isolated, two sharing a namespace) and two small instances. A subclass says
how each operation is carried out on its system under test and how that system's slots and
tenants read; after every step they must equal the model's. The system's own expensive checks
run after the steps tests/examples.py says, and after the last one."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from quota_service.config import Settings
from quota_service.core.block_table import BlockHandle
from quota_service.core.errors import KvQuotaError
from quota_service.core.model import AdmitParams, EndReason, TenantQuota, TenantState
from tests.examples import thorough_after
from tests.model.ledger_model import Model, Slot, Tenant

BS = 16
INSTANCES = {"gpu-0": 24, "gpu-1": 40}
TENANTS = {
    "t1": TenantQuota(20, 2000, 1, 6, 1),
    "t2": TenantQuota(60, 10**6, 1, 10, 1),
    "t3": TenantQuota(60, 10**6, 1, 10, 1),
    "t4": TenantQuota(60, 10**6, 1, 10, 1),
}
SHARED = ("t3", "t4")
NAMESPACE = "pub"
SYSTEM_PROMPTS = [list(range(s * 1000, s * 1000 + length)) for s, length in enumerate((32, 48, 40))]
OWNERS = ("tenants/t1", "tenants/t2", "tenants/t3", f"namespaces/{NAMESPACE}")

# One slot as both sides describe it: instance, id, state, references, pins, generation, hash.
SlotRow = tuple[str, int, str, int, int, int, bytes | None]
# One tenant: name, blocks in use, pinned blocks, tokens in flight.
TenantRow = tuple[str, int, int, int]


class LedgerRules(RuleBasedStateMachine):
    """The rules and the comparison; subclasses implement the `apply_*` and `observed_*` hooks
    (each `apply_*` raises KvQuotaError for a refusal)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Model(Settings().admission_limits, BS)
        self.requests = 0
        self.offboarded = False
        self.steps = 0

    # The system under test.

    def build_fleet(self) -> tuple[dict[str, str], str]:
        """Create INSTANCES, TENANTS and the namespace (SHARED in it); return each tenant's salt
        and the namespace's."""
        raise NotImplementedError

    def apply_admit(self, params: AdmitParams, ids: Sequence[int]) -> Sequence[BlockHandle]:
        """Admit; returns the reservation's live table."""
        raise NotImplementedError

    def apply_end(self, tenant: str, request_id: str, reason: EndReason) -> None:
        raise NotImplementedError

    def apply_release_blocks(
        self, tenant: str, request_id: str, handles: Sequence[BlockHandle]
    ) -> None:
        raise NotImplementedError

    def apply_pin(self, owner: str, pin_id: str, instance: str, tokens: Sequence[int]) -> None:
        raise NotImplementedError

    def apply_unpin(self, owner: str, pin_id: str) -> None:
        raise NotImplementedError

    def apply_offboard(self, tenant: str) -> None:
        raise NotImplementedError

    def observed(self, thorough: bool) -> tuple[list[SlotRow], list[TenantRow]]:
        """Every slot (by instance, then id) and every tenant (by name), and any other check
        of the system's own (its invariants); the expensive ones only if `thorough`."""
        raise NotImplementedError

    # The rules.

    @initialize()
    def fleet(self) -> None:
        salts, namespace_salt = self.build_fleet()
        self.model.namespaces[NAMESPACE] = namespace_salt
        for name, quota in TENANTS.items():
            namespace = NAMESPACE if name in SHARED else None
            self.model.tenants[name] = Tenant(salts[name], quota, namespace)
        self.model.slots = {name: [Slot() for _ in range(n)] for name, n in INSTANCES.items()}

    @rule(
        tenant=st.sampled_from(sorted(TENANTS)),
        instance=st.sampled_from(sorted(INSTANCES)),
        system=st.integers(0, len(SYSTEM_PROMPTS) - 1),
        suffix=st.integers(0, 40),
        output=st.integers(1, 40),
        n=st.integers(1, 2),
        with_ids=st.booleans(),
        # Hypothesis favours a strategy's first choices: most Admits take a fresh id.
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
        else:
            self.requests += 1
            request_id = f"r{self.requests}"
        tokens = SYSTEM_PROMPTS[system] + [90_000 + self.requests + i for i in range(suffix)]
        params = AdmitParams(tenant, request_id, instance, len(tokens), output, n, 0)
        ids = tokens if with_ids else []
        expected = self.model.admit(params, ids)
        try:
            table = self.apply_admit(params, ids)
        except KvQuotaError as refusal:
            assert refusal.reason == expected
            return
        assert expected is None
        model = self.model.reservations[(tenant, request_id)]
        if model.live:
            live = [BlockHandle(e.block_id, e.generation) for e in model.entries if not e.released]
            assert list(table) == live

    @rule(data=st.data(), cancel=st.booleans())
    def end(self, data: st.DataObject, cancel: bool) -> None:
        if not self.model.reservations:
            return
        tenant, request_id = data.draw(st.sampled_from(sorted(self.model.reservations)))
        self.apply_end(tenant, request_id, EndReason.CANCELLED if cancel else EndReason.RELEASED)
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
        try:
            self.apply_release_blocks(tenant, request_id, handles)
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
        if collection == "tenants" and self.model.tenants[owner_id].state is not TenantState.ACTIVE:
            return  # an offboarded tenant's pins are refused before any block work
        tokens = SYSTEM_PROMPTS[system]
        expected = self.model.pin(owner, pin_id, instance, tokens)
        try:
            self.apply_pin(owner, pin_id, instance, tokens)
        except KvQuotaError as refusal:
            assert refusal.reason == expected
            return
        assert expected is None

    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        if not self.model.pins:
            return
        owner, pin_id = data.draw(st.sampled_from(sorted(self.model.pins)))
        self.apply_unpin(owner, pin_id)
        self.model.unpin(owner, pin_id)

    @precondition(lambda self: self.requests >= 20 and not self.offboarded)
    @rule(tenant=st.sampled_from(("t1", "t2", "t4")))
    def offboard(self, tenant: str) -> None:
        """Once a run, after some history: it ends a tenant for the rest of the run."""
        self.offboarded = True
        self.apply_offboard(tenant)
        self.model.offboard(tenant)

    @invariant()
    def matches_the_model(self) -> None:
        self.steps += 1
        self.compare(thorough_after(self.steps))

    def teardown(self) -> None:
        # The last state gets the expensive checks too, unless the run failed already (hypothesis
        # tears down in a finally: the exception in flight is the one to report).
        if sys.exc_info()[0] is None and not thorough_after(self.steps):
            self.compare(thorough=True)

    def compare(self, thorough: bool) -> None:
        if not self.model.slots:
            return
        slots, tenants = self.observed(thorough)
        expected_slots = [
            (name, i, s.state, s.ref_count, s.pin_count, s.generation, s.content_hash)
            for name in sorted(self.model.slots)
            for i, s in enumerate(self.model.slots[name])
        ]
        assert slots == expected_slots
        expected_tenants = [
            (name, *self.model.tenant_blocks(name), self.model.tokens(name))
            for name in sorted(TENANTS)
        ]
        assert tenants == expected_tenants
