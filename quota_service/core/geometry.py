"""KV-cache geometry: bytes per token, capacity of a memory budget, and block arithmetic.

Everything here is pure integer arithmetic over validated inputs. All byte and token
counts are exact ``int`` values; the only float is ``MemoryBudget.utilization``, and it
is applied once, exactly as vLLM applies it, so every downstream figure stays integral.

Where vLLM decides something the plan depends on (a default, a rounding, a dtype), the rule here
is vLLM's, and the comment names the place in vLLM's source (vllm 0.32) it comes from.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "VLLM_BLOCK_SIZE",
    "VLLM_GPU_MEMORY_UTILIZATION",
    "GeometryError",
    "KvBudget",
    "KvCacheBytes",
    "KvDtype",
    "KvGeometry",
    "MemoryBudget",
    "blocks_for_request",
    "blocks_for_tokens",
    "capacity_blocks",
    "capacity_tokens",
    "dtype_bytes",
    "geometry_from_hf_config",
    "output_kv_tokens",
    "parse_dtype",
    "tokens_in_flight",
]


# vLLM's `CacheConfig.gpu_memory_utilization` default (vllm/config/cache.py).
VLLM_GPU_MEMORY_UTILIZATION = 0.92
# vLLM's `CacheConfig.DEFAULT_BLOCK_SIZE` (vllm/config/cache.py): what a GPU engine uses when
# `--block-size` is not given (its CPU backend picks 128 instead, vllm/platforms/cpu.py).
VLLM_BLOCK_SIZE = 16


class GeometryError(ValueError):
    """A bad geometry or memory budget; the message names the offending field and why."""


class KvDtype(enum.Enum):
    """Element type of the KV cache.

    Values are canonical names rather than byte widths: FP16 and BF16 are both 2 bytes,
    and equal enum values would make one an alias of the other. Use ``dtype_bytes`` for
    the width. Every value is accepted by ``parse_dtype``, so ``parse_dtype(d.value) is d``.
    """

    FP32 = "float32"
    FP16 = "float16"
    BF16 = "bfloat16"
    FP8 = "fp8"
    INT8 = "int8"


_DTYPE_BYTES: dict[KvDtype, int] = {
    KvDtype.FP32: 4,
    KvDtype.FP16: 2,
    KvDtype.BF16: 2,
    KvDtype.FP8: 1,
    KvDtype.INT8: 1,
}

_DTYPE_ALIASES: dict[str, KvDtype] = {
    "float32": KvDtype.FP32,
    "fp32": KvDtype.FP32,
    "float16": KvDtype.FP16,
    "fp16": KvDtype.FP16,
    "half": KvDtype.FP16,
    "bfloat16": KvDtype.BF16,
    "bf16": KvDtype.BF16,
    "fp8": KvDtype.FP8,
    "float8_e4m3fn": KvDtype.FP8,
    "float8_e5m2": KvDtype.FP8,
    "fp8_e4m3": KvDtype.FP8,
    "fp8_e5m2": KvDtype.FP8,
    "int8": KvDtype.INT8,
}


def dtype_bytes(dtype: KvDtype) -> int:
    """Bytes per element of ``dtype`` (always 1, 2 or 4)."""
    return _DTYPE_BYTES[dtype]


def parse_dtype(text: str) -> KvDtype:
    """Parse a dtype name as written by Hugging Face configs or vLLM, case-insensitively.

    Raises GeometryError for anything not in the known alias table (including vLLM's
    ``"auto"``, which only the engine can resolve).
    """
    try:
        return _DTYPE_ALIASES[text.strip().lower()]
    except KeyError:
        known = ", ".join(sorted(_DTYPE_ALIASES))
        raise GeometryError(f"dtype: unknown KV-cache dtype {text!r} (known: {known})") from None


def _check_int(name: str, value: object, minimum: int, error: type[ValueError]) -> int:
    """Return ``value`` if it is an int >= ``minimum``, else raise ``error`` naming ``name``."""
    # bool is an int subclass, but True as a layer count is always a bug.
    if not isinstance(value, int) or isinstance(value, bool):
        raise error(f"{name}: must be an integer, got {value!r}")
    if value < minimum:
        raise error(f"{name}: must be >= {minimum}, got {value}")
    return value


@dataclass(frozen=True, slots=True)
class KvGeometry:
    """Shape of one model's KV cache.

    Invariants (checked on construction, GeometryError naming the field otherwise):
    ``num_layers``, ``num_kv_heads`` and ``head_dim`` are ints >= 1, ``dtype`` is a
    KvDtype, and an MLA geometry has exactly one (latent) KV head. For MLA, ``head_dim``
    is the latent width ``kv_lora_rank + qk_rope_head_dim``.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: KvDtype
    mla: bool = False

    def __post_init__(self) -> None:
        _check_int("num_layers", self.num_layers, 1, GeometryError)
        _check_int("num_kv_heads", self.num_kv_heads, 1, GeometryError)
        _check_int("head_dim", self.head_dim, 1, GeometryError)
        if not isinstance(self.dtype, KvDtype):
            raise GeometryError(f"dtype: must be a KvDtype, got {self.dtype!r}")
        if self.mla and self.num_kv_heads != 1:
            # MLA caches one shared latent per layer; more heads would be silently ignored.
            raise GeometryError(f"num_kv_heads: must be 1 for MLA, got {self.num_kv_heads}")

    @property
    def bytes_per_token(self) -> int:
        """KV-cache bytes one token occupies across all layers (always >= 1)."""
        width = self.num_layers * self.head_dim * dtype_bytes(self.dtype)
        if self.mla:
            # One compressed latent per layer stands in for both K and V.
            return width
        return 2 * width * self.num_kv_heads

    def bytes_per_block(self, block_size: int) -> int:
        """Bytes of one paged-attention block of ``block_size`` tokens (block_size >= 1)."""
        _check_int("block_size", block_size, 1, GeometryError)
        return self.bytes_per_token * block_size


