"""Write the block-hash vectors that tests/unit/test_hashing.py checks kvquota against.

Run it with vLLM installed (the engine contract tests run it live):
    python scripts/vllm_hash_vectors.py --out tests/data/vllm_block_hashes.json
Hashes come from vLLM's own code path: a real `vllm.v1.request.Request` with the cache salt,
hashed by `get_request_block_hasher` after `init_none_hash`, as the engine does for every request.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path

# Must precede vLLM's imports: NONE_HASH depends on it (an engine with it set hashes differently).
os.environ.pop("PYTHONHASHSEED", None)

from vllm import SamplingParams, __version__
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils
from vllm.v1.request import Request

SEQUENCES = {
    "short": list(range(1, 70)),
    "random": random.Random(2026).choices(range(32000), k=200),
    "exact": [7] * 64,
}
SALTS = [None, "tenantA", "ZmFrZS1zYWx0LWZvci10ZXN0cw"]


def vectors() -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for algo in ("sha256", "sha256_cbor"):
        hash_fn = get_hash_fn_by_name(algo)
        kv_cache_utils.init_none_hash(hash_fn)
        for block_size in (16, 32):
            hasher = kv_cache_utils.get_request_block_hasher(block_size, hash_fn)
            for name, tokens in SEQUENCES.items():
                for salt in SALTS:
                    request = Request(
                        request_id=f"{name}-{block_size}-{salt}",
                        prompt_token_ids=tokens,
                        sampling_params=SamplingParams(max_tokens=1),
                        pooling_params=None,
                        cache_salt=salt,
                        block_hasher=hasher,
                    )
                    rows.append(
                        {
                            "algo": algo,
                            "block_size": block_size,
                            "sequence": name,
                            "cache_salt": salt,
                            "token_ids": tokens,
                            "hashes": [bytes(h).hex() for h in request.block_hashes],
                        }
                    )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    document = {"vllm_version": __version__, "vectors": vectors()}
    args.out.write_text(json.dumps(document, indent=1) + "\n")
    print(f"wrote {len(document['vectors'])} vectors from vLLM {__version__} to {args.out}")


if __name__ == "__main__":
    main()
