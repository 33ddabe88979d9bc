"""The reference model's rules (tests/model/rules.py) driven against a real PostgreSQL: each
run of a state machine gets a database of its own, a loop to run the system's calls on, and the
model's fleet registered in the catalog."""

from __future__ import annotations

import asyncio
from typing import Any

from quota_service.store.catalog import Catalog
from quota_service.store.database import connect
from tests.databases import Databases
from tests.integration.ledger_fixtures import add_instance
from tests.model.rules import BS, INSTANCES, NAMESPACE, SHARED, TENANTS, LedgerRules


class DatabaseRules(LedgerRules):
    databases: Databases

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.database = self.databases.take()
        self.engine = connect(self.databases.url(self.database), pool_size=2)

    def run(self, work: Any) -> Any:
        return self.loop.run_until_complete(work)

    def teardown(self) -> None:
        try:
            super().teardown()
        finally:
            self.close()

    def close(self) -> None:
        """What the machine holds is closed before this (subclasses close theirs first)."""
        self.run(self.engine.dispose())
        self.loop.close()
        self.databases.drop(self.database)

    async def register_fleet(self) -> None:
        """The model's instances, its namespace and its tenants (the shared ones in it)."""
        catalog = Catalog(self.engine)
        for name, blocks in INSTANCES.items():
            await add_instance(self.engine, name, blocks=blocks, block_size=BS)
        await catalog.create_namespace(NAMESPACE)
        for name, quota in TENANTS.items():
            await catalog.create_tenant(name, name, 1, quota)
        for name in SHARED:
            await catalog.update_tenant(name, {"namespace": NAMESPACE})