def _config_int(config: Mapping[str, object], key: str) -> int:
    value = config.get(key)
    if value is None:
        raise GeometryError(f"{key}: missing from model config")
    return _check_int(key, value, 1, GeometryError)


def _config_dtype(*configs: Mapping[str, object]) -> KvDtype:
    """The KV dtype vLLM's `--dtype auto` and `--kv-cache-dtype auto` give this config on a GPU
    with bfloat16 (Ampere and later): the config's dtype, except that float32 models are run in
    bfloat16 (`_resolve_auto_dtype` in vllm/config/model.py, "Downcast for float32 models"), as
    is a config that names no dtype (transformers' default is float32)."""
    for config in configs:
        # Older transformers write "torch_dtype"; newer ones write "dtype".
        for key in ("torch_dtype", "dtype"):
            value = config.get(key)
            if value is None:
                continue
            if not isinstance(value, str):
                raise GeometryError(f"{key}: must be a string, got {value!r}")
            dtype = parse_dtype(value)
            return KvDtype.BF16 if dtype is KvDtype.FP32 else dtype
    return KvDtype.BF16


def geometry_from_hf_config(
    config: Mapping[str, object], dtype: KvDtype | None = None
) -> KvGeometry:
    """Derive the KV geometry from a Hugging Face ``config.json`` mapping.

    Multimodal configs that keep the language model under ``text_config`` are read from
    there when ``num_hidden_layers`` is absent at the top level. A config with a non-null
    ``kv_lora_rank`` is MLA (DeepSeek-V2/V3): one latent head of width
    ``kv_lora_rank + qk_rope_head_dim``. The dtype is ``dtype`` if given, else what vLLM's
    ``auto`` makes of the config's ``torch_dtype``/``dtype`` (text config first, then top level):
    that dtype, with float32 and no dtype at all both meaning BF16.
    Missing, non-integer or non-positive required keys raise GeometryError naming the key.
    """
    source = config
    text_config = config.get("text_config")
    if "num_hidden_layers" not in config and isinstance(text_config, Mapping):
        source = text_config

    resolved_dtype = dtype if dtype is not None else _config_dtype(source, config)
    num_layers = _config_int(source, "num_hidden_layers")

    if source.get("kv_lora_rank") is not None:
        latent = _config_int(source, "kv_lora_rank") + _config_int(source, "qk_rope_head_dim")
        return KvGeometry(num_layers, 1, latent, resolved_dtype, mla=True)

    num_heads = _config_int(source, "num_attention_heads")
    num_kv_heads = (
        _config_int(source, "num_key_value_heads")
        if source.get("num_key_value_heads") is not None
        else num_heads
    )
    head_dim = (
        _config_int(source, "head_dim")
        if source.get("head_dim") is not None
        else _config_int(source, "hidden_size") // num_heads
    )
    return KvGeometry(num_layers, num_kv_heads, head_dim, resolved_dtype)


@dataclass(frozen=True, slots=True)
class MemoryBudget:
    """Device memory split between weights, fixed overhead and the KV cache.

    Invariants (GeometryError otherwise): ``total_bytes`` > 0, ``weights_bytes`` >= 0,
    ``overhead_bytes`` >= 0 (activations, CUDA graphs, fragmentation), and
    0 < ``utilization`` <= 1 (vLLM's ``gpu_memory_utilization``, its default unless given).
    Construction does not check that anything is left for the KV cache; ``kv_bytes`` does.
    """

    total_bytes: int
    weights_bytes: int
    overhead_bytes: int = 0
    utilization: float = VLLM_GPU_MEMORY_UTILIZATION

    def __post_init__(self) -> None:
        _check_int("total_bytes", self.total_bytes, 1, GeometryError)
        _check_int("weights_bytes", self.weights_bytes, 0, GeometryError)
        _check_int("overhead_bytes", self.overhead_bytes, 0, GeometryError)
        utilization: object = self.utilization
        if isinstance(utilization, bool) or not isinstance(utilization, int | float):
            raise GeometryError(f"utilization: must be a number, got {utilization!r}")
        # Written as a negated range so NaN is rejected too.
        if not 0 < utilization <= 1:
            raise GeometryError(f"utilization: must be in (0, 1], got {utilization}")

    def kv_bytes(self) -> int:
        """Bytes available to the KV cache; always > 0 or GeometryError.

        As vLLM's GPU worker has it: the memory it may take is ceil(total x utilization)
        (`request_memory` in vllm/v1/worker/utils.py), and the KV cache gets what is left of that
        after weights and the profiled peak (`determine_available_memory` in gpu_worker.py).
        """
        usable = math.ceil(self.total_bytes * self.utilization)
        kv = usable - self.weights_bytes - self.overhead_bytes
        if kv <= 0:
            raise GeometryError(
                "budget leaves no memory for the KV cache: "
                f"usable {usable} (total {self.total_bytes} x utilization {self.utilization})"
                f" - weights {self.weights_bytes} - overhead {self.overhead_bytes} = {kv} bytes"
            )
        return kv


