"""Following one engine's KV-event stream: a SUB socket for live batches, a DEALER for replay.

Sequence numbers let the subscriber see what it missed: a gap is filled by asking the engine's
replay socket for everything from the first missing number (a DEALER, since the replay answers
with many messages and an end marker). The engine cannot fill a gap older than its buffer, and a
sequence that goes back means the engine restarted (vLLM numbers from 0 again, with no epoch);
both mean the ledger must resynchronise this instance from empty.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import zmq
import zmq.asyncio

from quota_service.core.kv_events import EventBatch
from quota_service.engine.vllm.events import decode_batch

log = logging.getLogger(__name__)

END_OF_REPLAY = -1
REPLAY_TIMEOUT_MS = 5000


@dataclass(frozen=True, slots=True)
class Received:
    seq: int
    batch: EventBatch
    replayed: bool


@dataclass(frozen=True, slots=True)
class Resync:
    """What the engine holds is unknown past this point: start again from empty. `restarted`:
    the engine itself started again, so the work it was running is lost too."""

    reason: str
    seq: int
    restarted: bool


Item = Received | Resync


def _seq(frame: bytes) -> int:
    return int.from_bytes(frame, "big", signed=True)


class Subscriber:
    def __init__(self, endpoint: str, replay_endpoint: str | None, topic: str = "") -> None:
        self._context = zmq.asyncio.Context.instance()
        self._endpoint = endpoint
        self._replay_endpoint = replay_endpoint
        self._topic = topic.encode()
        self._sub: zmq.asyncio.Socket | None = None
        self.expected: int | None = None

    def connect(self) -> None:
        """Subscribe now, so nothing published from here on is missed."""
        if self._sub is None:
            self._sub = self._context.socket(zmq.SUB)
            self._sub.setsockopt(zmq.SUBSCRIBE, self._topic)
            self._sub.connect(self._endpoint)

    def close(self) -> None:
        if self._sub is not None:
            self._sub.close(linger=0)
            self._sub = None

    async def items(self) -> AsyncIterator[Item]:
        """Batches in sequence order, with gaps filled from the replay buffer, or a Resync."""
        self.connect()
        assert self._sub is not None
        while True:
            _, seq_frame, payload = await self._sub.recv_multipart()
            seq = _seq(seq_frame)
            if self.expected is not None and seq < self.expected:
                reason = f"sequence went back from {self.expected} to {seq}: engine restarted"
                yield Resync(reason, seq, restarted=True)
            elif self.expected is not None and seq > self.expected:
                async for item in self._fill(self.expected, seq):
                    yield item
            self.expected = seq + 1
            yield Received(seq, decode_batch(payload), replayed=False)

    async def _fill(self, first_missing: int, next_live: int) -> AsyncIterator[Item]:
        """Replay [first_missing, next_live) from the engine's buffer."""
        replayed = [r async for r in self.replay(first_missing)]
        wanted = [r for r in replayed if r.seq < next_live]
        if not wanted or wanted[0].seq != first_missing:
            reason = f"batches {first_missing}..{next_live - 1} are gone from the replay buffer"
            yield Resync(reason, next_live, restarted=False)
            return
        for item in wanted:
            yield item

    async def replay(self, start: int) -> AsyncIterator[Received]:
        """Every batch the engine still buffers with a sequence number >= start."""
        if self._replay_endpoint is None:
            return
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVTIMEO, REPLAY_TIMEOUT_MS)
        dealer.connect(self._replay_endpoint)
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                _, _, seq_frame, payload = await dealer.recv_multipart()
                seq = _seq(seq_frame)
                if seq == END_OF_REPLAY:
                    return
                yield Received(seq, decode_batch(payload), replayed=True)
        finally:
            dealer.close(linger=0)
