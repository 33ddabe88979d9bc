"""Between protobuf messages and core values. Unset fields take their documented defaults here."""

from __future__ import annotations

from datetime import datetime, timedelta

from google.protobuf.duration_pb2 import Duration
from google.protobuf.timestamp_pb2 import Timestamp

from kvquota.v1 import admission_pb2 as admission_pb
from kvquota.v1 import resources_pb2 as pb
from quota_service.core import geometry, names
from quota_service.core.admission import AdmitRequest
from quota_service.core.errors import FieldViolation, invalid_request
from quota_service.core.model import (
    AdmitParams,
    EndReason,
    Instance,
    InstanceState,
    Reservation,
    ReservationState,
    Tenant,
    TenantQuota,
    TenantState,
)

# vLLM's default gpu_memory_utilization (ENGINES.md).
DEFAULT_GPU_MEMORY_UTILIZATION = 0.92

_DTYPES = {
    pb.KV_DTYPE_FP32: geometry.KvDtype.FP32,
    pb.KV_DTYPE_FP16: geometry.KvDtype.FP16,
    pb.KV_DTYPE_BF16: geometry.KvDtype.BF16,
    pb.KV_DTYPE_FP8: geometry.KvDtype.FP8,
    pb.KV_DTYPE_INT8: geometry.KvDtype.INT8,
}
_DTYPE_VALUES = {v: k for k, v in _DTYPES.items()}
_TENANT_STATES = {
    TenantState.ACTIVE: pb.TENANT_STATE_ACTIVE,
    TenantState.SUSPENDED: pb.TENANT_STATE_SUSPENDED,
}
_INSTANCE_STATES = {
    InstanceState.ACTIVE: pb.INSTANCE_STATE_ACTIVE,
    InstanceState.DRAINING: pb.INSTANCE_STATE_DRAINING,
}
_RESERVATION_STATES = {
    ReservationState.ADMITTED: pb.RESERVATION_STATE_ADMITTED,
    ReservationState.ENDED: pb.RESERVATION_STATE_ENDED,
}
_END_REASONS = {
    EndReason.RELEASED: pb.END_REASON_RELEASED,
    EndReason.CANCELLED: pb.END_REASON_CANCELLED,
    EndReason.LEASE_EXPIRED: pb.END_REASON_LEASE_EXPIRED,
}


def timestamp(value: datetime) -> Timestamp:
    stamp = Timestamp()
    stamp.FromDatetime(value)
    return stamp


def duration(seconds: float) -> Duration:
    value = Duration()
    value.FromTimedelta(timedelta(seconds=seconds))
    return value


def _resource_id(name: str, collection: str, field: str, violations: list[FieldViolation]) -> str:
    value, violation = names.parse_child(name, collection, field)
    if violation:
        violations.append(violation)
    return value or ""


def admit_request(request: admission_pb.AdmitRequest) -> AdmitRequest:
    violations: list[FieldViolation] = []
    tenant = _resource_id(request.tenant, "tenants", "tenant", violations)
    instance = _resource_id(request.instance, "instances", "instance", violations)
    if violations:
        raise invalid_request(violations)
    lease_ttl = (
        request.lease_ttl.ToTimedelta().total_seconds() if request.HasField("lease_ttl") else None
    )
    return AdmitRequest(
        params=AdmitParams(
            tenant=tenant,
            request_id=request.request_id,
            instance=instance,
            prompt_tokens=request.prompt_tokens,
            max_output_tokens=request.max_output_tokens,
            n=request.n or 1,
            priority=request.priority,
        ),
        prompt_token_ids=tuple(request.prompt_token_ids),
        wait_timeout_seconds=request.wait_timeout.ToTimedelta().total_seconds(),
        lease_ttl_seconds=lease_ttl,
    )