@dataclass(frozen=True, slots=True)
class KvCacheBytes:
    """A KV cache of exactly ``kv_cache_bytes`` (>= 1): vLLM's ``--kv-cache-memory-bytes``, which
    sizes the cache without profiling and ignores ``gpu_memory_utilization``."""

    kv_cache_bytes: int

    def __post_init__(self) -> None:
        _check_int("kv_cache_bytes", self.kv_cache_bytes, 1, GeometryError)

    def kv_bytes(self) -> int:
        return self.kv_cache_bytes


# Memory for the KV cache: what is left of a device's budget, or a size given outright.
KvBudget = MemoryBudget | KvCacheBytes


def capacity_tokens(geometry: KvGeometry, budget: KvBudget) -> int:
    """Whole tokens the budget's KV memory holds; may be 0 if one token does not fit."""
    return budget.kv_bytes() // geometry.bytes_per_token


def capacity_blocks(geometry: KvGeometry, budget: KvBudget, block_size: int) -> int:
    """Whole blocks (rounded down) the budget's KV memory holds; always >= 1. This is vLLM's
    ``available_memory // bytes_per_block`` (`get_kv_cache_config_from_groups` in
    vllm/v1/core/kv_cache_utils.py), of which block 0 becomes its null block.

    Raises GeometryError if not even one block fits.
    """
    block_bytes = geometry.bytes_per_block(block_size)
    kv = budget.kv_bytes()
    blocks = kv // block_bytes
    if blocks == 0:
        raise GeometryError(
            f"block_size: one block of {block_size} tokens needs {block_bytes} bytes, "
            f"but the budget leaves only {kv} bytes for the KV cache"
        )
    return blocks


def blocks_for_tokens(tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``tokens`` (>= 0) tokens: ceil(tokens / block_size)."""
    _check_int("tokens", tokens, 0, ValueError)
    _check_int("block_size", block_size, 1, ValueError)
    return -(-tokens // block_size)


def _check_request(prompt_tokens: int, max_output_tokens: int, n: int) -> None:
    _check_int("prompt_tokens", prompt_tokens, 1, ValueError)
    _check_int("max_output_tokens", max_output_tokens, 0, ValueError)
    _check_int("n", n, 1, ValueError)


def output_kv_tokens(max_output_tokens: int) -> int:
    """Output tokens whose KV a sequence can come to hold: all but the last. vLLM computes a
    token's KV in the step after it was sampled, and a request that sampled its last token is
    finished in that step (`allocate_slots` in vllm/v1/core/kv_cache_manager.py asks slots only
    for the tokens it computes). With no output at all the prompt alone is computed."""
    return max(max_output_tokens, 1) - 1


def blocks_for_request(prompt_tokens: int, max_output_tokens: int, n: int, block_size: int) -> int:
    """Worst-case blocks vLLM gives a request that samples ``n`` sequences from one prompt.

    The prompt's full blocks are shared by all ``n`` sequences (prefix sharing); each
    sequence owns its partial prompt block plus the output tokens it computes
    (``output_kv_tokens``): ``p // bs + n * ceil((p % bs + max(max_out, 1) - 1) / bs)``. With
    n == 1 this is ``blocks_for_tokens(p + max(max_out, 1) - 1, bs)``, and it never decreases
    as n grows. Preconditions (ValueError otherwise): p >= 1, max_out >= 0, n >= 1, bs >= 1.
    """
    _check_request(prompt_tokens, max_output_tokens, n)
    _check_int("block_size", block_size, 1, ValueError)
    shared, partial = divmod(prompt_tokens, block_size)
    return shared + n * blocks_for_tokens(partial + output_kv_tokens(max_output_tokens), block_size)


def tokens_in_flight(prompt_tokens: int, max_output_tokens: int, n: int) -> int:
    """Worst-case tokens a request contributes, counting each sequence in full: (p + max_out) * n.

    Same preconditions as ``blocks_for_request`` (ValueError otherwise).
    """
    _check_request(prompt_tokens, max_output_tokens, n)
    return (prompt_tokens + max_output_tokens) * n
