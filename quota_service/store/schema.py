"""The ledger's tables. Alembic migrations are the only way they change; these models are what the
migrations are checked against. CHECK constraints hold the counters' invariants inside PostgreSQL
too, so a bug above the store cannot over-commit an instance even if it tried.
"""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from typing import Annotated

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    Numeric,
    Sequence,
    String,
    Text,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

ResourceId = Annotated[str, mapped_column(String(63))]
Count = Annotated[int, mapped_column(BigInteger, nullable=False, server_default="0")]
Timestamp = Annotated[datetime, mapped_column(DateTime(timezone=True), nullable=False)]
CreatedAt = Annotated[
    datetime, mapped_column(DateTime(timezone=True), nullable=False, server_default=func.now())
]


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


# Reservations and pins both hold block references; one id space names either.
HOLDER_IDS = Sequence("holder_ids", metadata=Base.metadata)


class TenantRow(Base):
    __tablename__ = "tenants"

    tenant: Mapped[ResourceId] = mapped_column(primary_key=True)
    display_name: Mapped[str] = mapped_column(String(200), server_default="")
    state: Mapped[str] = mapped_column(String(16), server_default="ACTIVE")
    weight: Mapped[int] = mapped_column(Integer, server_default="1")
    max_blocks: Mapped[int] = mapped_column(BigInteger)
    max_tokens_in_flight: Mapped[int] = mapped_column(BigInteger)
    max_queued_requests: Mapped[int] = mapped_column(BigInteger)
    max_pinned_blocks: Mapped[int] = mapped_column(BigInteger)
    max_cpu_tier_bytes: Mapped[int] = mapped_column(BigInteger)
    blocks_in_use: Mapped[Count]
    tokens_in_flight: Mapped[Count]
    # Exponentially weighted mean of observed holding times, for computed retry delays.
    mean_hold_seconds: Mapped[float | None]
    # Distinct blocks the tenant's pins hold (they count against max_pinned_blocks).
    pinned_blocks: Mapped[Count]
    queued_requests: Mapped[Count]
    # Secret: passed to vLLM as cache_salt; never logged.
    cache_salt: Mapped[str] = mapped_column(String(128))
    # A tenant in a shared namespace hashes (and so shares) its prefixes under the namespace's salt.
    namespace: Mapped[str | None] = mapped_column(ForeignKey("namespaces.namespace"))
    # Admit what its own limits would refuse, recording why (core/admission.py).
    shadow_mode: Mapped[bool] = mapped_column(server_default=text("false"))
    # Offboarding report, accumulated batch by batch so a resumed offboarding adds up.
    offboard_freed_blocks: Mapped[Count]
    offboard_shared_blocks: Mapped[Count]
    offboard_pinned_by_others: Mapped[Count]
    created_at: Mapped[CreatedAt]
    updated_at: Mapped[CreatedAt]

    __table_args__ = (
        CheckConstraint("state IN ('ACTIVE', 'SUSPENDED', 'DELETING', 'DELETED')", name="state"),
        CheckConstraint("weight >= 1", name="weight"),
        CheckConstraint(
            "max_blocks >= 0 AND max_tokens_in_flight >= 0 AND max_queued_requests >= 0 "
            "AND max_pinned_blocks >= 0 AND max_cpu_tier_bytes >= 0",
            name="quota_not_negative",
        ),
        CheckConstraint(
            "blocks_in_use >= 0 AND tokens_in_flight >= 0 AND pinned_blocks >= 0 "
            "AND queued_requests >= 0",
            name="usage_not_negative",
        ),
    )


class NamespaceRow(Base):
    """A named prefix-sharing scope that tenants opt into (public system prompts)."""

    __tablename__ = "namespaces"

    namespace: Mapped[ResourceId] = mapped_column(primary_key=True)
    cache_salt: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[CreatedAt]


