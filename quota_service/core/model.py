"""Plain values the decisions work on; the store loads and saves them, core never touches I/O."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import datetime

from quota_service.core.geometry import KvGeometry


class TenantState(enum.Enum):
    ACTIVE = "ACTIVE"
    SUSPENDED = "SUSPENDED"


class InstanceState(enum.Enum):
    ACTIVE = "ACTIVE"
    DRAINING = "DRAINING"


class ReservationState(enum.Enum):
    ADMITTED = "ADMITTED"
    ENDED = "ENDED"


class EndReason(enum.Enum):
    RELEASED = "RELEASED"
    CANCELLED = "CANCELLED"
    LEASE_EXPIRED = "LEASE_EXPIRED"


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


@dataclass(frozen=True, slots=True)
class InstancePool:
    """An instance's pool of KV blocks, as locked for one admission."""

    instance: str
    state: InstanceState
    block_size: int
    capacity_blocks: int
    max_model_len: int
    blocks_in_use: int
    mean_hold_seconds: float | None

    @property
    def free_blocks(self) -> int:
        return self.capacity_blocks - self.blocks_in_use


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
    lease_ttl_seconds: float
    lease_expires_at: datetime
    admitted_at: datetime
    ended_at: datetime | None
    end_reason: EndReason | None
    output_tokens: int | None

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
    live_reservations: int
    created_at: datetime
    updated_at: datetime


@dataclass(frozen=True, slots=True)
class InstanceSpec:
    """What registering an instance stores: its pool and, when known, its geometry."""

    instance: str
    model: str
    geometry: KvGeometry | None
    block_size: int
    capacity_blocks: int
    max_model_len: int

    @property
    def bytes_per_block(self) -> int | None:
        return self.geometry.bytes_per_block(self.block_size) if self.geometry else None


@dataclass(frozen=True, slots=True)
class Instance:
    spec: InstanceSpec
    state: InstanceState
    blocks_in_use: int
    live_reservations: int
    created_at: datetime
    updated_at: datetime

    @property
    def free_blocks(self) -> int:
        return self.spec.capacity_blocks - self.blocks_in_use
