"""A simulated GPU host: an in-process model of vLLM's block pool that publishes real vLLM-format
KV-cache events over ZMQ (PUB for live batches, ROUTER for replay). For the demo, fast tests and
benchmarks; never instead of the contract tests against real vLLM.

The pool follows vLLM's rules (ENGINES.md): block 0 is a null block; free blocks without a hash
are reused first, then cached ones least recently freed first; a request's blocks are freed tail
first; a prefix hit on a cached block takes it out of the free queue; full blocks are hashed with
the same chained hashes, the cache salt on the first block only.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio

from quota_service.core.hashing import HashAlgo, block_hashes, event_hash

REPLAY_BUFFER_BATCHES = 10_000
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


@dataclass
class _Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None


@dataclass
class SimulatedPool:
    """vLLM's BlockPool in miniature; returns the events each operation makes."""

    num_blocks: int
    block_size: int
    algo: HashAlgo = HashAlgo.SHA256
    blocks: list[_Block] = field(default_factory=list)
    # Free blocks in eviction order: unhashed ones are taken first, then cached ones (LRU first).
    free_unhashed: deque[int] = field(default_factory=deque)
    free_cached: OrderedDict[int, None] = field(default_factory=OrderedDict)
    cached: dict[int, int] = field(default_factory=dict)  # hash -> block id
    requests: dict[str, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.blocks = [_Block(i) for i in range(self.num_blocks)]
        self.free_unhashed = deque(range(1, self.num_blocks))  # block 0 is the null block

    @property
    def free_blocks(self) -> int:
        return len(self.free_unhashed) + len(self.free_cached)

    def admit(
        self, request_id: str, prompt: Sequence[int], output_tokens: int, salt: str | None
    ) -> list[dict[str, object]] | None:
        """Place a request (prompt and output) in the pool; None when it does not fit."""
        hashes = [event_hash(h) for h in block_hashes(prompt, self.block_size, salt, self.algo)]
        hits = []
        for h in hashes:
            if h not in self.cached:
                break
            hits.append(self.cached[h])
        total = -(-(len(prompt) + output_tokens) // self.block_size)
        reusable = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        if total - len(hits) > self.free_blocks - reusable:
            return None
        events: list[dict[str, object]] = []
        table = []
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                self.free_cached.pop(block_id, None)
            block.ref_count += 1
            table.append(block_id)
        stored = []
        for position in range(len(hits), total):
            block_id, evicted = self._take_free()
            if evicted is not None:
                events.append({"type": "BlockRemoved", "block_hashes": [evicted], "medium": "GPU"})
            block = self.blocks[block_id]
            block.ref_count = 1
            if position < len(hashes):  # a full prompt block: hashed and cached from now on
                block.hash = hashes[position]
                self.cached[block.hash] = block_id
                stored.append(block.hash)
            table.append(block_id)
        if stored:
            start = len(hits) * self.block_size
            events.append(
                {
                    "type": "BlockStored",
                    "block_hashes": stored,
                    "parent_block_hash": hashes[len(hits) - 1] if hits else None,
                    "token_ids": list(prompt[start : start + len(stored) * self.block_size]),
                    "block_size": self.block_size,
                    "medium": "GPU",
                }
            )
        self.requests[request_id] = table
        return events

    def finish(self, request_id: str) -> None:
        """Free a request's blocks tail first (finishing emits no event: they stay cached)."""
        for block_id in reversed(self.requests.pop(request_id, [])):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is None:
                    self.free_unhashed.append(block_id)
                else:
                    self.free_cached[block_id] = None

    def _take_free(self) -> tuple[int, int | None]:
        if self.free_unhashed:
            return self.free_unhashed.popleft(), None
        block_id, _ = self.free_cached.popitem(last=False)
        block = self.blocks[block_id]
        evicted, block.hash = block.hash, None
        assert evicted is not None
        del self.cached[evicted]
        return block_id, evicted


class EventPublisher:
    """vLLM's ZMQ publisher: [topic, seq (8 bytes, big-endian), msgpack batch] on a PUB socket,
    and a ROUTER that replays buffered batches from a sequence number, then an end marker."""

    def __init__(self, events_endpoint: str, replay_endpoint: str, topic: str = "kv") -> None:
        context = zmq.asyncio.Context.instance()
        self._pub = context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self._pub.bind(events_endpoint)
        self._replay = context.socket(zmq.ROUTER)
        self._replay.bind(replay_endpoint)
        self._topic = topic.encode()
        self._seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=REPLAY_BUFFER_BATCHES)
        self._encoder = msgspec.msgpack.Encoder()
        self._replaying = asyncio.create_task(self._serve_replays())

    @property
    def seq(self) -> int:
        return self._seq

    async def publish(self, events: list[dict[str, object]]) -> None:
        payload = self._encoder.encode([time.time(), events, 0])
        await self._pub.send_multipart([self._topic, self._seq.to_bytes(8, "big"), payload])
        self._buffer.append((self._seq, payload))
        self._seq += 1

    async def _serve_replays(self) -> None:
        while True:
            client, _, start = await self._replay.recv_multipart()
            first = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= first:
                    await self._replay.send_multipart(
                        [client, b"", self._topic, seq.to_bytes(8, "big"), payload]
                    )
            await self._replay.send_multipart([client, b"", b"", END_OF_REPLAY, b""])

    def close(self) -> None:
        self._replaying.cancel()
        self._pub.close(linger=0)
        self._replay.close(linger=0)