class InstanceRow(Base):
    __tablename__ = "instances"

    instance: Mapped[ResourceId] = mapped_column(primary_key=True)
    model: Mapped[str] = mapped_column(String(200), server_default="")
    # Geometry is unknown when an instance is registered from its block count alone.
    num_layers: Mapped[int | None] = mapped_column(Integer)
    num_kv_heads: Mapped[int | None] = mapped_column(Integer)
    head_dim: Mapped[int | None] = mapped_column(Integer)
    kv_dtype: Mapped[str | None] = mapped_column(String(8))
    mla: Mapped[bool] = mapped_column(server_default=text("false"))
    bytes_per_block: Mapped[int | None] = mapped_column(BigInteger)
    block_size: Mapped[int] = mapped_column(Integer)
    capacity_blocks: Mapped[int] = mapped_column(BigInteger)
    max_model_len: Mapped[int] = mapped_column(Integer)
    hash_algo: Mapped[str] = mapped_column(String(16), server_default="sha256")
    state: Mapped[str] = mapped_column(String(16), server_default="ACTIVE")
    # The wait queue's bounds (vLLM's front-door valves); what the pool and its queue hold is
    # its owner's to record (InstanceOwnerRow, the view instance_pool_counters).
    max_queued_requests: Mapped[int] = mapped_column(BigInteger, server_default="1024")
    # TTFT guard: queued prompt tokens <= target TTFT x prefill throughput (0: no guard).
    target_ttft_seconds: Mapped[float] = mapped_column(server_default="0")
    prefill_tokens_per_second: Mapped[float] = mapped_column(server_default="0")
    # The engine behind it, when kvquota follows one (vLLM's HTTP server and KV-event sockets).
    engine_url: Mapped[str | None] = mapped_column(String(200))
    # engine_url reduced to host:port (core/engine_address.py): an Admit naming the engine by
    # its address finds the instance through it.
    engine_address: Mapped[str | None] = mapped_column(String(200))
    kv_events_endpoint: Mapped[str | None] = mapped_column(String(200))
    kv_replay_endpoint: Mapped[str | None] = mapped_column(String(200))
    # The LMCache coordinator of its CPU tier, and its L1 as last read there.
    lmcache_coordinator_url: Mapped[str | None] = mapped_column(String(200))
    lmcache_instance_id: Mapped[str | None] = mapped_column(String(200))
    lmcache_model_name: Mapped[str | None] = mapped_column(String(200))
    lmcache_world_size: Mapped[int | None] = mapped_column(Integer)
    cpu_used_bytes: Mapped[int | None] = mapped_column(BigInteger)
    cpu_capacity_bytes: Mapped[int | None] = mapped_column(BigInteger)
    cpu_checked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # Compressed size / L1 size of chunks its CPU tier holds in a compressing L2 adapter, as
    # last measured there (NULL: it cannot compress, or nothing was measured yet).
    cpu_compression_ratio: Mapped[float | None]
    # Reconciliation: the last event batch applied and resynchronisations (the drift, blocks
    # the engine evicted that the ledger still counts as referenced, is its owner's clock).
    last_event_seq: Mapped[int | None] = mapped_column(BigInteger)
    # vllm:num_requests_running as last read, to compare with the live reservations.
    engine_requests_running: Mapped[int | None] = mapped_column(BigInteger)
    engine_checked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    engine_resyncs: Mapped[Count]
    created_at: Mapped[CreatedAt]
    updated_at: Mapped[CreatedAt]

    __table_args__ = (
        CheckConstraint("state IN ('ACTIVE', 'DRAINING')", name="state"),
        CheckConstraint(
            "max_queued_requests >= 0 AND target_ttft_seconds >= 0 "
            "AND prefill_tokens_per_second >= 0",
            name="queue",
        ),
        CheckConstraint(
            "block_size >= 1 AND capacity_blocks >= 1 AND max_model_len >= 1", name="pool"
        ),
        CheckConstraint("hash_algo IN ('sha256', 'sha256_cbor')", name="hash_algo"),
        Index("ix_instances_engine_address", "engine_address"),
    )


