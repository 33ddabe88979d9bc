"""The instance state machine alone, in process, beside vLLM's own KVCacheManager doing the same
work: an Admit+Release of one request (1,280 prompt tokens = 80 hashed blocks, 256 output tokens:
96 blocks), its prefix cached after the first. Also the cost at 1,000,000 slots against 1,000,
the memory of a 1,000,000-slot instance, offboarding 100,000 cached blocks, and rebuilding a
1,000,000-slot instance from its image.

    python -m bench.state_machine [--runs 3] [--pairs 2000] [--json]

vLLM runs in the engines' virtual environment (KVQUOTA_ENGINES_PYTHON, else .venv-engines, as
`make test-engines` builds it); without one its column says so. Writes
docs/benchmarks-state-machine.md unless --json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

from quota_service.config import Settings
from quota_service.core.admission import AdmitRequest
from quota_service.core.hashing import forget_digests
from quota_service.core.instance_machine import InstanceMachine, TenantSettings
from quota_service.core.model import (
    AdmitParams,
    EndReason,
    InstanceSpec,
    TenantQuota,
    TenantState,
)

BLOCK_SIZE = 16
PROMPT_TOKENS = 1280
OUTPUT_TOKENS = 256
NOW = 1_700_000_000.0
ROOT = Path(__file__).resolve().parent.parent
REPORT = ROOT / "docs" / "benchmarks-state-machine.md"


def build(slots: int) -> InstanceMachine:
    spec = InstanceSpec("bench", "bench", None, BLOCK_SIZE, slots, 1 << 20)
    machine = InstanceMachine(spec, Settings().admission_limits)
    quota = TenantQuota(10**9, 10**12, 1000, 10**9, 0)
    machine.set_tenant(TenantSettings("t", TenantState.ACTIVE, quota, 1, "salt", "tenants/t"))
    return machine


def pair_seconds(slots: int, pairs: int) -> float:
    """Mean seconds per Admit+Release of the same request (its prefix cached)."""
    machine = build(slots)
    token_ids = tuple(range(PROMPT_TOKENS))

    def pair(i: int) -> None:
        # Every block hashed each time, as vLLM's block hasher hashes each new Request's: the
        # digests the machine keeps for a shared prefix are forgotten first.
        forget_digests()
        params = AdmitParams("t", f"r{i}", "bench", PROMPT_TOKENS, OUTPUT_TOKENS, 1, 0)
        machine.admit(AdmitRequest(params, token_ids, 0.0, None), NOW)
        machine.end("t", f"r{i}", EndReason.RELEASED, NOW)

    for i in range(200):
        pair(i)
    start = time.perf_counter()
    for i in range(200, 200 + pairs):
        pair(i)
    return (time.perf_counter() - start) / pairs


def engines_python() -> str | None:
    named = os.environ.get("KVQUOTA_ENGINES_PYTHON")
    default = ROOT / ".venv-engines" / "bin" / "python"
    if named:
        return named
    return str(default) if default.exists() else None


def vllm_pair_seconds(python: str, pairs: int) -> float:
    script = ROOT / "bench" / "vllm_kv_manager.py"
    args = [python, "-P", str(script), "4096", str(BLOCK_SIZE)]
    args += [str(PROMPT_TOKENS), str(OUTPUT_TOKENS), str(pairs)]
    done = subprocess.run(args, capture_output=True, text=True, check=True, timeout=600)
    return float(json.loads(done.stdout.strip().splitlines()[-1])["seconds_per_pair"])


def traced_bytes(slots: int) -> int:
    tracemalloc.start()
    machine = build(slots)
    size, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del machine
    return size


def offboard_seconds(cached: int) -> float:
    """Offboarding a tenant whose `cached` blocks sit in the cache of a 1,000,000-slot pool."""
    machine = build(1_000_000)
    per_request = PROMPT_TOKENS // BLOCK_SIZE
    for i in range(cached // per_request):
        ids = tuple(range(i * PROMPT_TOKENS, (i + 1) * PROMPT_TOKENS))
        params = AdmitParams("t", f"r{i}", "bench", PROMPT_TOKENS, 1, 1, 0)
        machine.admit(AdmitRequest(params, ids, 0.0, None), NOW)
        machine.end("t", f"r{i}", EndReason.RELEASED, NOW)
    start = time.perf_counter()
    machine.offboard("t", NOW)
    return time.perf_counter() - start


def recover_seconds(cached: int, live: int) -> float:
    """Rebuilding a 1,000,000-slot instance from its image: `cached` blocks in the cache and
    `live` reservations of 96 blocks (the in-memory half of a new owner's recovery)."""
    machine = build(1_000_000)
    per_request = PROMPT_TOKENS // BLOCK_SIZE
    for i in range(cached // per_request):
        ids = tuple(range(i * PROMPT_TOKENS, (i + 1) * PROMPT_TOKENS))
        params = AdmitParams("t", f"c{i}", "bench", PROMPT_TOKENS, 1, 1, 0)
        machine.admit(AdmitRequest(params, ids, 0.0, None), NOW)
        machine.end("t", f"c{i}", EndReason.RELEASED, NOW)
    for i in range(live):
        params = AdmitParams("t", f"l{i}", "bench", PROMPT_TOKENS, OUTPUT_TOKENS, 1, 0)
        machine.admit(AdmitRequest(params, (), 0.0, None), NOW)
    image = machine.image()
    tenants = [here.settings for here in machine.tenants.values()]
    start = time.perf_counter()
    InstanceMachine.recover(machine.spec, machine.limits, tenants, image, 1 << 32)
    return time.perf_counter() - start


def spread(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def measure(runs: int, pairs: int, progress: Callable[[str], None]) -> dict[str, object]:
    python = engines_python()
    ours_small: list[float] = []
    ours_large: list[float] = []
    vllm: list[float] = []
    for run in range(1, runs + 1):
        # Interleaved, so that whatever else the machine does weighs on both alike.
        progress(f"run {run}/{runs}: state machine, 1,000 slots")
        ours_small.append(pair_seconds(1_000, pairs))
        progress(f"run {run}/{runs}: state machine, 1,000,000 slots")
        ours_large.append(pair_seconds(1_000_000, pairs))
        if python is not None:
            progress(f"run {run}/{runs}: vLLM KVCacheManager")
            vllm.append(vllm_pair_seconds(python, pairs))
    progress("memory of a 1,000,000-slot instance")
    memory = traced_bytes(1_000_000)
    progress("offboarding 100,000 cached blocks")
    offboard = offboard_seconds(100_000)
    progress("recovering 1,000,000 slots: 100,000 cached, 400 live reservations")
    recover = recover_seconds(100_000, 400)
    return {
        "pair_ms_1k_slots": spread([s * 1e3 for s in ours_small]),
        "pair_ms_1m_slots": spread([s * 1e3 for s in ours_large]),
        "vllm_pair_ms": spread([s * 1e3 for s in vllm]) if vllm else None,
        "bytes_1m_slots": memory,
        "offboard_100k_cached_s": offboard,
        "recover_1m_slots_s": recover,
        "runs": runs,
        "pairs": pairs,
    }


def render(result: dict[str, object]) -> str:
    def row(label: str, figures: object) -> str:
        if not isinstance(figures, dict):
            return f"| {label} | not measured (no engines environment) | | |"
        return (
            f"| {label} | {figures['min']:.3f} | {figures['median']:.3f} | {figures['max']:.3f} |"
        )

    lines = [
        "# The instance state machine in process",
        "",
        "Generated by `python -m bench.state_machine` (part of `make bench`).",
        f"One Admit+Release of the same request ({PROMPT_TOKENS} prompt tokens with their ids,",
        f"{OUTPUT_TOKENS} output tokens, block size 16: 80 hashed blocks and 96 in all; its",
        f"prefix cached after the first), {result['pairs']} pairs per run, {result['runs']} runs",
        "interleaved.",
        "",
        "| ms per Admit+Release | min | median | max |",
        "|---|---|---|---|",
        row("state machine, 1,000 slots", result["pair_ms_1k_slots"]),
        row("state machine, 1,000,000 slots", result["pair_ms_1m_slots"]),
        row(
            "vLLM KVCacheManager (Request + get_computed_blocks + allocate_slots + free)",
            result["vllm_pair_ms"],
        ),
        "",
        f"- Memory of a 1,000,000-slot instance: {int(str(result['bytes_1m_slots'])) / 1e6:.1f} MB"
        " (traced allocations).",
        f"- Offboarding a tenant with 100,000 cached blocks on it: "
        f"{float(str(result['offboard_100k_cached_s'])):.3f} s.",
        "- Rebuilding a 1,000,000-slot instance from its image (100,000 cached blocks, 400 live",
        f"  reservations of 96 blocks): {float(str(result['recover_1m_slots_s'])):.3f} s.",
        "  In memory only; `python -m bench.journal` measures the whole way, reading the record",
        "  from PostgreSQL included.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--pairs", type=int, default=2000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = measure(args.runs, args.pairs, lambda line: print(line, file=sys.stderr, flush=True))
    if args.json:
        print(json.dumps(result, indent=2))
        return
    text = render(result)
    REPORT.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
