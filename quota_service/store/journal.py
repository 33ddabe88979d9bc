"""The instance journal: what an instance's owner writes of its in-memory machine, in batches
of operations (a replica's owners' batches that wait for the same commit share its
transaction), and what a new owner reads back to rebuild it.

Rows per operation, never per block: a reservation or a pin is one row whose block table is
arrays; the slots whose contents changed in a batch are one `pool_deltas` row; the machine's small
scalars (fair clocks, holding times, drift) are merged into the owner's row, each tenant's into
its row of `instance_tenant_totals`; tenants' fleet-wide totals move by what the batch changed of
them, never past a quota (`QuotaRaced`). Every batch first moves the owner's row on
`WHERE epoch = :mine`, so a deposed owner commits nothing (`Deposed`). An owner holds a lease on
its instances, and a replica claims an instance only once the lease has lapsed (`InstanceHeld`).
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import msgspec
import psycopg
from sqlalchemy import text
from sqlalchemy.engine import Row, RowMapping
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from quota_service.core.admission import AdmitRequest
from quota_service.core.block_pool import ContentColumns
from quota_service.core.hashing import DIGEST_BYTES
from quota_service.core.instance_machine import (
    Changes,
    HeldTable,
    InstanceImage,
    InstanceMachine,
    PinRecord,
    ReservationRecord,
    TenantClocks,
    TenantSettings,
    Usage,
)
from quota_service.core.model import (
    AdmitParams,
    EndReason,
    Pin,
    ReservationState,
    TenantQuota,
    TenantState,
)
from quota_service.core.queueing import FairTags
from quota_service.store.pins import pin_from_row

# Generations a new owner's free slots start at: the epochs before its own times this, above
# any generation the instance issued before (a slot would need 2**40 drops within one epoch to
# reach the next); the first owner starts at 0.
GENERATIONS_PER_EPOCH = 1 << 40


class Deposed(Exception):
    """A newer owner holds the instance: this owner's batch was not committed."""


class RequestIdsReused(Exception):
    """New reservations of the batch had request ids the record holds already (reservations
    ended long ago): the batch was not committed."""

    def __init__(self, keys: list[tuple[str, str]]) -> None:
        super().__init__(", ".join(f"{t}/{r}" for t, r in keys))
        self.keys = keys


class PinIdTaken(Exception):
    """A pin of the batch has an id the record holds active on another instance (pinned there
    meanwhile): the batch was not committed."""


class QuotaRaced(Exception):
    """The batch would have taken tenants past their fleet-wide quota: other owners admitted
    for them meanwhile. It was not committed."""


class InstanceHeld(Exception):
    """Another replica's lease on the instance runs: it serves the instance."""

    def __init__(self, instance: str, owner: str, address: str, seconds_left: float) -> None:
        super().__init__(f"instances/{instance} is served by {owner} at {address}")
        self.instance = instance
        self.owner = owner
        self.address = address
        self.seconds_left = seconds_left


@dataclass(frozen=True, slots=True)
class TenantTotals:
    """What a tenant holds on one instance, as its fleet-wide totals count it."""

    blocks: int = 0
    tokens: int = 0
    pinned: int = 0
    queued: int = 0

    def minus(self, other: TenantTotals) -> TenantTotals:
        return TenantTotals(
            self.blocks - other.blocks,
            self.tokens - other.tokens,
            self.pinned - other.pinned,
            self.queued - other.queued,
        )


NO_TOTALS = TenantTotals()


def totals_of(machine: InstanceMachine, tenant: str) -> TenantTotals:
    here = machine.tenants.get(tenant)
    if here is None:
        return NO_TOTALS
    return TenantTotals(here.blocks, here.tokens, len(here.pinned), here.queued)


# Slots per row of a checkpoint: a statement of about a MB, however large the pool. A chunk's
# columns are Python objects while it is turned into its row (about 300 bytes a slot): at
# 65,536 slots a chunk, a checkpoint of a 1,000,000-slot instance took 20-30 MB more of the
# server's memory for a moment, its peak.
CHECKPOINT_CHUNK_SLOTS = 16_384

# A statement in the driver's placeholders (%(name)s) with its parameters.
Statement = tuple[str, Mapping[str, Any]]


@dataclass(slots=True)
class BatchRows:
    """One batch as rows, taken from the machine in one synchronous step (the records go on
    changing while the batch is written)."""

    reservations: list[dict[str, Any]] = field(default_factory=list)
    # Reservations the record has no row of yet.
    new_reservations: list[dict[str, Any]] = field(default_factory=list)
    pins: list[dict[str, Any]] = field(default_factory=list)
    removed_pins: list[dict[str, Any]] = field(default_factory=list)
    delta: dict[str, Any] | None = None
    clocks: dict[str, Any] = field(default_factory=dict)
    # Each tenant the batch touched: what it moved of the tenant's totals here (zeros when
    # nothing), and the tenant's clocks here now.
    totals: list[dict[str, Any]] = field(default_factory=list)
    # The pool's counters (slots per state, the queue), which the fence writes.
    counts: dict[str, int] = field(default_factory=dict)
    usage: list[dict[str, Any]] = field(default_factory=list)
    # The record's own statements that commit with the batch (InstanceOwner.apply).
    statements: list[Statement] = field(default_factory=list)
    # Every slot's contents as of this batch, taken with it and written once it committed, in
    # a transaction of its own (`Journal.write_checkpoint`) that drops the checkpoint and the
    # deltas it covers: recovery reads what is live, not all history. In chunks of
    # CHECKPOINT_CHUNK_SLOTS slots, each sent as a statement of its own.
    checkpoint: list[dict[str, Any]] | None = None

    @property
    def operations(self) -> int:
        """Its reservations and pins written: what a group commit counts."""
        return (
            len(self.new_reservations)
            + len(self.reservations)
            + len(self.pins)
            + len(self.removed_pins)
        )


def batch_rows(
    machine: InstanceMachine,
    changes: Changes,
    written: dict[str, TenantTotals],
    checkpoint: bool = False,
) -> BatchRows:
    """The rows of a batch. `written` holds each tenant's totals on this instance as last
    written; it is brought up to date for the tenants the batch touched. With `checkpoint`, every
    slot's contents as of the batch are taken too."""
    instance = machine.spec.instance
    rows = BatchRows()
    touched: set[str] = set()
    for record in changes.reservations.values():
        as_row = _reservation_row(instance, record)
        (rows.reservations if record.written else rows.new_reservations).append(as_row)
        record.written = True
        touched.add(record.key[0])
    for (owner, pin_id), pin in changes.pins.items():
        if pin is None:
            rows.removed_pins.append({"owner": owner, "pin_id": pin_id})
        else:
            rows.pins.append(_pin_row(instance, pin))
        collection, owner_id = owner.split("/", 1)
        if collection == "tenants":
            touched.add(owner_id)
    if checkpoint:
        chunks = machine.pool.contents_chunks(CHECKPOINT_CHUNK_SLOTS)
        rows.checkpoint = [
            {**_slot_arrays(machine.scopes, chunk), "chunk": number}
            for number, chunk in enumerate(chunks)
        ]
    if changes.slots or changes.dropped_slots:
        rows.delta = {"instance": instance, **_slot_arrays(machine.scopes, changes.slots)}
        rows.delta["dropped"] = _int_array(changes.dropped_slots)
    rows.usage = [
        row
        for tenant, usage in sorted(changes.usage.items())
        if (row := _usage_row(instance, tenant, usage))
    ]
    counts = machine.pool.counts()
    rows.counts = {
        "free": counts["FREE"],
        "cached": counts["CACHED"],
        "in_use": counts["IN_USE"],
        "pinned": counts["PINNED"],
        "queued": machine.queue_length,
        "queued_tokens": machine.queued_prompt_tokens,
    }
    rows.clocks = {
        "virtual_time": {str(p): t for p, t in machine.virtual_time.items()},
        "mean_hold_seconds": machine.mean_hold_seconds,
        "drift_blocks": machine.drift_blocks,
    }
    for tenant in sorted(touched):
        here = machine.tenants[tenant]
        now = totals_of(machine, tenant)
        moved = now.minus(written.get(tenant, NO_TOTALS))
        written[tenant] = now
        rows.totals.append(
            {
                "instance": instance,
                "tenant": tenant,
                "blocks": moved.blocks,
                "tokens": moved.tokens,
                "pinned": moved.pinned,
                "queued": moved.queued,
                "last_finish": {str(p): t for p, t in here.last_finish.items()},
                "mean_hold": here.mean_hold_seconds,
            }
        )
    return rows


