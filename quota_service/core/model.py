"""Plain values the decisions work on; the store loads and saves them, core never touches I/O."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from quota_service.core.block_table import BlockHandle
from quota_service.core.geometry import KvGeometry
from quota_service.core.hashing import HashAlgo


class TenantState(enum.Enum):
    ACTIVE = "ACTIVE"
    SUSPENDED = "SUSPENDED"
    # Offboarding: its reservations and pins are being released; it admits nothing.
    DELETING = "DELETING"
    DELETED = "DELETED"


class InstanceState(enum.Enum):
    ACTIVE = "ACTIVE"
    DRAINING = "DRAINING"


class ReservationState(enum.Enum):
    QUEUED = "QUEUED"
    ADMITTED = "ADMITTED"
    ENDED = "ENDED"


class EndReason(enum.Enum):
    RELEASED = "RELEASED"
    CANCELLED = "CANCELLED"
    LEASE_EXPIRED = "LEASE_EXPIRED"
    TENANT_DELETED = "TENANT_DELETED"
    # It waited its whole wait budget in the queue.
    QUEUE_TIMEOUT = "QUEUE_TIMEOUT"
    # The engine restarted under it: its work is lost.
    ENGINE_RESTARTED = "ENGINE_RESTARTED"
    # Its engine could not be reached to abort it within the hard timeout.
    ENGINE_UNREACHABLE = "ENGINE_UNREACHABLE"
    # A reclaim job's EVICT step preempted it: the engine aborted it and its blocks came back.
    PREEMPTED = "PREEMPTED"


@dataclass(frozen=True, slots=True)
class TenantQuota:
    max_blocks: int
    max_tokens_in_flight: int
    max_queued_requests: int
    max_pinned_blocks: int
    max_cpu_tier_bytes: int


@dataclass(frozen=True, slots=True)
class TenantAccount:
    """A tenant's quota and what it holds now, as locked for one admission."""

    tenant: str
    state: TenantState
    quota: TenantQuota
    blocks_in_use: int
    tokens_in_flight: int
    mean_hold_seconds: float | None
    pinned_blocks: int = 0
    # Admit what its own limits would refuse, recording why (see admission.decide).
    shadow_mode: bool = False


@dataclass(frozen=True, slots=True)
class InstancePool:
    """An instance's pool of KV blocks, as locked for one admission."""

    instance: str
    state: InstanceState
    block_size: int
    capacity_blocks: int
    max_model_len: int
    free_blocks: int
    # Cached and unreferenced: reusable by a prefix hit, or evicted to make room.
    cached_blocks: int
    hash_algo: HashAlgo
    mean_hold_seconds: float | None

    @property
    def allocatable_blocks(self) -> int:
        return self.free_blocks + self.cached_blocks


@dataclass(frozen=True, slots=True)
class AdmitParams:
    """What a gateway asks for; Admits repeating a (tenant, request_id) must agree on all of it."""

    tenant: str
    request_id: str
    instance: str
    prompt_tokens: int
    max_output_tokens: int
    n: int
    priority: int


@dataclass(frozen=True, slots=True)
class Reservation:
    tenant: str
    request_id: str
    instance: str
    prompt_tokens: int
    max_output_tokens: int
    n: int
    priority: int
    state: ReservationState
    reserved_blocks: int
    reserved_tokens: int
    prefix_hit_blocks: int
    lease_ttl_seconds: float
    # Set once admitted.
    lease_expires_at: datetime | None
    admitted_at: datetime | None
    ended_at: datetime | None
    end_reason: EndReason | None
    output_tokens: int | None
    # The live entries of its block table, in order (empty once it ended).
    block_table: Sequence[BlockHandle] = ()
    # Set while (and after) it waited in the queue; the position only while it waits.
    queued_at: datetime | None = None
    wait_deadline: datetime | None = None
    queue_position: int | None = None
    # Suspended between turns since then; offloaded: the bytes it holds in the CPU tier.
    suspended_at: datetime | None = None
    offloaded_bytes: int | None = None
    # Tier COMPRESSED: bytes it holds compressed (None: not compressed), and the measured
    # compressed / L1 size of what was demoted.
    compressed_bytes: int | None = None
    compression_ratio: float | None = None
    # What identifies its prompt's token ids for a repeated Admit (None: none were given).
    prompt_digest: bytes | None = None
    # Admitted in shadow mode although this refusal's reason would have refused it.
    shadow_refusal: str | None = None

    @property
    def params(self) -> AdmitParams:
        return AdmitParams(
            self.tenant,
            self.request_id,
            self.instance,
            self.prompt_tokens,
            self.max_output_tokens,
            self.n,
            self.priority,
        )


@dataclass(frozen=True, slots=True)
class Holding:
    """A live reservation seen as capacity that will come back: when, and how much."""

    expected_end: datetime
    blocks: int
    tokens: int


