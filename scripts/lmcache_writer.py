"""Store KV chunks into a running LMCache MP server the way a vLLM worker does, on the CPU, for
the CPU-tier contract tests: what the server stores is reported to its coordinator, so it shows
in the coordinator's directory, usage and quotas. It also retrieves them the way LMCache's vLLM
connector (LMCacheMPConnector) serves a request's prefix: a lookup, which brings the chunks
back from L2 into L1 when they are only there, the number of tokens it found, then a retrieve
into the engine's paged KV blocks.

Run with LMCache's Python (it needs lmcache and torch):
    .venv-lmcache/bin/python scripts/lmcache_writer.py --rpc tcp://127.0.0.1:5555 --model M
It registers as one rank-0 worker of a world-size-1 engine (a small paged KV cache in CPU
tensors, shared with the server through POSIX shared memory), prints {"ready": true}, then reads
JSON lines {"salt": S, "token_ids": [...]} from stdin and stores each sequence's whole chunks,
answering {"stored": bool, "chunks": n}. A line with "retrieve": true instead looks the sequence
up (its last token left out, as vLLM never takes that one from a cache) and retrieves what was
found into other blocks, answering {"hit_tokens": n, "retrieved": bool, "exact": bool,
"fp8_round_trip": bool}: whether the retrieved KV equals, bit for bit, what this process stored
for those chunks, or that cast to float8_e4m3fn and back (what an fp8 serde gives). It stays
registered until stdin closes (a prefetch needs the model's layout registered), then unregisters.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import uuid
from typing import Any

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
    # One engine block per chunk; block 0 is the engine's null block. Stores read blocks
    # 1..max_chunks, retrieves write the blocks after them.
    kv_caches = {
        f"model.layers.{i}.self_attn.attn": torch.randn(
            (2, 2 * args.max_chunks + 1, chunk, HEADS, HEAD_SIZE), dtype=torch.float16
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
            if asked.get("retrieve"):
                found = retrieve(client, transfer, kv_caches, args, asked["salt"], tokens)
                print(json.dumps(found), flush=True)
                continue
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


def retrieve(
    client: Any,
    transfer: Any,
    kv_caches: dict[str, torch.Tensor],
    args: argparse.Namespace,
    salt: str,
    tokens: list[int],
) -> dict[str, object]:
    """Look `tokens` up and retrieve the chunks found, as LMCacheMPConnector does for a
    request (its scheduler side: lookup, then the prefetch's status; its worker side: a
    retrieve into the blocks vLLM allocated), and compare what came back."""
    chunk = args.chunk_size
    request_id = uuid.uuid4().hex
    aligned = min((len(tokens) - 1) // chunk, args.max_chunks) * chunk

    def key(end: int, worker_id: int | None) -> IPCCacheServerKey:
        return IPCCacheServerKey(
            model_name=args.model,
            world_size=1,
            worker_id=worker_id,
            token_ids=tuple(tokens),
            start=0,
            end=end,
            request_id=request_id,
            cache_salt=salt,
            num_kv_readers=1,
        )

    client.lookup(key(aligned, None), 1).result(timeout=TIMEOUT_SECONDS)
    hit = client.wait_prefetch_status(request_id, TIMEOUT_SECONDS).result(timeout=TIMEOUT_SECONDS)
    chunks = int(hit or 0)
    retrieved = exact = fp8_round_trip = False
    if chunks:
        source = list(range(1, chunks + 1))
        target = list(range(args.max_chunks + 1, args.max_chunks + 1 + chunks))
        for cache in kv_caches.values():
            cache[:, target] = 0
        event = transfer.create_recorded_event()
        retrieved = bool(
            transfer.submit_retrieve(
                request_id, key(chunks * chunk, 0), kv_caches, [target], event, 1
            ).result(timeout=TIMEOUT_SECONDS)
        )
        got = [cache[:, target] for cache in kv_caches.values()]
        stored = [cache[:, source] for cache in kv_caches.values()]
        exact = all(torch.equal(g, s) for g, s in zip(got, stored, strict=True))
        fp8_round_trip = all(
            torch.equal(g, s.to(torch.float8_e4m3fn).to(s.dtype))
            for g, s in zip(got, stored, strict=True)
        )
    client.end_session(request_id).result(timeout=TIMEOUT_SECONDS)
    return {
        "hit_tokens": chunks * chunk,
        "retrieved": retrieved,
        "exact": exact,
        "fp8_round_trip": fp8_round_trip,
    }


if __name__ == "__main__":
    main()