def _usage_row(instance: str, tenant: str, usage: Usage) -> dict[str, Any] | None:
    """One usage event (store/usage.py integrates them), or None when nothing changed."""
    counts = {
        "pinned": usage.pinned,
        "cpu_bytes": usage.cpu_bytes,
        "compressed_bytes": usage.compressed_bytes,
        "tokens_reserved": usage.tokens_reserved,
        "output_tokens": usage.output_tokens,
        "admitted": usage.admitted,
        "queued": usage.queued,
    }
    keyed = {
        "blocks": {str(k): n for k, n in sorted(usage.blocks.items()) if n},
        "refused": {r: n for r, n in sorted(usage.refused.items()) if n},
        "shadow_refused": {r: n for r, n in sorted(usage.shadow_refused.items()) if n},
    }
    if not any(counts.values()) and not any(keyed.values()):
        return None
    return {"instance": instance, "tenant": tenant, **counts, **keyed}


def _slot_arrays(scopes: Sequence[str], slots: ContentColumns) -> dict[str, Any]:
    """A checkpoint's or a delta's arrays. Integer arrays go as array literals (the statement
    casts them): far cheaper to make than the driver's adaptation of each element."""
    return {
        "scopes": list(scopes),
        "slots": _int_array(slots.blocks),
        "generations": _int_array(slots.generations),
        "digests": slots.digests,
        "scope_ids": _int_array(slots.scopes),
        "engine_copies": _int_array(slots.engine_copies),
        "lru_seqs": _int_array(slots.lru_seqs),
    }


def _int_array(values: Iterable[int]) -> str:
    # A list's repr is made in C: faster than joining each number's str.
    return "{" + repr(list(values))[1:-1] + "}"


def _at(seconds: float | None) -> datetime | None:
    return None if seconds is None else datetime.fromtimestamp(seconds, UTC)


def _micros(seconds: float | None) -> int | None:
    """Microseconds since the epoch, rounded as `datetime.fromtimestamp(seconds, UTC)` rounds
    them (the fraction after `modf` to the microsecond, half to even), which is what recovery
    reads back; without making the datetime."""
    if seconds is None:
        return None
    fraction, whole = math.modf(seconds)
    return int(whole) * 1_000_000 + round(fraction * 1e6)


def _seconds(at: datetime | None) -> float | None:
    return None if at is None else at.timestamp()


def _reservation_row(instance: str, record: ReservationRecord) -> dict[str, Any]:
    """A reservation's row as JSON takes it: times as integer microseconds since the epoch
    (rounded as `datetime.fromtimestamp` rounds them, as the record's readers do; half the
    length of ISO 8601), the prompt's digest in hex, and its NULL columns left out
    (a key not there reads as NULL; most of a row's columns are NULL at any time, and
    PostgreSQL's CPU per row follows the JSON's length)."""
    p = record.params
    table = record.table
    digest = record.prompt_digest
    row = {
        "tenant": p.tenant,
        "request_id": p.request_id,
        "instance": instance,
        "prompt_tokens": p.prompt_tokens,
        "max_output_tokens": p.max_output_tokens,
        "n": p.n,
        "priority": p.priority,
        "state": record.state.value,
        "reserved_blocks": record.reserved_blocks,
        "reserved_tokens": record.tokens,
        "prefix_hit_blocks": record.prefix_hit_blocks,
        "lease_ttl_seconds": record.lease_ttl_seconds,
        "lease_expires_at": _micros(record.lease_expires_at),
        "admitted_at": _micros(record.admitted_at),
        "ended_at": _micros(record.ended_at),
        "end_reason": record.end_reason.value if record.end_reason is not None else None,
        "output_tokens": record.output_tokens,
        "queued_at": _micros(record.queued_at),
        "wait_deadline": _micros(record.wait_deadline),
        "virtual_start": record.tags.start,
        "virtual_finish": record.tags.finish,
        # A queued request's prompt, or a suspended session's tokens (the CPU tier's keys).
        "prompt_token_ids": (
            _int_array(record.prompt_token_ids) if record.prompt_token_ids else None
        ),
        "prompt_digest": digest.hex() if digest is not None else None,
        "shadow_refusal": record.shadow_refusal,
        "suspended_at": _micros(record.suspended_at),
        "offloaded_bytes": record.offloaded_bytes,
        "compressed_bytes": record.compressed_bytes,
        "compress_before_bytes": record.compress_before_bytes,
        "compress_after_bytes": record.compress_after_bytes,
        "freed_blocks": record.freed_blocks,
        "block_ids": _int_array(table.blocks) if table is not None else None,
        "block_generations": _int_array(table.generations) if table is not None else None,
        "released_positions": _released_positions(table) if table is not None else None,
        "queue_arrival": record.arrival,
    }
    return {column: value for column, value in row.items() if value is not None}


def _released_positions(table: HeldTable) -> str:
    released = table.released
    if table.live_entries == len(released):  # the common cases, with no loop in Python
        return "{}"
    if not table.live_entries:
        return _int_array(range(len(released)))
    return _int_array(i for i, gone in enumerate(released) if gone)


def _pin_row(instance: str, pin: PinRecord) -> dict[str, Any]:
    return {
        "owner": pin.owner,
        "pin_id": pin.pin_id,
        "tenant": pin.tenant,
        "instance": instance,
        "prompt_tokens": pin.prompt_tokens,
        "pinned_blocks": len(pin.table.blocks),
        "prefix_hash": pin.prefix,
        "created_at": _at(pin.created_at),
        "block_ids": list(pin.table.blocks),
        "block_generations": list(pin.table.generations),
        "salt": pin.salt,
        "token_ids": list(pin.token_ids),
    }


# A reservation's columns as the journal writes them, with their types in the JSON it sends
# and how each becomes the column's value. Integer arrays go as array literals in a JSON string:
# PostgreSQL reads a literal far faster than it converts a JSON array element by element (a
# table's ids and generations are most of a row). The journal's rows are read as `json`, not
# `jsonb`: they are read once, and converting them to jsonb first cost PostgreSQL more than
# reading them (in a probe of 2,000 admitted rows, 23-35 µs of CPU per row against 42-57 µs).
_RESERVATION_COLUMNS = (
    ("tenant", "text", None),
    ("request_id", "text", None),
    ("instance", "text", None),
    ("prompt_tokens", "int", None),
    ("max_output_tokens", "int", None),
    ("n", "int", None),
    ("priority", "int", None),
    ("state", "text", None),
    ("reserved_blocks", "bigint", None),
    ("reserved_tokens", "bigint", None),
    ("prefix_hit_blocks", "int", None),
    ("lease_ttl_seconds", "float8", None),
    ("lease_expires_at", "bigint", "micros"),
    ("admitted_at", "bigint", "micros"),
    ("ended_at", "bigint", "micros"),
    ("end_reason", "text", None),
    ("output_tokens", "int", None),
    ("queued_at", "bigint", "micros"),
    ("wait_deadline", "bigint", "micros"),
    ("virtual_start", "float8", None),
    ("virtual_finish", "float8", None),
    ("prompt_token_ids", "text", "int[]"),
    ("prompt_digest", "text", "hex"),
    ("shadow_refusal", "text", None),
    ("suspended_at", "bigint", "micros"),
    ("offloaded_bytes", "bigint", None),
    ("compressed_bytes", "bigint", None),
    ("compress_before_bytes", "bigint", None),
    ("compress_after_bytes", "bigint", None),
    ("freed_blocks", "int", None),
    ("block_ids", "text", "int[]"),
    ("block_generations", "text", "bigint[]"),
    ("released_positions", "text", "int[]"),
    ("queue_arrival", "bigint", None),
)


def _from_json(name: str, converted: str | None) -> str:
    if converted == "micros":
        # Exact: the microseconds go through float8 (interval * float8), exact below 2**53 (the
        # year 2255), and an interval of whole microseconds adds to a timestamptz as an integer.
        return f"timestamptz 'epoch' + r.{name} * interval '1 microsecond'"
    if converted == "hex":
        return f"decode(r.{name}, 'hex')"
    if converted is not None:
        return f"CAST(r.{name} AS {converted})"
    return f"r.{name}"


_COLUMN_NAMES = ", ".join(c for c, _, _ in _RESERVATION_COLUMNS)
_COLUMN_VALUES = ", ".join(_from_json(c, f) for c, _, f in _RESERVATION_COLUMNS)
_JSON_RECORD = ", ".join(f"{c} {t}" for c, t, _ in _RESERVATION_COLUMNS)

