"""kvquota's plugin in a real LiteLLM proxy, in front of a real vLLM."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx

from kvquota.client import AsyncKvquotaClient
from kvquota.v1 import resources_pb2 as pb
from tests.engines.conftest import MAX_MODEL_LEN, stop_vllm
from tests.gateways.calls import (
    Streamed,
    chat,
    cut_long_stream,
    ended,
    engine_metrics,
    metric,
    prompt_text,
    reservation,
    stream_chat,
)
from tests.gateways.conftest import Stack, gateway_config, start_litellm
from tests.gateways.test_envoy import admit_directly, cancel
from tests.integration.grpc_helpers import free_port

ACME = {"authorization": "Bearer acme-key"}
CALL_ID = "x-litellm-call-id"


def call_id(streamed: Streamed) -> str:
    """LiteLLM's call id, which the plugin admits under and vLLM runs the request as."""
    return streamed.headers[CALL_ID]


async def test_a_streamed_chat_is_admitted_salted_and_released(
    stack: Stack, kvquota: AsyncKvquotaClient
) -> None:
    system = prompt_text()
    # Asked for, or LiteLLM keeps the usage event from its client (the plugin sees it anyway).
    usage = {"stream_options": {"include_usage": True}}
    body = chat(system, model=stack.engine.model, max_tokens=8, **usage)
    first = await stream_chat(stack.litellm_url, ACME, body)
    assert first.status == 200, first.body
    request_id = first.headers[CALL_ID]
    assert first.events[0]["id"] == f"chatcmpl-{request_id}"  # vLLM ran it under that id
    held = await ended(kvquota, "acme", request_id)
    assert held.prompt_tokens == first.usage["prompt_tokens"]
    assert held.end_reason == pb.END_REASON_RELEASED
    assert held.output_tokens == first.usage["completion_tokens"] > 0

    hits_before = metric(await engine_metrics(stack.engine), "vllm:prefix_cache_hits_total")
    second = await stream_chat(
        stack.litellm_url, ACME, chat(system, "Who?", model=stack.engine.model)
    )
    assert second.status == 200, second.body
    again = await ended(kvquota, "acme", second.headers[CALL_ID])
    assert again.prefix_hit_blocks > 0
    assert metric(await engine_metrics(stack.engine), "vllm:prefix_cache_hits_total") > hits_before


async def test_over_quota_is_429_with_retry_after_and_never_reaches_vllm(
    stack: Stack, kvquota: AsyncKvquotaClient
) -> None:
    prompts_before = metric(await engine_metrics(stack.engine), "vllm:prompt_tokens_total")
    await admit_directly(kvquota, "tight", "tight-litellm-holder", 560, 8)
    try:
        body = chat(prompt_text(), model=stack.engine.model, max_tokens=8)
        over = await stream_chat(stack.litellm_url, {"authorization": "Bearer tight-key"}, body)
    finally:
        await cancel(kvquota, "tight", "tight-litellm-holder")
    assert over.status == 429, over.body
    assert int(over.headers["retry-after"]) >= 1
    too_long = await stream_chat(stack.litellm_url, ACME, {**body, "max_tokens": MAX_MODEL_LEN + 1})
    assert too_long.status == 400, too_long.body
    assert metric(await engine_metrics(stack.engine), "vllm:prompt_tokens_total") == prompts_before


async def test_a_client_that_goes_away_cancels_and_vllm_aborts(
    stack: Stack, kvquota: AsyncKvquotaClient
) -> None:
    await cut_long_stream(
        stack.engine, kvquota, stack.litellm_url, ACME, call_id, pb.END_REASON_CANCELLED
    )


async def test_a_whole_answer_is_released_and_an_upstream_error_cancelled(
    stack: Stack, kvquota: AsyncKvquotaClient
) -> None:
    body = chat(prompt_text(), model=stack.engine.model, max_tokens=6)
    url = f"{stack.litellm_url}/v1/chat/completions"
    async with httpx.AsyncClient(timeout=120) as client:
        whole = await client.post(url, json=body, headers=ACME)
        assert whole.status_code == 200, whole.text
        held = await ended(kvquota, "acme", whole.headers[CALL_ID])
        assert held.end_reason == pb.END_REASON_RELEASED
        assert held.output_tokens == whole.json()["usage"]["completion_tokens"]

        refused = await client.post(url, json={**body, "temperature": -1}, headers=ACME)
    assert refused.status_code >= 400, refused.text
    held = await ended(kvquota, "acme", refused.headers[CALL_ID])
    assert held.end_reason == pb.END_REASON_CANCELLED
    assert await reservation(kvquota, "acme", refused.headers[CALL_ID]) == held


async def test_a_proxy_killed_mid_stream_leaves_the_lease_to_free_the_blocks(
    stack: Stack, kvquota: AsyncKvquotaClient, gateways_bin: Path
) -> None:
    """Its own proxy, so the session's stays up."""
    work = stack.logs / "killed-litellm"
    work.mkdir(exist_ok=True)
    # The adapters share one configuration; its external processor's address is unused here.
    config = gateway_config(work, stack.kvquota, stack.engine, f"127.0.0.1:{free_port()}")
    proxy, url = start_litellm(gateways_bin, work, config, stack.engine, work / "litellm.log")
    try:
        await cut_long_stream(
            stack.engine,
            kvquota,
            url,
            ACME,
            call_id,
            pb.END_REASON_LEASE_EXPIRED,
            then=lambda: os.killpg(proxy.pid, signal.SIGKILL),
        )
    finally:
        stop_vllm(proxy)
