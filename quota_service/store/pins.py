"""Pins as the record holds them: system-prompt prefixes held resident on an instance, for a
tenant or a namespace. Pinning and unpinning are their instance's owner's
(owner/owned_pins.py); the blocks a pin holds are in its owner's memory, not in its row."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import RowMapping, text
from sqlalchemy.ext.asyncio import AsyncEngine

from quota_service.core.model import Pin, PinState
from quota_service.core.pagination import Page

_LIST_PINS = text(
    "SELECT * FROM pins WHERE owner = :owner AND pin_id > :after ORDER BY pin_id LIMIT :size"
)

_ACTIVE_PINS_OF_TENANT = text(
    "SELECT owner, pin_id FROM pins WHERE tenant = :tenant AND state = 'ACTIVE' "
    "AND instance = ANY(CAST(:here AS text[])) LIMIT :batch"
)


def pin_from_row(row: RowMapping) -> Pin:
    """A pin's row, without its blocks."""
    return Pin(
        owner=row["owner"],
        pin_id=row["pin_id"],
        instance=row["instance"],
        prompt_tokens=row["prompt_tokens"],
        pinned_blocks=row["pinned_blocks"],
        state=PinState(row["state"]),
        created_at=row["created_at"],
    )


class RecordedPins:
    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine

    async def list_pins(self, owner: str, page: Page) -> list[Pin]:
        params = {"owner": owner, "after": page.after or "", "size": page.size}
        async with self._engine.connect() as conn:
            return [pin_from_row(r) for r in (await conn.execute(_LIST_PINS, params)).mappings()]

    async def active_of_tenant(
        self, tenant: str, batch: int, here: Sequence[str]
    ) -> list[tuple[str, str]]:
        """The tenant's active pins on the instances `here`."""
        keys = {"tenant": tenant, "batch": batch, "here": list(here)}
        async with self._engine.connect() as conn:
            rows = await conn.execute(_ACTIVE_PINS_OF_TENANT, keys)
            return [(r.owner, r.pin_id) for r in rows]
