"""vLLM's own KVCacheManager doing what one Admit+Release does: a Request with its block hasher,
get_computed_blocks, allocate_slots for prompt + max_output, free. Run with the engines' Python
(it imports vllm); prints the mean seconds per pair as JSON. The reference for the state
machine's in-process cost (bench/state_machine.py)."""

from __future__ import annotations

import json
import sys
import time

import torch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request


def main() -> None:
    blocks, block_size, prompt, output, pairs = (int(a) for a in sys.argv[1:6])
    init_none_hash(sha256)
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=8, head_size=128, dtype=torch.float16
    )
    config = KVCacheConfig(blocks, [], [KVCacheGroupSpec(["layer.0"], spec)])
    manager = KVCacheManager(config, 1 << 20, block_size, block_size, enable_caching=True)
    hasher = get_request_block_hasher(block_size, sha256)
    token_ids = list(range(prompt))

    def pair(i: int) -> None:
        request = Request(
            f"r{i}",
            token_ids,
            SamplingParams(max_tokens=output),
            None,
            cache_salt="salt",
            block_hasher=hasher,
        )
        computed, hit_tokens, _ = manager.get_computed_blocks(request)
        allocated = manager.allocate_slots(
            request, prompt + output - hit_tokens, hit_tokens, computed
        )
        assert allocated is not None
        manager.free(request)

    for i in range(200):
        pair(i)
    start = time.perf_counter()
    for i in range(pairs):
        pair(i)
    print(json.dumps({"seconds_per_pair": (time.perf_counter() - start) / pairs}))


if __name__ == "__main__":
    main()
