"""The wait queue's rules: bounds, order, the starvation guard, and retry delays.

Order is strict priority first (higher classes are dispatched before lower ones), then
start-time fair queueing between tenants within a class, by tokens: a request costs its
(prompt + max_output) x n tokens divided by its tenant's weight. Its tags are
    start  = max(virtual time of the class, finish tag of the tenant's previous request)
    finish = start + cost / weight
and requests are served in order of start tag; the class's virtual time is the start tag of the
request admitted last. So backlogged tenants are served tokens in proportion to their weights,
a tenant flooding short requests gains nothing over one sending long ones, an idle tenant earns
no credit, and each tenant's own requests keep their arrival order (its tags only grow).

A request that does not fit may be passed by later ones that do, with two limits. Fairness:
in its class, only requests whose start tag is below its finish tag may pass it, so a tenant
sending small requests cannot fill every hole a large request of another tenant waits for and
run ahead of its share by more than about one request. Starvation: once it has waited
`max_bypass_wait`, dispatch stops at it, so the capacity released from then on is held for it
(a large request behind a stream of small ones is admitted within that wait plus one release).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from quota_service.core.admission import AdmissionLimits, AdmissionPlan, Grant, Shortfall
from quota_service.core.errors import KvQuotaError
from quota_service.core.reasons import Reason


@dataclass(frozen=True, slots=True)
class QueuePolicy:
    """Server settings for dispatch."""

    # How long a request that does not fit may be passed by later ones before capacity is held.
    max_bypass_wait_seconds: float = 5.0
    # Queued requests one dispatch pass considers (it stops earlier at a held request).
    dispatch_batch: int = 32


@dataclass(frozen=True, slots=True)
class FairTags:
    start: float
    finish: float


def fair_tags(virtual_time: float, last_finish: float, cost_tokens: int, weight: int) -> FairTags:
    start = max(virtual_time, last_finish)
    return FairTags(start, start + cost_tokens / weight)


@dataclass(frozen=True, slots=True)
class QueueLoad:
    """What waits on an instance (and for the tenant), and the instance's bounds."""

    queued_requests: int
    queued_prompt_tokens: int
    max_queued_requests: int
    # target TTFT x prefill throughput; None when the instance sets no TTFT guard.
    max_queued_prompt_tokens: int | None
    tenant_queued_requests: int
    tenant_max_queued_requests: int


def max_queued_prompt_tokens(
    target_ttft_seconds: float, prefill_tokens_per_second: float
) -> int | None:
    """vLLM's TTFT guard: queued prefill work must finish within the target time to first token."""
    if target_ttft_seconds <= 0 or prefill_tokens_per_second <= 0:
        return None
    return int(target_ttft_seconds * prefill_tokens_per_second)


def check_bounds(
    load: QueueLoad,
    prompt_tokens: int,
    instance: str,
    tenant: str,
    delay: float,
    shadow_mode: bool = False,
) -> str | None:
    """QUEUE_FULL (503 + Retry-After) when joining would pass a bound. In the tenant's shadow
    mode its own bound only says so (the reason is returned) and the request queues anyway."""
    full = None
    if load.queued_requests + 1 > load.max_queued_requests:
        full = f"instance {instance} has {load.queued_requests} requests queued, its limit"
    elif (
        load.max_queued_prompt_tokens is not None
        and load.queued_prompt_tokens + prompt_tokens > load.max_queued_prompt_tokens
    ):
        full = (
            f"instance {instance} has {load.queued_prompt_tokens} prompt tokens queued; "
            f"{prompt_tokens} more would pass its TTFT guard of {load.max_queued_prompt_tokens}"
        )
    elif load.tenant_queued_requests + 1 > load.tenant_max_queued_requests:
        if shadow_mode:
            return "QUEUE_FULL"
        full = f"tenant {tenant} has {load.tenant_queued_requests} requests queued, its limit"
    if full is not None:
        raise KvQuotaError(
            Reason.QUEUE_FULL,
            full,
            metadata={
                "instance": instance,
                "tenant": tenant,
                "queuedRequests": str(load.queued_requests),
            },
            retry_delay_seconds=delay,
        )
    return None


class Step(enum.Enum):
    ADMIT = "ADMIT"
    # Its tenant is over quota now: it waits for its own releases without holding anyone up.
    SKIP = "SKIP"
    # It does not fit, but has not waited max_bypass_wait yet: later requests may pass it.
    PASS = "PASS"
    # It has waited long enough: nothing behind it is admitted until it fits.
    HOLD = "HOLD"


@dataclass
class DispatchPass:
    """One pass over a queue in dispatch order: what to do with each request in turn."""

    max_bypass_wait_seconds: float
    # Per priority class: the lowest finish tag of a request passed over for want of room.
    barriers: dict[int, float] = field(default_factory=dict)

    def step(
        self,
        priority: int,
        tags: FairTags,
        decision: AdmissionPlan | Grant | Shortfall,
        waited_seconds: float,
    ) -> Step:
        barrier = self.barriers.get(priority)
        if not isinstance(decision, Shortfall):  # it fits
            return Step.ADMIT if barrier is None or tags.start < barrier else Step.PASS
        if decision.scope == "tenant":
            return Step.SKIP
        if waited_seconds >= self.max_bypass_wait_seconds:
            return Step.HOLD
        self.barriers[priority] = tags.finish if barrier is None else min(barrier, tags.finish)
        return Step.PASS


def queue_delay(
    ahead: int, mean_hold_seconds: float | None, live_reservations: int, limits: AdmissionLimits
) -> float | None:
    """Little's law: with L reservations live for a mean W each, the instance admits about
    lambda = L / W per second, so the `ahead` requests queued in front (plus this one) need about
    (ahead + 1) / lambda = (ahead + 1) x W / L seconds. None until holding times are observed."""
    if mean_hold_seconds is None:
        return None
    delay = (ahead + 1) * mean_hold_seconds / max(live_reservations, 1)
    return min(max(delay, limits.min_retry_delay_seconds), limits.max_retry_delay_seconds)


def queue_timeout(name: str, waited_seconds: float, delay: float) -> KvQuotaError:
    return KvQuotaError(
        Reason.QUEUE_TIMEOUT,
        f"{name} waited {waited_seconds:.1f}s, its whole wait budget, without being admitted",
        metadata={"name": name},
        retry_delay_seconds=delay,
    )


def cancelled(name: str) -> KvQuotaError:
    return KvQuotaError(
        Reason.RESERVATION_CANCELLED,
        f"{name} was cancelled while it waited",
        metadata={"name": name},
    )


def shutting_down(name: str, delay: float) -> KvQuotaError:
    """The server a caller waits on (a queued Admit, a watch) is going away: the caller asks
    another replica, with the same request id; a queued request keeps its place in the queue,
    which every replica shares."""
    return KvQuotaError(
        Reason.SERVER_SHUTTING_DOWN,
        f"this kvquota server is shutting down: ask another one about {name}",
        metadata={"name": name},
        retry_delay_seconds=delay,
    )
