"""The drift benchmark as a contract test: the ledger books what a real vLLM holds, request by
request, under a mixed load (bench/fidelity.py). It runs one round of the load here (about a
minute); `make bench-fidelity` runs it for minutes (KVQUOTA_FIDELITY_SECONDS) and writes the
figures to docs/benchmarks-fidelity.md (KVQUOTA_FIDELITY_REPORT)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from bench.fidelity import Endpoints, FidelityRun, write
from bench.harness import machine
from quota_service.api.server import HotPath
from quota_service.core.reclaim import DEFAULT_WATERMARKS
from quota_service.enforcement.cpu_tier_mirror import CpuTierMirror
from quota_service.enforcement.termination import Termination
from quota_service.jobs.reclaim_executor import ReclaimExecutor
from quota_service.store.cpu_tier import CpuTierBooks
from tests.engines.conftest import Followed


@pytest.mark.timeout(1200)  # vLLM's start, then a round (or KVQUOTA_FIDELITY_SECONDS) of load
async def test_the_ledger_books_what_vllm_holds(
    followed: Followed, engine: AsyncEngine, database_url: str, owned: HotPath
) -> None:
    seconds = float(os.environ.get("KVQUOTA_FIDELITY_SECONDS", "0"))  # 0: one round
    live, ledger = followed.live, followed.ledger
    termination = Termination(ledger, abort_timeout_seconds=5, hard_timeout_seconds=30)
    jobs = owned.reclaim(engine, DEFAULT_WATERMARKS)
    where = Endpoints("live", "acme", live.model, live.base_url, live.events, live.replay)
    run = FidelityRun(
        where,
        engine,
        ledger,
        owned.reconciler(engine),
        owned.inspection(engine),
        termination,
        ReclaimExecutor(jobs, termination, CpuTierMirror(CpuTierBooks(engine))),
        jobs,
    )
    try:
        report = await run.run(seconds)
    finally:
        await termination.close()
    if out := os.environ.get("KVQUOTA_FIDELITY_REPORT"):
        described = machine(database_url)
        write(report, f"{described['cpu']}, {described['cores']} cores", Path(out))
    before_reclaim = [r for r in report.requests if not r.phase.startswith("repeats after")]
    assert [r for r in before_reclaim if not r.agrees] == []
    # Once the ledger applied every event, the cached sets are equal after every phase before
    # the reclaim (whose FREE step drops blocks in the ledger only: vLLM has no call for it),
    # cut requests included: the cached blocks their reserved output displaced at admission,
    # which vLLM evicts only as it generates, are cached again when they end.
    reclaim = next(i for i, p in enumerate(report.phases) if p.phase.startswith("reclaim"))
    settled = report.phases[:reclaim]
    assert any(p.phase.endswith("cancel and abort") for p in settled)
    assert all(p.caught_up and p.only_in_ledger == p.only_in_engine == 0 for p in settled), settled
    # And never does the ledger know a cached block the engine dropped (the engine's copies of
    # a hash counted as the follower counts them).
    assert [p for p in report.phases if p.only_in_ledger] == []
    assert (report.drift_blocks, report.resyncs) == (0, 0)
    assert report.evictions_followed > 0  # the pool was small enough that the engine evicted