@dataclass(frozen=True, slots=True)
class Tenant:
    tenant: str
    display_name: str
    state: TenantState
    weight: int
    quota: TenantQuota
    blocks_in_use: int
    tokens_in_flight: int
    pinned_blocks: int
    queued_requests: int
    # The shared namespace it hashes its prefixes in, or None (isolated).
    namespace: str | None
    live_reservations: int
    created_at: datetime
    updated_at: datetime
    shadow_mode: bool = False
    # What its offloaded sessions hold in the CPU tier, and of it compressed.
    cpu_tier_bytes: int = 0
    compressed_bytes: int = 0


DEFAULT_MAX_QUEUED_REQUESTS = 1024


@dataclass(frozen=True, slots=True)
class QueueBounds:
    """An instance's wait-queue bounds (vLLM's front-door valves)."""

    max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS
    # TTFT guard: queued prompt tokens <= target TTFT x prefill throughput; 0 turns it off.
    target_ttft_seconds: float = 0.0
    prefill_tokens_per_second: float = 0.0


@dataclass(frozen=True, slots=True)
class LmcacheEndpoint:
    """The LMCache MP coordinator that holds an instance's CPU tier, and the instance there."""

    coordinator_url: str
    instance_id: str  # the MP server's id at the coordinator (`lmcache server --instance-id`)
    model_name: str  # the model name the engine's KV is stored under in LMCache
    world_size: int = 1


@dataclass(frozen=True, slots=True)
class EngineEndpoints:
    """The vLLM server behind an instance: its HTTP URL and KV-event sockets, and the LMCache
    coordinator of its CPU tier, if it has one."""

    url: str
    kv_events: str | None = None
    kv_replay: str | None = None
    lmcache: LmcacheEndpoint | None = None


@dataclass(frozen=True, slots=True)
class InstanceSpec:
    """What registering an instance stores: its pool and, when known, its geometry."""

    instance: str
    model: str
    geometry: KvGeometry | None
    block_size: int
    capacity_blocks: int
    max_model_len: int
    hash_algo: HashAlgo = HashAlgo.SHA256
    queue: QueueBounds = QueueBounds()
    engine: EngineEndpoints | None = None

    @property
    def bytes_per_block(self) -> int | None:
        return self.geometry.bytes_per_block(self.block_size) if self.geometry else None


@dataclass(frozen=True, slots=True)
class Instance:
    spec: InstanceSpec
    state: InstanceState
    # Slots per state; they add up to the capacity.
    free_blocks: int
    cached_blocks: int
    blocks_in_use: int
    pinned_blocks: int
    live_reservations: int
    created_at: datetime
    updated_at: datetime
    queued_requests: int = 0
    queued_prompt_tokens: int = 0
    # Reconciliation with the engine: blocks it evicted that the ledger still references, and
    # how often the ledger had to start again from empty.
    drift_blocks: int = 0
    engine_resyncs: int = 0
    # vllm:num_requests_running when last read (None: never), and when.
    engine_requests_running: int | None = None
    engine_checked_at: datetime | None = None
    # Its CPU tier's L1 (LMCache) when last read (None: no CPU tier, or never read), and when.
    cpu_used_bytes: int | None = None
    cpu_capacity_bytes: int | None = None
    cpu_checked_at: datetime | None = None
    # Compressed / L1 size last measured in its CPU tier (None: it cannot compress).
    cpu_compression_ratio: float | None = None


class PinState(enum.Enum):
    ACTIVE = "ACTIVE"
    REMOVED = "REMOVED"


@dataclass(frozen=True, slots=True)
class Pin:
    owner: str  # tenants/{t} or namespaces/{n}
    pin_id: str
    instance: str
    prompt_tokens: int
    pinned_blocks: int
    state: PinState
    created_at: datetime
    blocks: Sequence[BlockHandle] = ()


class BlockState(enum.Enum):
    FREE = "FREE"
    CACHED = "CACHED"
    IN_USE = "IN_USE"
    PINNED = "PINNED"


@dataclass(frozen=True, slots=True)
class Block:
    instance: str
    block_id: int
    generation: int
    state: BlockState
    ref_count: int
    pin_count: int
    content_hash: bytes | None
    hash_scope: str | None
    tier: str
    last_used_at: datetime | None


@dataclass(frozen=True, slots=True)
class InstanceUsage:
    """What one tenant holds on one instance."""

    instance: str
    blocks_in_use: int
    pinned_blocks: int
    # Of its blocks, those other tenants (or namespaces' pins) reference too.
    shared_blocks: int
    live_reservations: int
    tokens_in_flight: int


@dataclass(frozen=True, slots=True)
class TenantHoldings:
    """What a tenant holds in each tier now, beside its quota (exported as metrics)."""

    tenant: str
    # Distinct GPU blocks its live reservations and pins reference (pinned ones included).
    gpu_blocks: int
    pinned_blocks: int
    # Bytes its offloaded (suspended) sessions hold in the CPU tier, compressed or not (what
    # its CPU-tier quota counts), and of those the bytes held compressed.
    cpu_tier_bytes: int
    compressed_bytes: int
    tokens_in_flight: int
    queued_requests: int
    live_reservations: int
    quota: TenantQuota
