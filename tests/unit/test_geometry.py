"""Unit tests for quota_service.core.geometry, pinned to hand-checked reference figures."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from quota_service.core.geometry import (
    GeometryError,
    KvCacheBytes,
    KvDtype,
    KvGeometry,
    MemoryBudget,
    blocks_for_request,
    blocks_for_tokens,
    capacity_blocks,
    capacity_tokens,
    dtype_bytes,
    geometry_from_hf_config,
    parse_dtype,
    tokens_in_flight,
)

GiB = 1024**3
MiB = 1024**2

LLAMA_8B = KvGeometry(num_layers=32, num_kv_heads=8, head_dim=128, dtype=KvDtype.BF16)

# Trimmed copy of Qwen/Qwen2.5-7B config.json; the extra keys check they are ignored.
QWEN25_7B_CONFIG: dict[str, object] = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "hidden_act": "silu",
    "hidden_size": 3584,
    "initializer_range": 0.02,
    "intermediate_size": 18944,
    "max_position_embeddings": 131072,
    "max_window_layers": 28,
    "model_type": "qwen2",
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 131072,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.40.1",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 152064,
}

LLAMA3_8B_CONFIG: dict[str, object] = {
    "model_type": "llama",
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 32,
    "torch_dtype": "bfloat16",
}

# DeepSeek-V3 lists 128 KV heads, but MLA caches a single latent, so they must be ignored.
DEEPSEEK_V3_CONFIG: dict[str, object] = {
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "num_hidden_layers": 61,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "torch_dtype": "bfloat16",
}


# --- dtypes -------------------------------------------------------------------------------


def test_dtype_bytes() -> None:
    assert [dtype_bytes(d) for d in KvDtype] == [4, 2, 2, 1, 1]


def test_fp16_and_bf16_are_distinct_members() -> None:
    # Equal enum values would alias; all five members must survive.
    assert [d.name for d in KvDtype] == ["FP32", "FP16", "BF16", "FP8", "INT8"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("float32", KvDtype.FP32),
        ("fp32", KvDtype.FP32),
        ("float16", KvDtype.FP16),
        ("fp16", KvDtype.FP16),
        ("half", KvDtype.FP16),
        ("bfloat16", KvDtype.BF16),
        ("BF16", KvDtype.BF16),
        ("fp8", KvDtype.FP8),
        ("float8_e4m3fn", KvDtype.FP8),
        ("Float8_E5M2", KvDtype.FP8),
        ("fp8_e4m3", KvDtype.FP8),
        ("fp8_e5m2", KvDtype.FP8),
        ("INT8", KvDtype.INT8),
    ],
)
def test_parse_dtype(text: str, expected: KvDtype) -> None:
    assert parse_dtype(text) is expected


@pytest.mark.parametrize("dtype", list(KvDtype))
def test_parse_dtype_round_trips_value(dtype: KvDtype) -> None:
    assert parse_dtype(dtype.value) is dtype


@pytest.mark.parametrize("text", ["auto", "float64", "int4", ""])
def test_parse_dtype_rejects_unknown(text: str) -> None:
    with pytest.raises(GeometryError, match="dtype"):
        parse_dtype(text)


def test_geometry_error_is_value_error() -> None:
    assert issubclass(GeometryError, ValueError)


# --- KvGeometry ---------------------------------------------------------------------------


def test_llama_8b_bytes_per_token() -> None:
    assert LLAMA_8B.bytes_per_token == 131072


def test_1536_tokens_is_192_mib() -> None:
    assert (1024 + 512) * LLAMA_8B.bytes_per_token == 192 * MiB == 201326592


def test_qwen25_7b_bytes_per_token() -> None:
    assert KvGeometry(28, 4, 128, KvDtype.BF16).bytes_per_token == 57344


def test_fp8_halves_bf16_and_int8_is_one_byte_per_element() -> None:
    fp8 = KvGeometry(32, 8, 128, KvDtype.FP8)
    assert fp8.bytes_per_token * 2 == LLAMA_8B.bytes_per_token
    assert KvGeometry(1, 1, 1, KvDtype.INT8).bytes_per_token == 2  # K and V, 1 byte each
    assert KvGeometry(1, 1, 1, KvDtype.FP32).bytes_per_token == 8


def test_mla_stores_one_latent_without_separate_v() -> None:
    geometry = KvGeometry(61, 1, 512 + 64, KvDtype.BF16, mla=True)
    assert geometry.bytes_per_token == 61 * 576 * 2


def test_bytes_per_block() -> None:
    assert LLAMA_8B.bytes_per_block(16) == 16 * 131072
    assert LLAMA_8B.bytes_per_block(1) == LLAMA_8B.bytes_per_token


@pytest.mark.parametrize("block_size", [0, -16])
def test_bytes_per_block_rejects_non_positive(block_size: int) -> None:
    with pytest.raises(GeometryError, match="block_size"):
        LLAMA_8B.bytes_per_block(block_size)


@pytest.mark.parametrize("field", ["num_layers", "num_kv_heads", "head_dim"])
@pytest.mark.parametrize("value", [0, -1])
def test_geometry_rejects_non_positive_fields(field: str, value: int) -> None:
    kwargs: dict[str, object] = {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128}
    kwargs[field] = value
    with pytest.raises(GeometryError, match=field):
        KvGeometry(dtype=KvDtype.BF16, **kwargs)  # type: ignore[arg-type]


def test_geometry_rejects_non_integer_fields() -> None:
    with pytest.raises(GeometryError, match="head_dim"):
        KvGeometry(32, 8, 128.0, KvDtype.BF16)  # type: ignore[arg-type]
    with pytest.raises(GeometryError, match="num_layers"):
        KvGeometry(True, 8, 128, KvDtype.BF16)


def test_geometry_rejects_non_dtype() -> None:
    with pytest.raises(GeometryError, match="dtype"):
        KvGeometry(32, 8, 128, "bf16")  # type: ignore[arg-type]


def test_mla_requires_single_kv_head() -> None:
    with pytest.raises(GeometryError, match="num_kv_heads"):
        KvGeometry(61, 8, 576, KvDtype.BF16, mla=True)


def test_geometry_is_frozen() -> None:
    with pytest.raises(AttributeError):
        LLAMA_8B.num_layers = 1  # type: ignore[misc]


# --- geometry_from_hf_config --------------------------------------------------------------


def test_qwen25_7b_from_real_config() -> None:
    geometry = geometry_from_hf_config(QWEN25_7B_CONFIG)
    assert geometry == KvGeometry(28, 4, 128, KvDtype.BF16)
    assert geometry.bytes_per_token == 57344


def test_llama3_8b_head_dim_derived_from_hidden_size() -> None:
    geometry = geometry_from_hf_config(LLAMA3_8B_CONFIG)
    assert geometry == LLAMA_8B
    assert geometry.bytes_per_token == 131072


def test_missing_kv_heads_defaults_to_attention_heads() -> None:
    config = {k: v for k, v in LLAMA3_8B_CONFIG.items() if k != "num_key_value_heads"}
    assert geometry_from_hf_config(config).num_kv_heads == 32
    assert geometry_from_hf_config({**config, "num_key_value_heads": None}).num_kv_heads == 32


def test_explicit_head_dim_wins_over_hidden_size() -> None:
    # Gemma-style: head_dim is not hidden_size // heads.
    config = {**LLAMA3_8B_CONFIG, "hidden_size": 3072, "num_attention_heads": 16, "head_dim": 256}
    assert geometry_from_hf_config(config).head_dim == 256
    assert geometry_from_hf_config({**config, "head_dim": None}).head_dim == 192


def test_deepseek_v3_mla_config() -> None:
    geometry = geometry_from_hf_config(DEEPSEEK_V3_CONFIG)
    assert geometry == KvGeometry(61, 1, 576, KvDtype.BF16, mla=True)
    assert geometry.bytes_per_token == 61 * 576 * 2


def test_null_kv_lora_rank_is_not_mla() -> None:
    geometry = geometry_from_hf_config({**LLAMA3_8B_CONFIG, "kv_lora_rank": None})
    assert not geometry.mla


def test_mla_config_requires_rope_head_dim() -> None:
    config = {k: v for k, v in DEEPSEEK_V3_CONFIG.items() if k != "qk_rope_head_dim"}
    with pytest.raises(GeometryError, match="qk_rope_head_dim"):
        geometry_from_hf_config(config)


def test_dtype_argument_wins_over_config() -> None:
    geometry = geometry_from_hf_config(LLAMA3_8B_CONFIG, dtype=KvDtype.FP8)
    assert geometry.dtype is KvDtype.FP8
    assert geometry.bytes_per_token == 131072 // 2


def test_dtype_from_newer_dtype_key_and_default() -> None:
    config = {k: v for k, v in LLAMA3_8B_CONFIG.items() if k != "torch_dtype"}
    assert geometry_from_hf_config(config).dtype is KvDtype.BF16
    assert geometry_from_hf_config({**config, "dtype": "float16"}).dtype is KvDtype.FP16
    assert geometry_from_hf_config({**config, "torch_dtype": None}).dtype is KvDtype.BF16


def test_a_float32_model_is_cached_in_bfloat16_as_vllm_runs_it() -> None:
    """vLLM's `auto` dtype downcasts float32 models (`_resolve_auto_dtype`); asked for float32
    outright, the KV cache is float32."""
    config = {**LLAMA3_8B_CONFIG, "torch_dtype": "float32"}
    assert geometry_from_hf_config(config).dtype is KvDtype.BF16
    assert geometry_from_hf_config(config, KvDtype.FP32).dtype is KvDtype.FP32


def test_bad_config_dtype_raises() -> None:
    with pytest.raises(GeometryError, match="dtype"):
        geometry_from_hf_config({**LLAMA3_8B_CONFIG, "torch_dtype": "float64"})
    with pytest.raises(GeometryError, match="torch_dtype"):
        geometry_from_hf_config({**LLAMA3_8B_CONFIG, "torch_dtype": 16})


def test_text_config_is_read_for_multimodal_models() -> None:
    config: dict[str, object] = {
        "model_type": "llava",
        "torch_dtype": "float16",
        "vision_config": {"num_hidden_layers": 24, "hidden_size": 1024},
        "text_config": {k: v for k, v in LLAMA3_8B_CONFIG.items() if k != "torch_dtype"},
    }
    geometry = geometry_from_hf_config(config)
    # Shape from text_config; dtype falls back to the top level when text_config has none.
    assert geometry == KvGeometry(32, 8, 128, KvDtype.FP16)


def test_text_config_dtype_preferred_over_top_level() -> None:
    config = {"torch_dtype": "float32", "text_config": LLAMA3_8B_CONFIG}
    assert geometry_from_hf_config(config).dtype is KvDtype.BF16


def test_top_level_layers_take_precedence_over_text_config() -> None:
    config = {**LLAMA3_8B_CONFIG, "text_config": {**LLAMA3_8B_CONFIG, "num_hidden_layers": 2}}
    assert geometry_from_hf_config(config).num_layers == 32


@pytest.mark.parametrize("key", ["num_hidden_layers", "num_attention_heads", "hidden_size"])
def test_missing_required_key_is_named(key: str) -> None:
    config = {k: v for k, v in LLAMA3_8B_CONFIG.items() if k != key}
    with pytest.raises(GeometryError, match=key):
        geometry_from_hf_config(config)


@pytest.mark.parametrize("value", ["32", 32.0, True, None, 0])
def test_invalid_required_value_is_named(value: object) -> None:
    with pytest.raises(GeometryError, match="num_hidden_layers"):
        geometry_from_hf_config({**LLAMA3_8B_CONFIG, "num_hidden_layers": value})


def test_non_integer_optional_key_is_named() -> None:
    with pytest.raises(GeometryError, match="num_key_value_heads"):
        geometry_from_hf_config({**LLAMA3_8B_CONFIG, "num_key_value_heads": "8"})


# --- MemoryBudget and capacity ------------------------------------------------------------


def test_24gib_card_holds_49152_tokens() -> None:
    budget = MemoryBudget(24 * GiB, 16 * GiB, 2 * GiB, utilization=1.0)
    assert budget.kv_bytes() == 6 * GiB
    assert capacity_tokens(LLAMA_8B, budget) == 49152
    assert capacity_blocks(LLAMA_8B, budget, 16) == 49152 // 16


def test_utilization_is_applied_to_total_and_rounded_up_as_vllm_does() -> None:
    budget = MemoryBudget(total_bytes=1001, weights_bytes=100, utilization=0.5)
    assert budget.kv_bytes() == math.ceil(1001 * 0.5) - 100 == 401


def test_vllms_default_utilization_applies_unless_given() -> None:
    """The issue's example: Llama-3-8B on 80 GiB with 16 GiB of weights. At utilization 1.0
    the cache would hold 32,768 blocks; vLLM's default 0.92 leaves ceil(80 GiB x 0.92) - 16 GiB
    for 29,491 blocks of 2 MiB."""
    budget = MemoryBudget(total_bytes=80 * GiB, weights_bytes=16 * GiB)
    assert budget.utilization == 0.92
    assert capacity_blocks(LLAMA_8B, budget, 16) == 29491
    whole = MemoryBudget(80 * GiB, 16 * GiB, utilization=1.0)
    assert capacity_blocks(LLAMA_8B, whole, 16) == 32768


def test_a_kv_cache_given_in_bytes_is_the_budget() -> None:
    assert capacity_blocks(LLAMA_8B, KvCacheBytes(5 * (2 << 20) - 1), 16) == 4
    with pytest.raises(GeometryError, match="kv_cache_bytes"):
        KvCacheBytes(0)


def test_budget_with_nothing_left_raises() -> None:
    budget = MemoryBudget(total_bytes=24 * GiB, weights_bytes=16 * GiB, overhead_bytes=8 * GiB)
    with pytest.raises(GeometryError, match="no memory for the KV cache"):
        budget.kv_bytes()
    with pytest.raises(GeometryError, match="no memory for the KV cache"):
        capacity_tokens(LLAMA_8B, budget)


def test_utilization_can_exhaust_budget() -> None:
    budget = MemoryBudget(total_bytes=24 * GiB, weights_bytes=16 * GiB, utilization=0.5)
    with pytest.raises(GeometryError, match="no memory for the KV cache"):
        budget.kv_bytes()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"total_bytes": 0, "weights_bytes": 0}, "total_bytes"),
        ({"total_bytes": -1, "weights_bytes": 0}, "total_bytes"),
        ({"total_bytes": GiB, "weights_bytes": -1}, "weights_bytes"),
        ({"total_bytes": GiB, "weights_bytes": 0, "overhead_bytes": -1}, "overhead_bytes"),
        ({"total_bytes": GiB, "weights_bytes": 0, "utilization": 0.0}, "utilization"),
        ({"total_bytes": GiB, "weights_bytes": 0, "utilization": -0.5}, "utilization"),
        ({"total_bytes": GiB, "weights_bytes": 0, "utilization": 1.01}, "utilization"),
        ({"total_bytes": GiB, "weights_bytes": 0, "utilization": math.nan}, "utilization"),
        ({"total_bytes": GiB, "weights_bytes": 0, "utilization": "0.9"}, "utilization"),
        ({"total_bytes": float(GiB), "weights_bytes": 0}, "total_bytes"),
    ],
)
def test_budget_rejects_invalid_fields(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(GeometryError, match=field):
        MemoryBudget(**kwargs)  # type: ignore[arg-type]


def test_capacity_blocks_rounds_down() -> None:
    block = LLAMA_8B.bytes_per_block(16)
    budget = MemoryBudget(total_bytes=4 * block - 1, weights_bytes=0, utilization=1.0)
    assert capacity_blocks(LLAMA_8B, budget, 16) == 3
    assert capacity_tokens(LLAMA_8B, budget) == 4 * 16 - 1


def test_capacity_blocks_raises_when_no_block_fits() -> None:
    budget = MemoryBudget(total_bytes=LLAMA_8B.bytes_per_block(16) - 1, weights_bytes=0)
    with pytest.raises(GeometryError, match="block_size"):
        capacity_blocks(LLAMA_8B, budget, 16)


def test_capacity_tokens_may_be_zero() -> None:
    budget = MemoryBudget(total_bytes=LLAMA_8B.bytes_per_token - 1, weights_bytes=0)
    assert capacity_tokens(LLAMA_8B, budget) == 0


# --- block arithmetic ---------------------------------------------------------------------


def test_1500_tokens_is_94_blocks() -> None:
    assert blocks_for_tokens(1500, 16) == 94


def test_blocks_for_tokens_edges() -> None:
    assert blocks_for_tokens(0, 16) == 0
    assert blocks_for_tokens(16, 16) == 1
    assert blocks_for_tokens(17, 16) == 2


@pytest.mark.parametrize(("tokens", "block_size"), [(-1, 16), (10, 0), (10, -16)])
def test_blocks_for_tokens_rejects_invalid(tokens: int, block_size: int) -> None:
    with pytest.raises(ValueError):
        blocks_for_tokens(tokens, block_size)


@pytest.mark.parametrize(
    ("prompt", "max_out", "n", "block_size", "expected"),
    [
        (4096, 2048, 1, 16, 384),
        (2048, 1024, 1, 16, 192),
        (100, 20, 4, 16, 6 + 4 * 2),
        (4096, 0, 1, 16, 256),
        (4096, 0, 8, 16, 256),  # exact multiple, no output: only shared blocks
        (1, 0, 3, 16, 3),
        # vLLM never computes the last output token's KV: 1,024 + 1 tokens fit 64 blocks.
        (1024, 1, 1, 16, 64),
        (1024, 17, 1, 16, 65),
        (1023, 1, 2, 16, 63 + 2),
    ],
)
def test_blocks_for_request(
    prompt: int, max_out: int, n: int, block_size: int, expected: int
) -> None:
    assert blocks_for_request(prompt, max_out, n, block_size) == expected


@pytest.mark.parametrize(
    "args",
    [(0, 10, 1, 16), (10, -1, 1, 16), (10, 10, 0, 16), (10, 10, 1, 0), (10.0, 10, 1, 16)],
)
def test_blocks_for_request_rejects_invalid(args: tuple[int, int, int, int]) -> None:
    with pytest.raises(ValueError):
        blocks_for_request(*args)


def test_tokens_in_flight() -> None:
    assert tokens_in_flight(1024, 512, 1) == 1536
    assert tokens_in_flight(100, 20, 4) == 480
    with pytest.raises(ValueError, match="n"):
        tokens_in_flight(100, 20, 0)


# --- properties ---------------------------------------------------------------------------

prompts = st.integers(min_value=1, max_value=1_000_000)
outputs = st.integers(min_value=0, max_value=1_000_000)
fanouts = st.integers(min_value=1, max_value=64)
block_sizes = st.integers(min_value=1, max_value=256)


@given(prompts, outputs, block_sizes)
def test_single_sequence_request_is_plain_ceiling(p: int, m: int, bs: int) -> None:
    assert blocks_for_request(p, m, 1, bs) == blocks_for_tokens(p + max(m, 1) - 1, bs)


@given(prompts, outputs, fanouts, block_sizes)
def test_fanout_costs_between_one_and_n_unshared_sequences(p: int, m: int, n: int, bs: int) -> None:
    blocks = blocks_for_request(p, m, n, bs)
    computed = p + max(m, 1) - 1
    assert blocks_for_request(p, m, 1, bs) <= blocks <= n * blocks_for_tokens(computed, bs)
    # Every token the engine computes has a slot: shared prompt blocks plus per-sequence tails.
    assert blocks * bs >= (p // bs) * bs + n * (computed - p // bs * bs)
