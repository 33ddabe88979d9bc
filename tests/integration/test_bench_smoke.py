"""The benchmark suite's smoke form (`python -m bench.suite --quick`) runs end to end against the
test PostgreSQL, so the harness cannot rot: every scenario, the pgbench reference, the profile
and the report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import processes

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.bench_smoke
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quick_suite_measures_every_scenario(server_url: str, tmp_path: Path) -> None:
    docs = tmp_path / "benchmarks.md"
    env = {**os.environ, "KVQUOTA_DATABASE_URL": server_url}
    suite = processes.popen(
        # A quarter of a second a load point (the smoke form's own default is half a second),
        # after a warm-up as long: the test asks only that every figure be measured, not how
        # well. The queue mix keeps its own two seconds.
        [
            sys.executable,
            "-m",
            "bench.suite",
            "--quick",
            "--seconds",
            "0.25",
            "--json",
            "--docs",
            str(docs),
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        stdout, stderr = suite.communicate(timeout=280)
    finally:
        processes.stop(suite)  # and the servers it started, should it have left any
    assert suite.returncode == 0, stderr[-3000:]
    result = json.loads(stdout)

    # Every target got a figure, and the suite says whether it is met.
    assert {t["key"] for t in result["targets"]} >= {
        "throughput_no_prefix",
        "throughput_prefix",
        "throughput_of_floor",
        "server_cpu",
        "fleet",
        "p99_half_load",
        "pool_size",
        "offboarding",
        "reclaim_plan",
        "memory",
    }
    for target in result["targets"]:
        assert target["median"] is not None, target
        assert isinstance(target["met"], bool), target
    figures = result["figures"]
    for key in (
        "pgbench_tps",
        "grpc_floor_pairs_per_second",
        "pairs_per_second_no_prefix",
        "pairs_per_second_prefix",
        "operations_per_commit_no_prefix",
        "forwarded_pairs_per_second",
        "forwarding_cpu_ms_per_pair",
        "forwarded_owner_cpu_ms_per_pair",
        "half_no_prefix_admit_p99_ms",
        "pool_small_admit_p50_ms",
        "pool_big_admit_p50_ms",
        "queue_pairs_per_second",
        "offboard_seconds",
        "reclaim_plan_seconds",
        "server_peak_rss_mib",
    ):
        assert figures[key]["median"] > 0, key
    assert figures["offboard_blocks"]["median"] >= 1_920
    assert all(p["refused"] == 0 for run in result["runs"] for p in run["points"])

    report = docs.read_text()
    assert "## Targets" in report and "pgbench -N -c 1" in report
    assert "<!-- BEGIN ANALYSIS -->" in report


@pytest.mark.bench_smoke
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_instruction_count_of_server_and_floor(server_url: str) -> None:
    """`python -m bench.instructions` counts both processes' instructions over the pairs alone:
    a server does more per pair than the bare floor, and both do some."""
    counting = processes.popen(
        [sys.executable, "-m", "bench.instructions", "--clients", "2", "--pairs", "3", "--json"],
        cwd=ROOT,
        env={**os.environ, "KVQUOTA_DATABASE_URL": server_url},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        stdout, stderr = counting.communicate(timeout=280)
    finally:
        processes.stop(counting)  # and the servers it started under valgrind, if any are left
    assert counting.returncode == 0, stderr[-3000:]
    result = json.loads(stdout)
    assert result["server"]["pairs"] == result["floor"]["pairs"] == 6
    assert result["floor"]["instructions_per_pair"] > 100_000
    assert result["server_of_floor"] > 1