# A batch is written through the driver in one query (one round trip for all of it, whatever
# instances it holds batches of), so these statements use its placeholders; each kind of row goes
# as one JSON parameter (one statement however many rows), and statements whose order does not
# matter are one statement of several parts: each statement costs PostgreSQL about as much to
# parse, plan and start as its rows cost to write. The first statement moves the owner's row on
# under its epoch or fails the transaction, and writes the pool's counters in that row (migration
# 0030: in `instances` they cost a second row rewritten per batch, and its CHECK constraints);
# the ones after take the batch number from that row.
_NEXT_BATCH = (
    "SELECT journal_next_batch(%(instance)s, %(epoch)s, %(clocks)s::jsonb, %(free)s, "
    "%(cached)s, %(in_use)s, %(pinned)s, %(queued)s, %(queued_tokens)s)"
)
# What journal_next_batch (migrations 0021, 0030) fails with when the epoch is not the owner's.
DEPOSED_SQLSTATE = "KQ001"
# New reservations are inserted unless the request id is recorded already, and then the batch
# fails with those ids (journal_fresh, migration 0021); the changed ones replace their rows.
# Which ids were recorded is looked for only when fewer rows were inserted than sent (a hash
# anti-join that cost a one-operation batch about a tenth of its PostgreSQL CPU).
_WRITE_RESERVATIONS = (
    f"WITH r AS (SELECT * FROM json_to_recordset(%(new)s::json) AS r({_JSON_RECORD})), "
    f"inserted AS (INSERT INTO reservations ({_COLUMN_NAMES}) SELECT {_COLUMN_VALUES} FROM r "
    "ON CONFLICT (tenant, request_id) DO NOTHING RETURNING tenant, request_id), "
    f"changed AS (INSERT INTO reservations ({_COLUMN_NAMES}) SELECT {_COLUMN_VALUES} "
    f"FROM json_to_recordset(%(changed)s::json) AS r({_JSON_RECORD}) "
    "ON CONFLICT (tenant, request_id) DO UPDATE SET "
    + ", ".join(f"{c} = EXCLUDED.{c}" for c, _, _ in _RESERVATION_COLUMNS[2:])
    + ") SELECT CASE WHEN (SELECT count(*) FROM inserted) < (SELECT count(*) FROM r) "
    "THEN journal_fresh(ARRAY(SELECT r.tenant || '/' || r.request_id FROM r "
    "WHERE NOT EXISTS (SELECT 1 FROM inserted i "
    "WHERE i.tenant = r.tenant AND i.request_id = r.request_id))) END"
)
# What journal_fresh fails with.
REUSED_SQLSTATE = "KQ002"
# Tenants' fleet-wide totals move, never past a quota they grow in (journal_within_quota,
# migration 0027, fails the transaction (KQ003) naming the tenants it took past theirs; shadow-
# mode tenants are admitted past it on purpose), with each tenant's totals and clocks on each
# instance and the usage events: one statement for every batch of a transaction, its rows in
# JSON parameters read once. A tenant moves by the sum of what the batches moved of it, and is
# past its quota when it ends up there and some batch grew it. Its tenants' rows are locked
# first (`locked`, which a one-time filter of the update counts before it moves any), in the
# one order every commit of every replica follows, so that no two transactions wait on each
# other's (a deadlock PostgreSQL would break only after a second). Only the tenants that moved
# are updated, named in an array, which PostgreSQL looks up by key: joined with the JSON rows
# alone (estimated at 100) it read every tenant of the fleet in each batch (with 3,000 tenants,
# a one-operation batch cost twice its PostgreSQL CPU).
_MOVE_TOTALS = (
    "WITH locked AS (SELECT 1 FROM tenants WHERE tenant = ANY(%(tenants)s::text[]) "
    "ORDER BY tenant FOR NO KEY UPDATE), "
    "m AS (SELECT * FROM json_to_recordset(%(totals)s::json) "
    "AS m(instance text, tenant text, blocks bigint, tokens bigint, pinned bigint, "
    "queued bigint, last_finish jsonb, mean_hold float8)), "
    "f AS (SELECT tenant, sum(blocks) AS blocks, sum(tokens) AS tokens, sum(pinned) AS pinned, "
    "sum(queued) AS queued, bool_or(blocks > 0) AS grew_blocks, "
    "bool_or(tokens > 0) AS grew_tokens, bool_or(pinned > 0) AS grew_pinned "
    "FROM m GROUP BY tenant), "
    "moved AS (UPDATE tenants t SET blocks_in_use = t.blocks_in_use + f.blocks, "
    "tokens_in_flight = t.tokens_in_flight + f.tokens, "
    "pinned_blocks = t.pinned_blocks + f.pinned, queued_requests = t.queued_requests + f.queued "
    "FROM f WHERE t.tenant = f.tenant AND t.tenant = ANY(%(tenants)s::text[]) "
    "AND (SELECT count(*) FROM locked) >= 0 "
    "RETURNING t.tenant, NOT t.shadow_mode AND ("
    "(f.grew_blocks AND t.blocks_in_use > t.max_blocks) "
    "OR (f.grew_tokens AND t.tokens_in_flight > t.max_tokens_in_flight) "
    "OR (f.grew_pinned AND t.pinned_blocks > t.max_pinned_blocks)) AS over_quota), "
    "here AS (INSERT INTO instance_tenant_totals AS x (tenant, instance, blocks_in_use, "
    "tokens_in_flight, pinned_blocks, queued_requests, last_finish, mean_hold_seconds) "
    "SELECT m.tenant, m.instance, m.blocks, m.tokens, m.pinned, m.queued, m.last_finish, "
    "m.mean_hold FROM m "
    "ON CONFLICT (instance, tenant) DO UPDATE SET "
    "blocks_in_use = x.blocks_in_use + EXCLUDED.blocks_in_use, "
    "tokens_in_flight = x.tokens_in_flight + EXCLUDED.tokens_in_flight, "
    "pinned_blocks = x.pinned_blocks + EXCLUDED.pinned_blocks, "
    "queued_requests = x.queued_requests + EXCLUDED.queued_requests, "
    "last_finish = EXCLUDED.last_finish, mean_hold_seconds = EXCLUDED.mean_hold_seconds), "
    "usage AS (INSERT INTO usage_events (tenant, instance, blocks, pinned, cpu_bytes, "
    "compressed_bytes, tokens_reserved, output_tokens, admitted, queued, refused, shadow_refused) "
    "SELECT u.tenant, u.instance, u.blocks, u.pinned, u.cpu_bytes, u.compressed_bytes, "
    "u.tokens_reserved, u.output_tokens, u.admitted, u.queued, u.refused, u.shadow_refused "
    "FROM json_to_recordset(%(usage)s::json) AS u(instance text, tenant text, blocks jsonb, "
    "pinned int, cpu_bytes bigint, compressed_bytes bigint, tokens_reserved bigint, "
    "output_tokens bigint, admitted int, queued int, refused jsonb, shadow_refused jsonb)) "
    "SELECT journal_within_quota(ARRAY(SELECT tenant FROM moved WHERE over_quota ORDER BY tenant))"
)
# What journal_within_quota fails with.
OVER_QUOTA_SQLSTATE = "KQ003"
# What journal_pin_taken fails with.
PIN_TAKEN_SQLSTATE = "KQ004"
# A pin, and what the instance's CPU tier must pin too, as it is now (salt, coordinator): an
# unpin later reaches the same pins there whatever changed meanwhile. It replaces a recorded pin
# of its id only when that one was removed or is on the same instance; one active on another
# instance (pinned there meanwhile by its owner) fails the batch (journal_pin_taken, migration
# 0025).
_UPSERT_PIN = (
    "WITH pin AS (INSERT INTO pins (owner, pin_id, tenant, instance, prompt_tokens, "
    "pinned_blocks, prefix_hash, created_at, block_ids, block_generations, state, removed_at) "
    "VALUES (%(owner)s, %(pin_id)s, %(tenant)s, %(instance)s, %(prompt_tokens)s, "
    "%(pinned_blocks)s, %(prefix_hash)s, %(created_at)s, %(block_ids)s, "
    "%(block_generations)s, 'ACTIVE', NULL) "
    "ON CONFLICT (owner, pin_id) DO UPDATE SET tenant = EXCLUDED.tenant, "
    "instance = EXCLUDED.instance, prompt_tokens = EXCLUDED.prompt_tokens, "
    "pinned_blocks = EXCLUDED.pinned_blocks, prefix_hash = EXCLUDED.prefix_hash, "
    "created_at = EXCLUDED.created_at, block_ids = EXCLUDED.block_ids, "
    "block_generations = EXCLUDED.block_generations, state = 'ACTIVE', removed_at = NULL "
    "WHERE pins.state = 'REMOVED' OR pins.instance = EXCLUDED.instance "
    "RETURNING holder_id), "
    "mirrored AS (INSERT INTO cpu_tier_pins (holder_id, coordinator_url, model_name, "
    "world_size, cache_salt, token_ids) "
    "SELECT pin.holder_id, i.lmcache_coordinator_url, i.lmcache_model_name, "
    "i.lmcache_world_size, %(salt)s, %(token_ids)s::int[] FROM pin, instances i "
    "WHERE i.instance = %(instance)s AND i.lmcache_coordinator_url IS NOT NULL "
    "ON CONFLICT (holder_id) DO UPDATE SET coordinator_url = EXCLUDED.coordinator_url, "
    "model_name = EXCLUDED.model_name, world_size = EXCLUDED.world_size, "
    "cache_salt = EXCLUDED.cache_salt, token_ids = EXCLUDED.token_ids, chunk_keys = NULL, "
    "wanted = true) "
    "SELECT journal_pin_taken(ARRAY(SELECT %(owner)s || '/pins/' || %(pin_id)s "
    "WHERE NOT EXISTS (SELECT 1 FROM pin)))"
)
_REMOVE_PIN = (
    "WITH removed AS (UPDATE pins SET state = 'REMOVED', removed_at = now(), block_ids = NULL, "
    "block_generations = NULL "
    "WHERE owner = %(owner)s AND pin_id = %(pin_id)s AND state = 'ACTIVE' RETURNING holder_id) "
    "UPDATE cpu_tier_pins c SET wanted = false FROM removed r WHERE c.holder_id = r.holder_id"
)
_SLOT_ARRAYS = (
    "%(scopes)s::text[], %(slots)s::int[], %(generations)s::bigint[], %(digests)s::bytea, "
    "%(scope_ids)s::int[], %(engine_copies)s::int[], %(lru_seqs)s::bigint[]"
)
_INSERT_DELTA = (
    "INSERT INTO pool_deltas (instance, batch, scopes, slots, generations, digests, scope_ids, "
    f"engine_copies, lru_seqs, dropped) SELECT instance, batch, {_SLOT_ARRAYS}, "
    "%(dropped)s::int[] FROM instance_owners WHERE instance = %(instance)s AND epoch = %(epoch)s"
)
# A new checkpoint, as of a committed batch, replaces the last one and the deltas it covers.
# Later batches' deltas may be committing meanwhile: they are after it.
_DROP_COVERED = (
    "WITH checkpoint AS (DELETE FROM pool_checkpoints WHERE instance = %(instance)s) "
    "DELETE FROM pool_deltas WHERE instance = %(instance)s AND batch <= %(batch)s"
)
_WRITE_CHECKPOINT_CHUNK = (
    "INSERT INTO pool_checkpoints (instance, chunk, batch, scopes, slots, generations, digests, "
    f"scope_ids, engine_copies, lru_seqs) VALUES (%(instance)s, %(chunk)s, %(batch)s, "
    f"{_SLOT_ARRAYS})"
)
# A checkpoint's fence, last before its COMMIT: the owner's row locked under its epoch, so that
# a claim either committed before (no row: the checkpoint is rolled back) or waits for the
# COMMIT and then reads the checkpoint. The owner's batches wait on the lock only that long.
_CHECKPOINT_FENCE = (
    "SELECT 1 FROM instance_owners WHERE instance = %(instance)s AND epoch = %(epoch)s FOR UPDATE"
)
_INSTANCES_OF = text(
    "SELECT r.tenant, r.request_id, r.instance FROM reservations r "
    "JOIN unnest(CAST(:tenants AS text[]), CAST(:request_ids AS text[])) AS k(tenant, request_id) "
    "ON r.tenant = k.tenant AND r.request_id = k.request_id"
)
# An instance is claimed only when no other replica's lease on it runs (rows of owners that
# kept no lease count as lapsed); the claim raises the epoch, which fences the previous owner.
_CLAIM = text(
    "INSERT INTO instance_owners (instance, owner, address, epoch, lease_expires_at) "
    "VALUES (:instance, :owner, :address, 1, now() + make_interval(secs => :lease)) "
    "ON CONFLICT (instance) DO UPDATE SET owner = EXCLUDED.owner, "
    "address = EXCLUDED.address, epoch = instance_owners.epoch + 1, "
    "lease_expires_at = EXCLUDED.lease_expires_at "
    "WHERE instance_owners.lease_expires_at IS NULL OR instance_owners.lease_expires_at <= now() "
    "OR instance_owners.owner = EXCLUDED.owner "
    "RETURNING epoch, batch, clocks"
)
_HOLDER = text(
    "SELECT owner, address, extract(epoch FROM lease_expires_at - now()) AS seconds_left "
    "FROM instance_owners WHERE instance = :instance"
)
_RENEW = text(
    "UPDATE instance_owners o SET lease_expires_at = now() + make_interval(secs => :lease) "
    "FROM unnest(CAST(:instances AS text[]), CAST(:epochs AS bigint[])) AS k(instance, epoch) "
    "WHERE o.instance = k.instance AND o.epoch = k.epoch AND o.owner = :owner "
    "RETURNING o.instance"
)
# A replica that stops gives its instances up at once rather than when its leases run out.
# Each instance given up is announced ("handed:"), so that another replica claims it at once
# rather than at its next lease round (owners.py).
_RELEASE = text(
    "WITH released AS ("
    " UPDATE instance_owners o SET lease_expires_at = now() "
    " FROM unnest(CAST(:instances AS text[]), CAST(:epochs AS bigint[])) AS k(instance, epoch) "
    " WHERE o.instance = k.instance AND o.epoch = k.epoch AND o.owner = :owner"
    " RETURNING o.instance) "
    "SELECT pg_notify('kvquota_events', 'handed:' || instance) FROM released"
)
# Instances to take over without waiting for a call: those whose owner's lease lapsed (it died
# or stopped, leaving live reservations, a queue), and those never owned whose engine publishes
# KV events to follow. Others are claimed by the replica that first serves a call for them.
# The other replicas' machines learn a tenant's change from this (notifications.py).
_TENANT_CHANGED = text("SELECT pg_notify('kvquota_events', 'tenants:' || :tenant)")
_UNOWNED = text(
    "SELECT i.instance FROM instances i LEFT JOIN instance_owners o ON o.instance = i.instance "
    "WHERE (o.instance IS NOT NULL AND coalesce(o.lease_expires_at <= now(), true)) "
    "OR (o.instance IS NULL AND i.kv_events_endpoint IS NOT NULL) ORDER BY i.instance"
)
# What each tenant holds on each instance other than these (the ones a replica serves).
_HOLDINGS_ELSEWHERE = text(
    "SELECT tenant, instance, blocks_in_use, tokens_in_flight, pinned_blocks, queued_requests "
    "FROM instance_tenant_totals WHERE instance <> ALL(CAST(:here AS text[])) "
    "AND (blocks_in_use, tokens_in_flight, pinned_blocks, queued_requests) <> (0, 0, 0, 0)"
)
_INSTANCES = text("SELECT instance FROM instances ORDER BY instance")
_PIN = text("SELECT * FROM pins WHERE owner = :owner AND pin_id = :pin_id")
_NAMESPACE_SALT = text("SELECT cache_salt FROM namespaces WHERE namespace = :namespace")
_OWNER = text("SELECT epoch, batch, clocks FROM instance_owners WHERE instance = :instance")
_CHECKPOINT = text(
    "SELECT batch, scopes, slots, generations, digests, scope_ids, engine_copies, lru_seqs, "
    "CAST('{}' AS int[]) AS dropped FROM pool_checkpoints WHERE instance = :instance"
)
_DELTAS = text(
    "SELECT batch, scopes, slots, generations, digests, scope_ids, engine_copies, lru_seqs, "
    "dropped FROM pool_deltas WHERE instance = :instance AND batch > :after ORDER BY batch"
)
_LIVE_RESERVATIONS = text(
    "SELECT * FROM reservations WHERE instance = :instance AND state IN ('QUEUED', 'ADMITTED')"
)
_ENDED_RESERVATION = text(
    "SELECT * FROM reservations WHERE tenant = :tenant AND request_id = :request_id "
    "AND instance = :instance AND state = 'ENDED'"
)
_ACTIVE_PINS = text("SELECT * FROM pins WHERE instance = :instance AND state = 'ACTIVE'")
_TENANT_CLOCKS = text(
    "SELECT tenant, last_finish, mean_hold_seconds FROM instance_tenant_totals "
    "WHERE instance = :instance AND (last_finish <> '{}' OR mean_hold_seconds IS NOT NULL)"
)
# A tenant's salt is its namespace's when it has one: the hashes of its prefixes are then the
# namespace's (hash_scope), shared with the namespace's other tenants.
_TENANT_SETTINGS = text(
    "SELECT t.tenant, t.state, t.weight, t.shadow_mode, t.max_blocks, t.max_tokens_in_flight, "
    "t.max_queued_requests, t.max_pinned_blocks, t.max_cpu_tier_bytes, "
    "coalesce((SELECT ns.cache_salt FROM namespaces ns WHERE ns.namespace = t.namespace), "
    "t.cache_salt) AS cache_salt, "
    "CASE WHEN t.namespace IS NULL THEN 'tenants/' || t.tenant "
    "ELSE 'namespaces/' || t.namespace END AS hash_scope "
    "FROM tenants t WHERE CAST(:tenant AS text) IS NULL OR t.tenant = :tenant"
)


