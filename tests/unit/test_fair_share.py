"""Weighted fair sharing of tokens between backlogged tenants over many admissions, on the pure
instance state machine: the queue's rules are core/queueing.py's, the ones the SQL ledger uses
too. tests/integration/test_queue.py runs a short form of the same loop on the served queue."""

from __future__ import annotations

from collections import Counter

import pytest

from quota_service.core.admission import AdmitRequest
from quota_service.core.instance_machine import InstanceMachine
from quota_service.core.model import AdmitParams, EndReason, ReservationState
from tests.unit.machine_fixtures import check_recovery, machine, recount

NOW = 1_700_000_000.0
BS = 16


def flood(m: InstanceMachine, sizes: dict[str, int], admissions: int) -> Counter[str]:
    """Keeps twelve requests queued for each tenant (`sizes`: tenant -> blocks per request) and
    releases the oldest admitted request, one a step, until the queue has admitted
    `admissions`; returns the tokens the queue admitted per tenant. The requests admitted on
    arrival while the instance filled up are no part of the queue's share."""
    sent = 0
    now = NOW
    from_queue = 0
    tokens = Counter[str]()
    running: list[tuple[str, str]] = []  # admitted and not yet released, oldest first
    while from_queue < admissions:
        queued = Counter(r.key[0] for r in m.queued())
        for tenant, blocks in sizes.items():
            for _ in range(12 - queued[tenant]):
                sent += 1
                # prompt + max_output = blocks x BS tokens; the last output token gets no slot.
                params = AdmitParams(tenant, f"r{sent}", "gpu-0", blocks * BS - 1, 1, 1, 0)
                m.admit(AdmitRequest(params, (), 60.0, None), now)
        for key, record in m.reservations.items():
            if record.state is ReservationState.ADMITTED and key not in running:
                running.append(key)
                if record.queued_at is not None:
                    from_queue += 1
                    tokens[key[0]] += record.tokens
        now += 0.01
        tenant, request_id = running.pop(0)
        m.end(tenant, request_id, EndReason.RELEASED, now)  # dispatches in the same step
    return tokens


@pytest.mark.parametrize(
    ("light_blocks", "heavy_blocks"),
    [(2, 6), (6, 2), (4, 4)],
    ids=["light-short", "light-long", "same-size"],
)
def test_backlogged_tenants_are_served_tokens_by_weight(
    light_blocks: int, heavy_blocks: int
) -> None:
    """Weights 1 and 3 flooding one instance: over 600 admissions from the queue, the tokens
    admitted are within 5% of 1:3 whichever tenant sends the shorter requests, so flooding
    short requests gains a tenant nothing."""
    m = machine(blocks=48, tenants={"light": 1, "heavy": 3})
    tokens = flood(m, {"light": light_blocks, "heavy": heavy_blocks}, 600)
    ratio = tokens["heavy"] / tokens["light"]
    assert 3 * 0.95 <= ratio <= 3 * 1.05, (ratio, tokens)
    recount(m)
    check_recovery(m)