def reservation(value: Reservation) -> pb.Reservation:
    message = pb.Reservation(
        name=names.reservation_name(value.tenant, value.request_id),
        tenant=names.tenant_name(value.tenant),
        request_id=value.request_id,
        instance=names.instance_name(value.instance),
        prompt_tokens=value.prompt_tokens,
        max_output_tokens=value.max_output_tokens,
        n=value.n,
        priority=value.priority,
        state=_RESERVATION_STATES[value.state],
        reserved_blocks=value.reserved_blocks,
        reserved_tokens=value.reserved_tokens,
        lease_expire_time=timestamp(value.lease_expires_at),
        admit_time=timestamp(value.admitted_at),
        lease_ttl=duration(value.lease_ttl_seconds),
        output_tokens=value.output_tokens or 0,
    )
    if value.ended_at is not None:
        message.end_time.CopyFrom(timestamp(value.ended_at))
    if value.end_reason is not None:
        message.end_reason = _END_REASONS[value.end_reason]
    return message


def quota(message: pb.TenantQuota) -> TenantQuota:
    return TenantQuota(
        max_blocks=message.max_blocks,
        max_tokens_in_flight=message.max_tokens_in_flight,
        max_queued_requests=message.max_queued_requests,
        max_pinned_blocks=message.max_pinned_blocks,
        max_cpu_tier_bytes=message.max_cpu_tier_bytes,
    )


def tenant(value: Tenant) -> pb.Tenant:
    q = value.quota
    return pb.Tenant(
        name=names.tenant_name(value.tenant),
        display_name=value.display_name,
        state=_TENANT_STATES[value.state],
        quota=pb.TenantQuota(
            max_blocks=q.max_blocks,
            max_tokens_in_flight=q.max_tokens_in_flight,
            max_queued_requests=q.max_queued_requests,
            max_pinned_blocks=q.max_pinned_blocks,
            max_cpu_tier_bytes=q.max_cpu_tier_bytes,
        ),
        usage=pb.TenantUsage(
            blocks_in_use=value.blocks_in_use,
            tokens_in_flight=value.tokens_in_flight,
            live_reservations=value.live_reservations,
        ),
        weight=value.weight,
        create_time=timestamp(value.created_at),
        update_time=timestamp(value.updated_at),
    )


def kv_geometry(message: pb.KvGeometry) -> geometry.KvGeometry:
    dtype = _DTYPES.get(message.dtype)
    if dtype is None:
        raise invalid_request([FieldViolation("geometry.dtype", "required")])
    try:
        return geometry.KvGeometry(
            message.num_layers, message.num_kv_heads, message.head_dim, dtype, message.mla
        )
    except geometry.GeometryError as exc:
        raise invalid_request([FieldViolation("geometry", str(exc))]) from None


def memory_budget(message: pb.MemoryBudget) -> geometry.MemoryBudget:
    try:
        return geometry.MemoryBudget(
            total_bytes=message.total_bytes,
            weights_bytes=message.weights_bytes,
            overhead_bytes=message.overhead_bytes,
            utilization=message.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION,
        )
    except geometry.GeometryError as exc:
        raise invalid_request([FieldViolation("memory_budget", str(exc))]) from None


def instance(value: Instance) -> pb.Instance:
    spec = value.spec
    message = pb.Instance(
        name=names.instance_name(spec.instance),
        model=spec.model,
        block_size=spec.block_size,
        capacity_blocks=spec.capacity_blocks,
        max_model_len=spec.max_model_len,
        state=_INSTANCE_STATES[value.state],
        bytes_per_block=spec.bytes_per_block or 0,
        blocks_in_use=value.blocks_in_use,
        free_blocks=value.free_blocks,
        live_reservations=value.live_reservations,
        create_time=timestamp(value.created_at),
        update_time=timestamp(value.updated_at),
    )
    if spec.geometry is not None:
        g = spec.geometry
        message.geometry.CopyFrom(
            pb.KvGeometry(
                num_layers=g.num_layers,
                num_kv_heads=g.num_kv_heads,
                head_dim=g.head_dim,
                dtype=_DTYPE_VALUES[g.dtype],
                mla=g.mla,
            )
        )
    return message