@dataclass(frozen=True, slots=True)
class RecordedInstance:
    """What the record holds of an instance: enough to rebuild its machine."""

    epoch: int
    batch: int
    image: InstanceImage

    @property
    def generation_floor(self) -> int:
        return max(self.epoch - 1, 0) * GENERATIONS_PER_EPOCH


def tenant_settings_from_row(row: RowMapping) -> TenantSettings:
    quota = TenantQuota(**{name: row[name] for name in TenantQuota.__dataclass_fields__})
    return TenantSettings(
        row["tenant"],
        TenantState(row["state"]),
        quota,
        row["weight"],
        row["cache_salt"],
        row["hash_scope"],
        row["shadow_mode"],
    )


# A placeholder of the driver's, by name.
_PLACEHOLDER = re.compile(r"%\((\w+)\)s")


class _Unbound(Exception):
    """A parameter `_literal` leaves to the driver."""


def _literal(value: object) -> str:
    """One of the journal's own parameters as an SQL literal (the connection has
    standard_conforming_strings on: a quote is doubled, a backslash is itself). Text, numbers,
    bytes and text arrays, the kinds its hot-path statements take; any other raises _Unbound."""
    if value is None:
        return "NULL"
    if isinstance(value, str):
        if "\0" in value:
            raise _Unbound  # the driver refuses it, as PostgreSQL would
        return "'" + value.replace("'", "''") + "'"
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, bytes):
        return "'\\x" + value.hex() + "'"
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        quoted = (item.replace("\\", "\\\\").replace('"', '\\"') for item in value)
        return _literal("{" + ",".join(f'"{item}"' for item in quoted) + "}")
    raise _Unbound


