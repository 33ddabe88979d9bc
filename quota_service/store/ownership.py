"""Work one replica does at a time: PostgreSQL session-level advisory locks, tried (never waited
for), so that another replica skips what one is doing. PostgreSQL releases such a lock the moment
its connection goes, so when the owner dies another replica's next try takes over."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import psycopg
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from quota_service.store.notifications import libpq_url

_TRY_LOCK = text("SELECT pg_try_advisory_lock(hashtext(:key))")
_UNLOCK = text("SELECT pg_advisory_unlock(hashtext(:key))")


@asynccontextmanager
async def exclusive(engine: AsyncEngine, key: str) -> AsyncIterator[bool]:
    """For a piece of work: yields whether this replica holds `key` (False: another one does
    that work now), on a pooled connection kept until the block ends. Returning that connection
    to the pool only rolls back, which keeps a session lock: if taking or giving back the lock
    is interrupted (an error, a cancellation), the connection is discarded, which frees it."""
    async with engine.connect() as conn:
        try:
            held = bool((await conn.execute(_TRY_LOCK, {"key": key})).scalar_one())
            await conn.commit()
        except BaseException:
            await conn.invalidate()
            raise
        try:
            yield held
        finally:
            if held:
                try:
                    await conn.execute(_UNLOCK, {"key": key})
                    await conn.commit()
                except BaseException:
                    await conn.invalidate()
                    raise


@asynccontextmanager
async def owned(database_url: str, key: str) -> AsyncIterator[bool]:
    """For as long as a task runs: yields whether this replica holds `key`, on a connection of
    its own (not one the pool may recycle). Raises psycopg.Error or OSError when the database
    cannot be reached."""
    async with await psycopg.AsyncConnection.connect(
        libpq_url(database_url), autocommit=True
    ) as conn:
        tried = await conn.execute("SELECT pg_try_advisory_lock(hashtext(%s))", (key,))
        row = await tried.fetchone()
        yield bool(row and row[0])
