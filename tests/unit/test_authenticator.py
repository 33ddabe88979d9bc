"""The authenticator's cache of verified keys: one database read per key and lapse, however many
calls arrive while it is read."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import cast

import pytest

from quota_service.api.auth import Authenticator
from quota_service.core import access
from quota_service.core.access import ApiKey, Role
from quota_service.core.errors import KvQuotaError
from quota_service.core.reasons import Reason
from quota_service.store.access import ApiKeys

KEY_ID = "0123456789abcdef"
SECRET = "s" * 43
TOKEN = f"kvq_{KEY_ID}_{SECRET}"
CREATED = datetime(2026, 1, 1, tzinfo=UTC)


class SlowKeys:
    """Answers each read after a pause, counting the reads."""

    def __init__(self) -> None:
        self.reads = 0

    async def verified(self, key_id: str) -> tuple[ApiKey, bytes] | None:
        self.reads += 1
        await asyncio.sleep(0.01)
        key = ApiKey(key_id, "gateway", Role.GATEWAY, ("acme",), "bootstrap", CREATED, None)
        return key, access.digest(SECRET)


async def test_calls_that_find_a_key_unverified_share_one_read() -> None:
    keys = SlowKeys()
    authenticator = Authenticator(cast(ApiKeys, keys), required=True, cache_seconds=60.0)
    metadata = (("authorization", f"Bearer {TOKEN}"),)
    principals = await asyncio.gather(*(authenticator.principal(metadata) for _ in range(16)))
    assert keys.reads == 1
    assert {p.name for p in principals} == {f"apiKeys/{KEY_ID}"}
    # Verified: the next call reads nothing, and gets the same principal.
    assert await authenticator.principal(metadata) == principals[0]
    assert keys.reads == 1


async def test_a_secret_matched_once_lets_no_other_secret_of_the_key_through() -> None:
    keys = SlowKeys()
    authenticator = Authenticator(cast(ApiKeys, keys), required=True, cache_seconds=60.0)
    right = (("authorization", f"Bearer {TOKEN}"),)
    wrong = (("authorization", f"Bearer kvq_{KEY_ID}_{'t' * 43}"),)
    for metadata in (right, wrong, right, wrong):
        if metadata is right:
            assert (await authenticator.principal(metadata)).name == f"apiKeys/{KEY_ID}"
        else:
            with pytest.raises(KvQuotaError) as refused:
                await authenticator.principal(metadata)
            assert refused.value.reason is Reason.UNAUTHENTICATED
    assert keys.reads == 1
