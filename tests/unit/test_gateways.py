"""The gateways' pure parts: configuration, where tenant, priority and engine come from, the
body vLLM receives, usage read from however an answer is chunked, and the error body."""

from __future__ import annotations

import json

import grpc
import pytest

from kvquota.client import QuotaExceeded
from kvquota.gateways import openai_requests
from kvquota.gateways.config import ConfigError, EnvoyConfig, parse
from kvquota.gateways.ext_proc import mapping
from kvquota.gateways.openai_requests import CHAT_PATH, COMPLETIONS_PATH, BadLlmRequest
from kvquota.gateways.openai_responses import UsageReader, refusal_body

MODELS = {"models": {"llama": {"tokenizer": "/models/llama", "instance": "gpu-0"}}}


def test_configuration_is_checked_when_read() -> None:
    config = parse({"kvquota": "kvq:50051", **MODELS}, {"KVQUOTA_API_KEY": "kvq_1_secret"})
    assert config.kvquota == ("kvq:50051",) and config.api_key == "kvq_1_secret"
    assert config.models["llama"].instance == "gpu-0"
    for document, complaint in (
        ({**MODELS}, "kvquota must name"),
        ({"kvquota": "k:1"}, "no [models.NAME]"),
        ({"kvquota": "k:1", "wait_timeout": 2, **MODELS}, "unknown setting wait_timeout"),
        ({"kvquota": "k:1", "lease_ttl_seconds": "30", **MODELS}, "must be a float"),
        ({"kvquota": "k:1", "api_key": "x", **MODELS}, "KVQUOTA_API_KEY"),
        ({"kvquota": "k:1", "litellm": {"tenant_from": "org"}, **MODELS}, "tenant_from"),
        (
            {"kvquota": "k:1", "envoy": {"tenant_header": "a", "tenant_metadata": "b:c"}, **MODELS},
            "not both",
        ),
    ):
        with pytest.raises(ConfigError, match=complaint.replace("[", r"\[")):
            parse(document, {})


def test_the_tenant_comes_only_from_the_configured_source() -> None:
    by_header = EnvoyConfig(tenant_header="x-kvquota-tenant")
    headers = {"x-kvquota-tenant": "acme", "x-gateway-inference-fairness-id": "evil"}
    assert mapping.tenant(by_header, headers, {}) == "acme"
    with pytest.raises(mapping.UnknownTenant):
        mapping.tenant(by_header, {"x-gateway-inference-fairness-id": "acme"}, {})
    by_metadata = EnvoyConfig(tenant_metadata="envoy.filters.http.jwt_authn:payload.org")
    metadata = {"envoy.filters.http.jwt_authn": {"payload": {"org": "globex", "sub": "u1"}}}
    assert mapping.tenant(by_metadata, headers, metadata) == "globex"
    with pytest.raises(mapping.UnknownTenant):
        mapping.tenant(by_metadata, headers, {"envoy.filters.http.jwt_authn": {"payload": 1}})


def test_priority_and_engine_from_the_inference_extensions_headers() -> None:
    config = EnvoyConfig(
        tenant_header="t",
        engine_header="x-gateway-destination-endpoint",
        objective_priorities={"critical": 10, "sheddable": -10},
    )
    assert mapping.priority(config, {"x-gateway-inference-objective": "critical"}) == 10
    assert mapping.priority(config, {"x-gateway-inference-objective": "unknown"}) == 0
    assert mapping.priority(config, {}) == 0
    picked = {"x-gateway-destination-endpoint": "10.0.0.5:8000, 10.0.0.6:8000"}
    assert mapping.engine_address(config, picked) == "10.0.0.5:8000"
    assert mapping.engine_address(EnvoyConfig(tenant_header="t"), picked) == ""


