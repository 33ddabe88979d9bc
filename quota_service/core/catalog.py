"""Checks for the operators' writes: tenant quotas and instance registration."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict

from quota_service.core import geometry
from quota_service.core.errors import FieldViolation, invalid_request, refuse_invalid
from quota_service.core.hashing import HashAlgo
from quota_service.core.model import EngineEndpoints, InstanceSpec, QueueBounds, TenantQuota
from quota_service.core.names import check_resource_id, parse_child

MAX_DISPLAY_NAME = 200
MAX_MODEL_NAME = 200
MAX_WEIGHT = 10_000
# One row per slot: beyond this a pool is surely a typo in a budget (a million is a big GPU).
MAX_CAPACITY_BLOCKS = 10_000_000
# vLLM's --block-size choices (its CacheConfig BlockSize): powers of two from 1 to 256.
VLLM_BLOCK_SIZES = (1, 8, 16, 32, 64, 128, 256)
# Longer than any context a model serves today (2^20 tokens); it bounds the token ids a request
# may carry, and so the hashing one call may ask for.
MAX_CONTEXT_TOKENS = 1 << 20


QUOTA_FIELDS = tuple(TenantQuota.__dataclass_fields__)
TENANT_UPDATE_PATHS = (
    "display_name",
    "weight",
    "shared_namespace",
    "shadow_mode",
    "quota",
    *(f"quota.{f}" for f in QUOTA_FIELDS),
)


def _tenant_violations(
    display_name: str | None, weight: int | None, quota: Mapping[str, int]
) -> list[FieldViolation]:
    """What is wrong with the given tenant fields (None: not being set)."""
    violations = []
    if display_name is not None and len(display_name) > MAX_DISPLAY_NAME:
        violations.append(
            FieldViolation("tenant.display_name", f"at most {MAX_DISPLAY_NAME} characters")
        )
    if weight is not None and not 1 <= weight <= MAX_WEIGHT:
        violations.append(FieldViolation("tenant.weight", f"must be between 1 and {MAX_WEIGHT}"))
    violations.extend(
        FieldViolation(f"tenant.quota.{name}", "must not be negative")
        for name, value in quota.items()
        if value < 0
    )
    return violations


def check_new_tenant(tenant: str, display_name: str, weight: int, quota: TenantQuota) -> None:
    violation = check_resource_id(tenant, "tenant_id")
    violations = [violation] if violation else []
    violations += _tenant_violations(display_name, weight, asdict(quota))
    if violations:
        raise invalid_request(violations)


def tenant_changes(
    paths: Sequence[str],
    display_name: str,
    weight: int,
    quota: TenantQuota,
    shared_namespace: str = "",
    shadow_mode: bool = False,
    found: Sequence[FieldViolation] = (),
) -> dict[str, object]:
    """The columns an update sets: the fields its mask names (AIP-134), checked like a create.
    `found` holds what the caller found wrong already (the tenant's name), refused with the
    rest."""
    violations = [*found]
    if not paths or any(p not in TENANT_UPDATE_PATHS for p in paths):
        violations.append(
            FieldViolation("update_mask", f"paths must be among {', '.join(TENANT_UPDATE_PATHS)}")
        )
    quota_changes = {
        name: getattr(quota, name)
        for name in QUOTA_FIELDS
        if "quota" in paths or f"quota.{name}" in paths
    }
    new_name = display_name if "display_name" in paths else None
    new_weight = weight if "weight" in paths else None
    violations += _tenant_violations(new_name, new_weight, quota_changes)
    changes: dict[str, object] = dict(quota_changes)
    if "shared_namespace" in paths:
        # Empty leaves the namespace: the tenant is isolated again under its own salt.
        namespace, violation = (None, None)
        if shared_namespace:
            namespace, violation = parse_child(shared_namespace, "namespaces", "shared_namespace")
            violations += [violation] if violation else []
        changes["namespace"] = namespace
    refuse_invalid(violations)
    if new_name is not None:
        changes["display_name"] = new_name
    if new_weight is not None:
        changes["weight"] = new_weight
    if "shadow_mode" in paths:
        changes["shadow_mode"] = shadow_mode
    return changes


def instance_spec(
    instance: str,
    model: str,
    kv_geometry: geometry.KvGeometry | None,
    block_size: int,
    max_model_len: int,
    budget: geometry.MemoryBudget | None,
    num_gpu_blocks: int | None,
    hash_algo: HashAlgo = HashAlgo.SHA256,
    queue: QueueBounds | None = None,
    engine: EngineEndpoints | None = None,
    found: Sequence[FieldViolation] = (),
) -> InstanceSpec:
    """The pool an instance registers with: from its geometry and memory budget, or from the
    block count the engine itself reports (then the geometry is optional). `found` holds what
    the caller found wrong already, refused with the rest (a budget given with a geometry that
    did not parse is refused for the geometry alone)."""
    violations = [*found]
    violations += [v for v in (check_resource_id(instance, "instance_id"),) if v is not None]
    if len(model) > MAX_MODEL_NAME:
        violations.append(FieldViolation("model", f"at most {MAX_MODEL_NAME} characters"))
    block_size_known = block_size in VLLM_BLOCK_SIZES
    if not block_size_known:
        sizes = ", ".join(map(str, VLLM_BLOCK_SIZES))
        violations.append(FieldViolation("block_size", f"must be one of vLLM's: {sizes}"))
    if not block_size <= max_model_len <= MAX_CONTEXT_TOKENS:
        violations.append(
            FieldViolation(
                "max_model_len", f"must be between block_size and {MAX_CONTEXT_TOKENS} tokens"
            )
        )
    capacity = 0
    # A geometry or budget that did not parse is refused as such: no capacity follows from it.
    unparsed = {v.field.split(".")[0] for v in found} & {"geometry", "memory_budget"}
    if budget is not None and not unparsed:
        if kv_geometry is None:
            violations.append(FieldViolation("geometry", "required with memory_budget"))
        elif block_size_known:
            try:
                capacity = geometry.capacity_blocks(kv_geometry, budget, block_size)
            except geometry.GeometryError as exc:
                violations.append(FieldViolation("memory_budget", str(exc)))
    elif num_gpu_blocks is not None:
        if num_gpu_blocks < 1:
            violations.append(FieldViolation("num_gpu_blocks", "must be at least 1"))
        capacity = num_gpu_blocks
    elif not unparsed:
        violations.append(FieldViolation("capacity", "give memory_budget or num_gpu_blocks"))
    queue = queue or QueueBounds()
    if queue.max_queued_requests < 0:
        violations.append(FieldViolation("max_queued_requests", "must not be negative"))
    guard = (queue.target_ttft_seconds, queue.prefill_tokens_per_second)
    if not all(0 <= value < math.inf for value in guard):  # NaN too
        violations.append(
            FieldViolation("target_ttft", "TTFT guard values must be finite, not negative")
        )
    if capacity > MAX_CAPACITY_BLOCKS:
        violations.append(
            FieldViolation("capacity", f"{capacity} blocks is more than {MAX_CAPACITY_BLOCKS}")
        )
    if violations:
        raise invalid_request(violations)
    return InstanceSpec(
        instance, model, kv_geometry, block_size, capacity, max_model_len, hash_algo, queue, engine
    )
