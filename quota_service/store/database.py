"""Connections to the ledger's PostgreSQL and the transaction boundary every write goes through."""

from __future__ import annotations

import asyncio
import logging
import random
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from psycopg import errors as pg_errors
from sqlalchemy import TextClause, make_url, text
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.pool import QueuePool

from quota_service.core.errors import KvQuotaError
from quota_service.core.reasons import Reason

log = logging.getLogger(__name__)

T = TypeVar("T")

# Lock waits between replicas can still form cycles (e.g. two reapers ending reservations of the
# same tenants); PostgreSQL breaks them by failing one transaction, which is then simply retried.
_RETRYABLE = (pg_errors.DeadlockDetected, pg_errors.SerializationFailure)
MAX_ATTEMPTS = 5
RETRY_BACKOFF_SECONDS = 0.005


def driver_statement(statement: str) -> TextClause:
    """A statement written in the driver's placeholders (`%(name)s`, as an instance's owner
    sends them in its batches), for SQLAlchemy (`:name`)."""
    return text(re.sub(r"%\((\w+)\)s", r":\1", statement))


def sqlalchemy_url(url: str) -> str:
    """Accept plain `postgresql://` URLs (psql's form) and pick the psycopg 3 driver."""
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed.render_as_string(hide_password=False)


def connect(url: str, pool_size: int = 10) -> AsyncEngine:
    return create_async_engine(
        sqlalchemy_url(url),
        pool_size=pool_size,
        max_overflow=pool_size,
        # The hot path runs the same few statements: let psycopg prepare them server-side.
        connect_args={"prepare_threshold": 1},
    )


@dataclass(frozen=True, slots=True)
class PoolUsage:
    """The connection pool of an engine as it is now."""

    size: int  # connections it keeps open
    checked_out: int  # in use by a transaction or a read
    idle: int  # open, waiting in the pool
    overflow: int  # open beyond `size` (up to its max_overflow, then callers wait)


def pool_usage(engine: AsyncEngine) -> PoolUsage | None:
    """How the engine's pool is used; None for a pool that keeps no count (not a QueuePool).
    Cheap and lock-free: safe to call from a metrics scrape in another thread."""
    pool = engine.pool
    if not isinstance(pool, QueuePool):
        return None
    # overflow() starts at -size: the connections not opened yet count against it.
    return PoolUsage(pool.size(), pool.checkedout(), pool.checkedin(), max(0, pool.overflow()))


async def in_transaction(engine: AsyncEngine, work: Callable[[AsyncConnection], Awaitable[T]]) -> T:
    """Run `work` in one transaction: commit on return, roll back on any exception, and retry
    the whole unit when PostgreSQL chose it as a deadlock or serialization victim."""
    for attempt in range(1, MAX_ATTEMPTS + 1):
        try:
            async with engine.begin() as conn:
                return await work(conn)
        except DBAPIError as exc:
            if not isinstance(exc.orig, _RETRYABLE) or attempt == MAX_ATTEMPTS:
                raise
            log.info("retrying transaction after %s (attempt %d)", type(exc.orig).__name__, attempt)
            # Jitter so the transactions that collided do not collide again in step.
            await asyncio.sleep(random.uniform(0, RETRY_BACKOFF_SECONDS * attempt))
    raise AssertionError("unreachable")


async def reachable(engine: AsyncEngine) -> bool:
    """Whether the ledger answers a trivial query now."""
    try:
        async with engine.connect() as conn:
            await conn.execute(text("SELECT 1"))
    except Exception as exc:
        if unavailable_error(exc) is None:
            raise
        return False
    return True


def unavailable_error(exc: BaseException) -> KvQuotaError | None:
    """The refusal to give when the database cannot be reached: UNAVAILABLE, so callers retry."""
    if isinstance(exc, (OperationalError, InterfaceError, OSError)) or (
        isinstance(exc, DBAPIError) and exc.connection_invalidated
    ):
        return KvQuotaError(
            Reason.DATABASE_UNAVAILABLE,
            "the ledger database cannot be reached; retry shortly",
            retry_delay_seconds=1.0,
        )
    return None