class _Writer:
    """An owner's write connection, with the journal's statements it has prepared. A batch's
    statements are the same every time: PREPAREd once per connection, each batch EXECUTEs
    them, and PostgreSQL plans them once instead of parsing and planning each again (which
    cost it about as much as running them). PREPARE and EXECUTE are statements of their own,
    so a batch stays one query text, one round trip."""

    def __init__(self, connection: psycopg.AsyncConnection[Any]) -> None:
        self.connection = connection
        # Binds the statements client-side: a batch is one query text, however many.
        self.cursor = psycopg.AsyncClientCursor(connection)
        # Each prepared statement's EXECUTE as a template of its parameters' literals, and
        # their names (in the order of its placeholders).
        self._executes: dict[str, tuple[str, list[str]]] = {}
        # Literals made here need the standard quoting (the server's default since 9.1);
        # under the old one the driver binds every parameter.
        conforming = connection.info.parameter_status("standard_conforming_strings")
        self._literals = conforming == "on"
        self._encoding = connection.info.encoding

    async def run(self, query: str) -> list[psycopg.pq.abc.PGresult]:
        """Send one query (any number of statements) and read every statement's result,
        straight through libpq: the driver's cursor, its generators and its result sets were 5%
        of a served Admit+Release's instructions (a commit's results are a handful of one-row
        reads). A statement that failed raises its error, as
        the driver would (the ones after it did not run); a connection lost raises too."""
        pgconn = self.connection.pgconn
        pgconn.send_query(query.encode(self._encoding))
        while pgconn.flush():
            await self._ready(writing=True)
        results = []
        while True:
            while pgconn.is_busy():
                await self._ready(writing=False)
                pgconn.consume_input()
            result = pgconn.get_result()
            if result is None:
                break
            results.append(result)
        for result in results:
            if result.status == _FAILED:
                raise psycopg.errors.error_from_result(result, self._encoding)
        return results

    async def _ready(self, writing: bool) -> None:
        """Until the connection's socket can be read (or written) without waiting."""
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = loop.create_future()

        def wake() -> None:
            if not ready.done():
                ready.set_result(None)

        fileno = self.connection.pgconn.socket
        add, remove = (
            (loop.add_writer, loop.remove_writer)
            if writing
            else (loop.add_reader, loop.remove_reader)
        )
        add(fileno, wake)
        try:
            await ready
        finally:
            remove(fileno)

    def prepare(self, statements: Iterable[str]) -> list[str]:
        """The PREPAREs of the statements this connection has not prepared yet (a parameter
        that appears more than once is one parameter, numbered as it first appears)."""
        prepares = []
        for sql in statements:
            if sql in self._executes:
                continue
            name = f"journal_{len(self._executes)}"
            keys = list(dict.fromkeys(_PLACEHOLDER.findall(sql)))
            numbered = sql
            for number, key in enumerate(keys, 1):
                numbered = numbered.replace(f"%({key})s", f"${number}")
            prepares.append(f"PREPARE {name} AS {numbered}")
            arguments = f"({', '.join('{}' for _ in keys)})" if keys else ""
            self._executes[sql] = (f"EXECUTE {name}{arguments}", keys)
        return prepares

    def bound(self, sql: str, params: Mapping[str, Any]) -> str:
        """A prepared statement's EXECUTE with its parameters bound. Its literals are made here
        (the driver's binding, a Python call per parameter and copies of each batch's JSON,
        cost a served Admit+Release more than the batch's own rows); a parameter of a kind
        `_literal` does not make is bound by the driver, with the rest of its statement."""
        template, keys = self._executes[sql]
        if self._literals:
            try:
                return template.format(*[_literal(params[key]) for key in keys])
            except _Unbound:
                pass
        return self.cursor.mogrify(template.format(*(f"%({key})s" for key in keys)), params)


@dataclass(frozen=True, slots=True)
class GroupCommit:
    """When a replica holds its owners' batches open a moment before writing them. Under load
    (its last transaction carried at least `busy_operations` operations) more are on their way,
    and batches written at once would commit a few and leave the rest to the next: waiting
    `wait_seconds`, to the same moment for every owner, lets them share one transaction, and
    much of what a transaction costs the server and PostgreSQL is the same for a few operations
    as for many. A replica with little to do writes at once (one caller alone never waits).
    The threshold counts the replica's transaction, not one owner's batch: eight instances with
    four clients each committed 3.7 operations a transaction, in batches of one or two that
    never made their owner busy, and served 0.66 of one instance's pairs/s. A server takes its
    own from its settings (KVQUOTA_GROUP_COMMIT_*)."""

    wait_seconds: float
    busy_operations: int


WRITE_AT_ONCE = GroupCommit(wait_seconds=0.0, busy_operations=1)


@dataclass(slots=True)
class CommitStats:
    """How a replica's commits are doing: transactions, each of one or more owners' batches."""

    commits: int = 0
    # Operations the last transaction carried, of every owner's batches.
    last_operations: int = 0


@dataclass(slots=True)
class _Batch:
    """An owner's batch, as the statements of its transaction."""

    instance: str
    epoch: int
    rows: BatchRows

    def statements(self) -> list[Statement]:
        """Its fence first (the ones after take the batch number from the owner's row), then
        its pins and slot changes."""
        rows = self.rows
        fenced = {"instance": self.instance, "epoch": self.epoch}
        clocks = _JSON.encode(rows.clocks).decode()
        statements: list[Statement] = [(_NEXT_BATCH, {**fenced, "clocks": clocks, **rows.counts})]
        statements += [(_UPSERT_PIN, pin) for pin in rows.pins]
        statements += [(_REMOVE_PIN, pin) for pin in rows.removed_pins]
        if rows.delta is not None:
            statements.append((_INSERT_DELTA, {**rows.delta, **fenced}))
        return statements


# What a batch's row of a tenant moves of its totals (`batch_rows` writes a row for every
# tenant it touched, these zero where its totals did not move).
_MOVED = ("blocks", "tokens", "pinned", "queued")


def _moved(totals: Mapping[str, Any]) -> bool:
    return any(totals[name] for name in _MOVED)


