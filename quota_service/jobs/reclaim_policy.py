"""The reclaim policy every replica's maintenance loop runs: it starts reclaim jobs itself when
an instance is in use above its watermark while work waits, and when a tenant holds more blocks
than its quota (after a cut), up to the configured highest tier.

At most one job per scope (instance, and tenant or all) is open at a time, and at most one is
started per scope per cool-down period: its request_id names the scope and the period, so
replicas that decide at the same moment create the same job once."""

from __future__ import annotations

import hashlib
import logging
import time

from quota_service.core.errors import KvQuotaError
from quota_service.core.reasons import Reason
from quota_service.core.reclaim import Tier, policy_jobs
from quota_service.owner.owned_reclaim import OwnedReclaimJobs

log = logging.getLogger(__name__)


class ReclaimPolicy:
    def __init__(
        self,
        jobs: OwnedReclaimJobs,
        max_tier: Tier | None,
        watermark: float,
        cooldown_seconds: float,
    ) -> None:
        self._jobs = jobs
        self._max_tier = max_tier
        self._watermark = watermark
        self._cooldown = cooldown_seconds

    async def sweep(self) -> int:
        """Start the jobs the policy calls for now; returns how many this replica started."""
        if self._max_tier is None:
            return 0
        loads, excesses, open_scopes = await self._jobs.policy_inputs()
        period = int(time.time() // self._cooldown)
        started = 0
        for job in policy_jobs(loads, excesses, self._watermark, self._max_tier):
            scope = (job.instance, job.target.tenant)
            if scope in open_scopes:
                continue
            # A scope's id, bounded in length whatever the names.
            digest = hashlib.sha256(f"{job.instance}/{job.target.tenant}".encode()).hexdigest()
            request_id = f"policy-{period}-{digest[:32]}"
            try:
                if not (await self._jobs.preview(job.instance, job.target)).steps:
                    continue  # nothing it may take: no job (an empty one every period is noise)
                created = await self._jobs.create(request_id, job.instance, job.target, False)
            except KvQuotaError as exc:
                if exc.reason is not Reason.REQUEST_ID_REUSED:  # else another replica was first
                    log.warning("reclaim policy on %s: %s", job.instance, exc)
                continue
            log.info(
                "reclaim policy: %s on %s up to %s, %d blocks expected of %d (%s)",
                created.job_id,
                job.instance,
                job.target.max_tier.name,
                created.expected_blocks,
                job.target.target_blocks,
                job.cause,
            )
            started += 1
        return started
