"""The reclaim executor every replica runs: it applies the steps of open reclaim jobs. Steps
are claimed in the ledger, so replicas share the work and none is applied twice; an EVICT step
first deletes a suspended session's copy in the CPU tier and has the engine abort what runs
(through Termination, which keeps the blocks until the engine confirms), and is applied once the
reservation ended preempted. A COMPRESS step measures its session in the CPU tier and keeps the
measurement on the step, demotes the session's chunks (a delete of their L1 copies, which a
retry repeats harmlessly), and is then applied in the ledger once, with what was measured: a
killed executor leaves it to be retried or finds it applied. OFFLOAD and FREE steps are the
ledger's alone."""

from __future__ import annotations

import logging
from dataclasses import astuple

from quota_service.core.errors import ServedElsewhere
from quota_service.core.model import EndReason
from quota_service.core.reclaim import Demotion, Preemption
from quota_service.enforcement.cpu_tier_mirror import CpuTierMirror
from quota_service.enforcement.termination import Termination
from quota_service.owner.owned_reclaim import OwnedReclaimJobs

log = logging.getLogger(__name__)


class ReclaimExecutor:
    def __init__(
        self, jobs: OwnedReclaimJobs, termination: Termination, cpu_tier: CpuTierMirror
    ) -> None:
        self._jobs = jobs
        self._termination = termination
        self._cpu_tier = cpu_tier

    async def run(self, job_id: str, budget: int) -> int:
        """Apply up to `budget` steps of one job, in order; stops early at a preemption whose
        engine has not confirmed the abort yet (a later pass, or the abort sweep, finishes it)."""
        applied = 0
        asked: Preemption | None = None
        while applied < budget:
            try:
                outcome = await self._jobs.run_step(job_id)
            except ServedElsewhere:
                break  # the replica serving the step's instance applies it
            if outcome is False:
                break
            if isinstance(outcome, Demotion):
                if not await self._demote(job_id, outcome):
                    break  # the CPU tier cannot now: a later pass tries again
                applied += 1
                continue
            if isinstance(outcome, Preemption):
                if outcome == asked:
                    break
                asked = outcome
                await self._preempt(outcome)
                continue
            applied += 1
        return applied

    async def _preempt(self, victim: Preemption) -> None:
        """A suspended session's CPU-tier copy goes first (deleting is idempotent, so a crash
        before the end repeats it harmlessly; pinned chunks stay); then the engine aborts what
        runs, and the reservation ends preempted."""
        try:
            deleted = await self._cpu_tier.delete_session(victim.tenant, victim.request_id)
        except Exception as exc:
            log.warning("CPU-tier delete of %s/%s failed (%s)", *astuple(victim), exc)
            return
        if deleted is not None:
            log.info(
                "evicted %s/%s from the CPU tier: %d chunks, %d pinned kept",
                *astuple(victim),
                deleted.requested,
                deleted.skipped,
            )
        await self._termination.end(victim.tenant, victim.request_id, EndReason.PREEMPTED)

    async def _demote(self, job_id: str, step: Demotion) -> bool:
        """Measure (once: a retry uses what the step kept), demote, then apply the step.
        False: the CPU tier failed, and the step stays planned."""
        key = (step.tenant, step.request_id)
        try:
            measured = step.measured
            if measured is None:
                found = await self._cpu_tier.measure_session(*key)
                measured = await self._jobs.record_measurement(job_id, step.seq, found)
            if measured is not None and measured.before_bytes:
                await self._cpu_tier.demote_session(*key)
        except Exception as exc:
            log.warning("compressing %s/%s in the CPU tier failed (%s)", *key, exc)
            return False
        if await self._jobs.compress(job_id, step.seq):
            log.info("compressed %s/%s: %s", *key, measured)
        return True

    async def run_open(self, budget: int) -> int:
        """Apply up to `budget` steps of open jobs, oldest job first."""
        applied = 0
        for job_id in await self._jobs.open_jobs(budget):
            applied += await self.run(job_id, budget - applied)
            if applied >= budget:
                break
        return applied
