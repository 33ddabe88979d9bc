"""Reclaim planning: which KV memory to take back, tier by tier, least damage first, and how much
each step will really give back.

Tiers, in the order they are used (a job never goes past its highest allowed tier):
  FREE      cached blocks nobody references: one step for as many as are needed, which the
            executor takes least damage first (blocks of cold scopes, with no live reservation,
            before active ones; least recently used first within each).
  OFFLOAD   suspended reservations move to the CPU tier while its use stays below the low
            watermark; their blocks leave the GPU.
  COMPRESS  only when the CPU tier is above its high watermark and the instance can compress:
            offloaded sessions, coldest first, are demoted to the CPU tier's compressed form
            (lossy) until it is back at its low watermark, so more suspended reservations can
            be offloaded after it. Pinned chunks stay as they are.
  EVICT     last resort: suspended sessions the CPU tier cannot take are ended (their CPU-tier
            copy deleted), then running reservations are preempted, lowest priority first,
            most recently admitted first within a priority.
A reservation taken by OFFLOAD or EVICT drops its references; a block comes back to the GPU only
when every reference to it is dropped, so blocks shared with reservations outside the plan (other
tenants', or this tenant's that the plan does not touch) are never counted, nor are pinned blocks.
What the plan cannot take is listed with the reason, so the books and the real watermark agree.

Pure: the store loads a `PoolSnapshot` (counts, not blocks: only the entries of blocks that other
references share are listed one by one), the executor applies the steps.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from quota_service.core.errors import FieldViolation, invalid_request
from quota_service.core.names import tenant_name


class Tier(enum.IntEnum):
    FREE = 1
    OFFLOAD = 2
    COMPRESS = 3
    EVICT = 4


class Unreclaimable(enum.Enum):
    PINNED = "PINNED"  # a pin holds it resident
    SHARED = "SHARED"  # references the plan does not drop remain (another tenant, or held work)
    CPU_TIER_FULL = "CPU_TIER_FULL"  # a suspended reservation that the CPU tier has no room for
    # A suspended reservation whose tenant's CPU-tier quota (max_cpu_tier_bytes) has no room.
    TENANT_CPU_QUOTA = "TENANT_CPU_QUOTA"
    NO_CPU_TIER = "NO_CPU_TIER"  # the instance has no CPU tier (no LMCache) to offload to
    NO_COMPRESSION = "NO_COMPRESSION"  # the CPU tier is above its high watermark; cannot compress
    ABOVE_MAX_TIER = "ABOVE_MAX_TIER"  # reachable only by a tier the job does not allow


@dataclass(frozen=True, slots=True)
class CachedScope:
    scope: str  # whose salt hashed the blocks: tenants/{t} or namespaces/{n}
    blocks: int  # cached blocks (nobody references them) of that scope


@dataclass(frozen=True, slots=True)
class SharedEntry:
    """A block-table entry naming an unpinned block that other entries reference too (of other
    reservations, or of the same table)."""

    block_id: int
    generation: int
    ref_count: int  # every live reference


@dataclass(frozen=True, slots=True)
class LiveReservation:
    tenant: str
    request_id: str
    priority: int
    admitted_seq: int  # larger: admitted later
    suspended: bool
    entries: int  # its block table's length
    pinned_entries: int  # entries naming pinned blocks (never freed)
    shared: tuple[SharedEntry, ...]  # the other entries name blocks only they reference

    @property
    def sole_blocks(self) -> int:
        """Blocks that come back as soon as this reservation drops its references."""
        return self.entries - self.pinned_entries - len(self.shared)


@dataclass(frozen=True, slots=True)
class CpuTier:
    used_bytes: int
    capacity_bytes: int
    low_watermark: float  # offload only while use stays at or below this share
    high_watermark: float  # compress only above this share
    # Compressed size / original size, as last measured on the instance; None: it cannot
    # compress (no compressing L2, or nothing measured yet).
    compression_ratio: float | None


@dataclass(frozen=True, slots=True)
class CpuWatermarks:
    offload: float = 0.8  # offload only while the CPU tier's use stays at or below this share
    compress: float = 0.9  # compress only above this share


DEFAULT_WATERMARKS = CpuWatermarks()


# A CPU-tier reading older than this is not planned with (the mirror reads it every few
# seconds while the coordinator answers).
CPU_READING_MAX_AGE_SECONDS = 60.0


def cpu_tier(
    used_bytes: int | None,
    capacity_bytes: int | None,
    age_seconds: float | None,
    watermarks: CpuWatermarks,
    compression_ratio: float | None,
) -> CpuTier | None:
    """An instance's CPU tier as last read (None: it has none, or no recent reading). A ratio
    of 1 or more saves nothing: such a tier cannot compress."""
    if used_bytes is None or not capacity_bytes or age_seconds is None:
        return None
    if age_seconds > CPU_READING_MAX_AGE_SECONDS:
        return None
    ratio = compression_ratio if compression_ratio is not None and compression_ratio < 1 else None
    return CpuTier(used_bytes, capacity_bytes, watermarks.offload, watermarks.compress, ratio)


@dataclass(frozen=True, slots=True)
class OffloadedSession:
    """A suspended reservation in the CPU tier, not compressed yet, whose session's tokens are
    known (the CPU tier names its chunks by them)."""

    tenant: str
    request_id: str
    admitted_seq: int  # larger: admitted later
    cpu_bytes: int  # what it holds in the CPU tier


@dataclass(frozen=True, slots=True)
class PoolSnapshot:
    bytes_per_block: int
    cached: tuple[CachedScope, ...]
    reservations: tuple[LiveReservation, ...]
    pinned_only: tuple[tuple[str, int], ...]  # (pin owner, blocks only pins hold)
    cpu: CpuTier | None  # None: no CPU tier (no LMCache)
    offloaded: tuple[OffloadedSession, ...]
    # Per tenant with reservations here: the CPU-tier bytes its quota still allows, over every
    # instance (max_cpu_tier_bytes less what its offloaded sessions hold). Missing: none.
    cpu_room: Mapping[str, int]


@dataclass(frozen=True, slots=True)
class ReclaimTarget:
    target_blocks: int
    max_tier: Tier
    tenant: str | None = None  # None: the whole instance
    min_tier: Tier = Tier.FREE


@dataclass(frozen=True, slots=True)
class PlannedStep:
    tier: Tier
    # None: a FREE step frees `gpu_blocks` cached blocks, whichever are the least damaging
    # when it runs. Only jobs planned before FREE steps were counted name the one cached
    # block each of their FREE steps frees.
    block: tuple[int, int] | None
    # OFFLOAD, COMPRESS and EVICT: the reservation; FREE: none.
    reservation: tuple[str, str] | None
    gpu_blocks: int  # GPU slots this step gives back
    cpu_bytes: int  # CPU-tier bytes it takes (offload) or gives back (compress, negative)
    lossy: bool


@dataclass(frozen=True, slots=True)
class Exclusion:
    reason: Unreclaimable
    blocks: int
    reservation: tuple[str, str] | None = None


@dataclass(frozen=True, slots=True)
class ReclaimPlan:
    steps: tuple[PlannedStep, ...]
    excluded: tuple[Exclusion, ...]
    bytes_per_block: int

    def expected_blocks(self, tier: Tier) -> int:
        return sum(s.gpu_blocks for s in self.steps if s.tier is tier)

    @property
    def total_blocks(self) -> int:
        return sum(s.gpu_blocks for s in self.steps)

    @property
    def total_bytes(self) -> int:
        return self.total_blocks * self.bytes_per_block


def _in_scope(scope: str, tenant: str | None) -> bool:
    """Whether cached blocks of hash `scope` are a tenant's own (its name is the scope of its
    own salt; a namespace's blocks are shared)."""
    return tenant is None or scope == tenant_name(tenant)


