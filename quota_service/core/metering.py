"""Usage metering: what each tenant holds on each instance over time, integrated hour by hour.

Every change of what a tenant holds is one event: the blocks it starts or stops holding (keyed
by how many tenants share each block then: `k`), its pinned blocks, its bytes in the CPU tier
and in its compressed form, and counters (tokens reserved, output tokens, requests by outcome,
blocks reclaimed by tier).
Between events a tenant's holdings are constant, so an hour's usage is exact: each level times
how long it lasted. Time is in microseconds and levels are whole blocks, so every integral is an
integer and nothing is lost to rounding until a figure is shown.

Fair share: a block held by k tenants costs each of them 1/k for that time. Holding n_k blocks
shared k ways for t microseconds is n_k·t block-microseconds at share k; the fair figure is
Σ_k (n_k·t)/k. Because the integrals are kept per k, summing the fair figures of every tenant
gives back exactly the physical block-microseconds of the referenced blocks (conservation).

Pure: the store feeds events in time order and keeps each hour's end levels for the next.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from fractions import Fraction

from quota_service.core.errors import FieldViolation
from quota_service.core.reasons import Reason

MICROS = 1_000_000
HOUR_US = 3600 * MICROS


def hour_range_violations(start: datetime | None, end: datetime | None) -> list[FieldViolation]:
    """What is wrong with a range of usage to read, [start, end) in whole hours (UTC); None is
    a time that was no timestamp at all, refused as such."""
    violations = [
        FieldViolation(name, "must be a whole hour (UTC)")
        for name, value in (("start_time", start), ("end_time", end))
        if value is not None and (value.minute or value.second or value.microsecond)
    ]
    if start is not None and end is not None and end <= start:
        violations.append(FieldViolation("end_time", "must be after start_time"))
    return violations


# Refusals of an admission, metered per reason (a malformed request or an unknown tenant or
# instance is not one: nothing was asked of a real pool).
METERED_REFUSALS = frozenset(
    {
        Reason.TENANT_QUOTA_EXCEEDED,
        Reason.INSTANCE_OVERLOADED,
        Reason.QUEUE_FULL,
        Reason.REQUEST_EXCEEDS_CAPACITY,
        Reason.CONTEXT_LENGTH_EXCEEDED,
        Reason.TENANT_SUSPENDED,
        Reason.INSTANCE_DRAINING,
    }
)


@dataclass(frozen=True, slots=True)
class Counts:
    """What is counted rather than integrated over time."""

    tokens_reserved: int = 0
    output_tokens: int = 0
    admitted: int = 0
    queued: int = 0
    refused: Mapping[str, int] = field(default_factory=dict)  # reason → requests
    reclaimed: Mapping[str, int] = field(default_factory=dict)  # tier → blocks
    # Admitted in shadow mode: reason that would have refused them → requests.
    shadow_refused: Mapping[str, int] = field(default_factory=dict)

    def __add__(self, other: Counts) -> Counts:
        return Counts(
            self.tokens_reserved + other.tokens_reserved,
            self.output_tokens + other.output_tokens,
            self.admitted + other.admitted,
            self.queued + other.queued,
            dict(Counter(self.refused) + Counter(other.refused)),
            dict(Counter(self.reclaimed) + Counter(other.reclaimed)),
            dict(Counter(self.shadow_refused) + Counter(other.shadow_refused)),
        )


@dataclass(frozen=True, slots=True)
class UsageEvent:
    at_us: int  # microseconds since the epoch
    tenant: str
    instance: str
    # Δ blocks held, by how many tenants share them at that moment (k >= 1).
    blocks: Mapping[int, int] = field(default_factory=dict)
    pinned: int = 0  # Δ blocks the tenant pins
    cpu_bytes: int = 0  # Δ bytes the tenant holds in the CPU tier
    counts: Counts = Counts()
    compressed_bytes: int = 0  # Δ bytes it holds there compressed


@dataclass(frozen=True, slots=True)
class Levels:
    """What a tenant holds on an instance at one moment."""

    blocks: Mapping[int, int] = field(default_factory=dict)  # k → blocks shared k ways
    pinned: int = 0
    cpu_bytes: int = 0
    compressed_bytes: int = 0

    @property
    def empty(self) -> bool:
        held = self.pinned or self.cpu_bytes or self.compressed_bytes
        return not any(self.blocks.values()) and not held


@dataclass(frozen=True, slots=True)
class HourUsage:
    hour_start_us: int
    tenant: str
    instance: str
    block_us: Mapping[int, int]  # k → ∫ blocks shared k ways dt
    pinned_block_us: int
    cpu_byte_us: int
    counts: Counts
    end: Levels  # carried into the next hour
    compressed_byte_us: int = 0

    @property
    def gpu_block_seconds(self) -> Fraction:
        return Fraction(sum(self.block_us.values()), MICROS)

    @property
    def fair_block_seconds(self) -> Fraction:
        return sum((Fraction(us, k) for k, us in self.block_us.items()), Fraction()) / MICROS

    @property
    def pinned_block_seconds(self) -> Fraction:
        return Fraction(self.pinned_block_us, MICROS)

    @property
    def cpu_byte_seconds(self) -> Fraction:
        return Fraction(self.cpu_byte_us, MICROS)

    @property
    def compressed_byte_seconds(self) -> Fraction:
        return Fraction(self.compressed_byte_us, MICROS)


class _Meter:
    """One tenant on one instance through one hour."""

    def __init__(self, start: Levels, now_us: int) -> None:
        self.blocks: Counter[int] = Counter(start.blocks)
        self.pinned = start.pinned
        self.cpu_bytes = start.cpu_bytes
        self.compressed_bytes = start.compressed_bytes
        self.since_us = now_us
        self.block_us: Counter[int] = Counter()
        self.pinned_block_us = 0
        self.cpu_byte_us = 0
        self.compressed_byte_us = 0
        self.counts = Counts()

    def advance(self, now_us: int) -> None:
        elapsed = now_us - self.since_us
        for k, n in self.blocks.items():
            self.block_us[k] += n * elapsed
        self.pinned_block_us += self.pinned * elapsed
        self.cpu_byte_us += self.cpu_bytes * elapsed
        self.compressed_byte_us += self.compressed_bytes * elapsed
        self.since_us = now_us

    def apply(self, event: UsageEvent) -> None:
        self.blocks.update(event.blocks)
        self.pinned += event.pinned
        self.cpu_bytes += event.cpu_bytes
        self.compressed_bytes += event.compressed_bytes
        self.counts += event.counts

    def close(self, hour_start_us: int, tenant: str, instance: str) -> HourUsage:
        self.advance(hour_start_us + HOUR_US)
        blocks = {k: n for k, n in self.blocks.items() if n}
        end = Levels(blocks, self.pinned, self.cpu_bytes, self.compressed_bytes)
        return HourUsage(
            hour_start_us,
            tenant,
            instance,
            {k: us for k, us in self.block_us.items() if us},
            self.pinned_block_us,
            self.cpu_byte_us,
            self.counts,
            end,
            self.compressed_byte_us,
        )


def integrate_hour(
    hour_start_us: int,
    start: Mapping[tuple[str, str], Levels],
    events: Iterable[UsageEvent],
) -> list[HourUsage]:
    """The usage of one hour, per (tenant, instance) that held anything or had an event, from
    the levels at its start and its events in time order. An event recorded before the hour
    (it committed after its own hour had closed) counts from the hour's start: a closed hour
    never changes."""
    end_us = hour_start_us + HOUR_US
    meters = {
        key: _Meter(levels, hour_start_us) for key, levels in start.items() if not levels.empty
    }
    for event in events:
        if event.at_us >= end_us:
            raise ValueError(f"an event at {event.at_us} is past the hour {hour_start_us}")
        key = (event.tenant, event.instance)
        meter = meters.get(key)
        if meter is None:
            meter = meters[key] = _Meter(Levels(), hour_start_us)
        meter.advance(max(event.at_us, meter.since_us))
        meter.apply(event)
    return [
        meter.close(hour_start_us, tenant, instance)
        for (tenant, instance), meter in sorted(meters.items())
    ]


GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class BilledHour:
    """A closed hour as billed: its usage and the instance's bytes per block (None without
    its geometry: GiB-hours are then 0)."""

    usage: HourUsage
    bytes_per_block: int | None

    def _gib_hours(self, block_seconds: Fraction) -> Fraction:
        return block_seconds * (self.bytes_per_block or 0) / GIB / 3600

    @property
    def gpu_gib_hours(self) -> Fraction:
        return self._gib_hours(self.usage.gpu_block_seconds)

    @property
    def fair_share_gib_hours(self) -> Fraction:
        return self._gib_hours(self.usage.fair_block_seconds)

    @property
    def cpu_gib_hours(self) -> Fraction:
        return self.usage.cpu_byte_seconds / GIB / 3600

    @property
    def compressed_gib_hours(self) -> Fraction:
        return self.usage.compressed_byte_seconds / GIB / 3600


@dataclass(slots=True)
class UsageTotals:
    """Closed hours added up (a tenant's over a range): GiB-hours are summed hour by hour,
    each with its instance's bytes per block."""

    gpu_block_seconds: Fraction = Fraction()
    fair_share_block_seconds: Fraction = Fraction()
    pinned_block_seconds: Fraction = Fraction()
    gpu_gib_hours: Fraction = Fraction()
    fair_share_gib_hours: Fraction = Fraction()
    cpu_gib_hours: Fraction = Fraction()
    compressed_gib_hours: Fraction = Fraction()
    counts: Counts = Counts()

    def add(self, hour: BilledHour) -> None:
        usage = hour.usage
        self.gpu_block_seconds += usage.gpu_block_seconds
        self.fair_share_block_seconds += usage.fair_block_seconds
        self.pinned_block_seconds += usage.pinned_block_seconds
        self.gpu_gib_hours += hour.gpu_gib_hours
        self.fair_share_gib_hours += hour.fair_share_gib_hours
        self.cpu_gib_hours += hour.cpu_gib_hours
        self.compressed_gib_hours += hour.compressed_gib_hours
        self.counts += usage.counts
