"""What the gateway tests send and what they read back: OpenAI calls through a gateway, vLLM's
metrics, and kvquota's record of a reservation."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvquota.client import AsyncKvquotaClient
from kvquota.v1 import admin_pb2, admission_pb2, resources_pb2
from tests.engines.conftest import MAX_MODEL_LEN, Engine
from tests.gateways.conftest import INSTANCE

# A generation long enough to outlast its being cut off: it never stops early by itself.
LONG_TOKENS = MAX_MODEL_LEN // 2
LONG: dict[str, object] = {"max_tokens": LONG_TOKENS, "ignore_eos": True}


def prompt_text() -> str:
    """A system prompt no other test sends (vLLM's prefix cache outlives a test), long enough
    for full blocks."""
    words = " ".join(f"note{uuid.uuid4().hex[:6]}" for _ in range(12))
    return f"You are a helpful assistant. Remember these notes: {words}. " * 2


def chat(
    system: str, question: str = "What is the capital of France?", /, **extra: Any
) -> dict[str, Any]:
    return {
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ],
        **extra,
    }


@dataclass
class Streamed:
    status: int
    headers: httpx.Headers
    events: list[dict[str, Any]] = field(default_factory=list)
    body: bytes = b""

    @property
    def usage(self) -> dict[str, int]:
        usages = [e["usage"] for e in self.events if e.get("usage")]
        assert usages, "no usage in the stream"
        return dict(usages[-1])


async def stream_chat(
    url: str,
    headers: dict[str, str],
    body: dict[str, Any],
    stop_after_events: int | None = None,
    then: Callable[[], object] | None = None,
) -> Streamed:
    """Stream a chat completion. With `stop_after_events`: after that many events go away, or,
    given `then`, call it and read on to wherever the stream ends (a reset included)."""
    async with (
        httpx.AsyncClient(timeout=120) as client,
        client.stream(
            "POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, headers=headers
        ) as response,
    ):
        streamed = Streamed(response.status_code, response.headers)
        if response.status_code != 200:
            streamed.body = await response.aread()
            return streamed
        lines = response.aiter_lines()
        async for line in lines:
            if line.startswith("data: {"):
                streamed.events.append(json.loads(line.removeprefix("data: ")))
                if len(streamed.events) == stop_after_events:
                    if then is None:
                        return streamed  # leaving the block closes the connection mid-stream
                    then()
                    with contextlib.suppress(httpx.HTTPError):
                        async for _ in lines:
                            pass
                    return streamed
    return streamed


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        match = re.match(rf"^{re.escape(name)}\{{(.*)\}} (\S+)$", line)
        if match and all(f'{k}="{v}"' in match.group(1) for k, v in labels.items()):
            total += float(match.group(2))
    return total


async def engine_metrics(engine: Engine) -> str:
    async with httpx.AsyncClient(timeout=10) as client:
        return (await client.get(f"{engine.base_url}/metrics")).text


async def reservation(
    kvquota: AsyncKvquotaClient, tenant: str, request_id: str
) -> resources_pb2.Reservation:
    return await kvquota.admission.GetReservation(
        admission_pb2.GetReservationRequest(name=f"tenants/{tenant}/reservations/{request_id}")
    )


async def ended(
    kvquota: AsyncKvquotaClient, tenant: str, request_id: str, seconds: float = 30
) -> resources_pb2.Reservation:
    """The reservation once it has ended (its lease may have to run out first)."""
    for _ in range(int(seconds * 10)):
        held = await reservation(kvquota, tenant, request_id)
        if held.state == resources_pb2.RESERVATION_STATE_ENDED:
            return held
        await asyncio.sleep(0.1)
    raise AssertionError(f"{request_id} did not end: {held}")


async def blocks_in_use(kvquota: AsyncKvquotaClient) -> int:
    instance = await kvquota.admin.GetInstance(
        admin_pb2.GetInstanceRequest(name=f"instances/{INSTANCE}")
    )
    return instance.blocks_in_use


async def until_engine_idle(engine: Engine, seconds: float = 30) -> str:
    """vLLM's metrics once it runs nothing (an abort or a finish has reached the engine)."""
    for _ in range(int(seconds * 10)):
        text = await engine_metrics(engine)
        if metric(text, "vllm:num_requests_running") == 0:
            return text
        await asyncio.sleep(0.1)
    raise AssertionError("vLLM still runs a request")


async def cut_long_stream(
    engine: Engine,
    kvquota: AsyncKvquotaClient,
    url: str,
    headers: dict[str, str],
    request_id: Callable[[Streamed], str],
    end_reason: int,
    then: Callable[[], object] | None = None,
) -> None:
    """Stream a long generation of tenant acme and cut it after three events: the client goes
    away, or `then` kills a gateway process. The reservation must end with `end_reason`, the
    engine stop the generation early, and no block stay in use."""
    generated = metric(await engine_metrics(engine), "vllm:generation_tokens_total")
    body = chat(prompt_text(), model=engine.model, **LONG)
    cut = await stream_chat(url, headers, body, stop_after_events=3, then=then)
    held = await ended(kvquota, "acme", request_id(cut))
    assert held.end_reason == end_reason
    after = await until_engine_idle(engine)
    # Stopped, not finished: it would have generated all its tokens (ignore_eos).
    assert metric(after, "vllm:generation_tokens_total") - generated < LONG_TOKENS
    assert await blocks_in_use(kvquota) == 0
