"""vLLM's HTTP side: what /metrics says of the engine, and the dev-mode control endpoints
(VLLM_SERVER_DEV_MODE=1) that abort requests and reset the prefix cache."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True, slots=True)
class EngineMetrics:
    num_gpu_blocks: int
    block_size: int
    prefix_caching_hash_algo: str
    requests_running: int
    requests_waiting: int
    kv_cache_usage: float

    @property
    def usable_blocks(self) -> int:
        """vLLM keeps block 0 as a null block that never holds data."""
        return self.num_gpu_blocks - 1


@dataclass(frozen=True, slots=True)
class EngineDescription:
    """What registering an instance from a live engine reads off it."""

    model: str
    max_model_len: int
    metrics: EngineMetrics


class MetricsError(ValueError):
    """/metrics lacks what kvquota needs (vllm:cache_config_info)."""


def parse_metrics(text: str) -> EngineMetrics:
    """The engine's real pool (from the cache_config_info labels) and its load. Several engines
    (data-parallel ranks) in one server are added up."""
    config: dict[str, str] | None = None
    gauges = {"vllm:num_requests_running": 0.0, "vllm:num_requests_waiting": 0.0}
    usage = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:cache_config_info" and config is None:
                config = dict(sample.labels)
            elif sample.name in gauges:
                gauges[sample.name] += sample.value
            elif sample.name == "vllm:kv_cache_usage_perc":
                usage = max(usage, sample.value)
    if config is None or "num_gpu_blocks" not in config or "block_size" not in config:
        raise MetricsError("vllm:cache_config_info with num_gpu_blocks and block_size is missing")
    return EngineMetrics(
        num_gpu_blocks=int(config["num_gpu_blocks"]),
        block_size=int(config["block_size"]),
        prefix_caching_hash_algo=config.get("prefix_caching_hash_algo", "sha256"),
        requests_running=int(gauges["vllm:num_requests_running"]),
        requests_waiting=int(gauges["vllm:num_requests_waiting"]),
        kv_cache_usage=usage,
    )


def vllm_request_ids(request_id: str) -> tuple[str, str]:
    """The ids vLLM's OpenAI server gives a request whose request_id the gateway set."""
    return f"cmpl-{request_id}-0", f"chatcmpl-{request_id}"


class VllmHttp:
    def __init__(self, base_url: str, timeout_seconds: float = 5.0) -> None:
        self._client = httpx.AsyncClient(base_url=base_url, timeout=timeout_seconds)

    async def close(self) -> None:
        await self._client.aclose()

    async def metrics(self) -> EngineMetrics:
        response = await self._client.get("/metrics")
        response.raise_for_status()
        return parse_metrics(response.text)

    async def describe(self) -> EngineDescription:
        """The served model and its context length (/v1/models), and the pool (/metrics)."""
        response = await self._client.get("/v1/models")
        response.raise_for_status()
        served = response.json()["data"][0]
        return EngineDescription(
            model=str(served["id"]),
            max_model_len=int(served["max_model_len"]),
            metrics=await self.metrics(),
        )

    async def abort(self, request_ids: Sequence[str]) -> None:
        """Abort requests by kvquota's request ids. The gateway passes a reservation's request_id
        to vLLM (`request_id` in the body, or X-Request-Id), and vLLM derives its own ids from it:
        `cmpl-{id}-{i}` for the i-th prompt of a completion, `chatcmpl-{id}` for a chat
        completion. Both are aborted; ids vLLM does not know are ignored (and answered 200
        all the same, so the reply says nothing)."""
        engine_ids = [engine_id for rid in request_ids for engine_id in vllm_request_ids(rid)]
        response = await self._client.post("/abort_requests", json={"request_ids": engine_ids})
        response.raise_for_status()

    async def reset_prefix_cache(self) -> bool:
        """Drop every cached block; vLLM refuses (False) while any block is in use."""
        response = await self._client.post("/reset_prefix_cache")
        response.raise_for_status()
        return bool(response.json().get("success", True)) if response.content else True
