"""The invariant checks (quota_service/store/invariants.py) as an assertion for tests."""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncEngine

from quota_service.core.invariants import violations
from quota_service.store.invariants import check_record


async def assert_invariants(engine: AsyncEngine) -> None:
    broken = violations(await check_record(engine))
    assert not broken, "\n".join(broken)
