"""Two machines of one instance compared: an owner's live machine and one rebuilt from the
record (invariant 8: the owner's memory equals what the record derives). Each difference names
what differs and how it reads in each.

The comparison costs what the machines hold, not the pool's size: slot by slot over the slots
either machine hashed or names in a table or pin, and through the counters for the rest (a
slot neither hashed nor named is free in a rebuilt machine, so one that is not free in the live
machine shows in the counts of states)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from quota_service.core.instance_machine import InstanceMachine, PinRecord
from quota_service.core.names import reservation_name


@dataclass(frozen=True, slots=True)
class Difference:
    """One thing the two machines hold differently."""

    subject: str
    # How it reads in the live machine (the owner's memory) and in the rebuilt one.
    memory: str
    record: str

    def __str__(self) -> str:
        return f"{self.subject}: {self.memory} in memory, {self.record} in the record"


def machine_differences(live: InstanceMachine, rebuilt: InstanceMachine) -> list[Difference]:
    """What `rebuilt` (from the record of `live`'s instance) holds differently from `live`.
    Free slots' generations are not compared: a rebuilt machine starts them higher, so that
    no handle from before is valid again."""
    return [
        *_slot_differences(live, rebuilt),
        *_tenant_differences(live, rebuilt),
        *_reservation_differences(live, rebuilt),
        *_pin_differences(live, rebuilt),
        *_machine_scalars(live, rebuilt),
    ]


def _named_slots(machine: InstanceMachine) -> set[int]:
    named = set(machine.pool.contents_columns().blocks)
    for record in machine.reservations.values():
        if record.table is not None:
            named.update(record.table.live_blocks())
    for pin in machine.pins.values():
        named.update(pin.table.live_blocks())
    return named


def _slot(machine: InstanceMachine, block: int) -> tuple[object, ...]:
    pool = machine.pool
    state = pool.state(block)
    digest = pool.content_hash(block)
    return (
        state,
        pool.ref_count(block),
        pool.pin_count(block),
        None if state == "FREE" else pool.generation(block),
        None if digest is None else digest.hex(),
        None if digest is None else machine.scopes[pool.scope_id(block)],
        pool.engine_copies(block),
    )


_SLOT_FIELDS = ("state", "references", "pins", "generation", "hash", "scope", "engine copies")


def _slot_differences(live: InstanceMachine, rebuilt: InstanceMachine) -> Iterator[Difference]:
    if live.pool.capacity != rebuilt.pool.capacity:
        yield Difference("capacity", str(live.pool.capacity), str(rebuilt.pool.capacity))
        return
    yield from _differing("slot counts", live.pool.counts(), rebuilt.pool.counts())
    for block in sorted(_named_slots(live) | _named_slots(rebuilt)):
        mine, theirs = _slot(live, block), _slot(rebuilt, block)
        if mine != theirs:
            differing = [
                (name, a, b)
                for name, a, b in zip(_SLOT_FIELDS, mine, theirs, strict=True)
                if a != b
            ]
            yield Difference(
                f"slot {block}",
                ", ".join(f"{name} {a}" for name, a, _ in differing),
                ", ".join(f"{name} {b}" for name, _, b in differing),
            )
    if live.pool.lru_order() != rebuilt.pool.lru_order():
        yield Difference(
            "cached slots in eviction order",
            str(live.pool.lru_order()),
            str(rebuilt.pool.lru_order()),
        )


def _tenant_fields(machine: InstanceMachine, name: str) -> dict[str, object]:
    here = machine.tenants.get(name)
    if here is None:
        return {
            "slots held": 0,
            "entries held per slot": {},
            "pin entries per slot": {},
            "tokens in flight": 0,
            "queued requests": 0,
            "fair finish tags": {},
            "mean hold seconds": None,
        }
    return {
        "slots held": here.blocks,
        "entries held per slot": machine.held(name),
        "pin entries per slot": here.pinned,
        "tokens in flight": here.tokens,
        "queued requests": here.queued,
        "fair finish tags": here.last_finish,
        "mean hold seconds": here.mean_hold_seconds,
    }


def _tenant_differences(live: InstanceMachine, rebuilt: InstanceMachine) -> Iterator[Difference]:
    for name in sorted(live.tenants.keys() | rebuilt.tenants.keys()):
        mine = _tenant_fields(live, name)
        theirs = _tenant_fields(rebuilt, name)
        for field, value in mine.items():
            yield from _differing(f"tenants/{name}: {field}", value, theirs[field])


def _reservation_differences(
    live: InstanceMachine, rebuilt: InstanceMachine
) -> Iterator[Difference]:
    for key in sorted(live.reservations.keys() | rebuilt.reservations.keys()):
        mine, theirs = live.reservations.get(key), rebuilt.reservations.get(key)
        name = reservation_name(*key)
        if mine is None or theirs is None:
            yield Difference(name, _presence(mine), _presence(theirs))
            continue
        a, b = mine.snapshot(), theirs.snapshot()
        for field in dataclasses.fields(a):
            yield from _differing(
                f"{name}: {field.name}", getattr(a, field.name), getattr(b, field.name)
            )
    mine_order = [r.name for r in live.queued()]
    theirs_order = [r.name for r in rebuilt.queued()]
    yield from _differing("the queue in dispatch order", mine_order, theirs_order)


def _pin_table(pin: PinRecord) -> tuple[object, ...]:
    return (pin.tenant, pin.table.live_handles())


def _pin_differences(live: InstanceMachine, rebuilt: InstanceMachine) -> Iterator[Difference]:
    for key in sorted(live.pins.keys() | rebuilt.pins.keys()):
        mine, theirs = live.pins.get(key), rebuilt.pins.get(key)
        subject = f"{key[0]}/pins/{key[1]}"
        if mine is None or theirs is None:
            yield Difference(subject, _presence(mine), _presence(theirs))
        else:
            yield from _differing(
                f"{subject}: tenant and slots@generations", _pin_table(mine), _pin_table(theirs)
            )


def _machine_scalars(live: InstanceMachine, rebuilt: InstanceMachine) -> Iterator[Difference]:
    yield from _differing("virtual time per priority", live.virtual_time, rebuilt.virtual_time)
    yield from _differing("mean hold seconds", live.mean_hold_seconds, rebuilt.mean_hold_seconds)
    yield from _differing("drifted blocks", live.drift_blocks, rebuilt.drift_blocks)


def _presence(found: object | None) -> str:
    return "absent" if found is None else "present"


def _differing(subject: str, mine: object, theirs: object) -> Iterator[Difference]:
    """A difference when the values differ; of a mapping, only the keys whose values do."""
    if mine == theirs:
        return
    if isinstance(mine, Mapping) and isinstance(theirs, Mapping):
        keys = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
        mine = {k: mine.get(k) for k in keys}
        theirs = {k: theirs.get(k) for k in keys}
    yield Difference(subject, str(mine), str(theirs))
