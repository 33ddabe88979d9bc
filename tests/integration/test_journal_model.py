"""Property-based stateful test of the instance journal against the reference model (the rules
are tests/model/rules.py): each instance's machine is served by an owner that commits every
step's changes to PostgreSQL. After every step, besides everything the machine test checks,
tenants' fleet-wide totals in the record must equal their holdings in memory; after the steps
tests/examples.py says, and after the last, a machine rebuilt from the record alone must equal the
live one (invariant 8), and the record's derived views (each slot's references and state, each
tenant's holdings) must equal the machines'."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test
from sqlalchemy import text

from quota_service.core.instance_machine import InstanceMachine
from quota_service.owner.instance_owner import InstanceOwner
from quota_service.store.journal import Journal
from tests.databases import Databases
from tests.examples import examples
from tests.integration.database_rules import DatabaseRules
from tests.model.rules import INSTANCES, TENANTS
from tests.unit.machine_fixtures import assert_same_machine, next_generation, slot_rows
from tests.unit.test_instance_machine_model import MachinesVersusModel


class JournalVersusModel(MachinesVersusModel, DatabaseRules):
    def __init__(self) -> None:
        super().__init__()
        self.journal = Journal(self.engine)
        self.owners: dict[str, InstanceOwner] = {}

    def close(self) -> None:
        self.run(self.journal.close())
        super().close()

    def build_fleet(self) -> tuple[dict[str, str], str]:
        async def build() -> None:
            await self.register_fleet()
            for name in INSTANCES:
                # The live machines start empty, as the record does: claim them as they are.
                recorded = await self.journal.load(name, "test", "", 0.0)
                # Checkpoints every few dozen slot changes: recovery reads them and the deltas.
                self.owners[name] = InstanceOwner(
                    self.machines[name], self.journal, recorded.epoch, checkpoint_min_slots=40
                )

        self.run(build())
        tenants = self.run(self.journal.tenants())
        for one in tenants:
            self._publish(one)
        self.salts = self.run(self._own_salts())
        self.namespace_salt = next(t.salt for t in tenants if t.scope.startswith("namespaces/"))
        return self.salts, self.namespace_salt

    async def _own_salts(self) -> dict[str, str]:
        async with self.engine.connect() as conn:
            rows = await conn.execute(text("SELECT tenant, cache_salt FROM tenants"))
            return {tenant: salt for tenant, salt in rows.all()}

    def check_record(self, name: str, machine: InstanceMachine, thorough: bool) -> None:
        owner = self.owners[name]
        self.run(owner.apply(lambda m, now: None))
        assert not machine.changes_pending()
        if not thorough:
            return
        recorded = self.run(self.journal.read(name))
        tenants = self.run(self.journal.tenants())
        settings = {one.tenant: one for one in tenants}
        # The record's settings are the catalog's; the machine's may be newer (offboarding).
        settings.update({n: here.settings for n, here in machine.tenants.items()})
        fresh = InstanceMachine.recover(
            machine.spec,
            machine.limits,
            settings.values(),
            recorded.image,
            next_generation(machine),
        )
        assert_same_machine(machine, fresh)
        self._check_views(name, machine)

    def _check_views(self, name: str, machine: InstanceMachine) -> None:
        async def read() -> tuple[Sequence[Any], Sequence[Any]]:
            async with self.engine.connect() as conn:
                slots = await conn.execute(
                    text(
                        "SELECT block_id, state, ref_count, pin_count, generation, content_hash "
                        "FROM journal_slots WHERE instance = :i ORDER BY block_id"
                    ),
                    {"i": name},
                )
                holdings = await conn.execute(
                    text(
                        "SELECT tenant, blocks_in_use, pinned_blocks, tokens_in_flight "
                        "FROM journal_tenant_holdings WHERE instance = :i ORDER BY tenant"
                    ),
                    {"i": name},
                )
                return slots.all(), holdings.all()

        slots, holdings = self.run(read())
        expected = [row for row in slot_rows(machine) if row[1] != "FREE"]
        assert [tuple(row) for row in slots] == expected
        in_memory = [
            (tenant, here.blocks, len(here.pinned), here.tokens)
            for tenant, here in sorted(machine.tenants.items())
            if here.blocks
        ]
        assert [tuple(row) for row in holdings] == in_memory

    def observed(self, thorough: bool) -> Any:
        observed = super().observed(thorough)

        async def totals() -> Sequence[Any]:
            async with self.engine.connect() as conn:
                rows = await conn.execute(
                    text(
                        "SELECT tenant, blocks_in_use, pinned_blocks, tokens_in_flight, "
                        "queued_requests FROM tenants ORDER BY tenant"
                    )
                )
                return rows.all()

        held: Counter[tuple[str, str]] = Counter()
        for machine in self.machines.values():
            for tenant, here in machine.tenants.items():
                held[(tenant, "blocks")] += here.blocks
                held[(tenant, "pinned")] += len(here.pinned)
                held[(tenant, "tokens")] += here.tokens
                held[(tenant, "queued")] += here.queued
        expected = [
            (t, held[(t, "blocks")], held[(t, "pinned")], held[(t, "tokens")], held[(t, "queued")])
            for t in sorted(TENANTS)
        ]
        assert [tuple(row) for row in self.run(totals())] == expected
        return observed


def test_journal_matches_the_reference_model(databases: Databases) -> None:
    JournalVersusModel.databases = databases
    run_state_machine_as_test(
        JournalVersusModel,
        settings=settings(
            max_examples=examples(5),
            stateful_step_count=50,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )


pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]