def transaction_statements(batches: Sequence[_Batch]) -> list[Statement]:
    """The journal's statements of a transaction that commits `batches` (of different
    instances): each batch's own, then one for all their reservations, then one for their
    tenants' totals, so that the tenants' rows stay locked only from there to the commit."""
    statements = [statement for batch in batches for statement in batch.statements()]
    every = [batch.rows for batch in batches]
    new = [row for rows in every for row in rows.new_reservations]
    changed = [row for rows in every for row in rows.reservations]
    if new or changed:
        statements.append((_WRITE_RESERVATIONS, {"new": _json(new), "changed": _json(changed)}))
    totals = [here for rows in every for here in rows.totals]
    tenants = sorted({here["tenant"] for here in totals if _moved(here)})
    moved = {
        "tenants": tenants,
        "totals": _json(totals),
        "usage": _json([row for rows in every for row in rows.usage]),
    }
    statements.append((_MOVE_TOTALS, moved))
    return statements


@dataclass(slots=True, eq=False)
class _Queued:
    """A batch and its caller, waiting for the commit in flight to end: then the caller is
    answered, or leads the next commit, of every batch that waited (`turn`'s result)."""

    batch: _Batch
    turn: asyncio.Future[list[_Queued] | None]
    number: int = 0
    error: BaseException | None = None
    answered: bool = False

    def answer(self, number: int = 0, error: BaseException | None = None) -> None:
        self.number, self.error, self.answered = number, error, True
        if not self.turn.done():
            self.turn.set_result(None)


class _Failed(Exception):
    """A transaction failed; `rolled_back` when it surely committed nothing."""

    def __init__(self, cause: psycopg.Error, rolled_back: bool) -> None:
        super().__init__(str(cause))
        self.cause = cause
        self.rolled_back = rolled_back