class _Planner:
    def __init__(self, pool: PoolSnapshot, target: ReclaimTarget) -> None:
        self.pool = pool
        self.target = target
        self.steps: list[PlannedStep] = []
        self.excluded: list[Exclusion] = []
        self.freed = 0
        self.dropped: Counter[tuple[int, int]] = Counter()
        self.cpu_used = pool.cpu.used_bytes if pool.cpu is not None else 0
        self.cpu_room = Counter(pool.cpu_room)
        self.over_cpu_quota: set[tuple[str, str]] = set()

    @property
    def done(self) -> bool:
        return self.freed >= self.target.target_blocks

    def add(self, step: PlannedStep) -> None:
        self.steps.append(step)
        self.freed += step.gpu_blocks
        self.cpu_used += step.cpu_bytes

    def free_cached(self) -> None:
        tenant = self.target.tenant
        cached = sum(c.blocks for c in self.pool.cached if _in_scope(c.scope, tenant))
        wanted = min(cached, self.target.target_blocks - self.freed)
        if wanted > 0:
            self.add(PlannedStep(Tier.FREE, None, None, wanted, 0, False))

    def drop(self, reservation: LiveReservation) -> int:
        """Drop the reservation's references; how many blocks that frees."""
        freed = reservation.sole_blocks
        for b in reservation.shared:
            key = (b.block_id, b.generation)
            self.dropped[key] += 1
            freed += self.dropped[key] == b.ref_count
        return freed

    def offload(self, candidates: Iterable[LiveReservation]) -> list[LiveReservation]:
        """Offload what fits below the CPU tier's low watermark; returns what did not fit."""
        cpu = self.pool.cpu
        left: list[LiveReservation] = []
        for r in candidates:
            if self.done:
                left.append(r)
                continue
            size = r.entries * self.pool.bytes_per_block
            if cpu is None or self.cpu_used + size > cpu.capacity_bytes * cpu.low_watermark:
                left.append(r)
                continue
            key = (r.tenant, r.request_id)
            if size > self.cpu_room[r.tenant]:
                self.over_cpu_quota.add(key)
                left.append(r)
                continue
            self.cpu_room[r.tenant] -= size
            self.add(PlannedStep(Tier.OFFLOAD, None, key, self.drop(r), size, False))
        return left

    def compress(self) -> bool:
        """Above the high watermark, compress offloaded sessions, coldest first, until the
        CPU tier is back at its low watermark (what it saves is what the instance's measured
        ratio says; pinned chunks stay, so it may save less). Whether any step was planned."""
        cpu = self.pool.cpu
        if cpu is None or self.cpu_used <= cpu.capacity_bytes * cpu.high_watermark:
            return False
        if cpu.compression_ratio is None:
            self.excluded.append(Exclusion(Unreclaimable.NO_COMPRESSION, 0))
            return False
        tenant = self.target.tenant
        sessions = [s for s in self.pool.offloaded if tenant is None or s.tenant == tenant]
        planned = False
        for s in sorted(sessions, key=lambda s: s.admitted_seq):
            if self.cpu_used <= cpu.capacity_bytes * cpu.low_watermark:
                break
            saved = int(s.cpu_bytes * (1.0 - cpu.compression_ratio))
            key = (s.tenant, s.request_id)
            self.add(PlannedStep(Tier.COMPRESS, None, key, 0, -saved, True))
            planned = True
        return planned

    def evict(
        self, idle: Sequence[LiveReservation], running: Sequence[LiveReservation]
    ) -> list[LiveReservation]:
        """Idle sessions the CPU tier could not take go first (nothing runs there), oldest
        first; then running work, lowest priority and most recently admitted first. Returns
        the idle sessions left."""
        order = [*idle, *sorted(running, key=lambda r: (r.priority, -r.admitted_seq))]
        left = []
        for r in order:
            if self.done:
                left.append(r)
                continue
            key = (r.tenant, r.request_id)
            self.add(PlannedStep(Tier.EVICT, None, key, self.drop(r), 0, False))
        return [r for r in left if r.suspended]

    def report_unfreed(self) -> None:
        """Blocks of taken reservations that stay on the GPU, and why."""
        taken = {s.reservation for s in self.steps if s.reservation is not None}
        pinned: dict[tuple[str, str], int] = {}
        shared: dict[tuple[str, str], int] = {}
        for r in self.pool.reservations:
            key = (r.tenant, r.request_id)
            if key not in taken:
                continue
            pinned[key] = r.pinned_entries
            shared[key] = sum(
                self.dropped[(b.block_id, b.generation)] < b.ref_count for b in r.shared
            )
        for reason, counts in ((Unreclaimable.PINNED, pinned), (Unreclaimable.SHARED, shared)):
            self.excluded += [Exclusion(reason, n, key) for key, n in sorted(counts.items()) if n]


