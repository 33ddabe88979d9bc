"""The ledger's tables. Alembic migrations are the only way they change; these models are what the
migrations are checked against. CHECK constraints hold the counters' invariants inside PostgreSQL
too, so a bug above the store cannot over-commit an instance even if it tried.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    func,
    text,
)
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
    # Secret: passed to vLLM as cache_salt; never logged.
    cache_salt: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[CreatedAt]
    updated_at: Mapped[CreatedAt]

    __table_args__ = (
        CheckConstraint("state IN ('ACTIVE', 'SUSPENDED')", name="state"),
        CheckConstraint("weight >= 1", name="weight"),
        CheckConstraint(
            "max_blocks >= 0 AND max_tokens_in_flight >= 0 AND max_queued_requests >= 0 "
            "AND max_pinned_blocks >= 0 AND max_cpu_tier_bytes >= 0",
            name="quota_not_negative",
        ),
        CheckConstraint("blocks_in_use >= 0 AND tokens_in_flight >= 0", name="usage_not_negative"),
    )


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
    state: Mapped[str] = mapped_column(String(16), server_default="ACTIVE")
    blocks_in_use: Mapped[Count]
    mean_hold_seconds: Mapped[float | None]
    created_at: Mapped[CreatedAt]
    updated_at: Mapped[CreatedAt]

    __table_args__ = (
        CheckConstraint("state IN ('ACTIVE', 'DRAINING')", name="state"),
        CheckConstraint(
            "block_size >= 1 AND capacity_blocks >= 1 AND max_model_len >= 1", name="pool"
        ),
        # Invariant 1 (counts): never below zero, never above capacity.
        CheckConstraint("blocks_in_use BETWEEN 0 AND capacity_blocks", name="blocks_in_use"),
    )


class ReservationRow(Base):
    __tablename__ = "reservations"

    tenant: Mapped[ResourceId] = mapped_column(ForeignKey("tenants.tenant"), primary_key=True)
    request_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    instance: Mapped[ResourceId] = mapped_column(ForeignKey("instances.instance"))
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    max_output_tokens: Mapped[int] = mapped_column(Integer)
    n: Mapped[int] = mapped_column(Integer)
    priority: Mapped[int] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(16))
    reserved_blocks: Mapped[int] = mapped_column(BigInteger)
    reserved_tokens: Mapped[int] = mapped_column(BigInteger)
    lease_ttl_seconds: Mapped[float]
    lease_expires_at: Mapped[Timestamp]
    admitted_at: Mapped[Timestamp]
    ended_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    end_reason: Mapped[str | None] = mapped_column(String(32))
    output_tokens: Mapped[int | None] = mapped_column(Integer)

    __table_args__ = (
        CheckConstraint("state IN ('ADMITTED', 'ENDED')", name="state"),
        # Invariant 7: every reservation is live, or ended with a time and a reason.
        CheckConstraint(
            "(state = 'ADMITTED') = (ended_at IS NULL AND end_reason IS NULL)", name="ended"
        ),
        CheckConstraint("reserved_blocks >= 0 AND reserved_tokens >= 0", name="reserved"),
        # The reaper's scan and the retry-delay estimates read only live reservations.
        Index(
            "ix_reservations_live_lease",
            "lease_expires_at",
            postgresql_where=text("state = 'ADMITTED'"),
        ),
        Index(
            "ix_reservations_live_instance",
            "instance",
            "lease_expires_at",
            postgresql_where=text("state = 'ADMITTED'"),
        ),
        Index(
            "ix_reservations_live_tenant",
            "tenant",
            "lease_expires_at",
            postgresql_where=text("state = 'ADMITTED'"),
        ),
    )