class Journal:
    """Reads and writes of the instance journal. Writes are the owners' alone.

    A replica commits one transaction at a time: the batches of its owners that arrive while
    one is in flight wait, and then commit together in the next, which the first of their
    callers leads (`write`). A fleet's owners thus share commits: eight instances with four
    clients each committed a batch of one or two operations each, in eight transactions in
    flight at once, at four times one instance's PostgreSQL CPU per pair. One transaction holds
    many tenants' rows to its commit, which no other commit of the replica waits on; other
    replicas' commits lock them in the same order (`transaction_statements`). A transaction of
    several batches that one of them fails (its fence, a quota, a request id) is rolled back,
    and its batches commit again one by one, so that each fails or commits on its own."""

    def __init__(self, engine: AsyncEngine, group_commit: GroupCommit = WRITE_AT_ONCE) -> None:
        self._engine = engine
        self._group_commit = group_commit
        # The moment the owners waiting on a busy replica take their batches (`gathered`), and
        # when (time.monotonic) its last transaction ended.
        self._gathering: asyncio.Future[None] | None = None
        self._ended = -math.inf
        # Owners waiting for the moment, and how many the last one woke.
        self._gathered = self._woken = 0
        self._url = engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
        # Write connections: every one open, and those no commit uses now.
        self._writers: set[_Writer] = set()
        self._idle: list[_Writer] = []
        self._closed = False
        self.stats = CommitStats()
        # Whether a commit is in flight, and the batches waiting for it to end.
        self._committing = False
        self._queued: list[_Queued] = []

    async def write(self, instance: str, epoch: int, rows: BatchRows) -> int:
        """Commit one batch of an owner's (the owner groups its operations into batches, and
        writes one at a time). With no commit in flight the caller commits its batch in its own
        task: no hop to another task and back on the way to PostgreSQL, which a caller waiting
        alone would feel in its answer. Returns the batch's number in the record. Raises
        Deposed when a newer owner exists (RequestIdsReused, QuotaRaced, PinIdTaken as they
        say)."""
        me = _Queued(_Batch(instance, epoch, rows), asyncio.get_running_loop().create_future())
        if self._committing:
            self._queued.append(me)
            try:
                group = await me.turn
            except asyncio.CancelledError:
                # Cancelled just as the turn to lead came: the others of the group go on. (Just
                # as it was answered, or while it waited, there is nothing to pass on.)
                led = me.turn.result() if me.turn.done() and not me.turn.cancelled() else None
                if led is not None:
                    self._pass_on(led, me)
                raise
        else:
            self._committing = True
            group = [me]
            if self._woken > 1:
                # The other owners woken at the same moment (`gathered`) write their batches in
                # this turn of the event loop: they join this transaction. (Not for an owner
                # woken alone: what the loop runs meanwhile would delay its commit, a twelfth
                # of one instance's pairs/s at 32 clients.)
                self._woken = 0
                try:
                    await asyncio.sleep(0)
                except asyncio.CancelledError:
                    self._pass_on(group, me)
                    raise
                group += self._take_queued()
        if group is not None:
            await self._lead(group)
        if me.error is not None:
            raise me.error
        return me.number

    def _busy(self) -> bool:
        """Whether the last transaction carried many operations (more are on their way)."""
        commit = self._group_commit
        return commit.wait_seconds > 0 and self.stats.last_operations >= commit.busy_operations

    async def gathered(self) -> None:
        """Return when an owner may take its batch and write it. At once, unless this replica
        is busy: its last transaction carried many operations and is still being written, or
        ended less than `wait_seconds` ago, or another owner waits already (after a pause the
        next operation is written at once). Then `wait_seconds` after the first owner asked, for
        every owner that asks meanwhile."""
        if not self._busy():
            return
        if self._gathering is None:
            paused = time.monotonic() - self._ended >= self._group_commit.wait_seconds
            if paused and not self._committing:
                return
            loop = asyncio.get_running_loop()
            gathering = self._gathering = loop.create_future()
            self._gathered = 0

            def due() -> None:
                self._gathering, self._woken = None, self._gathered
                if not gathering.done():
                    gathering.set_result(None)

            loop.call_later(self._group_commit.wait_seconds, due)
        self._gathered += 1
        # One owner stopped while it waits leaves the moment to the others.
        await asyncio.shield(self._gathering)

    async def _lead(self, group: list[_Queued]) -> None:
        """Commit a group of batches and answer each, then hand the batches that waited
        meanwhile to the first of their callers."""
        try:
            await self._settle(group)
        finally:
            for queued in group:
                if not queued.answered:  # cut short (cancelled): whether it took is unknown
                    queued.answer(error=psycopg.OperationalError("the commit was cut short"))
            self._hand_over()

    def _pass_on(self, group: list[_Queued], leaving: _Queued) -> None:
        self._queued[:0] = [queued for queued in group if queued is not leaving]
        self._hand_over()

    def _take_queued(self) -> list[_Queued]:
        """The batches waiting for a turn (not those whose callers left)."""
        waiting = [queued for queued in self._queued if not queued.turn.done()]
        self._queued = []
        return waiting

    def _hand_over(self) -> None:
        waiting = self._take_queued()
        if waiting:
            waiting[0].turn.set_result(waiting)
        else:
            self._committing = False

    async def _settle(self, group: list[_Queued]) -> None:
        # In the instances' order, as other replicas' transactions that touch the same rows
        # (an instance taken over meanwhile) take them.
        group.sort(key=lambda queued: queued.batch.instance)
        try:
            numbers = await self._commit([queued.batch for queued in group])
        except _Failed as failed:
            if failed.rolled_back and len(group) > 1:
                for queued in group:
                    await self._settle([queued])
                return
            for queued in group:
                queued.answer(error=_error_of(queued.batch.instance, failed.cause))
            return
        for queued, number in zip(group, numbers, strict=True):
            queued.answer(number)

    async def _commit(self, batches: list[_Batch]) -> list[int]:
        """One transaction in one round trip: the batches' statements, bound here, go as one
        query between BEGIN and COMMIT. The journal's own statements run prepared (`_Writer`),
        the record's that ride along (`BatchRows.statements`) as they are. A statement that
        fails fails the rest, and the transaction is rolled back: `_Failed`. Any other failure
        (the connection lost, a COMMIT cut short that may have taken) fails it too, and the
        connection is not trusted again. Returns each batch's number in the record."""
        writer = await self._connected()
        cursor = writer.cursor
        own = transaction_statements(batches)
        prepares = writer.prepare(sql for sql, _ in own)
        query = ";".join(
            [
                *prepares,
                "BEGIN",
                *(writer.bound(sql, params) for sql, params in own),
                *(
                    cursor.mogrify(sql, params)
                    for batch in batches
                    for sql, params in batch.rows.statements
                ),
                "COMMIT",
            ]
        )
        try:
            numbers = _batch_numbers(await writer.run(query), len(batches))
        except psycopg.Error as exc:
            raise _Failed(exc, await self._kept_if_rolled_back(writer)) from exc
        except BaseException:
            # Cut short (cancelled): whether the transaction took is unknown.
            await self._drop(writer)
            raise
        self._idle.append(writer)
        self.stats.commits += 1
        self.stats.last_operations = sum(batch.rows.operations for batch in batches)
        self._ended = time.monotonic()
        return numbers

    async def write_checkpoint(
        self, instance: str, epoch: int, batch: int, chunks: Sequence[Mapping[str, Any]]
    ) -> None:
        """Record every slot's contents as of `batch` (committed), in place of the checkpoint
        and the deltas up to it, in a transaction of its own: the owner's later batches commit
        meanwhile instead of waiting behind it. Fenced like a batch: raises Deposed when a newer
        owner exists (nothing is then written)."""
        writer = await self._connected()
        covered = {"instance": instance, "batch": batch}
        statements = [
            (_DROP_COVERED, covered),
            *((_WRITE_CHECKPOINT_CHUNK, {**chunk, **covered}) for chunk in chunks),
        ]
        fence = (_CHECKPOINT_FENCE, {"instance": instance, "epoch": epoch})
        prepares = writer.prepare(sql for sql, _ in [*statements, fence])
        deposed = False
        try:
            await writer.run(";".join([*prepares, "BEGIN"]))
            # One statement each, bound as it is sent: the query text of a large pool's
            # checkpoint is never in memory whole.
            for sql, params in statements:
                await writer.run(writer.bound(sql, params))
            [fenced] = await writer.run(writer.bound(*fence))
            deposed = not fenced.ntuples
            await writer.run("ROLLBACK" if deposed else "COMMIT")
        except psycopg.Error as exc:
            await self._kept_if_rolled_back(writer)
            raise _error_of(instance, exc)  # noqa: B904 (its cause is set)
        except BaseException:
            await self._drop(writer)
            raise
        self._idle.append(writer)
        if deposed:
            raise Deposed(instance)

    async def _kept_if_rolled_back(self, writer: _Writer) -> bool:
        """After a failed transaction: the connection is used again when the transaction surely
        committed nothing (returns True), and closed otherwise."""
        if await _rolled_back(writer.connection):
            self._idle.append(writer)
            return True
        await self._drop(writer)
        return False

    async def _drop(self, writer: _Writer) -> None:
        self._writers.discard(writer)
        await writer.connection.close()

    async def _connected(self) -> _Writer:
        """A write connection no commit uses now, opened when none is."""
        self._raise_if_closed()
        while self._idle:
            writer = self._idle.pop()
            if not writer.connection.closed:
                return writer
            self._writers.discard(writer)
        # Autocommit: the driver adds no BEGIN of its own (a round trip). No prepare_threshold:
        # every batch's query text is new, so the driver's count of texts seen is work for
        # nothing (the statements are PREPAREd by name, `_Writer`).
        connection = await psycopg.AsyncConnection.connect(
            self._url, autocommit=True, prepare_threshold=None
        )
        if self._closed:  # closed while this one connected: nothing else would close it
            await connection.close()
            self._raise_if_closed()
        # Generic plans always: left to choose, PostgreSQL planned the tenants' statements
        # again for every batch once the fleet had thousands of tenants (its generic plan's
        # estimate for an array of tenants looked dearer than one tenant's custom plan), a
        # third of a batch's CPU. Set here rather than as a connection option, which would
        # replace the options the database URL or PGOPTIONS give.
        try:
            await connection.execute("SET plan_cache_mode = force_generic_plan")
        except BaseException:
            await connection.close()
            raise
        writer = _Writer(connection)
        self._writers.add(writer)
        return writer

    def _raise_if_closed(self) -> None:
        if self._closed:
            raise psycopg.OperationalError("the journal is closed: this replica is stopping")

    async def close(self) -> None:
        """Close the write connections; no batch is written after."""
        self._closed = True
        writers, self._writers, self._idle = self._writers, set(), []
        for writer in writers:
            await writer.connection.close()

    async def instances_of(self, keys: Sequence[tuple[str, str]]) -> dict[tuple[str, str], str]:
        """The instances these reservations are recorded on (the ones that are)."""
        tenants, request_ids = zip(*keys, strict=True) if keys else ((), ())
        params = {"tenants": list(tenants), "request_ids": list(request_ids)}
        async with self._engine.connect() as conn:
            await conn.execution_options(isolation_level="AUTOCOMMIT")
            rows = await conn.execute(_INSTANCES_OF, params)
            return {(tenant, request_id): instance for tenant, request_id, instance in rows}

    async def ended_reservation(
        self, instance: str, tenant: str, request_id: str
    ) -> ReservationRecord | None:
        """A reservation that ended on the instance, as the record has it (a rebuilt machine
        knows only the live ones)."""
        params = {"instance": instance, "tenant": tenant, "request_id": request_id}
        async with self._engine.connect() as conn:
            row = (await conn.execute(_ENDED_RESERVATION, params)).mappings().first()
        return None if row is None else _record_from_row(row)

    async def recorded_pin(self, owner: str, pin_id: str) -> Pin | None:
        """A pin as the record has it (its blocks are its owner's to tell)."""
        async with self._engine.connect() as conn:
            params = {"owner": owner, "pin_id": pin_id}
            row = (await conn.execute(_PIN, params)).mappings().first()
        return None if row is None else pin_from_row(row)

    async def namespace_salt(self, namespace: str) -> str | None:
        async with self._engine.connect() as conn:
            params = {"namespace": namespace}
            return (await conn.execute(_NAMESPACE_SALT, params)).scalar_one_or_none()

    async def instances(self) -> list[str]:
        async with self._engine.connect() as conn:
            return [r[0] for r in await conn.execute(_INSTANCES)]

    async def tenants(self, only: str | None = None) -> list[TenantSettings]:
        """Every tenant's settings as the catalog has them now (`only`: that tenant's)."""
        async with self._engine.connect() as conn:
            rows = (await conn.execute(_TENANT_SETTINGS, {"tenant": only})).mappings().all()
        return [tenant_settings_from_row(r) for r in rows]

    async def load(
        self, instance: str, owner: str, address: str, lease_seconds: float
    ) -> RecordedInstance:
        """Claim the instance under a new epoch and read what its machine is rebuilt from, in
        one transaction: a batch of the previous owner either committed before this or fails
        after it (its epoch is gone). Raises InstanceHeld while another replica's lease runs."""
        params = {"instance": instance, "owner": owner, "address": address}
        async with self._engine.begin() as conn:
            claim = await conn.execute(_CLAIM, {**params, "lease": lease_seconds})
            claimed = claim.mappings().first()
            if claimed is None:
                held = (await conn.execute(_HOLDER, {"instance": instance})).mappings().one()
                raise _held(instance, held)
            return await _recorded(conn, instance, dict(claimed))

    async def holder(self, instance: str) -> InstanceHeld | None:
        """The replica whose lease on the instance runs now, if one does."""
        async with self._engine.connect() as conn:
            held = (await conn.execute(_HOLDER, {"instance": instance})).mappings().first()
        if held is None or held["seconds_left"] is None or held["seconds_left"] <= 0:
            return None
        return _held(instance, held)

    async def renew(self, owner: str, epochs: Mapping[str, int], lease_seconds: float) -> set[str]:
        """Extend this replica's leases on these instances (under these epochs); returns the
        instances whose lease it still held."""
        if not epochs:
            return set()
        params = {
            "owner": owner,
            "instances": list(epochs),
            "epochs": list(epochs.values()),
            "lease": lease_seconds,
        }
        async with self._engine.begin() as conn:
            return {row[0] for row in await conn.execute(_RENEW, params)}

    async def release(self, owner: str, epochs: Mapping[str, int]) -> None:
        """End this replica's leases on these instances now, and tell the other replicas: one
        of them may claim each."""
        params = {"owner": owner, "instances": list(epochs), "epochs": list(epochs.values())}
        async with self._engine.begin() as conn:
            await conn.execute(_RELEASE, params)

    async def tell_tenant_changed(self, tenant: str) -> None:
        """Tell every replica that a tenant's settings or state changed."""
        async with self._engine.begin() as conn:
            await conn.execute(_TENANT_CHANGED, {"tenant": tenant})

    async def unowned(self) -> list[str]:
        """The instances to take over now that no replica's lease covers (see _UNOWNED)."""
        async with self._engine.connect() as conn:
            return [r[0] for r in await conn.execute(_UNOWNED)]

    async def holdings_elsewhere(self, here: Sequence[str]) -> dict[str, dict[str, TenantTotals]]:
        """What each tenant holds on each instance other than `here`, as recorded."""
        found: dict[str, dict[str, TenantTotals]] = {}
        async with self._engine.connect() as conn:
            for tenant, instance, *totals in await conn.execute(
                _HOLDINGS_ELSEWHERE, {"here": list(here)}
            ):
                found.setdefault(tenant, {})[instance] = TenantTotals(*totals)
        return found

    async def read(self, instance: str) -> RecordedInstance:
        """What the record holds of an instance now, without claiming it (for checks)."""
        async with self._engine.connect() as conn:
            # One snapshot for all its statements: the owner's batches and checkpoints commit
            # meanwhile, and a checkpoint committing between the read of the last one and the
            # read of the deltas would leave neither the deltas it drops nor itself in view.
            # (`load` needs no such care: its claim fences the owner first.)
            await conn.execution_options(isolation_level="REPEATABLE READ")
            async with conn.begin():
                owner = (await conn.execute(_OWNER, {"instance": instance})).mappings().first()
                found = dict(owner) if owner else {"epoch": 0, "batch": 0, "clocks": {}}
                return await _recorded(conn, instance, found)


