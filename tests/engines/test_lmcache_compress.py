"""What a COMPRESS tier can rest on in LMCache 0.5.6's MP mode, checked against a real
coordinator and MP server. Neither has a compress call, but an L2 adapter configured with a
compressing serde (`"serde": {"type": "fp8"}`) holds every chunk in half the bytes of L1's
float16 copy (the default store policy writes L1 through to every L2 adapter). Deleting chosen
chunks from L1 alone (the MP server's key-addressed `DELETE /cache/objects`, keys from the
coordinator's directory) leaves them only in that compressed form, and a prefetch brings them
back into L1 at full size. The coordinator's `POST /cache/delete` with tier l1 does not honour
its own pins (they filter L2 only), so a compress step must name the unpinned chunks' keys
itself, as kvquota's does (tests/engines/test_compress_tier.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from quota_service.core.model import LmcacheEndpoint
from quota_service.engine.lmcache import LmcacheCoordinator
from tests.engines.conftest import ChunkWriter, Lmcache, lmcache_at

CHUNK = 256
L1_CHUNK_BYTES = 16 << 10  # the writer's chunk: 2 layers x K and V x 256 tokens x 8 x float16
SETTLE_SECONDS = 10.0


async def sizes(lmcache: Lmcache, salt: str, tokens: list[int]) -> list[dict[str, int]]:
    """Per whole chunk: tier -> bytes the MP server holds it in, per the coordinator."""
    body = {
        "model_name": lmcache.model_name,
        "world_size": 1,
        "token_ids": tokens,
        "cache_salt": salt,
    }
    async with httpx.AsyncClient(base_url=lmcache.coordinator_url, timeout=10) as client:
        response = await client.post("/directory/lookup", json=body)
        response.raise_for_status()
    return [
        {p["tier"]: p["size_bytes"] for p in result["placements"]}
        for result in response.json()["results"]
    ]


async def chunk_keys(lmcache: Lmcache, salt: str, tokens: list[int]) -> list[dict[str, object]]:
    """The object keys of the whole chunks, as the coordinator's directory names them."""
    body = {
        "model_name": lmcache.model_name,
        "world_size": 1,
        "token_ids": tokens,
        "cache_salt": salt,
    }
    async with httpx.AsyncClient(base_url=lmcache.coordinator_url, timeout=10) as client:
        response = await client.post("/directory/lookup", json=body)
        response.raise_for_status()
    return [dict(result["key"]) for result in response.json()["results"]]


async def server_url(lmcache: Lmcache) -> str:
    """The MP server's admin HTTP, from the coordinator's membership."""
    async with httpx.AsyncClient(base_url=lmcache.coordinator_url, timeout=10) as client:
        members = (await client.get("/instances")).json()["instances"]
    server = next(m for m in members if m["instance_id"] == lmcache.instance_id)
    return f"http://{server['ip']}:{server['http_port']}"


async def until(
    expected: list[dict[str, int]], lmcache: Lmcache, salt: str, tokens: list[int]
) -> None:
    last = None
    for _ in range(int(SETTLE_SECONDS / 0.2)):
        last = await sizes(lmcache, salt, tokens)
        if last == expected:
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"expected {expected}, the coordinator says {last}")


async def test_an_fp8_l2_holds_a_session_in_half_the_bytes_and_gives_it_back(
    tmp_path: Path,
) -> None:
    serde = {"type": "fp8"}
    l2: dict[str, object] = {"type": "fs", "base_path": str(tmp_path / "l2"), "serde": serde}
    with lmcache_at(tmp_path, l2) as lmcache:
        writer = ChunkWriter(lmcache)
        coordinator = LmcacheCoordinator(lmcache.coordinator_url)
        where = LmcacheEndpoint(lmcache.coordinator_url, lmcache.instance_id, lmcache.model_name)
        try:
            salt, tokens = "compress-salt", list(range(7000, 7000 + 2 * CHUNK))
            assert writer.store(salt, tokens) == 2
            full, compressed = {"l1": L1_CHUNK_BYTES}, {"l2": L1_CHUNK_BYTES // 2}
            await until([full | compressed] * 2, lmcache, salt, tokens)

            # The first chunk is a pinned system prompt: only the second leaves L1.
            await coordinator.pin(where, salt, tokens[:CHUNK])
            keys = await chunk_keys(lmcache, salt, tokens)
            async with httpx.AsyncClient(base_url=await server_url(lmcache), timeout=10) as server:
                unpinned = {"keys": keys[1:], "tier": "l1"}
                deleted = await server.request("DELETE", "/cache/objects", json=unpinned)
                deleted.raise_for_status()
            await until([full | compressed, compressed], lmcache, salt, tokens)

            request_id = await coordinator.prefetch(where, salt, tokens)
            assert await coordinator.prefetch_done(where, request_id) == (2, 2)
            await until([full | compressed] * 2, lmcache, salt, tokens)

            # The coordinator's L1 delete takes the pinned chunk too.
            body = {
                "instance_id": lmcache.instance_id,
                "model_name": lmcache.model_name,
                "world_size": 1,
                "token_ids": tokens,
                "cache_salt": salt,
                "tier": "l1",
                "force": False,
            }
            async with httpx.AsyncClient(base_url=lmcache.coordinator_url, timeout=10) as client:
                deleted = await client.post("/cache/delete", json=body)
                deleted.raise_for_status()
            assert (deleted.json()["affected"], deleted.json()["skipped"]) == (2, 0)
            await until([compressed] * 2, lmcache, salt, tokens)
            await coordinator.unpin(where, salt, tokens[:CHUNK])
        finally:
            await coordinator.close()
            writer.close()
