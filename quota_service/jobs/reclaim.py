"""The reclaim executor every replica runs: it applies the steps of open reclaim jobs. Steps
are claimed in the ledger, so replicas share the work and none is applied twice; an EVICT step
first has the engine abort its reservation (through Termination, which keeps the blocks until
the engine confirms), and is applied once the reservation ended preempted."""

from __future__ import annotations

from quota_service.core.model import EndReason
from quota_service.core.reclaim import Preemption
from quota_service.jobs.termination import Termination
from quota_service.store.reclaim import ReclaimJobs


class ReclaimExecutor:
    def __init__(self, jobs: ReclaimJobs, termination: Termination) -> None:
        self._jobs = jobs
        self._termination = termination

    async def run(self, job_id: str, budget: int) -> int:
        """Apply up to `budget` steps of one job, in order; stops early at a preemption whose
        engine has not confirmed the abort yet (a later pass, or the abort sweep, finishes it)."""
        applied = 0
        asked: Preemption | None = None
        while applied < budget:
            outcome = await self._jobs.run_step(job_id)
            if outcome is False:
                break
            if isinstance(outcome, Preemption):
                if outcome == asked:
                    break
                asked = outcome
                await self._termination.end(outcome.tenant, outcome.request_id, EndReason.PREEMPTED)
                continue
            applied += 1
        return applied

    async def run_open(self, budget: int) -> int:
        """Apply up to `budget` steps of open jobs, oldest job first."""
        applied = 0
        for job_id in await self._jobs.open_jobs(budget):
            applied += await self.run(job_id, budget - applied)
            if applied >= budget:
                break
        return applied