_IN_ERROR = psycopg.pq.TransactionStatus.INERROR
_FAILED = psycopg.pq.ExecStatus.FATAL_ERROR


def _batch_numbers(results: Sequence[psycopg.pq.abc.PGresult], count: int) -> list[int]:
    """The numbers of a committed transaction's batches: their fences' results, in order."""
    numbers = [
        int(value)
        for result in results
        if result.nfields
        and result.fname(0) == b"journal_next_batch"
        and result.ntuples
        and (value := result.get_value(0, 0)) is not None
    ]
    if len(numbers) != count:
        raise psycopg.ProgrammingError(f"{count} batches' fences returned {len(numbers)} numbers")
    return numbers


async def _rolled_back(connection: psycopg.AsyncConnection[Any]) -> bool:
    """Whether a failed transaction surely committed nothing: a statement failed it (so its
    COMMIT never ran), and it is rolled back now."""
    if connection.info.transaction_status is not _IN_ERROR:
        return False
    try:
        await connection.execute("ROLLBACK")
    except psycopg.Error:
        return False
    return True


def _error_of(instance: str, exc: psycopg.Error) -> Exception:
    """What a failed transaction of one batch means for it."""
    message = exc.diag.message_primary or ""
    error: Exception
    if exc.sqlstate == DEPOSED_SQLSTATE:
        error = Deposed(instance)
    elif exc.sqlstate == REUSED_SQLSTATE and message:
        keys = [key.split("/", 1) for key in message.split(" ")]
        error = RequestIdsReused([(t, r) for t, r in keys])
    elif exc.sqlstate == OVER_QUOTA_SQLSTATE:
        error = QuotaRaced(message)
    elif exc.sqlstate == PIN_TAKEN_SQLSTATE:
        error = PinIdTaken(message)
    else:
        return exc
    error.__cause__ = exc
    return error


def _held(instance: str, row: RowMapping) -> InstanceHeld:
    return InstanceHeld(instance, row["owner"], row["address"], float(row["seconds_left"]))


async def _recorded(
    conn: AsyncConnection, instance: str, owner: Mapping[str, Any]
) -> RecordedInstance:
    rows = list((await conn.execute(_CHECKPOINT, {"instance": instance})).all())
    after = rows[0].batch if rows else -1
    rows += (await conn.execute(_DELTAS, {"instance": instance, "after": after})).all()
    live = await conn.execute(_LIVE_RESERVATIONS, {"instance": instance})
    reservations = tuple(_record_from_row(r) for r in live.mappings())
    pins = await conn.execute(_ACTIVE_PINS, {"instance": instance})
    pin_records = tuple(_pin_from_row(r) for r in pins.mappings())
    clocks = owner["clocks"]
    tenant_clocks = await conn.execute(_TENANT_CLOCKS, {"instance": instance})
    image = InstanceImage(
        _slot_contents(rows),
        tuple(rows[-1].scopes if rows else ()),
        reservations,
        pin_records,
        {int(p): t for p, t in clocks.get("virtual_time", {}).items()},
        {
            tenant: TenantClocks({int(p): t for p, t in last_finish.items()}, mean_hold)
            for tenant, last_finish, mean_hold in tenant_clocks
        },
        clocks.get("mean_hold_seconds"),
        clocks.get("drift_blocks", 0),
    )
    return RecordedInstance(int(owner["epoch"]), int(owner["batch"]), image)


# The batch's JSON parameters: msgspec's encoder takes a sixth of the time json.dumps takes.
_JSON = msgspec.json.Encoder()


def _json(rows: list[dict[str, Any]]) -> str | None:
    return _JSON.encode(rows).decode() if rows else None


# Where a slot's contents are in the rows `_slot_contents` reads: the row's number in the high
# bits, the slot's place in that row's arrays in the low ones.
_PLACE_BITS = 32


def _slot_contents(rows: Sequence[Row[Any]]) -> ContentColumns:
    """The slots' contents a checkpoint's chunks and the deltas after it record, as columns:
    each slot as the last row naming it has it, none for those a later delta dropped. Columns
    in, columns out: a large pool's recovery makes no object per slot."""
    latest: dict[int, int] = {}
    for number, row in enumerate(rows):
        start = number << _PLACE_BITS
        latest.update(zip(row.slots, range(start, start + len(row.slots)), strict=True))
        for block in row.dropped:
            latest.pop(block, None)
    blocks = sorted(latest)
    places = [(latest[b] >> _PLACE_BITS, latest[b] & ((1 << _PLACE_BITS) - 1)) for b in blocks]
    digests = [bytes(row.digests) for row in rows]
    width = DIGEST_BYTES

    def column(name: str) -> list[int]:
        values = [getattr(row, name) for row in rows]
        return [values[r][i] for r, i in places]

    return ContentColumns(
        blocks,
        column("generations"),
        b"".join([digests[r][i * width : (i + 1) * width] for r, i in places]),
        column("scope_ids"),
        column("engine_copies"),
        column("lru_seqs"),
    )


def _record_from_row(row: RowMapping) -> ReservationRecord:
    params = AdmitParams(
        row["tenant"],
        row["request_id"],
        row["instance"],
        row["prompt_tokens"],
        row["max_output_tokens"],
        row["n"],
        row["priority"],
    )
    token_ids = tuple(row["prompt_token_ids"] or ())
    ttl = row["lease_ttl_seconds"]
    record = ReservationRecord(
        AdmitRequest(params, token_ids, 0.0, ttl),
        row["reserved_blocks"],
        row["reserved_tokens"],
        ttl,
    )
    record.prompt_digest = row["prompt_digest"]
    record.state = ReservationState(row["state"])
    record.end_reason = EndReason(row["end_reason"]) if row["end_reason"] else None
    if row["block_ids"] is not None:
        table = HeldTable(row["block_ids"], row["block_generations"], pinned=False)
        for position in row["released_positions"] or ():
            table.released[position] = 1
        table.live_entries -= len(row["released_positions"] or ())
        record.table = table
    record.prefix_hit_blocks = row["prefix_hit_blocks"]
    record.lease_expires_at = _seconds(row["lease_expires_at"])
    record.admitted_at = _seconds(row["admitted_at"])
    record.ended_at = _seconds(row["ended_at"])
    record.output_tokens = row["output_tokens"]
    record.queued_at = _seconds(row["queued_at"])
    record.wait_deadline = _seconds(row["wait_deadline"])
    record.tags = FairTags(row["virtual_start"] or 0.0, row["virtual_finish"] or 0.0)
    record.arrival = row["queue_arrival"] or 0
    record.suspended_at = _seconds(row["suspended_at"])
    record.offloaded_bytes = row["offloaded_bytes"]
    record.compressed_bytes = row["compressed_bytes"]
    record.compress_before_bytes = row["compress_before_bytes"]
    record.compress_after_bytes = row["compress_after_bytes"]
    record.freed_blocks = row["freed_blocks"]
    record.written = True
    record.shadow_refusal = row["shadow_refusal"]
    return record


def _pin_from_row(row: RowMapping) -> PinRecord:
    table = HeldTable(row["block_ids"], row["block_generations"], pinned=True)
    return PinRecord(
        row["owner"],
        row["pin_id"],
        row["tenant"],
        bytes(row["prefix_hash"]),
        row["prompt_tokens"],
        table,
        row["created_at"].timestamp(),
    )
