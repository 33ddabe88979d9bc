"""Property-based stateful test of the memory hot path as the server wires it (the ledger's,
pins' and offboarding's calls served by the instances' owners, over PostgreSQL) against the
reference model (tests/model/rules.py). After every step every slot must match the model,
every tenant's fleet-wide totals in the record too, each machine's counters must agree with a
recount of its tables (invariants 1-4), and a machine rebuilt from the record alone must equal
the live one (invariant 8; after the steps tests/examples.py says, and after the last)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test
from sqlalchemy import text

from quota_service.config import Settings
from quota_service.core.admission import AdmitRequest
from quota_service.core.block_table import BlockHandle
from quota_service.core.instance_machine import InstanceMachine
from quota_service.core.model import AdmitParams, EndReason
from quota_service.core.queueing import QueuePolicy
from quota_service.enforcement.termination import Termination
from quota_service.owner.owned_offboarding import OwnedOffboarding
from quota_service.owner.owned_pins import OwnedPins
from quota_service.owner.owners import OwnedLedger, Owners
from tests.databases import Databases
from tests.examples import examples
from tests.integration.database_rules import DatabaseRules
from tests.model.rules import INSTANCES, SlotRow, TenantRow
from tests.unit.machine_fixtures import assert_same_machine, next_generation, recount, slot_rows


class ServedVersusModel(DatabaseRules):
    def __init__(self) -> None:
        super().__init__()
        limits = Settings().admission_limits
        self.owners = Owners(self.engine, limits, QueuePolicy(), "model")
        self.ledger = OwnedLedger(self.engine, self.owners, limits)
        self.pins = OwnedPins(self.engine, self.owners)
        termination = Termination(self.ledger, abort_timeout_seconds=1.0, hard_timeout_seconds=5.0)
        self.offboarding = OwnedOffboarding(
            self.engine, self.ledger, self.pins, termination, self.owners
        )

    def close(self) -> None:
        self.run(self.owners.close())
        super().close()

    def build_fleet(self) -> tuple[dict[str, str], str]:
        async def build() -> tuple[dict[str, str], str]:
            await self.register_fleet()
            async with self.engine.connect() as conn:
                rows = await conn.execute(text("SELECT tenant, cache_salt FROM tenants"))
                ns = await conn.execute(text("SELECT cache_salt FROM namespaces"))
                return {t: salt for t, salt in rows.all()}, ns.scalar_one()

        built: tuple[dict[str, str], str] = self.run(build())
        return built

    def apply_admit(self, params: AdmitParams, ids: Sequence[int]) -> Sequence[BlockHandle]:
        reservation, _ = self.run(self.ledger.admit(AdmitRequest(params, tuple(ids), 0.0, None)))
        return list(reservation.block_table)

    def apply_end(self, tenant: str, request_id: str, reason: EndReason) -> None:
        output = None if reason is EndReason.CANCELLED else 1
        self.run(self.ledger.end(tenant, request_id, reason, output))

    def apply_release_blocks(
        self, tenant: str, request_id: str, handles: Sequence[BlockHandle]
    ) -> None:
        self.run(self.ledger.release_blocks(tenant, request_id, handles))

    def apply_pin(self, owner: str, pin_id: str, instance: str, tokens: Sequence[int]) -> None:
        self.run(self.pins.pin(owner, pin_id, instance, tokens))

    def apply_unpin(self, owner: str, pin_id: str) -> None:
        self.run(self.pins.unpin(owner, pin_id))

    def apply_offboard(self, tenant: str) -> None:
        self.run(self.offboarding.delete_tenant(tenant))

    def observed(self, thorough: bool) -> tuple[list[SlotRow], list[TenantRow]]:
        self.run(self.owners.take_over_unowned())
        slots: list[SlotRow] = []
        for name in sorted(INSTANCES):
            owner = self.run(self.owners.owner(name))
            machine: InstanceMachine = owner.machine
            recount(machine)
            if thorough:
                recorded = self.run(self.owners.journal.read(name))
                tenants = {t.tenant: t for t in self.run(self.owners.journal.tenants())}
                tenants.update({n: here.settings for n, here in machine.tenants.items()})
                fresh = InstanceMachine.recover(
                    machine.spec,
                    machine.limits,
                    tenants.values(),
                    recorded.image,
                    next_generation(machine),
                )
                assert_same_machine(machine, fresh)
            slots += [(name, *row) for row in slot_rows(machine)]

        async def totals() -> list[Any]:
            async with self.engine.connect() as conn:
                rows = await conn.execute(
                    text(
                        "SELECT tenant, blocks_in_use, pinned_blocks, tokens_in_flight "
                        "FROM tenants ORDER BY tenant"
                    )
                )
                return [tuple(r) for r in rows]

        return slots, self.run(totals())


def test_the_served_memory_path_matches_the_reference_model(databases: Databases) -> None:
    ServedVersusModel.databases = databases
    run_state_machine_as_test(
        ServedVersusModel,
        settings=settings(
            max_examples=examples(5),
            stateful_step_count=50,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )


pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]
