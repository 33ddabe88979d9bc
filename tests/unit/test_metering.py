"""Usage metering on a scripted timeline (a controlled clock): exact block-seconds per tier,
pinned and fair-share figures, hand-computed; conservation of fair shares; hours chained."""

from __future__ import annotations

from fractions import Fraction

import pytest

from quota_service.core.metering import (
    GIB,
    HOUR_US,
    MICROS,
    BilledHour,
    Counts,
    Levels,
    UsageEvent,
    UsageTotals,
    integrate_hour,
)

S = MICROS  # one second
BLOCK = 16384


def timeline() -> list[UsageEvent]:
    return [
        UsageEvent(10 * S, "acme", "gpu-0", {1: 4}, counts=Counts(tokens_reserved=64, admitted=1)),
        # bolt (same namespace) joins two of acme's blocks: both now pay half for them.
        UsageEvent(20 * S, "bolt", "gpu-0", {2: 2}, counts=Counts(tokens_reserved=32, admitted=1)),
        UsageEvent(20 * S, "acme", "gpu-0", {1: -2, 2: 2}),
        UsageEvent(30 * S, "bolt", "gpu-0", counts=Counts(refused={"TENANT_QUOTA_EXCEEDED": 1})),
        UsageEvent(40 * S, "acme", "gpu-0", pinned=1),
        UsageEvent(70 * S, "bolt", "gpu-0", {2: -2}, counts=Counts(output_tokens=5)),
        UsageEvent(70 * S, "acme", "gpu-0", {2: -2, 1: 2}),
        # acme's session goes to the CPU tier: 4 blocks of 16 KiB.
        UsageEvent(100 * S, "acme", "gpu-0", {1: -4}, cpu_bytes=4 * BLOCK),
        UsageEvent(100 * S, "acme", "gpu-0", counts=Counts(reclaimed={"OFFLOAD": 4})),
    ]


def test_a_scripted_hour_gives_exactly_the_hand_computed_figures() -> None:
    acme, bolt = integrate_hour(0, {}, timeline())
    # acme: 4 private blocks 10..20 s (40), 2 private 20..70 (100), 4 private 70..100 (120);
    # 2 shared two ways 20..70 (100, of which it pays half).
    assert acme.block_us == {1: 260 * S, 2: 100 * S}
    assert acme.gpu_block_seconds == 360
    assert acme.fair_block_seconds == 310
    assert acme.pinned_block_seconds == 3600 - 40
    assert acme.cpu_byte_seconds == 4 * BLOCK * (3600 - 100)
    assert acme.counts == Counts(tokens_reserved=64, admitted=1, reclaimed={"OFFLOAD": 4})
    assert acme.end == Levels({}, 1, 4 * BLOCK)
    assert (bolt.gpu_block_seconds, bolt.fair_block_seconds) == (Fraction(100), Fraction(50))
    assert bolt.counts == Counts(32, 5, 1, refused={"TENANT_QUOTA_EXCEEDED": 1})
    assert bolt.end.empty


def test_fair_shares_add_up_to_the_physical_block_seconds() -> None:
    hours = integrate_hour(0, {}, timeline())
    # acme's 4 blocks were referenced from 10 s to 100 s: 360 block-seconds, whoever held them.
    assert sum((h.fair_block_seconds for h in hours), Fraction()) == 4 * 90


def test_an_hour_starts_from_the_last_one_s_levels() -> None:
    first = integrate_hour(0, {}, timeline())
    carried = {(h.tenant, h.instance): h.end for h in first}
    (acme,) = integrate_hour(HOUR_US, carried, [])  # bolt held nothing at the end: no row
    assert acme.pinned_block_seconds == 3600
    assert acme.cpu_byte_seconds == 4 * BLOCK * 3600
    assert acme.gpu_block_seconds == 0


def test_a_late_event_counts_from_the_hour_it_reaches() -> None:
    late = UsageEvent(HOUR_US - 5 * S, "acme", "gpu-0", {1: 1})  # its own hour had closed
    (acme,) = integrate_hour(HOUR_US, {}, [late])
    assert acme.gpu_block_seconds == 3600
    with pytest.raises(ValueError):
        integrate_hour(0, {}, [UsageEvent(HOUR_US, "acme", "gpu-0")])


def test_gib_hours_use_the_instance_s_bytes_per_block_and_totals_add_hours() -> None:
    acme, bolt = integrate_hour(0, {}, timeline())
    billed = BilledHour(acme, bytes_per_block=GIB // 4)  # four blocks make a GiB
    assert billed.gpu_gib_hours == Fraction(360, 4 * 3600)
    assert billed.fair_share_gib_hours == Fraction(310, 4 * 3600)
    assert billed.cpu_gib_hours == Fraction(4 * BLOCK * 3500, GIB * 3600)
    assert BilledHour(acme, None).gpu_gib_hours == 0  # no geometry: no bytes
    totals = UsageTotals()
    for hour in (billed, BilledHour(bolt, GIB // 4)):
        totals.add(hour)
    assert totals.fair_share_block_seconds == 310 + 50
    assert (totals.counts.admitted, totals.counts.refused) == (2, {"TENANT_QUOTA_EXCEEDED": 1})
