"""Property-based stateful test of the SQL ledger against the reference model (the rules are
tests/model/rules.py): after every step every block must match the model (state, references,
pins, generation, contents), every tenant counter too, and DESIGN.md's invariants 1-6 must hold
in the database (checked after the steps tests/examples.py says, and after the last)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test
from sqlalchemy import text

from quota_service.config import Settings
from quota_service.core.admission import AdmitRequest
from quota_service.core.block_table import BlockHandle
from quota_service.core.invariants import violations
from quota_service.core.model import AdmitParams, EndReason
from quota_service.store.catalog import Catalog
from quota_service.store.database import connect
from quota_service.store.invariants import check_record
from quota_service.store.ledger import Ledger
from quota_service.store.pins import Pins
from tests.databases import Databases
from tests.examples import examples
from tests.integration.ledger_fixtures import add_instance, offboarding_service
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


class LedgerMachine(LedgerRules):
    databases: Databases

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.database = self.databases.take()
        self.engine = connect(self.databases.url(self.database), pool_size=2)
        limits = Settings().admission_limits
        self.ledger = Ledger(self.engine, limits)
        self.pins = Pins(self.engine, limits)
        self.offboarding = offboarding_service(self.engine, self.ledger, self.pins)

    def run(self, work: Any) -> Any:
        return self.loop.run_until_complete(work)

    def teardown(self) -> None:
        try:
            super().teardown()
        finally:
            self.close()

    def close(self) -> None:
        self.run(self.engine.dispose())
        self.loop.close()
        self.databases.drop(self.database)

    def build_fleet(self) -> tuple[dict[str, str], str]:
        catalog = Catalog(self.engine)

        async def build() -> tuple[dict[str, str], str]:
            for name, blocks in INSTANCES.items():
                await add_instance(self.engine, name, blocks=blocks, block_size=BS)
            await catalog.create_namespace(NAMESPACE)
            for name, quota in TENANTS.items():
                await catalog.create_tenant(name, name, 1, quota)
            for name in SHARED:
                await catalog.update_tenant(name, {"namespace": NAMESPACE})
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
        async def read() -> tuple[Sequence[Any], Sequence[Any], list[str]]:
            async with self.engine.connect() as conn:
                blocks = await conn.execute(
                    text(
                        "SELECT instance, block_id, state, ref_count, pin_count, generation, "
                        "content_hash FROM blocks ORDER BY instance, block_id"
                    )
                )
                tenants = await conn.execute(
                    text(
                        "SELECT tenant, blocks_in_use, pinned_blocks, tokens_in_flight "
                        "FROM tenants ORDER BY tenant"
                    )
                )
                broken = violations(await check_record(self.engine)) if thorough else []
                return blocks.all(), tenants.all(), broken

        blocks, tenants, broken = self.run(read())
        assert not broken, broken
        return [tuple(b) for b in blocks], [tuple(t) for t in tenants]


def test_ledger_matches_the_reference_model(databases: Databases) -> None:
    LedgerMachine.databases = databases
    run_state_machine_as_test(
        LedgerMachine,
        settings=settings(
            max_examples=examples(10),
            stateful_step_count=60,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )


pytestmark = [pytest.mark.timeout(1200), pytest.mark.slow]