class ReservationRow(Base):
    __tablename__ = "reservations"

    # Not foreign keys (nor the instance): the journal writes these rows in every batch, and a
    # key's check locked the tenant's and the instance's rows there; the owner writes only
    # reservations of tenants it knows on the instance it owns, and neither row is ever deleted.
    tenant: Mapped[ResourceId] = mapped_column(primary_key=True)
    request_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    # Admission order's tie-break (drawn from the sequence pins' ids come from).
    holder_id: Mapped[int] = mapped_column(
        BigInteger, HOLDER_IDS, server_default=HOLDER_IDS.next_value()
    )
    instance: Mapped[ResourceId]
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    max_output_tokens: Mapped[int] = mapped_column(Integer)
    n: Mapped[int] = mapped_column(Integer)
    priority: Mapped[int] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(16))
    reserved_blocks: Mapped[int] = mapped_column(BigInteger)
    reserved_tokens: Mapped[int] = mapped_column(BigInteger)
    prefix_hit_blocks: Mapped[int] = mapped_column(Integer, server_default="0")
    lease_ttl_seconds: Mapped[float]
    # Set when admitted (a queued request has neither yet).
    lease_expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    admitted_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    ended_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    end_reason: Mapped[str | None] = mapped_column(String(32))
    output_tokens: Mapped[int | None] = mapped_column(Integer)
    # The wait queue: when it joined, until when it waits, its fair-queueing tags, and the prompt
    # it will be admitted with (dropped once it leaves the queue).
    queued_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    wait_deadline: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    virtual_start: Mapped[float | None]
    virtual_finish: Mapped[float | None]
    prompt_token_ids: Mapped[list[int] | None] = mapped_column(ARRAY(Integer))
    # SHA-256 of the prompt's token ids as the Admit gave them (NULL: none): a repeat with other
    # tokens under the same request_id is refused.
    prompt_digest: Mapped[bytes | None] = mapped_column(LargeBinary)
    # Admitted in its tenant's shadow mode although this reason would have refused it.
    shadow_refusal: Mapped[str | None] = mapped_column(String(32))
    # Release follows the engine: when ending it needs an abort the engine has not confirmed
    # yet, when that was first asked and the reason it will end with.
    abort_requested_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    abort_reason: Mapped[str | None] = mapped_column(String(32))
    # When a reclaim ended it: how many blocks its end gave back (its last references), which
    # the reclaim step reports as what it really freed.
    freed_blocks: Mapped[int | None] = mapped_column(Integer)
    # A multi-turn session idle between turns (SuspendReservation): since when, and, once a
    # reclaim moved it to the CPU tier, the bytes it holds there (its GPU blocks are gone).
    suspended_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    offloaded_bytes: Mapped[int | None] = mapped_column(BigInteger)
    # Its block table as its instance's owner journals it (one row per reservation, never one
    # per block): slot ids and generations in table order, and the positions given back early.
    block_ids: Mapped[list[int] | None] = mapped_column(ARRAY(Integer))
    block_generations: Mapped[list[int] | None] = mapped_column(ARRAY(BigInteger))
    released_positions: Mapped[list[int] | None] = mapped_column(ARRAY(Integer))
    # Arrival order in its instance's wait queue (ties of the fair-queueing tags).
    queue_arrival: Mapped[int | None] = mapped_column(BigInteger)
    # Tier COMPRESSED: once a reclaim demoted the session's chunks to the CPU tier's compressing
    # L2, the bytes it holds in that form (offloaded_bytes keeps what stayed in L1: pinned
    # chunks, or ones without a compressed copy), and what the demoted chunks took in L1 before
    # and take compressed after, as LMCache measured them (their ratio is the measured one).
    compressed_bytes: Mapped[int | None] = mapped_column(BigInteger)
    compress_before_bytes: Mapped[int | None] = mapped_column(BigInteger)
    compress_after_bytes: Mapped[int | None] = mapped_column(BigInteger)

    __table_args__ = (
        CheckConstraint("state IN ('QUEUED', 'ADMITTED', 'ENDED')", name="state"),
        # Invariant 7: every reservation is live (queued or admitted), or ended with a time and
        # a reason; an admitted one has a lease.
        CheckConstraint(
            "(state IN ('QUEUED', 'ADMITTED')) = (ended_at IS NULL AND end_reason IS NULL)",
            name="ended",
        ),
        CheckConstraint(
            "state <> 'ADMITTED' OR (admitted_at IS NOT NULL AND lease_expires_at IS NOT NULL)",
            name="lease",
        ),
        CheckConstraint(
            "state <> 'QUEUED' OR (queued_at IS NOT NULL AND wait_deadline IS NOT NULL "
            "AND virtual_start IS NOT NULL)",
            name="queued",
        ),
        CheckConstraint("reserved_blocks >= 0 AND reserved_tokens >= 0", name="reserved"),
        # Only a session off the GPU can be compressed, and its measurement comes with it.
        CheckConstraint(
            "compressed_bytes IS NULL OR (offloaded_bytes IS NOT NULL "
            "AND compress_before_bytes > 0 AND compress_after_bytes >= 0)",
            name="compressed",
        ),
        # What reads the record's live reservations (an owner's recovery, reconciliation, the
        # abort loop, offboarding, reclaim) reads a few thousand rows at most; every index more
        # costs each journaled write of a reservation an entry.
        Index(
            "ix_reservations_live",
            "instance",
            postgresql_where=text("state IN ('QUEUED', 'ADMITTED')"),
        ),
    )


