"""What the record keeps of each instance's engine, for the follower (jobs/follower.py) and its
owner (owner/owned_reconcile.py): which engines publish KV events, the last batch of them
applied, the reservations an engine restart ends, and the requests the engine says it runs."""

from __future__ import annotations

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

# In the driver's placeholders: an instance's owner commits them with the batch of events.
APPLIED = "UPDATE instances SET last_event_seq = %(seq)s WHERE instance = %(instance)s"
RESYNCED = (
    "UPDATE instances SET engine_resyncs = engine_resyncs + 1, last_event_seq = %(seq)s "
    "WHERE instance = %(instance)s"
)

_LIVE_ON_INSTANCE = text(
    "SELECT tenant, request_id FROM reservations WHERE instance = :instance AND state = 'ADMITTED'"
)

_FOLLOWED = text(
    "SELECT instance, kv_events_endpoint, kv_replay_endpoint, engine_url FROM instances "
    "WHERE kv_events_endpoint IS NOT NULL ORDER BY instance"
)

_LAST_APPLIED = text("SELECT last_event_seq FROM instances WHERE instance = :instance")

_ENGINE_RUNNING = text(
    "UPDATE instances SET engine_requests_running = :running, engine_checked_at = now() "
    "WHERE instance = :instance"
)


class EngineRecord:
    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine

    async def followed_engines(self) -> list[tuple[str, str, str | None, str | None]]:
        """(instance, events endpoint, replay endpoint, engine URL) of every instance whose
        engine publishes KV events."""
        async with self._engine.connect() as conn:
            return [(i, e, r, u) for i, e, r, u in await conn.execute(_FOLLOWED)]

    async def last_applied(self, instance: str) -> int | None:
        """The sequence number of the last batch applied (-1: resynchronised from empty, None:
        never followed)."""
        async with self._engine.connect() as conn:
            seq = (await conn.execute(_LAST_APPLIED, {"instance": instance})).scalar_one_or_none()
            return None if seq is None else int(seq)

    async def live_on_instance(self, instance: str) -> list[tuple[str, str]]:
        """(tenant, request_id) of the reservations admitted on the instance."""
        async with self._engine.connect() as conn:
            rows = await conn.execute(_LIVE_ON_INSTANCE, {"instance": instance})
            return [(r.tenant, r.request_id) for r in rows]

    async def record_engine_load(self, instance: str, running: int) -> None:
        """What the engine says it runs, beside the live reservations (GetInstance)."""
        async with self._engine.begin() as conn:
            await conn.execute(_ENGINE_RUNNING, {"instance": instance, "running": running})