def plan(pool: PoolSnapshot, target: ReclaimTarget) -> ReclaimPlan:
    """The steps, in order, that reach the target (or everything allowed, when it cannot be
    reached), and what stays and why."""
    p = _Planner(pool, target)
    if target.min_tier <= Tier.FREE:
        p.free_cached()
    scoped = [r for r in pool.reservations if target.tenant is None or r.tenant == target.tenant]
    # Coldest first: the reservation idle longest (admitted earliest) goes to the CPU first.
    suspended = sorted((r for r in scoped if r.suspended), key=lambda r: r.admitted_seq)
    running = [r for r in scoped if not r.suspended]
    allowed = range(target.min_tier, target.max_tier + 1)
    if Tier.OFFLOAD in allowed:
        suspended = p.offload(suspended)
    if not p.done and Tier.COMPRESS in allowed and p.compress() and Tier.OFFLOAD in allowed:
        suspended = p.offload(suspended)
    if Tier.EVICT in allowed:
        suspended = p.evict(suspended, running)
    if not p.done and Tier.OFFLOAD in allowed:
        full = Unreclaimable.CPU_TIER_FULL if pool.cpu is not None else Unreclaimable.NO_CPU_TIER
        for r in suspended:
            key = (r.tenant, r.request_id)
            why = Unreclaimable.TENANT_CPU_QUOTA if key in p.over_cpu_quota else full
            p.excluded.append(Exclusion(why, r.entries, key))
    beyond = (running if target.max_tier < Tier.EVICT else []) + (
        suspended if target.max_tier < Tier.OFFLOAD else []
    )
    if not p.done and beyond:
        held = sum(r.entries for r in beyond)
        p.excluded.append(Exclusion(Unreclaimable.ABOVE_MAX_TIER, held))
    pinned = sum(n for owner, n in pool.pinned_only if _in_scope(owner, target.tenant))
    if pinned:
        p.excluded.append(Exclusion(Unreclaimable.PINNED, pinned))
    p.report_unfreed()
    return ReclaimPlan(tuple(p.steps), tuple(p.excluded), pool.bytes_per_block)