class PinRow(Base):
    """A pinned prefix: its blocks stay resident and are never reclaimed while pinned."""

    __tablename__ = "pins"

    holder_id: Mapped[int] = mapped_column(
        BigInteger, HOLDER_IDS, server_default=HOLDER_IDS.next_value(), primary_key=True
    )
    # "tenants/{t}" or "namespaces/{n}"; the pin's name is {owner}/pins/{pin_id}.
    owner: Mapped[str] = mapped_column(String(80))
    pin_id: Mapped[str] = mapped_column(String(63))
    tenant: Mapped[str | None] = mapped_column(ForeignKey("tenants.tenant"))
    instance: Mapped[ResourceId] = mapped_column(ForeignKey("instances.instance"))
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    pinned_blocks: Mapped[int] = mapped_column(Integer)
    # The last block's hash identifies the prefix (chained hashes cover every earlier token).
    prefix_hash: Mapped[bytes] = mapped_column(LargeBinary)
    state: Mapped[str] = mapped_column(String(16), server_default="ACTIVE")
    created_at: Mapped[CreatedAt]
    removed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # The slots it holds, as its instance's owner journals them.
    block_ids: Mapped[list[int] | None] = mapped_column(ARRAY(Integer))
    block_generations: Mapped[list[int] | None] = mapped_column(ARRAY(BigInteger))

    __table_args__ = (
        CheckConstraint("state IN ('ACTIVE', 'REMOVED')", name="state"),
        Index("uq_pins_owner_pin_id", "owner", "pin_id", unique=True),
    )


