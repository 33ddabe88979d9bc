"""Shared pieces of the instance state machine's tests: tenants, a small machine, and a recount
of everything the machine keeps incrementally (DESIGN.md invariants 1-4)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import replace

from quota_service.config import Settings
from quota_service.core.block_pool import ContentColumns
from quota_service.core.hashing import DIGEST_BYTES
from quota_service.core.instance_machine import HeldTable, InstanceMachine, TenantSettings
from quota_service.core.machine_comparison import machine_differences
from quota_service.core.model import InstanceSpec, QueueBounds, TenantQuota, TenantState

ROOMY = TenantQuota(10**6, 10**9, 100, 10**6, 0)


def machine(
    blocks: int = 64,
    block_size: int = 16,
    tenants: dict[str, int] | None = None,
    queue: QueueBounds | None = None,
) -> InstanceMachine:
    """A machine with tenants (name: weight) that have room enough for any test."""
    spec = InstanceSpec("gpu-0", "m", None, block_size, blocks, 8192, queue=queue or QueueBounds())
    built = InstanceMachine(spec, Settings().admission_limits)
    for name, weight in (tenants or {"a": 1}).items():
        built.set_tenant(
            TenantSettings(
                name, TenantState.ACTIVE, ROOMY, weight, f"salt-{name}", f"tenants/{name}"
            )
        )
    return built


def recount(machine: InstanceMachine) -> None:
    """Recount every slot's references, the pool's counters and each tenant's holdings from the
    machine's tables and pins, and check that live tables name only current handles."""
    pool = machine.pool
    refs: Counter[int] = Counter()
    pinned: Counter[int] = Counter()
    held: dict[str, Counter[int]] = {name: Counter() for name in machine.tenants}
    pinned_by: dict[str, Counter[int]] = {name: Counter() for name in machine.tenants}
    tokens: Counter[str] = Counter()
    tables: list[tuple[str | None, HeldTable]] = [
        (r.key[0], r.table) for r in machine.reservations.values() if r.table is not None
    ]
    tables += [(p.tenant, p.table) for p in machine.pins.values()]
    for tenant, table in tables:
        for block, generation, released in zip(
            table.blocks, table.generations, table.released, strict=True
        ):
            if released:
                continue
            assert pool.generation(block) == generation, "a live table names a stale handle"
            refs[block] += 1
            pinned[block] += table.pinned
            if tenant is not None:
                held[tenant][block] += 1
                pinned_by[tenant][block] += table.pinned
    for record in machine.reservations.values():
        if record.table is not None:
            tokens[record.key[0]] += record.tokens
    states: Counter[str] = Counter()
    for block in range(pool.capacity):
        assert pool.ref_count(block) == refs[block], f"slot {block}: references"
        assert pool.pin_count(block) == pinned[block], f"slot {block}: pins"
        states[pool.state(block)] += 1
    assert {k: v for k, v in pool.counts().items() if v} == dict(states)
    assert sum(pool.counts().values()) == pool.capacity
    cached = {b for b in range(pool.capacity) if pool.state(b) == "CACHED"}
    assert set(pool.lru_order()) == cached and len(pool.lru_order()) == len(cached)
    for name, here in machine.tenants.items():
        assert machine.held(name) == dict(sorted(held[name].items())), f"tenant {name}: held"
        assert here.blocks == len(held[name]), f"tenant {name}: slots held"
        assert here.pinned == {b: c for b, c in pinned_by[name].items() if c}, name
        assert here.tokens == tokens[name], f"tenant {name}: tokens in flight"


def slot_rows(machine: InstanceMachine) -> list[tuple[int, str, int, int, int, bytes | None]]:
    """Every slot as the model tests compare them: id, state, references, pins, generation,
    hash."""
    pool = machine.pool
    return [
        (
            b,
            pool.state(b),
            pool.ref_count(b),
            pool.pin_count(b),
            pool.generation(b),
            pool.content_hash(b),
        )
        for b in range(pool.capacity)
    ]


def next_generation(machine: InstanceMachine) -> int:
    """A generation floor above every handle the machine issued (a new owner's)."""
    return max(machine.pool.generation(b) for b in range(machine.pool.capacity)) + 1


def shares_held(machine: InstanceMachine) -> dict[str, Counter[int]]:
    """Each tenant's blocks by how many tenants hold each (metering's k), recounted."""
    held = {name: machine.held(name) for name in machine.tenants}
    holders: Counter[int] = Counter()
    for blocks in held.values():
        holders.update(blocks.keys())
    return {
        name: Counter(holders[block] for block in blocks) for name, blocks in held.items() if blocks
    }


# A slot's contents as the journal records them: (slot, generation, digest, scope, engine
# copies, LRU place).
SlotRecord = tuple[int, int, bytes, int, int, int]


def slot_records(columns: ContentColumns) -> list[SlotRecord]:
    """The slots of `columns` one by one."""
    width = DIGEST_BYTES
    digests = [columns.digests[i * width : (i + 1) * width] for i in range(len(columns))]
    return list(
        zip(
            columns.blocks,
            columns.generations,
            digests,
            columns.scopes,
            columns.engine_copies,
            columns.lru_seqs,
            strict=True,
        )
    )


def columns_of(records: Iterable[SlotRecord]) -> ContentColumns:
    """Slots as the columns a pool gives them in, in slot order."""
    ordered = sorted(records)
    if not ordered:
        return ContentColumns.empty()
    columns = (list(column) for column in zip(*ordered, strict=True))
    blocks, generations, digests, scopes, copies, lru_seqs = columns
    return ContentColumns(blocks, generations, b"".join(digests), scopes, copies, lru_seqs)


def check_recovery(live: InstanceMachine, recorded: dict[int, SlotRecord] | None = None) -> None:
    """A new owner rebuilding the machine from its image must hold exactly what the live one
    holds. With `recorded` (slot contents kept from the machine's changes, as the journal keeps
    them), the image's slots are those, and they must be the pool's contents."""
    image = live.image()
    if recorded is not None:
        kept = columns_of(recorded.values())
        assert kept == image.slots
        image = replace(image, slots=kept)
    settings = [here.settings for here in live.tenants.values()]
    fresh = InstanceMachine.recover(live.spec, live.limits, settings, image, next_generation(live))
    assert_same_machine(live, fresh)


def assert_same_machine(live: InstanceMachine, fresh: InstanceMachine) -> None:
    """`fresh`, rebuilt from a record of `live`, holds exactly what `live` holds; its free slots
    only need generations above any `live` issued."""
    differences = machine_differences(live, fresh)
    assert not differences, "\n".join(map(str, differences))
    for block in range(live.pool.capacity):
        if live.pool.state(block) == "FREE":
            assert fresh.pool.generation(block) > live.pool.generation(block), f"slot {block}"
    recount(fresh)
