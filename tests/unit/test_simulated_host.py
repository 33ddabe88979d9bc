"""The simulated host follows vLLM's block pool rules and speaks vLLM's wire format."""

from __future__ import annotations

import asyncio
import socket

from quota_service.core.hashing import block_hashes, event_hash
from quota_service.core.kv_events import BlockRemoved, BlockStored
from quota_service.engine.simulated import EventPublisher, SimulatedPool
from quota_service.engine.vllm.subscriber import Received, Subscriber

BS = 4


def test_pool_rules() -> None:
    pool = SimulatedPool(num_blocks=7, block_size=BS)  # 6 usable: block 0 is the null block
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9]  # 2 full blocks + a partial one
    events = pool.admit("a", a, output_tokens=3, salt="s")
    assert events is not None
    assert pool.requests["a"] == [1, 2, 3]
    stored = [e for e in events if e["type"] == "BlockStored"]
    assert stored[0]["block_hashes"] == [event_hash(h) for h in block_hashes(a, BS, "s")]
    pool.finish("a")  # tail first: block 3 (unhashed) is reused first, then 2, then 1
    assert list(pool.free_unhashed)[-1] == 3
    hit = pool.admit("b", a[:8], output_tokens=1, salt="s")
    assert hit == [] and pool.requests["b"][:2] == [1, 2]  # a prefix hit stores nothing new
    pool.finish("b")
    assert pool.admit("too-big", list(range(100, 124)), output_tokens=8, salt=None) is None
    # Filling the pool evicts cached blocks least recently freed first (b's tail before its head).
    events = pool.admit("c", list(range(100, 120)), output_tokens=4, salt=None)
    assert events is not None
    removed = [e["block_hashes"][0] for e in events if e["type"] == "BlockRemoved"]  # type: ignore[index]
    assert removed == [event_hash(h) for h in reversed(block_hashes(a[:8], BS, "s"))]


async def test_publisher_speaks_vllms_wire_format_and_replays() -> None:
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    publisher = EventPublisher(f"tcp://127.0.0.1:{ports[0]}", f"tcp://127.0.0.1:{ports[1]}")
    subscriber = Subscriber(f"tcp://127.0.0.1:{ports[0]}", f"tcp://127.0.0.1:{ports[1]}")
    subscriber.connect()
    await asyncio.sleep(0.2)
    pool = SimulatedPool(num_blocks=9, block_size=BS)
    for i in range(6):
        events = pool.admit(f"r{i}", [i * 10 + t for t in range(8)], 1, None)
        assert events is not None
        await publisher.publish(events)
        pool.finish(f"r{i}")
    received: list[Received] = []

    async def read() -> None:
        async for item in subscriber.items():
            assert isinstance(item, Received)
            received.append(item)

    task = asyncio.create_task(read())
    await asyncio.sleep(0.3)
    task.cancel()
    kinds = [type(e) for r in received for e in r.batch.events]
    assert [r.seq for r in received] == list(range(6))
    assert BlockStored in kinds and BlockRemoved in kinds
    replayed = [r.seq async for r in subscriber.replay(2)]
    assert replayed == [2, 3, 4, 5]
    subscriber.close()
    publisher.close()
