"""Capacity planning for one engine: from a model's KV geometry and a GPU memory budget, how many
tokens and blocks the KV cache holds, how many requests of each context length fit at once, how
many a target arrival rate keeps in flight (Little's law: L = λ·W), and the vLLM flags that
follow. Pure arithmetic; the CLI prints it (`kvquota plan`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from quota_service.core.geometry import (
    GeometryError,
    KvGeometry,
    MemoryBudget,
    blocks_for_tokens,
    capacity_blocks,
)

# vLLM's default prefill chunk: a step never batches fewer tokens than this.
MIN_BATCHED_TOKENS = 2048


@dataclass(frozen=True, slots=True)
class ContextFit:
    context_tokens: int
    blocks_per_request: int
    max_concurrency: int  # requests of this length that fit in the cache at once


@dataclass(frozen=True, slots=True)
class CapacityPlan:
    bytes_per_token: int
    bytes_per_block: int
    kv_bytes: int
    tokens: int  # whole blocks' worth of tokens
    blocks: int
    fits: tuple[ContextFit, ...]
    # Little's law, when an arrival rate and a mean request time are given.
    needed_concurrency: int | None
    # Recommended vLLM flags.
    num_gpu_blocks_override: int
    max_num_seqs: int
    max_num_batched_tokens: int
    # Queued prompt tokens beyond which a new request waits longer than the target TTFT.
    max_num_queued_tokens: int | None


def littles_law(arrival_rate: float, mean_seconds: float) -> int:
    """Requests in flight on average: λ·W, rounded up to whole requests."""
    if arrival_rate <= 0 or mean_seconds <= 0:
        raise GeometryError("arrival rate and mean request time must be positive")
    # Rounded to 9 places first, so float noise (0.1 * 30 is 3.0000000000000004) adds no request.
    return math.ceil(round(arrival_rate * mean_seconds, 9))


def plan_capacity(
    geometry: KvGeometry,
    budget: MemoryBudget,
    block_size: int,
    contexts: Sequence[int],
    arrival_rate: float | None = None,
    mean_seconds: float | None = None,
    ttft_seconds: float | None = None,
    prefill_tokens_per_second: float | None = None,
) -> CapacityPlan:
    if not contexts or any(c < 1 for c in contexts):
        raise GeometryError("context lengths must be at least 1 token")
    blocks = capacity_blocks(geometry, budget, block_size)
    fits = tuple(
        ContextFit(c, blocks_for_tokens(c, block_size), blocks // blocks_for_tokens(c, block_size))
        for c in sorted(set(contexts))
    )
    needed = None
    if arrival_rate is not None and mean_seconds is not None:
        needed = littles_law(arrival_rate, mean_seconds)
    shortest, longest = fits[0], fits[-1]
    # kvquota admits by blocks, so long requests are held back before vLLM would have to preempt:
    # vLLM's batch may be as large as the shortest requests that fit, or the load, if smaller.
    max_seqs = max(1, shortest.max_concurrency)
    if needed is not None:
        max_seqs = max(1, min(max_seqs, needed))
    queued = None
    if ttft_seconds is not None and prefill_tokens_per_second is not None:
        queued = math.floor(ttft_seconds * prefill_tokens_per_second)
    return CapacityPlan(
        bytes_per_token=geometry.bytes_per_token,
        bytes_per_block=geometry.bytes_per_block(block_size),
        kv_bytes=budget.kv_bytes(),
        tokens=blocks * block_size,
        blocks=blocks,
        fits=fits,
        needed_concurrency=needed,
        num_gpu_blocks_override=blocks,
        max_num_seqs=max_seqs,
        max_num_batched_tokens=max(MIN_BATCHED_TOKENS, longest.context_tokens),
        max_num_queued_tokens=queued,
    )
