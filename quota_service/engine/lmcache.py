"""The LMCache MP coordinator (HTTP): the CPU tier below an instance's GPU.

kvquota mirrors each salt's CPU-tier quota and its pins there, deletes a preempted session's
CPU-tier copy, demotes a compressed session's chunks from L1 to a compressing L2 adapter (the
MP server's key-addressed delete of their L1 copies), prefetches a resumed session back into L1
(L2 decompresses it on the way), and reads how full L1 is. The
coordinator's calls are synchronous and have no job ids, so every call here is either
idempotent by nature (quota PUT/DELETE, delete, lookup, reads), and retried after a timeout or
a 5xx, or a refcount change (pin, unpin) that is never retried blindly: the pin mirror decides
what to send from the coordinator's own counts (core/pin_mirror.py), so a replay after a lost
answer sends nothing twice. Salts are secret: they never appear in an error (paths are reported
as templates).

LMCache works in chunks (256 tokens by default): only whole chunks are stored, pinned or
counted, and a chunk's key chains over every token before it, so keys come from the coordinator
(`lookup`) rather than being recomputed here.

Compression is no call of LMCache's MP mode: an L2 adapter configured with a compressing serde
(`"serde": {"type": "fp8"}`, half of float16's bytes) holds every chunk the default store policy
writes through to it in that form, so deleting a chunk's L1 copy leaves it only compressed. The
coordinator's own L1 delete ignores pins, so the chunks to demote are named by key, pinned ones
left out (tests/engines/test_lmcache_compress.py shows both).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from quota_service.core.model import LmcacheEndpoint

GIB = float(1 << 30)
TIMEOUT_SECONDS = 2.0
RETRIES = 3
RETRY_DELAY_SECONDS = 0.2


class LmcacheError(RuntimeError):
    """The coordinator refused a call, or could not be reached after the retries."""


@dataclass(frozen=True, slots=True)
class CpuTierUsage:
    """An MP server's L1 (DRAM) as the coordinator reports it."""

    used_bytes: int
    capacity_bytes: int


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What an instance's CPU tier can do: it can compress when an L2 adapter wraps what it
    stores in a serde (what that saves, if anything, is measured on real chunks)."""

    chunk_size: int
    l1: CpuTierUsage
    can_compress: bool


@dataclass(frozen=True, slots=True)
class ChunkPlacement:
    key: str  # the chunk's hash (hex), as pins and the directory name it
    object_key: Mapping[str, object]  # the whole key, as the MP server's deletes take it
    size_bytes: Mapping[str, int]  # "l1", "l2" → bytes this MP server holds it in there

    @property
    def tiers(self) -> frozenset[str]:
        return frozenset(self.size_bytes)


@dataclass(frozen=True, slots=True)
class DeleteResult:
    requested: int
    skipped: int  # pinned chunks the delete left in place


class LmcacheCoordinator:
    def __init__(self, url: str, timeout_seconds: float = TIMEOUT_SECONDS) -> None:
        self.url = url
        self._client = httpx.AsyncClient(base_url=url, timeout=timeout_seconds)

    async def close(self) -> None:
        await self._client.aclose()

    async def _call(
        self,
        method: str,
        path: str,
        body: Mapping[str, object] | None = None,
        *,
        salt: str = "",
        params: Mapping[str, str] | None = None,
        retry: bool = True,
    ) -> Any:
        """One call to `path` ("{salt}" stands for the salt); a retryable one is repeated after a
        connection error, a timeout or a 5xx. Whatever goes wrong raises LmcacheError."""
        attempts = RETRIES if retry else 1
        url = path.replace("{salt}", salt or "_default")  # the coordinator's name for ""
        for attempt in range(attempts):
            try:
                response = await self._client.request(method, url, json=body, params=params)
            except httpx.HTTPError as exc:
                failure = f"{method} {path}: {type(exc).__name__}"
            else:
                # The coordinator echoes requests in its errors: only the status is kept.
                failure = f"{method} {path}: HTTP {response.status_code}"
                if response.status_code < 500:
                    if response.is_error:
                        raise LmcacheError(failure)
                    try:
                        return response.json()
                    except ValueError:
                        raise LmcacheError(f"{method} {path}: not JSON") from None
            if attempt + 1 < attempts:
                await asyncio.sleep(RETRY_DELAY_SECONDS * 2**attempt)
        raise LmcacheError(failure)

    # Quotas (per cache_salt; the coordinator enforces them on L2).

    async def set_quota(self, salt: str, limit_bytes: int) -> None:
        await self._call("PUT", "/quota/{salt}", {"limit_gb": limit_bytes / GIB}, salt=salt)

    async def delete_quota(self, salt: str) -> None:
        await self._call("DELETE", "/quota/{salt}", salt=salt)

    async def quotas(self) -> dict[str, int]:
        """Salt → limit in bytes, for salts that have a quota."""
        listed = await self._call("GET", "/quota", params={"tier": "l2"})
        return {
            row["cache_salt"]: round(row["quota_limit_gb"] * GIB)
            for row in listed["by_cache_salt"]
            if row["quota_exists"]
        }

    # Chunks: keys, placements, pins, deletes, prefetches.

    async def lookup(
        self, where: LmcacheEndpoint, salt: str, token_ids: Sequence[int]
    ) -> list[ChunkPlacement]:
        """Each whole chunk of `token_ids`: its key and the tiers `where` holds it in, with
        its size there."""
        found = await self._call("POST", "/directory/lookup", _tokens(where, salt, token_ids))
        return [
            ChunkPlacement(
                result["key"]["chunk_hash_hex"],
                result["key"],
                {
                    p["tier"]: int(p["size_bytes"])
                    for p in result["placements"]
                    if p["instance_id"] == where.instance_id
                },
            )
            for result in found["results"]
        ]

    async def pin_counts(self, where: LmcacheEndpoint, salt: str) -> dict[str, int]:
        """Chunk key → pin count, for the salt's pinned chunks of `where`'s model."""
        counts: dict[str, int] = {}
        offset, page = 0, 1000
        while True:
            params = {
                "cache_salt": salt,
                "model_name": where.model_name,
                "offset": str(offset),
                "limit": str(page),
            }
            listed = await self._call("GET", "/cache/pins", params=params)
            for pin in listed["pins"]:
                counts[pin["key"]["chunk_hash_hex"]] = pin["pin_count"]
            offset += page
            if offset >= listed["total"]:
                return counts

    async def pin(self, where: LmcacheEndpoint, salt: str, token_ids: Sequence[int]) -> None:
        """Add one pin to every whole chunk of the prefix. Not retried: a retry after a lost
        answer would pin twice."""
        await self._call("POST", "/cache/pins", _tokens(where, salt, token_ids), retry=False)

    async def unpin(self, where: LmcacheEndpoint, salt: str, token_ids: Sequence[int]) -> None:
        await self._call("DELETE", "/cache/pins", _tokens(where, salt, token_ids), retry=False)

    async def delete(
        self, where: LmcacheEndpoint, salt: str, token_ids: Sequence[int]
    ) -> DeleteResult:
        """Drop the chunks from L1 and L2 of `where`'s MP server; pinned chunks stay."""
        body = {
            **_tokens(where, salt, token_ids),
            "instance_id": where.instance_id,
            "tier": "all",
            "force": False,
        }
        result = await self._call("POST", "/cache/delete", body)
        return DeleteResult(result["requested"], result["skipped"])

    async def prefetch(self, where: LmcacheEndpoint, salt: str, token_ids: Sequence[int]) -> str:
        """Start bringing the chunks from L2 back into L1; returns the prefetch's id ("" when
        there is no whole chunk)."""
        body = {**_tokens(where, salt, token_ids), "instance_id": where.instance_id}
        submitted = await self._call("POST", "/cache/prefetches", body)
        return str(submitted["request_id"])

    async def prefetch_done(self, where: LmcacheEndpoint, request_id: str) -> tuple[int, int]:
        """(chunks found, chunks asked) once the prefetch completed. The coordinator forgets
        a prefetch when it reports it completed, so this is asked until then, once after."""
        path = f"/cache/prefetches/{where.instance_id}/{request_id}"
        while True:
            status = await self._call("GET", path)
            if status["status"] == "completed":
                return int(status["found_keys"]), int(status["total_keys"])
            await asyncio.sleep(RETRY_DELAY_SECONDS)

    # The CPU tier itself.

    async def usage(self, where: LmcacheEndpoint) -> CpuTierUsage:
        """The MP server's L1: bytes used of its capacity."""
        entry = await self._call("GET", f"/instances/{where.instance_id}/usage")
        for module in entry["modules"]:
            if module["tier"] == "l1":
                return CpuTierUsage(module["used_bytes"], module["capacity_bytes"])
        raise LmcacheError(f"{where.instance_id} reports no L1 tier")

    async def _server(self, where: LmcacheEndpoint) -> LmcacheCoordinator:
        """A client of `where`'s MP server's admin HTTP (its address from the coordinator's
        membership), which answers the same way the coordinator does; the caller closes it."""
        members = await self._call("GET", "/instances")
        server = next(
            (m for m in members["instances"] if m["instance_id"] == where.instance_id), None
        )
        if server is None:
            raise LmcacheError(f"no MP server {where.instance_id!r} is registered")
        return LmcacheCoordinator(f"http://{server['ip']}:{server['http_port']}")

    async def capabilities(self, where: LmcacheEndpoint) -> Capabilities:
        """Discovered from the MP server's own status and its L1 usage."""
        direct = await self._server(where)
        try:
            status = await direct._call("GET", "/status")
        finally:
            await direct.close()
        adapters = status["storage_manager"]["l2_adapters"]
        can_compress = any(a.get("serde_wrapped", False) for a in adapters)
        return Capabilities(int(status["chunk_size"]), await self.usage(where), can_compress)

    async def drop_from_l1(
        self, where: LmcacheEndpoint, chunks: Sequence[ChunkPlacement]
    ) -> DeleteResult:
        """Delete the chunks' L1 copies on `where`'s MP server, leaving their L2 copies: a
        chunk read or written just now is skipped (its lock is honoured). Idempotent: a chunk
        no longer in L1 is not there to delete."""
        if not chunks:
            return DeleteResult(0, 0)
        body = {"keys": [c.object_key for c in chunks], "tier": "l1", "force": False}
        direct = await self._server(where)
        try:
            result = await direct._call("DELETE", "/cache/objects", body)
        finally:
            await direct.close()
        return DeleteResult(len(chunks), int(result["skipped"]))


def _tokens(where: LmcacheEndpoint, salt: str, token_ids: Sequence[int]) -> dict[str, object]:
    return {
        "model_name": where.model_name,
        "world_size": where.world_size,
        "token_ids": list(token_ids),
        "cache_salt": salt,
    }
