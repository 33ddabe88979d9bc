"""Capacity planning for one engine: from a model's KV geometry and a GPU memory budget, how many
tokens and blocks the KV cache holds, how many requests of each context length fit at once, how
many a target arrival rate keeps in flight (Little's law: L = λ·W), and the vLLM flags that
follow. Pure arithmetic; the CLI prints it (`kvquota plan`).

Every figure is vLLM's own arithmetic on the same inputs (core/geometry.py cites where), and the
flags make the engine's pool the plan's: vLLM given `--kv-cache-memory-bytes` and `--block-size`
reports exactly `blocks` as its `num_gpu_blocks`."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from quota_service.core.geometry import (
    GeometryError,
    KvBudget,
    KvDtype,
    KvGeometry,
    blocks_for_tokens,
    capacity_blocks,
)

# vLLM's `SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS` (vllm/config/scheduler.py), its token
# budget per step where no larger default applies: the plan never recommends fewer.
MIN_BATCHED_TOKENS = 2048

# The KV-cache dtypes a plan can name to vLLM (`CacheDType` in vllm/config/cache.py).
_VLLM_KV_CACHE_DTYPES = {KvDtype.FP16: "float16", KvDtype.BF16: "bfloat16", KvDtype.FP8: "fp8"}


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
    # What vLLM reports as num_gpu_blocks; block 0 is its null block, so requests get one fewer
    # (what kvquota registers as the instance's capacity).
    blocks: int
    usable_blocks: int
    fits: tuple[ContextFit, ...]
    # Little's law, when an arrival rate and a mean request time are given.
    needed_concurrency: int | None
    # Recommended vLLM flags.
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    # Queued prompt tokens beyond which a new request waits longer than the target TTFT.
    max_num_queued_tokens: int | None
    # The vLLM arguments that give the engine this plan's pool and batch limits.
    vllm_args: tuple[str, ...]


def littles_law(arrival_rate: float, mean_seconds: float) -> int:
    """Requests in flight on average: λ·W, rounded up to whole requests."""
    if arrival_rate <= 0 or mean_seconds <= 0:
        raise GeometryError("arrival rate and mean request time must be positive")
    # Rounded to 9 places first, so float noise (0.1 * 30 is 3.0000000000000004) adds no request.
    return math.ceil(round(arrival_rate * mean_seconds, 9))


def vllm_args(
    kv_bytes: int,
    block_size: int,
    kv_cache_dtype: KvDtype | None,
    max_num_seqs: int,
    max_num_batched_tokens: int,
) -> tuple[str, ...]:
    """`vllm serve` arguments for a pool of exactly kv_bytes // bytes_per_block blocks.

    The KV cache is given in bytes, as vLLM's own start-up log advises for manual control: with
    `--gpu-memory-utilization` alone its size would follow vLLM's profiling of activations,
    which no plan can know. `--kv-cache-dtype` is named only when the plan was given a dtype
    (otherwise vLLM's `auto` resolves the config's dtype as the plan did)."""
    args = ["--block-size", str(block_size), "--kv-cache-memory-bytes", str(kv_bytes)]
    if kv_cache_dtype is not None:
        name = _VLLM_KV_CACHE_DTYPES.get(kv_cache_dtype)
        if name is None:
            known = ", ".join(d.value for d in _VLLM_KV_CACHE_DTYPES)
            raise GeometryError(f"dtype: vLLM has no {kv_cache_dtype.value} KV cache ({known})")
        args += ["--kv-cache-dtype", name]
    args += [
        "--max-num-seqs",
        str(max_num_seqs),
        "--max-num-batched-tokens",
        str(max_num_batched_tokens),
    ]
    return tuple(args)


def plan_capacity(
    geometry: KvGeometry,
    budget: KvBudget,
    block_size: int,
    contexts: Sequence[int],
    arrival_rate: float | None = None,
    mean_seconds: float | None = None,
    ttft_seconds: float | None = None,
    prefill_tokens_per_second: float | None = None,
    kv_cache_dtype: KvDtype | None = None,
) -> CapacityPlan:
    """The plan for `geometry` in `budget`. `kv_cache_dtype` is the dtype the caller chose (it is
    then named to vLLM); None means the geometry's dtype is what vLLM's `auto` resolves to."""
    if not contexts or any(c < 1 for c in contexts):
        raise GeometryError("context lengths must be at least 1 token")
    blocks = capacity_blocks(geometry, budget, block_size)
    usable = blocks - 1
    if usable < 1:
        raise GeometryError("the KV cache holds only vLLM's null block: no block for requests")
    fits = tuple(
        ContextFit(c, blocks_for_tokens(c, block_size), usable // blocks_for_tokens(c, block_size))
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
    kv_bytes = budget.kv_bytes()
    # vLLM refuses to start with fewer batched tokens than sequences (SchedulerConfig).
    batched = max(MIN_BATCHED_TOKENS, longest.context_tokens, max_seqs)
    return CapacityPlan(
        bytes_per_token=geometry.bytes_per_token,
        bytes_per_block=geometry.bytes_per_block(block_size),
        kv_bytes=kv_bytes,
        tokens=blocks * block_size,
        blocks=blocks,
        usable_blocks=usable,
        fits=fits,
        needed_concurrency=needed,
        block_size=block_size,
        max_num_seqs=max_seqs,
        max_num_batched_tokens=batched,
        max_num_queued_tokens=queued,
        vllm_args=vllm_args(kv_bytes, block_size, kv_cache_dtype, max_seqs, batched),
    )