class InstanceOwnerRow(Base):
    """Who serves an instance from memory, under which epoch, and the journal's position: every
    batch's transaction moves `batch` on with `WHERE epoch = :mine`, so a deposed owner's batch
    changes nothing. `clocks` holds the machine's own scalars (fair-queueing virtual times, mean
    holding time, drift), merged per batch; each tenant's are in its `instance_tenant_totals`
    row."""

    __tablename__ = "instance_owners"

    instance: Mapped[ResourceId] = mapped_column(ForeignKey("instances.instance"), primary_key=True)
    owner: Mapped[str] = mapped_column(String(200))
    address: Mapped[str] = mapped_column(String(200), server_default="")
    epoch: Mapped[int] = mapped_column(BigInteger)
    lease_expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    batch: Mapped[Count]
    clocks: Mapped[dict[str, object]] = mapped_column(JSONB, server_default=text("'{}'::jsonb"))
    # The pool's counters as of the last batch, written by its fence (NULL before the first):
    # slots per state (invariant 1: they add up to the capacity, which the invariant checks
    # compare with the slots themselves), and the wait queue's requests and prompt tokens.
    # Not CHECKed: the row is rewritten by every batch, and PostgreSQL parses and plans a
    # table's CHECK constraints again for each statement that writes it.
    free_blocks: Mapped[int | None] = mapped_column(BigInteger)
    cached_blocks: Mapped[int | None] = mapped_column(BigInteger)
    blocks_in_use: Mapped[int | None] = mapped_column(BigInteger)
    pinned_blocks: Mapped[int | None] = mapped_column(BigInteger)
    queued_requests: Mapped[int | None] = mapped_column(BigInteger)
    queued_prompt_tokens: Mapped[int | None] = mapped_column(BigInteger)


class InstanceTenantTotalsRow(Base):
    """What a tenant holds on one instance, as the tenant's fleet-wide totals count it: moved
    by each batch of the instance's owner with the tenant's totals (the journal's _MOVE_TOTALS), and
    read by the other replicas' owners, whose quota decisions need what it holds elsewhere. With
    it, the tenant's fair-queueing clocks there (finish tag per priority, mean holding time),
    written by each batch that touched the tenant and read back by a new owner."""

    __tablename__ = "instance_tenant_totals"

    # The key by instance first: a new owner reads its instance's rows.
    instance: Mapped[ResourceId] = mapped_column(ForeignKey("instances.instance"), primary_key=True)
    tenant: Mapped[ResourceId] = mapped_column(primary_key=True)
    blocks_in_use: Mapped[Count]
    tokens_in_flight: Mapped[Count]
    pinned_blocks: Mapped[Count]
    queued_requests: Mapped[Count]
    # Priority (as text: a JSON key) -> virtual finish tag.
    last_finish: Mapped[dict[str, float]] = mapped_column(JSONB, server_default=text("'{}'::jsonb"))
    mean_hold_seconds: Mapped[float | None]


class PoolCheckpointRow(Base):
    """An instance's slot contents (the slots holding a hash) as of a batch, one array per
    field, in chunks of a bounded number of slots; the deltas after it complete the picture."""

    __tablename__ = "pool_checkpoints"

    instance: Mapped[ResourceId] = mapped_column(ForeignKey("instances.instance"), primary_key=True)
    chunk: Mapped[int] = mapped_column(Integer, primary_key=True, server_default="0")
    batch: Mapped[int] = mapped_column(BigInteger)
    scopes: Mapped[list[str]] = mapped_column(ARRAY(Text))
    slots: Mapped[list[int]] = mapped_column(ARRAY(Integer))
    generations: Mapped[list[int]] = mapped_column(ARRAY(BigInteger))
    # 32 bytes per slot, in the order of `slots`.
    digests: Mapped[bytes] = mapped_column(LargeBinary)
    scope_ids: Mapped[list[int]] = mapped_column(ARRAY(Integer))
    engine_copies: Mapped[list[int]] = mapped_column(ARRAY(Integer))
    lru_seqs: Mapped[list[int]] = mapped_column(ARRAY(BigInteger))
    written_at: Mapped[CreatedAt]