class JobState(enum.Enum):
    PLANNED = "PLANNED"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"


class StepState(enum.Enum):
    PLANNED = "PLANNED"
    APPLIED = "APPLIED"
    SKIPPED = "SKIPPED"  # nothing to do any more: the pool changed since the plan (see note)
    FAILED = "FAILED"


@dataclass(frozen=True, slots=True)
class ReclaimTally:
    """What the finished steps of one tier gave back on one instance, over every job."""

    instance: str
    tier: Tier
    state: StepState  # APPLIED or SKIPPED
    steps: int
    blocks: int
    # GPU bytes of those blocks; None when the instance's geometry is unknown.
    bytes: int | None


@dataclass(frozen=True, slots=True)
class Preemption:
    """An EVICT step's reservation still runs: the engine must abort it before the step can
    be applied."""

    tenant: str
    request_id: str


@dataclass(frozen=True, slots=True)
class CompressMeasurement:
    """What the CPU tier holds of a session, measured before a COMPRESS step demotes it: L1
    bytes of the chunks to demote, their bytes in the compressing L2, and L1 bytes of its
    chunks that stay (pinned, or with no compressed copy)."""

    before_bytes: int
    after_bytes: int
    kept_bytes: int

    @property
    def ratio(self) -> float:
        """Compressed size / original size of what is demoted (1.0: nothing is)."""
        return self.after_bytes / self.before_bytes if self.before_bytes else 1.0

    def booked(self, offloaded_bytes: int) -> tuple[int, int]:
        """The session's CPU-tier bytes as booked (`offloaded_bytes`, in the ledger's geometry,
        which LMCache's chunk bytes need not share) split by the measured shares: (bytes that
        stay in the CPU tier, bytes it holds compressed)."""
        whole = self.before_bytes + self.kept_bytes
        if not whole:
            return offloaded_bytes, 0
        moved = offloaded_bytes * self.before_bytes // whole
        return offloaded_bytes - moved, -(-offloaded_bytes * self.after_bytes // whole)


@dataclass(frozen=True, slots=True)
class Demotion:
    """A COMPRESS step's session is still to be demoted in the CPU tier: measured there first
    (`measured` None), then its chunks leave L1, and only then is the step applied. Nothing
    changed in the ledger."""

    seq: int
    tenant: str
    request_id: str
    measured: CompressMeasurement | None


@dataclass(frozen=True, slots=True)
class JobStep:
    seq: int
    planned: PlannedStep
    state: StepState
    # GPU blocks it gave back; None until it ran. A FREE step frees its blocks a batch per
    # transaction: while it is still PLANNED, this is what it has freed so far.
    actual_blocks: int | None
    note: str | None


@dataclass(frozen=True, slots=True)
class ReclaimJob:
    job_id: str
    request_id: str
    instance: str
    target: ReclaimTarget
    dry_run: bool
    state: JobState
    expected_blocks: int
    excluded: tuple[Exclusion, ...]
    steps: tuple[JobStep, ...]

    @property
    def actual_blocks(self) -> int:
        return sum(s.actual_blocks or 0 for s in self.steps)

    @property
    def differences(self) -> tuple[JobStep, ...]:
        """Finished steps that gave back other than planned, each with its reason."""
        return tuple(
            s
            for s in self.steps
            if s.state is not StepState.PLANNED
            and s.actual_blocks is not None
            and s.actual_blocks != s.planned.gpu_blocks
        )


MIN_TIER_ABOVE_MAX = FieldViolation("min_tier", "must not be above max_tier")


def request_violations(
    target_blocks: int, target_bytes: int, max_tier: Tier | None, min_tier: Tier | None
) -> list[FieldViolation]:
    """What is wrong with a CreateReclaimJob's target and tiers (a tier None: not one this
    server knows), before the instance is looked up to turn bytes into blocks."""
    negative = [
        field
        for field, value in (("target_blocks", target_blocks), ("target_bytes", target_bytes))
        if value < 0
    ]
    violations = [FieldViolation(field, "must not be negative") for field in negative]
    if not negative and (target_blocks > 0) == (target_bytes > 0):
        violations.append(
            FieldViolation("target_blocks", "give exactly one of target_blocks, target_bytes")
        )
    if max_tier is None:
        violations.append(FieldViolation("max_tier", "name the highest tier allowed"))
    if min_tier is None:
        violations.append(FieldViolation("min_tier", "not a reclaim tier"))
    elif max_tier is not None and min_tier > max_tier:
        violations.append(MIN_TIER_ABOVE_MAX)
    return violations


def check_target(target: ReclaimTarget) -> None:
    violations = []
    if target.target_blocks <= 0:
        violations.append(FieldViolation("target", "must be a positive number of blocks"))
    if target.min_tier > target.max_tier:
        violations.append(MIN_TIER_ABOVE_MAX)
    if violations:
        raise invalid_request(violations)


# Policy: reclaim jobs started by the service itself.


@dataclass(frozen=True, slots=True)
class InstanceLoad:
    instance: str
    capacity_blocks: int
    used_blocks: int  # referenced or pinned: what admission cannot reuse
    queued_requests: int


@dataclass(frozen=True, slots=True)
class TenantExcess:
    tenant: str
    excess_blocks: int  # held beyond its quota (the quota was cut below what it holds)
    held: tuple[tuple[str, int], ...]  # (instance, blocks it holds there)


@dataclass(frozen=True, slots=True)
class PolicyJob:
    instance: str
    target: ReclaimTarget
    cause: str


# What the policy measures (blocks referenced or pinned) is what FREE cannot lower: cached blocks
# are reusable by admission already, and a tenant's usage counts only what it references.
POLICY_MIN_TIER = Tier.OFFLOAD


def policy_jobs(
    loads: Sequence[InstanceLoad],
    excesses: Sequence[TenantExcess],
    watermark: float,
    max_tier: Tier,
) -> list[PolicyJob]:
    """The jobs the policy starts: an instance in use above its watermark while work waits
    gives back down to the watermark; a tenant over its block quota gives back its excess,
    from the instances where it holds most first."""
    jobs = []
    for load in loads:
        over = load.used_blocks - int(watermark * load.capacity_blocks)
        if load.queued_requests > 0 and over > 0:
            cause = f"{load.used_blocks} of {load.capacity_blocks} blocks in use, work queued"
            target = ReclaimTarget(over, max_tier, None, POLICY_MIN_TIER)
            jobs.append(PolicyJob(load.instance, target, cause))
    for excess in excesses:
        left = excess.excess_blocks
        for instance, held in sorted(excess.held, key=lambda h: (-h[1], h[0])):
            if left <= 0:
                break
            take = min(left, held)
            target = ReclaimTarget(take, max_tier, excess.tenant, POLICY_MIN_TIER)
            cause = f"tenant {excess.tenant} holds {excess.excess_blocks} blocks over its quota"
            jobs.append(PolicyJob(instance, target, cause))
            left -= take
    return jobs
