"""EVICT: a reclaim job preempts running reservations, lowest priority and most recently
admitted first; the engine aborts them before their blocks come back; the callers see
PREEMPTED; the job reports the blocks each preemption really freed."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from quota_service.api.server import HotPath
from quota_service.config import Settings
from quota_service.core import catalog
from quota_service.core.admission import AdmitRequest
from quota_service.core.errors import Code, KvQuotaError
from quota_service.core.model import EndReason, EngineEndpoints, ReservationState
from quota_service.core.reclaim import JobState, ReclaimTarget, StepState, Tier
from quota_service.enforcement.cpu_tier_mirror import CpuTierMirror
from quota_service.enforcement.termination import Termination
from quota_service.jobs.reclaim_executor import ReclaimExecutor
from quota_service.store.catalog import Catalog
from quota_service.store.cpu_tier import CpuTierBooks
from quota_service.store.reclaim import ended_before_preemption
from tests.integration.engine_stubs import closed_port
from tests.integration.invariants import assert_invariants
from tests.integration.ledger_fixtures import add_instance, add_tenant, counters, request

BS = 16


def running(
    request_id: str, tenant: str = "acme", priority: int = 0, prompt: tuple[int, ...] = ()
) -> AdmitRequest:
    """A request holding 4 blocks (63 prompt tokens and 1 output token)."""
    prompt = prompt or tuple(range(10_000, 10_000 + 4 * BS - 1))
    base = request(request_id, len(prompt), 1, tenant=tenant)
    return replace(base, params=replace(base.params, priority=priority), prompt_token_ids=prompt)


async def test_evict_preempts_lowest_priority_newest_first_and_reports_what_it_freed(
    engine: AsyncEngine, settings: Settings, owned: HotPath
) -> None:
    await add_instance(engine, blocks=64)
    await add_tenant(engine, "acme")
    await add_tenant(engine, "bolt")
    ledger = owned.ledger
    # acme's "old" and "new" share a 2-block prefix: preempting "new" frees only its own blocks.
    shared = tuple(range(2 * BS))
    await ledger.admit(running("old", prompt=shared + tuple(range(500, 500 + 2 * BS - 1))))
    await ledger.admit(running("new", prompt=shared + tuple(range(900, 900 + 2 * BS - 1))))
    await ledger.admit(running("vip", priority=5))
    await ledger.admit(running("b1", tenant="bolt"))

    jobs = owned.reclaim(engine, settings.cpu_watermarks)
    target = ReclaimTarget(4, Tier.EVICT, "acme")
    job = await jobs.create("evict-acme", "gpu-0", target, dry_run=False)
    # Nothing is cached, so straight to EVICT: "new" (priority 0, admitted last) gives back
    # only its 2 private blocks, the prefix stays with "old"; so "old" goes too, with the prefix.
    assert [(s.planned.tier, s.planned.reservation, s.planned.gpu_blocks) for s in job.steps] == [
        (Tier.EVICT, ("acme", "new"), 2),
        (Tier.EVICT, ("acme", "old"), 4),
    ]
    termination = Termination(ledger, abort_timeout_seconds=0.5, hard_timeout_seconds=5.0)
    executor = ReclaimExecutor(jobs, termination, CpuTierMirror(CpuTierBooks(engine)))
    assert await executor.run(job.job_id, 10) == 2
    assert await jobs.run_step(job.job_id) is False
    done = await jobs.get(job.job_id)
    assert (done.state, done.actual_blocks, done.differences) == (JobState.SUCCEEDED, 6, ())
    for rid in ("new", "old"):
        ended = await ledger.get("acme", rid)
        assert (ended.state, ended.end_reason) == (ReservationState.ENDED, EndReason.PREEMPTED)
        with pytest.raises(KvQuotaError) as renew:
            await ledger.renew("acme", rid, None)
        assert (renew.value.code, renew.value.reason) == (Code.ABORTED, "PREEMPTED")
    assert (await ledger.get("acme", "vip")).state is ReservationState.ADMITTED
    assert (await ledger.get("bolt", "b1")).state is ReservationState.ADMITTED
    assert (await counters(engine))["tenant:acme"]["blocks_in_use"] == 4
    await termination.close()
    await assert_invariants(engine)


async def test_an_evict_step_waits_for_the_engine_and_says_why_it_got_less(
    engine: AsyncEngine, settings: Settings, owned: HotPath
) -> None:
    """The engine does not answer: the preempted reservation keeps its blocks (the engine may
    still be generating) and the step waits; ended otherwise meanwhile, the step is skipped
    with the reason."""
    unreachable = EngineEndpoints(f"http://127.0.0.1:{closed_port()}")
    spec = catalog.instance_spec("gpu-0", "m", None, BS, 8192, None, 64, engine=unreachable)
    await Catalog(engine).register_instance(spec)
    await add_tenant(engine, "acme")
    ledger = owned.ledger
    await ledger.admit(running("first", prompt=tuple(range(4 * BS - 1))))
    await ledger.admit(running("second"))
    jobs = owned.reclaim(engine, settings.cpu_watermarks)
    job = await jobs.create("evict", "gpu-0", ReclaimTarget(8, Tier.EVICT), dry_run=False)
    assert [s.planned.reservation for s in job.steps] == [("acme", "second"), ("acme", "first")]
    termination = Termination(ledger, abort_timeout_seconds=0.2, hard_timeout_seconds=60.0)
    executor = ReclaimExecutor(jobs, termination, CpuTierMirror(CpuTierBooks(engine)))
    assert await executor.run(job.job_id, 10) == 0  # the abort is pending
    assert (await ledger.get("acme", "second")).state is ReservationState.ADMITTED
    assert (await counters(engine))["instance:gpu-0"]["blocks_in_use"] == 8
    # The gateway releases it meanwhile (the engine finished): no abort needed, step skipped.
    await termination.end("acme", "second", EndReason.RELEASED, 1)
    await asyncio.sleep(0.6)  # past the engine's first backoff
    assert await executor.run(job.job_id, 1) == 1
    waiting = await jobs.get(job.job_id)
    assert waiting.state is JobState.RUNNING
    skipped = waiting.steps[0]
    assert (skipped.state, skipped.actual_blocks, skipped.note) == (
        StepState.SKIPPED,
        0,
        ended_before_preemption("RELEASED"),
    )
    assert waiting.differences == (skipped,)
    await termination.close()
    await assert_invariants(engine)
