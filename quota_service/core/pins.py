"""Pinning a system-prompt prefix: its full blocks stay resident, charged to the pinning tenant's
pin budget (a namespace's pins are the operator's and charge no tenant)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from quota_service.core.admission import Shortfall, tenant_not_active
from quota_service.core.block_table import CachedBlock
from quota_service.core.errors import (
    FieldViolation,
    KvQuotaError,
    QuotaViolation,
    refuse_invalid,
)
from quota_service.core.model import InstancePool, InstanceState, TenantAccount, TenantState
from quota_service.core.reasons import Reason

MAX_PIN_TOKENS = 1 << 20


@dataclass(frozen=True, slots=True)
class PinPlan:
    hits: tuple[CachedBlock, ...]
    # Hashes of the blocks to allocate after the cached prefix (every pinned block is full).
    new_hashes: tuple[bytes, ...]


def token_violations(token_ids: Sequence[int]) -> list[FieldViolation]:
    """What is wrong with a prefix to pin on any instance: checked with the rest of its request,
    before the instance (and so its block size) is looked up."""
    violations = []
    if not token_ids:
        violations.append(FieldViolation("token_ids", "a pin needs at least one full block"))
    if len(token_ids) > MAX_PIN_TOKENS:
        violations.append(FieldViolation("token_ids", f"at most {MAX_PIN_TOKENS} tokens"))
    if any(t < 0 for t in token_ids):
        violations.append(FieldViolation("token_ids", "token ids are never negative"))
    return violations


def check_prefix(token_ids: Sequence[int], block_size: int) -> None:
    """A prefix to pin on an instance of `block_size`: at least one full block, and nothing
    `token_violations` refuses."""
    violations = token_violations(token_ids)
    if token_ids and len(token_ids) < block_size:
        violations.append(
            FieldViolation("token_ids", f"a pin needs at least one full block of {block_size}")
        )
    refuse_invalid(violations)


def decide(
    hashes: Sequence[bytes],
    hits: Sequence[CachedBlock],
    pool: InstancePool,
    account: TenantAccount | None,
) -> PinPlan | Shortfall:
    """Pin the blocks of `hashes` (their cached prefix `hits`, new blocks for the rest), or say
    why not. A pin needs room only for its new blocks; hits on cached blocks use up evictable
    room as an admission's do."""
    if pool.state is InstanceState.DRAINING:
        raise KvQuotaError(
            Reason.INSTANCE_DRAINING,
            f"instance {pool.instance} is draining",
            metadata={"instance": pool.instance},
        )
    if len(hashes) > pool.capacity_blocks:
        raise KvQuotaError(
            Reason.REQUEST_EXCEEDS_CAPACITY,
            f"{len(hashes)} blocks is more than instance {pool.instance} has",
            metadata={"requestedBlocks": str(len(hashes))},
        )
    new_blocks = len(hashes) - len(hits)
    if account is not None:
        if account.state is not TenantState.ACTIVE:
            raise tenant_not_active(account.tenant, account.state)
        pinned_new = new_blocks + sum(1 for h in hits if not h.pinned_by_tenant)
        pin_room = account.quota.max_pinned_blocks - account.pinned_blocks
        if pinned_new > pin_room:
            # Pins do not expire: no retry delay would help; someone must unpin first.
            raise KvQuotaError(
                Reason.TENANT_QUOTA_EXCEEDED,
                f"tenant {account.tenant} has room for {max(pin_room, 0)} more pinned blocks, "
                f"the prefix needs {pinned_new}",
                metadata={"tenant": account.tenant, "requestedBlocks": str(pinned_new)},
                quota_violations=(
                    QuotaViolation(
                        f"tenants/{account.tenant}",
                        f"pinned blocks: needs {pinned_new}, {max(pin_room, 0)} left in quota",
                    ),
                ),
            )
        new_to_tenant = new_blocks + sum(1 for h in hits if not h.held_by_tenant)
        room = account.quota.max_blocks - account.blocks_in_use
        if new_to_tenant > room:
            return Shortfall("tenant", new_to_tenant, 0, room, 0)
    allocatable = pool.allocatable_blocks - sum(1 for h in hits if h.evictable)
    if new_blocks > allocatable:
        return Shortfall("instance", new_blocks, 0, allocatable, 0)
    return PinPlan(tuple(hits), tuple(hashes[len(hits) :]))


def pin_id_reused(owner: str, pin_id: str) -> KvQuotaError:
    """A pin id already pinning another prefix (or on another instance)."""
    name = f"{owner}/pins/{pin_id}"
    return KvQuotaError(
        Reason.PIN_ID_REUSED, f"{name} already pins another prefix", metadata={"name": name}
    )
