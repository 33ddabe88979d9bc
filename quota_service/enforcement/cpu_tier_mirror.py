"""The CPU tier's shell: keeps each LMCache coordinator in step with the ledger (every salt's
quota, every pin), reads each instance's CPU tier (its L1, what it can do, and the ratio its
compressing L2 gives on real chunks), and moves sessions in and out of it for resume, compression
and eviction. Every replica's maintenance loop runs the mirror; an
advisory lock per coordinator lets one replica at a time decide what to send, and a coordinator
that fails is left alone for a backoff, so a down CPU tier never holds the loop up for long.

A coordinator's answers are parsed here; any way one goes wrong (refused, unreachable, or a
reply of an unexpected shape) is logged and retried on a later pass, never raised to a caller
that did not ask for the CPU tier."""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict

from quota_service.core.backoff import Backoff
from quota_service.core.pin_mirror import PinChain, pin_changes
from quota_service.core.reclaim import CompressMeasurement
from quota_service.engine.lmcache import ChunkPlacement, DeleteResult, LmcacheCoordinator
from quota_service.store.cpu_tier import CpuTierBooks, MirroredPin, Session

log = logging.getLogger(__name__)

# A resume waits this long at most for its session to come back into L1 (best effort: what is
# not there yet the engine recomputes).
PREFETCH_TIMEOUT_SECONDS = 5.0
# After a coordinator failed: leave it alone 1 s, 2 s, ... up to 60 s.
BACKOFF_INITIAL_SECONDS = 1.0
BACKOFF_MAX_SECONDS = 60.0


class CpuTierMirror:
    def __init__(self, books: CpuTierBooks) -> None:
        self._books = books
        self._clients: dict[str, LmcacheCoordinator] = {}
        self._backoff = Backoff(BACKOFF_INITIAL_SECONDS, BACKOFF_MAX_SECONDS)

    def _client(self, url: str) -> LmcacheCoordinator:
        client = self._clients.get(url)
        if client is None:
            client = self._clients[url] = LmcacheCoordinator(url)
        return client

    def _ready(self, url: str) -> bool:
        return self._backoff.ready(url, asyncio.get_running_loop().time())

    def _failed(self, url: str, what: str, exc: Exception) -> None:
        delay = self._backoff.failed(url, asyncio.get_running_loop().time())
        log.warning("CPU tier at %s: %s failed (%s); next try in %ss", url, what, exc, delay)

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()

    async def mirror(self) -> int:
        """One pass over every coordinator; returns how many changes it sent."""
        changes = 0
        for url in await self._books.coordinators():
            if not self._ready(url):
                continue
            async with self._books.exclusive(url) as held:
                if not held:
                    continue  # another replica mirrors this coordinator now
                try:
                    changes += await self._mirror_quotas(url) + await self._mirror_pins(url)
                except Exception as exc:
                    self._failed(url, "mirror", exc)
                    continue
            self._backoff.succeeded(url)
        for instance, where in await self._books.instances():
            if not self._ready(where.coordinator_url):
                continue
            try:
                found = await self._client(where.coordinator_url).capabilities(where)
            except Exception as exc:
                self._failed(where.coordinator_url, f"reading {instance}'s CPU tier", exc)
                continue
            used, capacity = found.l1.used_bytes, found.l1.capacity_bytes
            await self._books.record_usage(instance, used, capacity)
            await self._measure_compression(instance, found.can_compress)
        return changes

    async def _measure_compression(self, instance: str, can_compress: bool) -> None:
        """The instance's compression ratio, measured on the coldest session a COMPRESS step
        could take (its chunks both in L1 and compressed); kept as it was while there is none,
        forgotten when the tier cannot compress."""
        if not can_compress:
            await self._books.record_compression_ratio(instance, None)
            return
        sample = await self._books.compressible_sample(instance)
        if sample is None:
            return
        try:
            _, measured = await self._demotable(sample)
        except Exception as exc:
            self._failed(sample.where.coordinator_url, f"measuring {instance}'s ratio", exc)
            return
        if measured.before_bytes:
            await self._books.record_compression_ratio(instance, measured.ratio)

    async def _demotable(
        self, session: Session
    ) -> tuple[list[ChunkPlacement], CompressMeasurement]:
        """The session's chunks a demotion takes from L1 (held there and compressed in L2,
        and not pinned: pins are never compressed), and what they and the rest weigh in L1."""
        client = self._client(session.where.coordinator_url)
        chunks = await client.lookup(session.where, session.salt, session.token_ids)
        pinned = await client.pin_counts(session.where, session.salt)
        demoted = [c for c in chunks if c.tiers >= {"l1", "l2"} and not pinned.get(c.key)]
        kept = [c for c in chunks if "l1" in c.tiers and c not in demoted]
        return demoted, CompressMeasurement(
            sum(c.size_bytes["l1"] for c in demoted),
            sum(c.size_bytes["l2"] for c in demoted),
            sum(c.size_bytes["l1"] for c in kept),
        )

    async def measure_session(self, tenant: str, request_id: str) -> CompressMeasurement:
        """What demoting the session would take from L1 and hold compressed (all zero when it
        has no session in a CPU tier). Raises when the coordinator cannot tell now."""
        session = await self._books.session(tenant, request_id)
        if session is None:
            return CompressMeasurement(0, 0, 0)
        return (await self._demotable(session))[1]

    async def demote_session(self, tenant: str, request_id: str) -> DeleteResult | None:
        """Drop the L1 copies of the session's demotable chunks, leaving them compressed in L2.
        Repeating it deletes nothing more. Raises when the CPU tier cannot do it now."""
        session = await self._books.session(tenant, request_id)
        if session is None:
            return None
        demoted, _ = await self._demotable(session)
        client = self._client(session.where.coordinator_url)
        return await client.drop_from_l1(session.where, demoted)

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
        """Bring a resuming session's chunks from L2 back into L1 (decompressed, when it was
        compressed) before its blocks are allocated again. Best effort, and bounded: what is
        not found the engine recomputes."""
        session = await self._books.session(tenant, request_id)
        if session is None or not self._ready(session.where.coordinator_url):
            return
        client = self._client(session.where.coordinator_url)

        async def prefetch() -> tuple[int, int]:
            started = await client.prefetch(session.where, session.salt, session.token_ids)
            return await client.prefetch_done(session.where, started) if started else (0, 0)

        try:
            found, asked = await asyncio.wait_for(prefetch(), PREFETCH_TIMEOUT_SECONDS)
        except Exception as exc:
            self._failed(session.where.coordinator_url, "prefetch", exc)
            return
        log.info("prefetched %d of %d chunks of %s/%s", found, asked, tenant, request_id)

    async def delete_session(self, tenant: str, request_id: str) -> DeleteResult | None:
        """Drop an evicted session's chunks from its CPU tier; pinned chunks stay. Raises when
        the coordinator cannot do it now (the caller tries again later)."""
        session = await self._books.session(tenant, request_id)
        if session is None:
            return None
        client = self._client(session.where.coordinator_url)
        return await client.delete(session.where, session.salt, session.token_ids)
