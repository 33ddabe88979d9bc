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

    def reset(self) -> bool:
        """vLLM's reset_prefix_cache: only when no block is in use; every cached block is freed."""
        if any(block.ref_count for block in self.blocks[1:]):
            return False
        for block_id in self.free_cached:
            self.blocks[block_id].hash = None
            self.free_unhashed.append(block_id)
        self.free_cached.clear()
        self.cached.clear()
        return True

    @property
    def usage(self) -> float:
        """vllm:kv_cache_usage_perc: blocks with references, of the usable ones."""
        return sum(1 for b in self.blocks[1:] if b.ref_count) / (self.num_blocks - 1)

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
        # The endpoints as bound ("tcp://127.0.0.1:*" picks a free port).
        self.events_endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
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


@dataclass
class _Running:
    aborted: asyncio.Event = field(default_factory=asyncio.Event)


class SimulatedHost:
    """The simulated engine as vLLM serves it: the OpenAI completions endpoint (token-id prompts),
    /metrics, /v1/models, /health, and the dev-mode /abort_requests and /reset_prefix_cache,
    with generation paced at `tokens_per_second`; its pool publishes vLLM-format events."""

    def __init__(
        self,
        pool: SimulatedPool,
        publisher: EventPublisher,
        model: str = "simulated",
        tokens_per_second: float = 1000.0,
    ) -> None:
        self.pool = pool
        self.publisher = publisher
        self.model = model
        self.tokens_per_second = tokens_per_second
        self.running: dict[str, _Running] = {}
        self._room = asyncio.Event()
        self._server: asyncio.Server | None = None

    @property
    def max_model_len(self) -> int:
        return (self.pool.num_blocks - 1) * self.pool.block_size

    async def serve(self, host: str, port: int) -> int:
        """Listen on host:port (0: any free port); returns the port."""
        self._server = await asyncio.start_server(self._connection, host, port)
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        self.publisher.close()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request_line = (await reader.readline()).decode()
            headers = {}
            while (line := (await reader.readline()).decode().strip()) != "":
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            method, path, _ = request_line.split(" ", 2)
            status, content_type, payload = await self._route(method, path, body)
        except (ValueError, KeyError, asyncio.IncompleteReadError) as exc:
            status, content_type, payload = 400, "text/plain", str(exc).encode()
        writer.write(
            f"HTTP/1.1 {status} {_REASONS.get(status, 'OK')}\r\n"
            f"content-type: {content_type}\r\ncontent-length: {len(payload)}\r\n"
            "connection: close\r\n\r\n".encode()
            + payload
        )
        await writer.drain()
        writer.close()

    async def _route(self, method: str, path: str, body: bytes) -> tuple[int, str, bytes]:
        path = path.split("?", 1)[0]
        if (method, path) == ("GET", "/health"):
            return 200, "text/plain", b""
        if (method, path) == ("GET", "/metrics"):
            return 200, "text/plain; version=0.0.4", self._metrics().encode()
        if (method, path) == ("GET", "/v1/models"):
            card = {"id": self.model, "object": "model", "max_model_len": self.max_model_len}
            return 200, "application/json", msgspec.json.encode({"data": [card]})
        if (method, path) == ("POST", "/v1/completions"):
            return 200, "application/json", msgspec.json.encode(await self._complete(body))
        if (method, path) == ("POST", "/abort_requests"):
            ids = msgspec.json.decode(body).get("request_ids") or list(self.running)
            aborted = [rid for rid in ids if rid in self.running]
            for rid in aborted:
                self.running[rid].aborted.set()
            return 200, "application/json", msgspec.json.encode({"aborted": len(aborted)})
        if (method, path) == ("POST", "/reset_prefix_cache"):
            success = self.pool.reset()
            if success:
                await self.publisher.publish([{"type": "AllBlocksCleared"}])
            return 200, "application/json", msgspec.json.encode({"success": success})
        return 404, "text/plain", b"not found"

    async def _complete(self, body: bytes) -> dict[str, object]:
        request = msgspec.json.decode(body)
        prompt = list(request["prompt"])
        max_tokens = int(request.get("max_tokens") or 16)
        engine_id = f"cmpl-{request.get('request_id') or id(request)}-0"
        salt = request.get("cache_salt")
        while (events := self.pool.admit(engine_id, prompt, max_tokens, salt)) is None:
            self._room.clear()  # vLLM would queue it: wait until a request finishes
            await self._room.wait()
        if events:
            await self.publisher.publish(events)
        running = self.running[engine_id] = _Running()
        started = time.monotonic()
        finish = "length"
        try:
            await asyncio.wait_for(running.aborted.wait(), max_tokens / self.tokens_per_second)
            finish = "abort"
        except TimeoutError:
            pass
        finally:
            del self.running[engine_id]
            self.pool.finish(engine_id)
            self._room.set()
        generated = min(max_tokens, int((time.monotonic() - started) * self.tokens_per_second))
        return {
            "id": engine_id.removesuffix("-0"),
            "object": "text_completion",
            "model": self.model,
            "choices": [{"index": 0, "text": "", "finish_reason": finish}],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": generated},
        }

    def _metrics(self) -> str:
        labels = (
            f'block_size="{self.pool.block_size}",engine="0",'
            f'num_gpu_blocks="{self.pool.num_blocks}",'
            f'prefix_caching_hash_algo="{self.pool.algo.value}"'
        )
        return "\n".join(
            [
                "# TYPE vllm:cache_config_info gauge",
                f"vllm:cache_config_info{{{labels}}} 1.0",
                "# TYPE vllm:num_requests_running gauge",
                f'vllm:num_requests_running{{engine="0"}} {len(self.running)}',
                "# TYPE vllm:num_requests_waiting gauge",
                'vllm:num_requests_waiting{engine="0"} 0',
                "# TYPE vllm:kv_cache_usage_perc gauge",
                f'vllm:kv_cache_usage_perc{{engine="0"}} {self.pool.usage}',
                "",
            ]
        )


_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found"}
