"""kvquota's external processor in a real Envoy, in front of a real vLLM."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
from google.protobuf.duration_pb2 import Duration

from kvquota.client import NO_RETRIES, AsyncKvquotaClient, KvquotaError
from kvquota.v1 import admission_pb2
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
from tests.gateways.conftest import (
    INSTANCE,
    TIGHT_TOKENS,
    Stack,
    envoy_yaml,
    gateway_config,
    start_envoy,
    start_ext_proc,
)
from tests.integration.grpc_helpers import free_port

ACME = {"x-api-key": "acme-key"}
GLOBEX = {"x-api-key": "globex-key"}
# Long enough to be running when the client or the gateway goes away.


def first_request_id(streamed: Streamed) -> str:
    """The request id vLLM ran a stream under, from its first event."""
    return request_id_of(streamed.events[0]["id"])


def request_id_of(response_id: str) -> str:
    """vLLM names a chat completion chatcmpl-{request id}: the gateway's id reached it."""
    assert response_id.startswith("chatcmpl-"), response_id
    return response_id.removeprefix("chatcmpl-")


async def test_a_streamed_chat_is_admitted_salted_and_released(
    stack: Stack, kvquota: AsyncKvquotaClient
) -> None:
    system = prompt_text()
    first = await stream_chat(
        stack.envoy_url, ACME, chat(system, model=stack.engine.model, max_tokens=8)
    )
    assert first.status == 200, first.body
    request_id = request_id_of(first.events[0]["id"])
    held = await reservation(kvquota, "acme", request_id)
    # The gateway tokenized (chat template included) exactly as vLLM did.
    assert held.prompt_tokens == first.usage["prompt_tokens"]
    assert held.end_reason == pb.END_REASON_RELEASED
    assert held.output_tokens == first.usage["completion_tokens"] > 0

    hits_before = metric(await engine_metrics(stack.engine), "vllm:prefix_cache_hits_total")
    body = chat(system, "Who are you?", model=stack.engine.model, max_tokens=4)
    second = await stream_chat(stack.envoy_url, ACME, body)
    assert second.status == 200, second.body
    again = await reservation(kvquota, "acme", request_id_of(second.events[0]["id"]))
    assert again.prefix_hit_blocks > 0
    hits_after = metric(await engine_metrics(stack.engine), "vllm:prefix_cache_hits_total")
    assert hits_after > hits_before  # the same tenant's salt reached vLLM both times

    # Another tenant, the same prompt: no prefix is shared, in kvquota or in vLLM.
    other = await stream_chat(stack.envoy_url, GLOBEX, body)
    assert other.status == 200, other.body
    theirs = await reservation(kvquota, "globex", request_id_of(other.events[0]["id"]))
    assert theirs.prefix_hit_blocks == 0
    assert metric(await engine_metrics(stack.engine), "vllm:prefix_cache_hits_total") == hits_after


async def admit_directly(
    kvquota: AsyncKvquotaClient, tenant: str, request_id: str, prompt: int, output: int
) -> None:
    await kvquota.admission.Admit(
        admission_pb2.AdmitRequest(
            tenant=f"tenants/{tenant}",
            request_id=request_id,
            instance=f"instances/{INSTANCE}",
            prompt_tokens=prompt,
            max_output_tokens=output,
            lease_ttl=Duration(seconds=120),
        )
    )


async def cancel(kvquota: AsyncKvquotaClient, tenant: str, request_id: str) -> None:
    await kvquota.admission.Cancel(
        admission_pb2.CancelRequest(name=f"tenants/{tenant}/reservations/{request_id}")
    )


