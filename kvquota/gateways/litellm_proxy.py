"""kvquota as a LiteLLM proxy plugin. In the proxy's config.yaml:

    litellm_settings:
      callbacks: ["kvquota.gateways.litellm_proxy.admission"]

with KVQUOTA_GATEWAY_CONFIG naming the gateway's TOML file (config.py) and KVQUOTA_API_KEY its
key. Per request:

- `async_pre_call_hook` admits: the tenant is the caller's virtual key's team, user or alias
  (litellm.tenant_from), the prompt is tokenized as vLLM will, and `cache_salt` and `request_id`
  go to vLLM in `extra_body`. A refusal is an HTTP error with kvquota's status and retry-after.
- streams: `async_post_call_streaming_iterator_hook` wraps the stream. Its end releases with
  the output tokens of the last `usage`; anything else (the client went away and the stream was
  closed, an upstream error) cancels, which aborts the generation in vLLM. LiteLLM's success
  logging fires for an aborted stream too, so nothing is released from there.
- non-streaming calls: `async_post_call_success_hook` releases with the answer's usage;
  `async_post_call_failure_hook` (upstream errors, timeouts) cancels.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import AsyncExitStack
from typing import Any

from fastapi import HTTPException
from litellm.integrations.custom_logger import CustomLogger

from kvquota.client import AsyncKvquotaClient, KvquotaError, Reservation, current_request_id
from kvquota.gateways import config as gateway_config
from kvquota.gateways.admission import Admissions
from kvquota.gateways.openai_requests import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    BadLlmRequest,
    parse,
)

log = logging.getLogger(__name__)

# LiteLLM's call types, by the OpenAI route they stand for.
_PATHS = {
    "completion": CHAT_PATH,
    "acompletion": CHAT_PATH,
    "text_completion": COMPLETIONS_PATH,
    "atext_completion": COMPLETIONS_PATH,
}


class _Held:
    """One admitted call: its reservation and the stack whose exit releases or cancels it."""

    def __init__(self, reservation: Reservation, scope: AsyncExitStack) -> None:
        self.reservation = reservation
        self.scope = scope

    async def release(self, output_tokens: int) -> None:
        self.reservation.output_tokens = output_tokens
        await self.scope.aclose()

    async def cancel(self) -> None:
        await self.scope.__aexit__(asyncio.CancelledError, asyncio.CancelledError(), None)


def _completion_tokens(response: Any) -> int:
    usage = getattr(response, "usage", None)
    tokens = getattr(usage, "completion_tokens", None)
    return tokens if isinstance(tokens, int) else 0


class KvquotaAdmission(CustomLogger):  # type: ignore[misc]
    def __init__(self, config: gateway_config.GatewayConfig | None = None) -> None:
        super().__init__()
        self._config = config
        self._admissions: Admissions | None = None
        self._client: AsyncKvquotaClient | None = None
        # Admitted calls by LiteLLM's call id, until their end releases or cancels them.
        self._held: dict[str, _Held] = {}

    def _ready(self) -> tuple[Admissions, AsyncKvquotaClient]:
        """Configured on first use: LiteLLM imports this module before it starts its loop."""
        if self._admissions is None or self._client is None:
            config = self._config or gateway_config.load()
            self._admissions = Admissions(config)
            self._client = AsyncKvquotaClient(list(config.kvquota), api_key=config.api_key)
        return self._admissions, self._client

    def _tenant(self, key: Any, tenant_from: str) -> str:
        tenant = {
            "team": getattr(key, "team_id", None),
            "user": getattr(key, "user_id", None),
            "key_alias": getattr(key, "key_alias", None),
        }[tenant_from]
        if not tenant:
            raise HTTPException(401, detail=f"this key has no {tenant_from}: no kvquota tenant")
        return str(tenant)

    async def async_pre_call_hook(
        self, user_api_key_dict: Any, cache: Any, data: dict[str, Any], call_type: str
    ) -> dict[str, Any]:
        path = _PATHS.get(call_type)
        if path is None:
            return data
        admissions, client = self._ready()
        request_id = str(data.get("litellm_call_id") or uuid.uuid4().hex)
        current_request_id.set(request_id)
        scope = AsyncExitStack()
        try:
            request = parse(path, data)
            tenant = self._tenant(user_api_key_dict, admissions.config.litellm.tenant_from)
            prompt_token_ids = await asyncio.to_thread(admissions.prompt_token_ids, request)
            admit = admissions.admit_request(
                request, tenant=tenant, request_id=request_id, prompt_token_ids=prompt_token_ids
            )
            reservation = await scope.enter_async_context(client.reservation(admit))
        except BadLlmRequest as bad:
            raise HTTPException(400, detail=str(bad)) from None
        except KvquotaError as refused:
            raise HTTPException(
                refused.http_status,
                detail={"message": refused.message, "code": refused.reason},
                headers=refused.headers,
            ) from None
        self._held[request_id] = _Held(reservation, scope)
        extra_body = {
            **(data.get("extra_body") or {}),
            "cache_salt": reservation.cache_salt,
            "request_id": request_id,
        }
        data["extra_body"] = extra_body
        if request.max_tokens is None:
            data["max_tokens"] = admissions.max_tokens(request)
        if request.stream:
            data["stream_options"] = {**(data.get("stream_options") or {}), "include_usage": True}
        return data

    def _take(self, request_data: dict[str, Any]) -> _Held | None:
        return self._held.pop(str(request_data.get("litellm_call_id")), None)

    async def async_post_call_streaming_iterator_hook(
        self, user_api_key_dict: Any, response: AsyncIterator[Any], request_data: dict[str, Any]
    ) -> AsyncGenerator[Any, None]:
        held = self._take(request_data)
        if held is None:
            async for chunk in response:
                yield chunk
            return
        output_tokens = 0
        completed = False
        try:
            async for chunk in response:
                output_tokens = _completion_tokens(chunk) or output_tokens
                yield chunk
            completed = True
        finally:
            # try/finally, not except: a client that went away closes this generator
            # (GeneratorExit), which no except clause for Exception sees.
            if completed:
                await held.release(output_tokens)
            else:
                await held.cancel()

    async def async_post_call_success_hook(
        self, data: dict[str, Any], user_api_key_dict: Any, response: Any
    ) -> Any:
        if not data.get("stream"):
            held = self._take(data)
            if held is not None:
                await held.release(_completion_tokens(response))
        return response

    async def async_post_call_failure_hook(
        self,
        request_data: dict[str, Any],
        original_exception: Exception,
        user_api_key_dict: Any,
        traceback_str: str | None = None,
    ) -> None:
        held = self._take(request_data)
        if held is not None:
            log.info("cancelled %s: %s", held.reservation.name, original_exception)
            await held.cancel()


# The instance config.yaml names.
admission = KvquotaAdmission()
