"""What a gateway reads from an OpenAI request (/v1/chat/completions, /v1/completions) and what it
writes into it before vLLM sees it: the tenant's `cache_salt`, the reservation's `request_id`,
an explicit output limit (the reservation holds prompt + limit, so the engine must not go past
it) and, when streaming, `stream_options.include_usage` (the last event then carries the output
token count that Release meters).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"


class BadLlmRequest(ValueError):
    """A request the gateway answers itself with 400: it cannot be admitted as sent."""


@dataclass(frozen=True, slots=True)
class LlmRequest:
    model: str
    stream: bool
    n: int
    # As the client asked (max_completion_tokens before max_tokens, as vLLM reads them); None
    # when it named none.
    max_tokens: int | None
    # Chat: the messages and what vLLM passes to the chat template besides them.
    messages: Sequence[Mapping[str, Any]] | None = None
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    # Completions: a text, or token ids.
    prompt: str | Sequence[int] | None = None


def _positive_int(body: Mapping[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise BadLlmRequest(f"{key} must be a positive integer")
    return value


def _prompt(body: Mapping[str, Any]) -> str | list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        return prompt
    # Several prompts are several requests to vLLM: one reservation cannot stand for them.
    raise BadLlmRequest("prompt must be one text or one list of token ids")


def parse(path: str, body: Mapping[str, Any]) -> LlmRequest:
    """The request as an Admit needs it; `path` tells chat from completions."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadLlmRequest("model is required")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadLlmRequest("stream must be true or false")
    limits = (_positive_int(body, "max_completion_tokens"), _positive_int(body, "max_tokens"))
    max_tokens = next((limit for limit in limits if limit is not None), None)
    n = _positive_int(body, "n") or 1
    if path == CHAT_PATH:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadLlmRequest("messages must be a non-empty list")
        if not all(isinstance(m, Mapping) for m in messages):
            raise BadLlmRequest("every message is an object")
        template_kwargs = {
            "add_generation_prompt": body.get("add_generation_prompt", True),
            "continue_final_message": body.get("continue_final_message", False),
            **(body.get("chat_template_kwargs") or {}),
        }
        if body.get("tools"):
            template_kwargs["tools"] = body["tools"]
        return LlmRequest(model, stream, n, max_tokens, messages, template_kwargs)
    if path == COMPLETIONS_PATH:
        return LlmRequest(model, stream, n, max_tokens, prompt=_prompt(body))
    raise BadLlmRequest(f"{path} is not admitted by kvquota")


def parse_body(path: str, raw: bytes) -> tuple[dict[str, Any], LlmRequest]:
    """The JSON body and the request it holds."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadLlmRequest(f"the body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadLlmRequest("the body is not a JSON object")
    return body, parse(path, body)


def admitted_body(
    body: Mapping[str, Any],
    request: LlmRequest,
    *,
    cache_salt: str,
    request_id: str,
    max_tokens: int,
) -> dict[str, Any]:
    """The body vLLM receives once the request is admitted with `max_tokens` reserved."""
    rewritten = {**body, "cache_salt": cache_salt, "request_id": request_id}
    if request.max_tokens is None:
        rewritten["max_tokens"] = max_tokens
    if request.stream:
        rewritten["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
    return rewritten


def encode(body: Mapping[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()
