"""Store KV chunks into a running LMCache MP server the way a vLLM worker does, on the CPU, for
the CPU-tier contract tests: what the server stores is reported to its coordinator, so it shows
in the coordinator's directory, usage and quotas.

Run with LMCache's Python (it needs lmcache and torch):
    .venv-lmcache/bin/python scripts/lmcache_writer.py --rpc tcp://127.0.0.1:5555 --model M
It registers as one rank-0 worker of a world-size-1 engine (a small paged KV cache in CPU
tensors, shared with the server through POSIX shared memory), prints {"ready": true}, then reads
JSON lines {"salt": S, "token_ids": [...]} from stdin and stores each sequence's whole chunks,
answering {"stored": bool, "chunks": n}. It stays registered until stdin closes (a prefetch
needs the model's layout registered), then unregisters.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import uuid

import torch
import zmq
from lmcache.utils import EngineType
from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey
from lmcache.v1.multiprocess.group_view import EngineGroupInfo
from lmcache.v1.multiprocess.transfer_context import create_transfer_context
from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

TIMEOUT_SECONDS = 30.0
LAYERS, HEADS, HEAD_SIZE = 2, 1, 8  # 16 KiB a 256-token chunk in fp16


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rpc", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--max-chunks", type=int, default=16)
    args = parser.parse_args()
    chunk = args.chunk_size
    # One engine block per chunk; block 0 is the engine's null block.
    kv_caches = {
        f"model.layers.{i}.self_attn.attn": torch.randn(
            (2, args.max_chunks + 1, chunk, HEADS, HEAD_SIZE), dtype=torch.float16
        )
        for i in range(LAYERS)
    }
    context = zmq.Context()
    context.setsockopt(zmq.LINGER, 0)
    client = RequestClientFactory.create(args.rpc, context=context)
    # The server keeps a worker's layout by its id: a fresh id per process, never reused.
    transfer = create_transfer_context(
        kv_caches, mode="lmcache_driven", instance_id=os.getpid(), req_client=client
    )
    transfer.register(
        kv_caches,
        args.model,
        1,
        1,
        TIMEOUT_SECONDS,
        layout_hints={"kv_layout": "NHD"},
        engine_group_infos=[
            EngineGroupInfo(
                engine_group_id=0, layer_indices=tuple(range(LAYERS)), tokens_per_block=chunk
            )
        ],
        engine_type=EngineType.VLLM,
    )
    print(json.dumps({"ready": True}), flush=True)
    try:
        for line in sys.stdin:
            asked = json.loads(line)
            tokens = [int(t) for t in asked["token_ids"]]
            chunks = min(len(tokens) // chunk, args.max_chunks)
            stored = True
            if chunks:
                request_id = uuid.uuid4().hex
                key = IPCCacheServerKey(
                    model_name=args.model,
                    world_size=1,
                    worker_id=0,
                    token_ids=tuple(tokens),
                    start=0,
                    end=chunks * chunk,
                    request_id=request_id,
                    cache_salt=asked["salt"],
                    num_kv_readers=1,
                )
                event = transfer.create_recorded_event()
                blocks = [list(range(1, chunks + 1))]
                stored = bool(
                    transfer.submit_store(request_id, key, kv_caches, blocks, event, 1).result(
                        timeout=TIMEOUT_SECONDS
                    )
                )
                # An open session would hold read locks on what it stored.
                client.end_session(request_id).result(timeout=TIMEOUT_SECONDS)
            print(json.dumps({"stored": stored, "chunks": chunks}), flush=True)
    finally:
        unregistered = transfer.unregister()
        if unregistered is not None:
            unregistered.result(timeout=TIMEOUT_SECONDS)
        transfer.close()
        client.close()
        context.term()


if __name__ == "__main__":
    main()
