"""`kvquota plan`'s arithmetic reproduces the reference figures: 128 KiB per token for
Llama-3-8B, a 48k-token KV budget on the whole of 24 GiB less 16 GiB of weights and 2 GiB of
overhead, and a Little's-law concurrency of 207 for 20 requests/s held 10.34 s each. Its
defaults are vLLM's (tests/engines/test_plan_contract.py checks the pool against vLLM itself)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from quota_service.cli import main as cli_main
from quota_service.core.capacity import littles_law, plan_capacity
from quota_service.core.geometry import (
    VLLM_BLOCK_SIZE,
    GeometryError,
    KvCacheBytes,
    KvDtype,
    MemoryBudget,
    geometry_from_hf_config,
)
from tests.unit.test_geometry import LLAMA3_8B_CONFIG

GIB = 1 << 30


def test_the_reference_figures() -> None:
    geometry = geometry_from_hf_config(LLAMA3_8B_CONFIG)
    budget = MemoryBudget(24 * GIB, 16 * GIB, 2 * GIB, utilization=1.0)
    plan = plan_capacity(geometry, budget, 16, [8192, 2048], 20, 10.34)
    assert plan.bytes_per_token == 128 * 1024
    assert (plan.tokens, plan.blocks, plan.bytes_per_block) == (48 * 1024, 3072, 2 << 20)
    # vLLM keeps block 0 as its null block: requests share the other 3,071.
    assert plan.usable_blocks == 3071
    assert [(f.context_tokens, f.blocks_per_request, f.max_concurrency) for f in plan.fits] == [
        (2048, 128, 23),
        (8192, 512, 5),
    ]
    assert plan.needed_concurrency == 207
    # The cache holds 23 of the shortest requests at once: fewer than the load needs, so that
    # bounds vLLM's batch (kvquota's admission holds longer requests back).
    assert plan.max_num_seqs == 23
    light = plan_capacity(geometry, budget, 16, [2048], 1, 10)
    assert light.max_num_seqs == 10  # the load needs fewer than fit
    assert plan.max_num_batched_tokens == 8192
    assert plan.vllm_args == (
        "--block-size",
        "16",
        "--kv-cache-memory-bytes",
        str(6 * GIB),
        "--max-num-seqs",
        "23",
        "--max-num-batched-tokens",
        "8192",
    )


def test_every_default_is_vllms() -> None:
    """No utilization given: vLLM's 0.92 of the memory, rounded up as vLLM rounds it; block size
    16; a float32 config cached in bfloat16. A dtype the caller names is named to vLLM."""
    geometry = geometry_from_hf_config({**LLAMA3_8B_CONFIG, "torch_dtype": "float32"})
    plan = plan_capacity(geometry, MemoryBudget(80 * GIB, 16 * GIB), VLLM_BLOCK_SIZE, [2048])
    assert (plan.bytes_per_token, plan.blocks) == (128 * 1024, 29491)
    assert plan.kv_bytes == math.ceil(80 * GIB * 0.92) - 16 * GIB
    assert "--kv-cache-dtype" not in plan.vllm_args
    fp8 = plan_capacity(geometry, KvCacheBytes(GIB), 16, [2048], kv_cache_dtype=KvDtype.FP8)
    assert fp8.vllm_args[4:6] == ("--kv-cache-dtype", "fp8")
    with pytest.raises(GeometryError, match="int8"):
        plan_capacity(geometry, KvCacheBytes(GIB), 16, [2048], kv_cache_dtype=KvDtype.INT8)


def test_batched_tokens_never_fall_below_the_sequences() -> None:
    """vLLM refuses max_num_batched_tokens < max_num_seqs at start-up."""
    geometry = geometry_from_hf_config(LLAMA3_8B_CONFIG)
    plan = plan_capacity(geometry, KvCacheBytes(64 * GIB), 16, [16])
    assert plan.max_num_batched_tokens == plan.max_num_seqs > 2048


def test_littles_law_rounds_up_to_whole_requests() -> None:
    assert littles_law(20, 10.34) == 207
    assert littles_law(20, 10) == 200
    with pytest.raises(GeometryError):
        littles_law(0, 10)


def test_the_cli_prints_the_plan_and_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA3_8B_CONFIG))
    command = [
        "plan",
        "--config",
        str(config),
        "--gpu-memory",
        "24GiB",
        "--weights",
        "16GiB",
        "--overhead",
        "2GiB",
        "--utilization",
        "1",
        "--arrival-rate",
        "20",
        "--request-seconds",
        "10.34",
        "--ttft",
        "2",
        "--prefill-rate",
        "8000",
    ]
    assert cli_main(command) == 0
    out = capsys.readouterr().out
    assert "128KiB" in out and "49152" in out and "207" in out
    assert "vllm serve MODEL --block-size 16 --kv-cache-memory-bytes 6442450944" in out
    assert "max_num_queued_tokens 16000" in out
    assert cli_main([*command, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (plan["tokens"], plan["needed_concurrency"]) == (49152, 207)
    assert cli_main([*command[:2], str(tmp_path / "missing.json"), *command[3:]]) == 2
    assert "missing.json" in capsys.readouterr().err
    assert cli_main(["plan", "--config", str(config), "--gpu-memory", "24GiB"]) == 2
    assert "--kv-cache-memory" in capsys.readouterr().err
    assert cli_main(["plan", "--config", str(config), "--kv-cache-memory", "1GiB", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["blocks"] == 512


def test_float_noise_adds_no_request() -> None:
    assert littles_law(0.1, 30) == 3