async def test_refusals_are_answered_by_the_gateway_and_never_reach_vllm(
    stack: Stack, kvquota: AsyncKvquotaClient
) -> None:
    prompts_before = metric(await engine_metrics(stack.engine), "vllm:prompt_tokens_total")
    body = chat(prompt_text(), model=stack.engine.model, max_tokens=8)
    envoy = stack.envoy_url

    # Over its quota now: 429, and retry-after is kvquota's own delay.
    await admit_directly(kvquota, "tight", "tight-holder", TIGHT_TOKENS - 40, 8)
    try:
        over = await stream_chat(envoy, {"x-api-key": "tight-key"}, body)
        async with AsyncKvquotaClient(stack.kvquota, retry=NO_RETRIES) as once:
            try:
                await admit_directly(once, "tight", "tight-probe", 100, 8)
                raise AssertionError("kvquota admitted over the quota")
            except KvquotaError as refused:
                delay = int(refused.headers["retry-after"])
    finally:
        await cancel(kvquota, "tight", "tight-holder")
    assert over.status == 429, over.body
    # Asked a moment apart: the delay (a lease's remaining time) may have crossed a second.
    assert delay <= int(over.headers["retry-after"]) <= delay + 1
    assert httpx.Response(429, content=over.body).json()["error"]["code"] == "TENANT_QUOTA_EXCEEDED"

    # The instance full: 503 with retry-after.
    await admit_directly(kvquota, "globex", "globex-holder", 32 * 50, 32 * 12)
    try:
        full = await stream_chat(envoy, ACME, body)
    finally:
        await cancel(kvquota, "globex", "globex-holder")
    assert full.status == 503, full.body
    assert int(full.headers["retry-after"]) >= 1

    # Longer than the engine's context: 400.
    too_long = await stream_chat(envoy, ACME, {**body, "max_tokens": MAX_MODEL_LEN + 1})
    assert too_long.status == 400, too_long.body
    error = httpx.Response(400, content=too_long.body).json()["error"]
    assert error["code"] == "CONTEXT_LENGTH_EXCEEDED"

    assert metric(await engine_metrics(stack.engine), "vllm:prompt_tokens_total") == prompts_before


async def test_a_client_that_goes_away_cancels_and_vllm_aborts(
    stack: Stack, kvquota: AsyncKvquotaClient
) -> None:
    await cut_long_stream(
        stack.engine, kvquota, stack.envoy_url, ACME, first_request_id, pb.END_REASON_CANCELLED
    )


async def test_a_whole_answer_is_released_and_an_upstream_error_cancelled(
    stack: Stack, kvquota: AsyncKvquotaClient
) -> None:
    body = chat(prompt_text(), model=stack.engine.model, max_tokens=6)
    async with httpx.AsyncClient(timeout=120) as client:
        whole = await client.post(f"{stack.envoy_url}/v1/chat/completions", json=body, headers=ACME)
        assert whole.status_code == 200, whole.text
        answer = whole.json()
        held = await reservation(kvquota, "acme", request_id_of(answer["id"]))
        assert held.end_reason == pb.END_REASON_RELEASED
        assert held.output_tokens == answer["usage"]["completion_tokens"]

        # Admitted, then refused by vLLM itself: the reservation is cancelled, not metered.
        request_id = "upstream-error-1"
        headers = {**ACME, "x-request-id": request_id}
        refused = await client.post(
            f"{stack.envoy_url}/v1/chat/completions",
            json={**body, "temperature": -1},
            headers=headers,
        )
    assert refused.status_code == 400, refused.text
    held = await ended(kvquota, "acme", request_id)
    assert held.end_reason == pb.END_REASON_CANCELLED


async def test_a_processor_killed_mid_stream_leaves_the_lease_to_free_the_blocks(
    stack: Stack, kvquota: AsyncKvquotaClient, gateways_bin: Path
) -> None:
    """Its own processor and Envoy, so the session's stay up."""
    work = stack.logs / "killed"
    work.mkdir(exist_ok=True)
    ext_proc_port, envoy_port = free_port(), free_port()
    listen = f"127.0.0.1:{ext_proc_port}"
    config = gateway_config(work, stack.kvquota, stack.engine, listen)
    processor = start_ext_proc(gateways_bin, config, listen, work / "ext_proc.log")
    envoy_config = envoy_yaml(work, envoy_port, stack.engine, ext_proc_port)
    envoy = start_envoy(gateways_bin, envoy_config, envoy_port, work / "envoy.log")
    try:
        await cut_long_stream(
            stack.engine,
            kvquota,
            f"http://127.0.0.1:{envoy_port}",
            ACME,
            first_request_id,
            pb.END_REASON_LEASE_EXPIRED,
            then=lambda: os.killpg(processor.pid, signal.SIGKILL),
        )
    finally:
        stop_vllm(envoy)
        stop_vllm(processor)
