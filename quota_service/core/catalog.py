"""Checks for the operators' writes: tenant quotas and instance registration."""

from __future__ import annotations

from quota_service.core import geometry
from quota_service.core.errors import FieldViolation, invalid_request
from quota_service.core.model import InstanceSpec, TenantQuota
from quota_service.core.names import check_resource_id

MAX_DISPLAY_NAME = 200
MAX_MODEL_NAME = 200
MAX_WEIGHT = 10_000


def check_tenant_fields(
    tenant: str, display_name: str, weight: int, quota: TenantQuota, quota_field: str = "quota"
) -> None:
    violations = [v for v in (check_resource_id(tenant, "tenant_id"),) if v is not None]
    if len(display_name) > MAX_DISPLAY_NAME:
        violations.append(FieldViolation("display_name", f"at most {MAX_DISPLAY_NAME} characters"))
    if not 1 <= weight <= MAX_WEIGHT:
        violations.append(FieldViolation("weight", f"must be between 1 and {MAX_WEIGHT}"))
    for name in TenantQuota.__dataclass_fields__:
        if getattr(quota, name) < 0:
            violations.append(FieldViolation(f"{quota_field}.{name}", "must not be negative"))
    if violations:
        raise invalid_request(violations)


def instance_spec(
    instance: str,
    model: str,
    kv_geometry: geometry.KvGeometry | None,
    block_size: int,
    max_model_len: int,
    budget: geometry.MemoryBudget | None,
    num_gpu_blocks: int | None,
) -> InstanceSpec:
    """The pool an instance registers with: from its geometry and memory budget, or from the
    block count the engine itself reports (then the geometry is optional)."""
    violations = [v for v in (check_resource_id(instance, "instance_id"),) if v is not None]
    if len(model) > MAX_MODEL_NAME:
        violations.append(FieldViolation("model", f"at most {MAX_MODEL_NAME} characters"))
    if block_size < 1:
        violations.append(FieldViolation("block_size", "must be at least 1"))
    if max_model_len < 1:
        violations.append(FieldViolation("max_model_len", "must be at least 1"))
    capacity = 0
    if budget is not None:
        if kv_geometry is None:
            violations.append(FieldViolation("geometry", "required with memory_budget"))
        elif block_size >= 1:
            try:
                capacity = geometry.capacity_blocks(kv_geometry, budget, block_size)
            except geometry.GeometryError as exc:
                violations.append(FieldViolation("memory_budget", str(exc)))
    elif num_gpu_blocks is not None:
        if num_gpu_blocks < 1:
            violations.append(FieldViolation("num_gpu_blocks", "must be at least 1"))
        capacity = num_gpu_blocks
    else:
        violations.append(FieldViolation("capacity", "give memory_budget or num_gpu_blocks"))
    if violations:
        raise invalid_request(violations)
    return InstanceSpec(instance, model, kv_geometry, block_size, capacity, max_model_len)