class PoolDeltaRow(Base):
    """What one batch changed of an instance's slot contents: the slots that hold a hash now
    (as a checkpoint lists them) and the slots whose contents were dropped."""

    __tablename__ = "pool_deltas"

    # Not a foreign key: the journal writes a delta in most batches (see ReservationRow).
    instance: Mapped[ResourceId] = mapped_column(primary_key=True)
    batch: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    scopes: Mapped[list[str]] = mapped_column(ARRAY(Text))
    slots: Mapped[list[int]] = mapped_column(ARRAY(Integer))
    generations: Mapped[list[int]] = mapped_column(ARRAY(BigInteger))
    digests: Mapped[bytes] = mapped_column(LargeBinary)
    scope_ids: Mapped[list[int]] = mapped_column(ARRAY(Integer))
    engine_copies: Mapped[list[int]] = mapped_column(ARRAY(Integer))
    lru_seqs: Mapped[list[int]] = mapped_column(ARRAY(BigInteger))
    dropped: Mapped[list[int]] = mapped_column(ARRAY(Integer))


class CpuTierPinRow(Base):
    """A pin as the instance's CPU tier (an LMCache coordinator) must hold it: written with the
    pin, marked unwanted by the unpin, and deleted once the coordinator shows it gone. It keeps
    what it was pinned under (coordinator, model, salt), so a salt rotated or an endpoint changed
    since never strands a pin there."""

    __tablename__ = "cpu_tier_pins"

    # The pin's holder id (not a foreign key: a removed pin may be forgotten first).
    holder_id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    coordinator_url: Mapped[str] = mapped_column(String(200))
    model_name: Mapped[str] = mapped_column(String(200))
    world_size: Mapped[int] = mapped_column(Integer)
    # Secret, as the tenant's: never logged.
    cache_salt: Mapped[str] = mapped_column(String(128))
    token_ids: Mapped[list[int]] = mapped_column(ARRAY(Integer))
    # The prefix's chunk keys, once the coordinator named them.
    chunk_keys: Mapped[list[str] | None] = mapped_column(ARRAY(Text))
    wanted: Mapped[bool] = mapped_column(Boolean, server_default=text("true"))

    __table_args__ = (Index("ix_cpu_tier_pins_coordinator_url", "coordinator_url"),)


class ReclaimJobRow(Base):
    """A reclaim job: its scope and target, and the plan's totals; the plan is its steps."""

    __tablename__ = "reclaim_jobs"

    job_id: Mapped[ResourceId] = mapped_column(primary_key=True)
    # The caller's id for CreateReclaimJob: a repeat returns the same job.
    request_id: Mapped[str] = mapped_column(String(128), unique=True)
    instance: Mapped[ResourceId] = mapped_column(ForeignKey("instances.instance"))
    tenant: Mapped[str | None] = mapped_column(ForeignKey("tenants.tenant"))
    target_blocks: Mapped[int] = mapped_column(BigInteger)
    max_tier: Mapped[str] = mapped_column(String(16))
    min_tier: Mapped[str] = mapped_column(String(16), server_default="FREE")
    dry_run: Mapped[bool] = mapped_column(Boolean)
    state: Mapped[str] = mapped_column(String(16))
    expected_blocks: Mapped[int] = mapped_column(BigInteger)
    # What the plan cannot take and why: [{"reason", "blocks", "tenant", "request_id"}].
    excluded: Mapped[list[dict[str, object]]] = mapped_column(JSONB)
    created_at: Mapped[CreatedAt]
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

    __table_args__ = (
        CheckConstraint(
            "state IN ('PLANNED', 'RUNNING', 'SUCCEEDED', 'FAILED', 'CANCELLED')", name="state"
        ),
        CheckConstraint("max_tier IN ('FREE', 'OFFLOAD', 'COMPRESS', 'EVICT')", name="max_tier"),
        CheckConstraint("min_tier IN ('FREE', 'OFFLOAD', 'COMPRESS', 'EVICT')", name="min_tier"),
        Index(
            "ix_reclaim_jobs_open",
            "created_at",
            postgresql_where=text("state IN ('PLANNED', 'RUNNING')"),
        ),
    )


