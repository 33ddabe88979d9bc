"""`kvquota plan`'s arithmetic reproduces the reference figures: 128 KiB per token for
Llama-3-8B, a 48k-token KV budget on 24 GiB less 16 GiB of weights and 2 GiB of overhead, and a
Little's-law concurrency of 207 for 20 requests/s held 10.34 s each."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from quota_service.cli import main as cli_main
from quota_service.core.capacity import littles_law, plan_capacity
from quota_service.core.geometry import GeometryError, MemoryBudget, geometry_from_hf_config
from tests.unit.test_geometry import LLAMA3_8B_CONFIG

GIB = 1 << 30


def test_the_reference_figures() -> None:
    geometry = geometry_from_hf_config(LLAMA3_8B_CONFIG)
    budget = MemoryBudget(24 * GIB, 16 * GIB, 2 * GIB)
    plan = plan_capacity(geometry, budget, 16, [8192, 2048], 20, 10.34)
    assert plan.bytes_per_token == 128 * 1024
    assert (plan.tokens, plan.blocks, plan.bytes_per_block) == (48 * 1024, 3072, 2 << 20)
    assert [(f.context_tokens, f.blocks_per_request, f.max_concurrency) for f in plan.fits] == [
        (2048, 128, 24),
        (8192, 512, 6),
    ]
    assert plan.needed_concurrency == 207
    # The cache holds 24 of the shortest requests at once: fewer than the load needs, so that
    # bounds vLLM's batch (kvquota's admission holds longer requests back).
    assert (plan.num_gpu_blocks_override, plan.max_num_seqs) == (3072, 24)
    light = plan_capacity(geometry, budget, 16, [2048], 1, 10)
    assert light.max_num_seqs == 10  # the load needs fewer than fit
    assert plan.max_num_batched_tokens == 8192


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
    assert "--num-gpu-blocks-override 3072" in out and "max_num_queued_tokens 16000" in out
    assert cli_main([*command, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (plan["tokens"], plan["needed_concurrency"]) == (49152, 207)
    assert cli_main([*command[:2], str(tmp_path / "missing.json"), *command[3:]]) == 2
    assert "missing.json" in capsys.readouterr().err


def test_float_noise_adds_no_request() -> None:
    assert littles_law(0.1, 30) == 3