def test_requests_are_read_as_vllm_reads_them() -> None:
    chat = openai_requests.parse(
        CHAT_PATH,
        {
            "model": "llama",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 100,
            "max_completion_tokens": 50,
            "n": 2,
            "stream": True,
        },
    )
    assert (chat.max_tokens, chat.n, chat.stream) == (50, 2, True)
    assert chat.chat_template_kwargs["add_generation_prompt"] is True
    completion = openai_requests.parse(COMPLETIONS_PATH, {"model": "m", "prompt": ["one"]})
    assert (completion.prompt, completion.max_tokens, completion.n) == ("one", None, 1)
    ids = openai_requests.parse(COMPLETIONS_PATH, {"model": "m", "prompt": [1, 2, 3]})
    assert ids.prompt == [1, 2, 3]
    for path, body in (
        (CHAT_PATH, {"messages": [{"role": "user", "content": "x"}]}),
        (CHAT_PATH, {"model": "m", "messages": []}),
        (CHAT_PATH, {"model": "m", "messages": [{"role": "user"}], "max_tokens": 0}),
        (COMPLETIONS_PATH, {"model": "m", "prompt": ["one", "two"]}),
        ("/v1/embeddings", {"model": "m", "input": "x"}),
    ):
        with pytest.raises(BadLlmRequest):
            openai_requests.parse(path, body)
    with pytest.raises(BadLlmRequest, match="not JSON"):
        openai_requests.parse_body(CHAT_PATH, b"{")


def test_the_admitted_body_carries_salt_request_id_limit_and_usage() -> None:
    body = {
        "model": "llama",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"continuous_usage_stats": False},
        "cache_salt": "chosen-by-the-client",
    }
    request = openai_requests.parse(CHAT_PATH, body)
    admitted = openai_requests.admitted_body(
        body, request, cache_salt="secret", request_id="req-1", max_tokens=256
    )
    assert admitted == {
        **body,
        "cache_salt": "secret",  # never the client's
        "request_id": "req-1",
        "max_tokens": 256,  # what was reserved: the engine must not go past it
        "stream_options": {"continuous_usage_stats": False, "include_usage": True},
    }
    limited = {"model": "m", "prompt": "x", "max_tokens": 9}
    request = openai_requests.parse(COMPLETIONS_PATH, limited)
    kept = openai_requests.admitted_body(
        limited, request, cache_salt="s", request_id="r", max_tokens=9
    )
    assert kept == {**limited, "cache_salt": "s", "request_id": "r"}
    assert json.loads(openai_requests.encode(kept)) == kept


def test_usage_is_read_however_the_stream_is_cut() -> None:
    events = (
        b'data: {"id":"chatcmpl-r","choices":[{"delta":{"content":"a"}}],"usage":null}\n\n'
        b'data: {"id":"chatcmpl-r","choices":[],"usage":{"prompt_tokens":11,'
        b'"completion_tokens":7,"total_tokens":18}}\n\n'
        b"data: [DONE]\n\n"
    )
    for cut in range(1, len(events)):
        reader = UsageReader(event_stream=True)
        reader.feed(events[:cut])
        reader.feed(events[cut:])
        reader.finish()
        assert (reader.prompt_tokens, reader.completion_tokens) == (11, 7), cut
    whole = UsageReader(event_stream=False)
    for part in (b'{"id":"x","usage":{"prompt_tokens":3,', b'"completion_tokens":5}}'):
        whole.feed(part)
    whole.finish()
    assert whole.completion_tokens == 5
    broken = UsageReader(event_stream=False)
    broken.feed(b"<html>bad gateway</html>")
    broken.finish()
    assert broken.completion_tokens is None


def test_a_refusal_is_an_openai_error_with_retry_after() -> None:
    refused = QuotaExceeded(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "TENANT_QUOTA_EXCEEDED",
        "tenant acme is over its quota now",
        retry_delay_seconds=2.2,
    )
    assert json.loads(refusal_body(refused)) == {
        "error": {
            "message": "tenant acme is over its quota now",
            "type": "rate_limit_error",
            "param": None,
            "code": "TENANT_QUOTA_EXCEEDED",
        }
    }
    assert (refused.http_status, refused.headers) == (429, {"retry-after": "3"})
