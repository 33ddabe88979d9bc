"""The comparison of a live machine with one rebuilt from its record (invariant 8): nothing when
they agree, and each kind of difference named when one of them changes behind the other's back:
a slot's counts, a tenant's holdings, a reservation or one of its fields, a pin, a scalar."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from quota_service.core.admission import AdmitRequest
from quota_service.core.instance_machine import InstanceMachine
from quota_service.core.machine_comparison import machine_differences
from quota_service.core.model import AdmitParams
from tests.unit.machine_fixtures import machine, next_generation

NOW = 1_700_000_000.0


def busy_machine() -> InstanceMachine:
    """Two tenants sharing nothing, a pin, a shared prefix, and a request in the queue."""
    m = machine(blocks=16, tenants={"a": 1, "b": 1})
    prefix = tuple(range(32))
    m.pin("tenants/a", "system", prefix, "salt-a", "tenants/a", "a", NOW)
    for tenant, request_id, prompt, ids in (
        ("a", "r1", 40, (*prefix, *range(100, 108))),
        ("a", "r2", 40, (*prefix, *range(200, 208))),
        ("b", "r3", 64, ()),
        ("b", "r4", 80, ()),  # more than is free: it waits
    ):
        params = AdmitParams(tenant, request_id, "gpu-0", prompt, 16, 1, 0)
        m.admit(AdmitRequest(params, ids, 10.0, None), NOW)
    assert m.queue_length == 1
    return m


def rebuilt(live: InstanceMachine) -> InstanceMachine:
    settings = [here.settings for here in live.tenants.values()]
    return InstanceMachine.recover(
        live.spec, live.limits, settings, live.image(), next_generation(live)
    )


def test_a_machine_rebuilt_from_its_record_holds_what_it_holds() -> None:
    live = busy_machine()
    assert machine_differences(live, rebuilt(live)) == []


def _extra_reference(m: InstanceMachine) -> None:
    table = m.reservations[("a", "r1")].table
    assert table is not None
    m.pool.reference(table.blocks[-1], pinned=False)


def _tokens(m: InstanceMachine) -> None:
    m.tenants["b"].tokens += 1


def _lease(m: InstanceMachine) -> None:
    record = m.reservations[("a", "r2")]
    assert record.lease_expires_at is not None
    record.lease_expires_at += 60


def _unpinned(m: InstanceMachine) -> None:
    del m.pins[("tenants/a", "system")]


def _forgotten(m: InstanceMachine) -> None:
    del m.reservations[("b", "r3")]


def _drift(m: InstanceMachine) -> None:
    m.drift_blocks += 2


@pytest.mark.parametrize(
    ("plant", "subjects"),
    [
        (_extra_reference, ["slot 3"]),
        (_tokens, ["tenants/b: tokens in flight"]),
        (_lease, ["tenants/a/reservations/r2: lease_expires_at"]),
        (_unpinned, ["tenants/a/pins/system"]),
        (_forgotten, ["tenants/b/reservations/r3"]),
        (_drift, ["drifted blocks"]),
    ],
    ids=["slot", "tenant", "reservation", "pin", "reservation-missing", "scalar"],
)
def test_a_difference_planted_in_memory_is_named(
    plant: Callable[[InstanceMachine], None], subjects: list[str]
) -> None:
    live = busy_machine()
    record = rebuilt(live)
    plant(live)
    found = machine_differences(live, record)
    assert [d.subject for d in found] == subjects
    assert all(d.memory != d.record for d in found)