class ReclaimStepRow(Base):
    """One durable step of a job, applied in the same transaction that marks it, so a crash
    leaves it planned (retried) or applied (never repeated)."""

    __tablename__ = "reclaim_steps"

    job_id: Mapped[ResourceId] = mapped_column(
        ForeignKey("reclaim_jobs.job_id", ondelete="CASCADE"), primary_key=True
    )
    seq: Mapped[int] = mapped_column(Integer, primary_key=True)
    tier: Mapped[str] = mapped_column(String(16))
    # FREE: the block handle; OFFLOAD and EVICT: the reservation.
    block_id: Mapped[int | None] = mapped_column(Integer)
    generation: Mapped[int | None] = mapped_column(BigInteger)
    tenant: Mapped[str | None] = mapped_column(String(63))
    request_id: Mapped[str | None] = mapped_column(String(128))
    expected_blocks: Mapped[int] = mapped_column(Integer)
    cpu_bytes: Mapped[int] = mapped_column(BigInteger)
    lossy: Mapped[bool] = mapped_column(Boolean)
    state: Mapped[str] = mapped_column(String(16), server_default="PLANNED")
    actual_blocks: Mapped[int | None] = mapped_column(Integer)
    # Why a step gave back other than expected (e.g. the block was reused since the plan).
    note: Mapped[str | None] = mapped_column(String(200))
    applied_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # COMPRESS: what the CPU tier measured before demoting the session's chunks (recorded before
    # they leave L1, so a retry after a crash books what was measured): L1 bytes of the chunks
    # to demote, their compressed bytes in L2, and L1 bytes of its chunks that stay.
    bytes_before: Mapped[int | None] = mapped_column(BigInteger)
    bytes_after: Mapped[int | None] = mapped_column(BigInteger)
    bytes_kept: Mapped[int | None] = mapped_column(BigInteger)

    __table_args__ = (
        CheckConstraint("state IN ('PLANNED', 'APPLIED', 'SKIPPED', 'FAILED')", name="state"),
        CheckConstraint("tier IN ('FREE', 'OFFLOAD', 'COMPRESS', 'EVICT')", name="tier"),
    )


class UsageEventRow(Base):
    """One change of what a tenant holds on an instance, or of its counters (core/metering.py):
    appended by the statement that makes the change, consumed by the hourly rollup."""

    __tablename__ = "usage_events"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    tenant: Mapped[ResourceId]
    instance: Mapped[ResourceId]
    # Δ blocks held, keyed by how many tenants shared each then ({"1": 4, "2": -2}).
    blocks: Mapped[dict[str, int]] = mapped_column(JSONB, server_default=text("'{}'::jsonb"))
    pinned: Mapped[int] = mapped_column(Integer, server_default="0")
    cpu_bytes: Mapped[int] = mapped_column(BigInteger, server_default="0")
    compressed_bytes: Mapped[int] = mapped_column(BigInteger, server_default="0")
    tokens_reserved: Mapped[int] = mapped_column(BigInteger, server_default="0")
    output_tokens: Mapped[int] = mapped_column(BigInteger, server_default="0")
    admitted: Mapped[int] = mapped_column(Integer, server_default="0")
    queued: Mapped[int] = mapped_column(Integer, server_default="0")
    refused: Mapped[dict[str, int]] = mapped_column(JSONB, server_default=text("'{}'::jsonb"))
    reclaimed: Mapped[dict[str, int]] = mapped_column(JSONB, server_default=text("'{}'::jsonb"))
    # Admitted in shadow mode, by the reason that would have refused them.
    shadow_refused: Mapped[dict[str, int]] = mapped_column(
        JSONB, server_default=text("'{}'::jsonb")
    )
    # The closed hour that accounted it (NULL: not rolled up yet).
    hour: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

    __table_args__ = (Index("ix_usage_events_open", "at", postgresql_where=text("hour IS NULL")),)


