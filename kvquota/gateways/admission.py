"""The Admit a gateway sends for one OpenAI request, whichever gateway it is."""

from __future__ import annotations

from google.protobuf.duration_pb2 import Duration

from kvquota.gateways.config import GatewayConfig, ModelRoute
from kvquota.gateways.openai_requests import BadLlmRequest, LlmRequest
from kvquota.gateways.tokenizing import PromptTokenizer
from kvquota.v1 import admission_pb2


def _duration(seconds: float) -> Duration:
    duration = Duration()
    duration.FromNanoseconds(round(seconds * 1e9))
    return duration


class Admissions:
    """Turns requests into Admits under one configuration; holds each model's tokenizer."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self._tokenizers = {
            name: PromptTokenizer(route.tokenizer) for name, route in config.models.items()
        }

    def route(self, request: LlmRequest) -> ModelRoute:
        route = self.config.models.get(request.model)
        if route is None:
            raise BadLlmRequest(f"model {request.model!r} is not served through kvquota here")
        return route

    def prompt_token_ids(self, request: LlmRequest) -> list[int]:
        self.route(request)
        return self._tokenizers[request.model].prompt_token_ids(request)

    def max_tokens(self, request: LlmRequest) -> int:
        return request.max_tokens or self.config.default_max_tokens

    def admit_request(
        self,
        request: LlmRequest,
        *,
        tenant: str,
        request_id: str,
        prompt_token_ids: list[int],
        priority: int = 0,
        engine_address: str = "",
    ) -> admission_pb2.AdmitRequest:
        """`engine_address`, when the gateway's endpoint picker chose the engine, wins over the
        model's configured one."""
        route = self.route(request)
        if not (engine_address or route.engine_address or route.instance):
            raise BadLlmRequest(f"no engine is named for model {request.model!r}")
        return admission_pb2.AdmitRequest(
            tenant=f"tenants/{tenant}",
            request_id=request_id,
            instance="" if engine_address else route.instance and f"instances/{route.instance}",
            engine_address=engine_address or route.engine_address,
            prompt_tokens=len(prompt_token_ids),
            max_output_tokens=self.max_tokens(request),
            n=request.n,
            priority=priority,
            prompt_token_ids=prompt_token_ids,
            wait_timeout=_duration(self.config.wait_timeout_seconds),
            lease_ttl=_duration(self.config.lease_ttl_seconds),
        )
