"""The CPU tier's shell: keeps each LMCache coordinator in step with the ledger (every salt's
quota, every pin), reads how full each instance's L1 is, and moves sessions in and out of it
for resume and eviction. Every replica's maintenance loop runs the mirror; an advisory lock
per coordinator lets one replica at a time decide what to send."""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict

from quota_service.core.cpu_tier import PinChain, pin_changes
from quota_service.engine.lmcache import DeleteResult, LmcacheCoordinator, LmcacheError
from quota_service.store.cpu_tier import CpuTierBooks, MirroredPin

log = logging.getLogger(__name__)

PREFETCH_TIMEOUT_SECONDS = 10.0


class CpuTier:
    def __init__(self, books: CpuTierBooks) -> None:
        self._books = books
        self._clients: dict[str, LmcacheCoordinator] = {}

    def _client(self, url: str) -> LmcacheCoordinator:
        client = self._clients.get(url)
        if client is None:
            client = self._clients[url] = LmcacheCoordinator(url)
        return client

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()

    async def mirror(self) -> int:
        """One pass over every coordinator; returns how many changes it sent. A coordinator
        that fails is tried again on the next pass."""
        changes = 0
        for url in await self._books.coordinators():
            async with self._books.exclusive(url) as held:
                if not held:
                    continue  # another replica mirrors this coordinator now
                try:
                    changes += await self._mirror_quotas(url) + await self._mirror_pins(url)
                except LmcacheError as exc:
                    log.warning("CPU tier at %s: mirror failed (%s)", url, exc)
        for instance, where in await self._books.instances():
            try:
                usage = await self._client(where.coordinator_url).usage(where)
            except LmcacheError as exc:
                log.info("CPU tier of %s: usage unknown (%s)", instance, exc)
                continue
            await self._books.record_usage(instance, usage.used_bytes, usage.capacity_bytes)
        return changes

    async def _mirror_quotas(self, url: str) -> int:
        """The coordinator's per-salt quotas are kvquota's: every salt in the fleet is one it
        gave out, so a quota for a salt it no longer knows (rotated, or its tenant offboarded)
        is removed. The empty salt's (unsalted traffic) is the operator's and left alone."""
        client = self._client(url)
        wanted = await self._books.salt_quotas()
        present = await client.quotas()
        changes = 0
        for salt, limit in wanted.items():
            if present.get(salt) != limit:
                await client.set_quota(salt, limit)
                changes += 1
        for salt in present.keys() - wanted.keys() - {""}:
            await client.delete_quota(salt)
            changes += 1
        return changes

    async def _mirror_pins(self, url: str) -> int:
        client = self._client(url)
        groups: dict[tuple[str, int, str], list[MirroredPin]] = defaultdict(list)
        for pin in await self._books.pins(url):
            groups[(pin.where.model_name, pin.where.world_size, pin.salt)].append(pin)
        changes = 0
        for pins in groups.values():
            chains = []
            for pin in pins:
                keys = pin.chunk_keys
                if keys is None:  # the coordinator names the chunks; once per pin
                    placements = await client.lookup(pin.where, pin.salt, pin.token_ids)
                    keys = tuple(p.key for p in placements)
                    await self._books.save_chunk_keys(pin.holder_id, keys)
                chains.append(PinChain(keys, pin.token_ids, pin.wanted))
            where, salt = pins[0].where, pins[0].salt
            for change in pin_changes(chains, await client.pin_counts(where, salt)):
                send = client.pin if change.delta > 0 else client.unpin
                for _ in range(abs(change.delta)):
                    await send(where, salt, change.chain.token_ids)
                changes += abs(change.delta)
            await self._books.forget_unpinned([p.holder_id for p in pins if not p.wanted])
        return changes

    async def prefetch_session(self, tenant: str, request_id: str) -> None:
        """Bring a resuming session's chunks from L2 back into L1 before its blocks are
        allocated again. Best effort: what is not found is recomputed by the engine."""
        session = await self._books.session(tenant, request_id)
        if session is None:
            return
        client = self._client(session.where.coordinator_url)
        try:
            prefetch = await client.prefetch(session.where, session.salt, session.token_ids)
            if prefetch:
                found, asked = await asyncio.wait_for(
                    client.prefetch_done(session.where, prefetch), PREFETCH_TIMEOUT_SECONDS
                )
                log.info("prefetched %d of %d chunks of %s/%s", found, asked, tenant, request_id)
        except (LmcacheError, TimeoutError) as exc:
            log.warning("prefetch of %s/%s failed (%s)", tenant, request_id, exc)

    async def delete_session(self, tenant: str, request_id: str) -> DeleteResult | None:
        """Drop an evicted session's chunks from its CPU tier; pinned chunks stay."""
        session = await self._books.session(tenant, request_id)
        if session is None:
            return None
        client = self._client(session.where.coordinator_url)
        return await client.delete(session.where, session.salt, session.token_ids)