class UsageHourRow(Base):
    """A closed hour of one tenant on one instance: integrals in block-microseconds (per share
    k), counters, and the levels at its end that the next hour starts from. Never updated."""

    __tablename__ = "usage_hours"

    hour: Mapped[datetime] = mapped_column(DateTime(timezone=True), primary_key=True)
    tenant: Mapped[ResourceId] = mapped_column(primary_key=True)
    instance: Mapped[ResourceId] = mapped_column(primary_key=True)
    block_us: Mapped[dict[str, int]] = mapped_column(JSONB)
    pinned_block_us: Mapped[int] = mapped_column(BigInteger)
    cpu_byte_us: Mapped[Decimal] = mapped_column(Numeric(38, 0))
    compressed_byte_us: Mapped[Decimal] = mapped_column(Numeric(38, 0), server_default="0")
    tokens_reserved: Mapped[int] = mapped_column(BigInteger)
    output_tokens: Mapped[int] = mapped_column(BigInteger)
    admitted: Mapped[int] = mapped_column(BigInteger)
    queued: Mapped[int] = mapped_column(BigInteger)
    refused: Mapped[dict[str, int]] = mapped_column(JSONB)
    reclaimed: Mapped[dict[str, int]] = mapped_column(JSONB)
    shadow_refused: Mapped[dict[str, int]] = mapped_column(
        JSONB, server_default=text("'{}'::jsonb")
    )
    bytes_per_block: Mapped[int | None] = mapped_column(BigInteger)
    end_blocks: Mapped[dict[str, int]] = mapped_column(JSONB)
    end_pinned: Mapped[int] = mapped_column(BigInteger)
    end_cpu_bytes: Mapped[int] = mapped_column(BigInteger)
    end_compressed_bytes: Mapped[int] = mapped_column(BigInteger, server_default="0")


class UsageClosedHourRow(Base):
    """Hours the rollup has closed, in order: the row is written in the transaction that
    writes the hour, so an hour closes once, whichever replica gets there first."""

    __tablename__ = "usage_closed_hours"

    hour: Mapped[datetime] = mapped_column(DateTime(timezone=True), primary_key=True)
    closed_at: Mapped[CreatedAt]
    events: Mapped[int] = mapped_column(BigInteger)
    late_events: Mapped[int] = mapped_column(BigInteger)


class ApiKeyRow(Base):
    """An API key of a principal: only the SHA-256 of its secret is kept (the secret has 256 bits
    of entropy, so a slow hash would add nothing), shown once at creation. Revoked keys stay, so
    the audit log's principals keep their names."""

    __tablename__ = "api_keys"

    key_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    display_name: Mapped[str] = mapped_column(String(63))
    role: Mapped[str] = mapped_column(String(16))
    # The tenants a gateway acts for, or a tenant key's own tenant (not foreign keys: a key
    # outlives an offboarded tenant and then reaches nothing).
    tenants: Mapped[list[str]] = mapped_column(ARRAY(String(63)), server_default="{}")
    secret_sha256: Mapped[bytes] = mapped_column(LargeBinary)
    creator: Mapped[str] = mapped_column(String(80))
    created_at: Mapped[CreatedAt]
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

    __table_args__ = (CheckConstraint("role IN ('ADMIN', 'GATEWAY', 'TENANT')", name="role"),)


class AuditEventRow(Base):
    """An administrative action, or an attempt at one: who, what, on which resource, with which
    request id and outcome. Appended after the action; never updated."""

    __tablename__ = "audit_events"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    at: Mapped[CreatedAt]
    # "apiKeys/{key_id}" of the caller, or "anonymous" while authentication is off.
    principal: Mapped[str] = mapped_column(String(80))
    method: Mapped[str] = mapped_column(String(120))
    resource: Mapped[str] = mapped_column(String(300))
    request_id: Mapped[str] = mapped_column(String(128))
    # The gRPC status code name of the answer (OK, PERMISSION_DENIED, …).
    code: Mapped[str] = mapped_column(String(32))

    __table_args__ = (
        Index("ix_audit_events_at", "at"),
        Index("ix_audit_events_principal_at", "principal", "at"),
    )
