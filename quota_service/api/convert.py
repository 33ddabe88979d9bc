"""Between protobuf messages and core values. Unset fields take their documented defaults here."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

from google.protobuf.duration_pb2 import Duration
from google.protobuf.internal.containers import RepeatedCompositeFieldContainer
from google.protobuf.timestamp_pb2 import Timestamp

from kvquota.v1 import admission_pb2 as admission_pb
from kvquota.v1 import resources_pb2 as pb
from quota_service.core import admission, engine_address, geometry, names
from quota_service.core.access import ApiKey, AuditEvent, Role
from quota_service.core.admission import AdmissionLimits, AdmitRequest
from quota_service.core.block_table import BlockHandle, BlockHandles
from quota_service.core.errors import FieldViolation, invalid_request, quoted, refuse_invalid
from quota_service.core.hashing import HashAlgo, event_hash
from quota_service.core.model import (
    AdmitParams,
    Block,
    BlockState,
    EndReason,
    EngineEndpoints,
    Instance,
    InstanceState,
    LmcacheEndpoint,
    Pin,
    PinState,
    Reservation,
    ReservationState,
    Tenant,
    TenantQuota,
    TenantState,
)
from quota_service.core.reclaim import ReclaimJob, Tier

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
    TenantState.DELETING: pb.TENANT_STATE_DELETING,
    TenantState.DELETED: pb.TENANT_STATE_DELETED,
}
_INSTANCE_STATES = {
    InstanceState.ACTIVE: pb.INSTANCE_STATE_ACTIVE,
    InstanceState.DRAINING: pb.INSTANCE_STATE_DRAINING,
}
_HASH_ALGOS = {
    HashAlgo.SHA256: pb.PREFIX_HASH_ALGO_SHA256,
    HashAlgo.SHA256_CBOR: pb.PREFIX_HASH_ALGO_SHA256_CBOR,
}
_RESERVATION_STATES = {
    ReservationState.QUEUED: pb.RESERVATION_STATE_QUEUED,
    ReservationState.ADMITTED: pb.RESERVATION_STATE_ADMITTED,
    ReservationState.ENDED: pb.RESERVATION_STATE_ENDED,
}
_END_REASONS = {
    EndReason.RELEASED: pb.END_REASON_RELEASED,
    EndReason.CANCELLED: pb.END_REASON_CANCELLED,
    EndReason.LEASE_EXPIRED: pb.END_REASON_LEASE_EXPIRED,
    EndReason.TENANT_DELETED: pb.END_REASON_TENANT_DELETED,
    EndReason.QUEUE_TIMEOUT: pb.END_REASON_QUEUE_TIMEOUT,
    EndReason.ENGINE_RESTARTED: pb.END_REASON_ENGINE_RESTARTED,
    EndReason.ENGINE_UNREACHABLE: pb.END_REASON_ENGINE_UNREACHABLE,
    EndReason.PREEMPTED: pb.END_REASON_PREEMPTED,
}


EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def timestamp(value: datetime) -> Timestamp:
    """As Timestamp.FromDatetime has it (a naive value is UTC), by exact timedelta arithmetic:
    a twentieth of its cost, and every answer carries several."""
    seconds, nanos = _since_epoch(value)
    return Timestamp(seconds=seconds, nanos=nanos)


def _since_epoch(value: datetime) -> tuple[int, int]:
    """A Timestamp's seconds and nanos for `value`."""
    since = value.replace(tzinfo=UTC) - EPOCH if value.tzinfo is None else value - EPOCH
    return since.days * 86_400 + since.seconds, since.microseconds * 1000


# Protobuf's own bounds: Durations of at most 10,000 years, Timestamps in years 1 to 9999.
MAX_DURATION_SECONDS = 315_576_000_000
MIN_TIMESTAMP_SECONDS = -62_135_596_800
MAX_TIMESTAMP_SECONDS = 253_402_300_799
NANOS = 1_000_000_000


def seconds(value: Duration, field: str, violations: list[FieldViolation]) -> float | None:
    """A Duration as seconds; None, with what is wrong in `violations`, unless it is one
    protobuf itself would accept."""
    same_sign = value.seconds * value.nanos >= 0
    if abs(value.seconds) > MAX_DURATION_SECONDS or abs(value.nanos) >= NANOS or not same_sign:
        violations.append(FieldViolation(field, "not a valid duration"))
        return None
    return value.seconds + value.nanos / NANOS


def instant(value: Timestamp, field: str, violations: list[FieldViolation]) -> datetime | None:
    """A Timestamp as a UTC datetime; None, with what is wrong in `violations`, unless it is a
    valid one."""
    valid_seconds = MIN_TIMESTAMP_SECONDS <= value.seconds <= MAX_TIMESTAMP_SECONDS
    if not valid_seconds or not 0 <= value.nanos < NANOS:
        violations.append(FieldViolation(field, "not a valid timestamp"))
        return None
    return value.ToDatetime(UTC)


def duration(seconds: float) -> Duration:
    """As Duration.FromTimedelta has it (microsecond precision, nanos of the seconds' sign), by
    arithmetic: every reservation carries one."""
    since = timedelta(seconds=seconds)
    whole, nanos = since.days * 86_400 + since.seconds, since.microseconds * 1000
    if whole < 0 and nanos > 0:
        whole, nanos = whole + 1, nanos - NANOS
    return Duration(seconds=whole, nanos=nanos)


def _resource_id(name: str, collection: str, field: str, violations: list[FieldViolation]) -> str:
    value, violation = names.parse_child(name, collection, field)
    if violation:
        violations.append(violation)
    return value or ""


def admit_request(
    request: admission_pb.AdmitRequest, limits: AdmissionLimits
) -> tuple[AdmitRequest, str | None]:
    """The Admit, checked whole before any database work: every fault is refused at once. With
    it, the key of the engine address it names its instance by (None: it names the instance,
    and the AdmitRequest carries it)."""
    violations: list[FieldViolation] = []
    tenant = _resource_id(request.tenant, "tenants", "tenant", violations)
    instance, address = "", None
    if not request.engine_address:
        instance = _resource_id(request.instance, "instances", "instance", violations)
    elif request.instance:
        violations.append(
            FieldViolation("engine_address", "give instance or engine_address, not both")
        )
    else:
        address, violation = engine_address.parse(request.engine_address, "engine_address")
        violations += [violation] if violation else []
    admit = AdmitRequest(
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
        # A Duration that is not one is refused as such, not checked again as a value.
        wait_timeout_seconds=seconds(request.wait_timeout, "wait_timeout", violations) or 0.0,
        lease_ttl_seconds=lease_ttl(request, violations),
    )
    refuse_invalid([*violations, *admission.request_violations(admit, limits)])
    return admit, address


def lease_ttl(
    request: admission_pb.AdmitRequest | admission_pb.RenewLeaseRequest,
    violations: list[FieldViolation],
) -> float | None:
    """The lease TTL asked for, or None for the default (and for one that is no Duration, with
    what is wrong in `violations`)."""
    if not request.HasField("lease_ttl"):
        return None
    return seconds(request.lease_ttl, "lease_ttl", violations)


def reservation(value: Reservation) -> pb.Reservation:
    message = pb.Reservation()
    fill_reservation(message, value)
    return message


def fill_reservation(message: pb.Reservation, value: Reservation) -> None:
    """Write a reservation into an empty message: into the one a response holds, so that its
    block table is not copied again."""
    message.MergeFrom(
        pb.Reservation(
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
            prefix_hit_blocks=value.prefix_hit_blocks,
            lease_ttl=duration(value.lease_ttl_seconds),
            output_tokens=value.output_tokens or 0,
            shadow_refusal=value.shadow_refusal or "",
        )
    )
    for field, when in (
        ("lease_expire_time", value.lease_expires_at),
        ("admit_time", value.admitted_at),
        ("end_time", value.ended_at),
        ("queue_time", value.queued_at),
        ("wait_deadline", value.wait_deadline),
        ("suspend_time", value.suspended_at),
    ):
        if when is not None:
            stamp = getattr(message, field)
            stamp.seconds, stamp.nanos = _since_epoch(when)
    add_block_handles(message.block_table, value.block_table)
    if value.queue_position is not None:
        message.queue_position = value.queue_position
    message.offloaded_bytes = value.offloaded_bytes or 0
    message.offloaded = value.offloaded_bytes is not None
    message.compressed_bytes = value.compressed_bytes or 0
    message.compression_ratio = value.compression_ratio or 0.0
    if value.end_reason is not None:
        message.end_reason = _END_REASONS[value.end_reason]


def block_handle(value: BlockHandle) -> pb.BlockHandle:
    return pb.BlockHandle(block_id=value.block_id, generation=value.generation)


def add_block_handles(
    field: RepeatedCompositeFieldContainer[pb.BlockHandle], values: Sequence[BlockHandle]
) -> None:
    """Append handles to a message's repeated field. Filled in place: a whole table (96
    entries and more on every Admit) costs a third of building each handle as a message of
    its own and copying it in. A table's columns are read as pairs, not as named tuples."""
    add = field.add
    pairs = values.pairs() if isinstance(values, BlockHandles) else values
    for block_id, generation in pairs:
        entry = add()
        entry.block_id = block_id
        entry.generation = generation


def hash_algo(value: pb.PrefixHashAlgo.ValueType, violations: list[FieldViolation]) -> HashAlgo:
    """Unset means sha256, vLLM's default; a value this server does not know is a violation
    (never stored as the default: the ledger's hashes would not be the engine's)."""
    if value == pb.PREFIX_HASH_ALGO_UNSPECIFIED:
        return HashAlgo.SHA256
    known = {v: k for k, v in _HASH_ALGOS.items()}.get(value)
    if known is None:
        violations.append(FieldViolation("hash_algo", "not a PrefixHashAlgo this server knows"))
    return known or HashAlgo.SHA256


# Endpoint strings are stored in columns of 200 characters.
MAX_ENDPOINT = 200


def engine_endpoints(
    message: pb.EngineEndpoints, violations: list[FieldViolation]
) -> EngineEndpoints:
    """The endpoints given, each checked; what is wrong goes to `violations`."""
    if not message.url.startswith(("http://", "https://")) or len(message.url) > MAX_ENDPOINT:
        violations.append(
            FieldViolation("engine.url", f"must be an http(s) URL of at most {MAX_ENDPOINT}")
        )
    for field, value in (
        ("engine.kv_events_endpoint", message.kv_events_endpoint),
        ("engine.kv_replay_endpoint", message.kv_replay_endpoint),
    ):
        if value and (not value.startswith(("tcp://", "ipc://")) or len(value) > MAX_ENDPOINT):
            violations.append(
                FieldViolation(
                    field, f"must be a tcp:// or ipc:// endpoint of at most {MAX_ENDPOINT}"
                )
            )
    lmcache = None
    if message.HasField("lmcache"):
        given = message.lmcache
        if not given.coordinator_url.startswith(("http://", "https://")) or (
            len(given.coordinator_url) > MAX_ENDPOINT
        ):
            violations.append(
                FieldViolation(
                    "engine.lmcache.coordinator_url",
                    f"must be an http(s) URL of at most {MAX_ENDPOINT} characters",
                )
            )
        for field, value in (
            ("engine.lmcache.instance_id", given.instance_id),
            ("engine.lmcache.model_name", given.model_name),
        ):
            if not value or len(value) > MAX_ENDPOINT:
                violations.append(FieldViolation(field, f"1 to {MAX_ENDPOINT} characters"))
        if given.world_size < 0:
            violations.append(FieldViolation("engine.lmcache.world_size", "must not be negative"))
        lmcache = LmcacheEndpoint(
            given.coordinator_url, given.instance_id, given.model_name, given.world_size or 1
        )
    return EngineEndpoints(
        message.url,
        message.kv_events_endpoint or None,
        message.kv_replay_endpoint or None,
        lmcache,
    )


def engine_hash_algo(name: str) -> HashAlgo:
    """The engine's --prefix-caching-hash-algo; one kvquota cannot reproduce is refused."""
    try:
        return HashAlgo(name)
    except ValueError:
        raise invalid_request(
            [
                FieldViolation(
                    "engine", f"prefix_caching_hash_algo {quoted(name)}: use sha256 or sha256_cbor"
                )
            ]
        ) from None


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
            pinned_blocks=value.pinned_blocks,
            queued_requests=value.queued_requests,
            cpu_tier_bytes=value.cpu_tier_bytes,
            compressed_bytes=value.compressed_bytes,
        ),
        shared_namespace=names.namespace_name(value.namespace) if value.namespace else "",
        shadow_mode=value.shadow_mode,
        weight=value.weight,
        create_time=timestamp(value.created_at),
        update_time=timestamp(value.updated_at),
    )


def kv_geometry(
    message: pb.KvGeometry, violations: list[FieldViolation]
) -> geometry.KvGeometry | None:
    """The geometry given, or None with what is wrong in `violations`."""
    dtype = _DTYPES.get(message.dtype)
    if dtype is None:
        violations.append(FieldViolation("geometry.dtype", "required: one of KV_DTYPE_*"))
        return None
    try:
        return geometry.KvGeometry(
            message.num_layers, message.num_kv_heads, message.head_dim, dtype, message.mla
        )
    except geometry.GeometryError as exc:
        violations.append(FieldViolation("geometry", str(exc)))
        return None


def memory_budget(
    message: pb.MemoryBudget, violations: list[FieldViolation]
) -> geometry.MemoryBudget | None:
    """The budget given, or None with what is wrong in `violations`."""
    try:
        return geometry.MemoryBudget(
            total_bytes=message.total_bytes,
            weights_bytes=message.weights_bytes,
            overhead_bytes=message.overhead_bytes,
            utilization=message.gpu_memory_utilization or geometry.VLLM_GPU_MEMORY_UTILIZATION,
        )
    except geometry.GeometryError as exc:
        violations.append(FieldViolation("memory_budget", str(exc)))
        return None


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
        cached_blocks=value.cached_blocks,
        pinned_blocks=value.pinned_blocks,
        hash_algo=_HASH_ALGOS[spec.hash_algo],
        max_queued_requests=spec.queue.max_queued_requests,
        target_ttft=duration(spec.queue.target_ttft_seconds),
        prefill_tokens_per_second=spec.queue.prefill_tokens_per_second,
        queued_requests=value.queued_requests,
        queued_prompt_tokens=value.queued_prompt_tokens,
        drift_blocks=value.drift_blocks,
        engine_resyncs=value.engine_resyncs,
        engine_requests_running=(
            -1 if value.engine_requests_running is None else value.engine_requests_running
        ),
        live_reservations=value.live_reservations,
        create_time=timestamp(value.created_at),
        update_time=timestamp(value.updated_at),
    )
    if value.engine_checked_at is not None:
        message.engine_check_time.CopyFrom(timestamp(value.engine_checked_at))
    if spec.engine is not None:
        message.engine.CopyFrom(
            pb.EngineEndpoints(
                url=spec.engine.url,
                kv_events_endpoint=spec.engine.kv_events or "",
                kv_replay_endpoint=spec.engine.kv_replay or "",
            )
        )
        if spec.engine.lmcache is not None:
            lmcache = spec.engine.lmcache
            message.engine.lmcache.CopyFrom(
                pb.LmcacheEndpoint(
                    coordinator_url=lmcache.coordinator_url,
                    instance_id=lmcache.instance_id,
                    model_name=lmcache.model_name,
                    world_size=lmcache.world_size,
                )
            )
    if value.cpu_checked_at is not None:
        message.cpu_used_bytes = value.cpu_used_bytes or 0
        message.cpu_capacity_bytes = value.cpu_capacity_bytes or 0
        message.cpu_check_time.CopyFrom(timestamp(value.cpu_checked_at))
    message.cpu_compression_ratio = value.cpu_compression_ratio or 0.0
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


_PIN_STATES = {PinState.ACTIVE: pb.PIN_STATE_ACTIVE, PinState.REMOVED: pb.PIN_STATE_REMOVED}
_BLOCK_STATES = {
    BlockState.FREE: pb.BLOCK_STATE_FREE,
    BlockState.CACHED: pb.BLOCK_STATE_CACHED,
    BlockState.IN_USE: pb.BLOCK_STATE_IN_USE,
    BlockState.PINNED: pb.BLOCK_STATE_PINNED,
}
_BLOCK_STATE_VALUES = {v: k for k, v in _BLOCK_STATES.items()}
_TIERS = {
    "GPU": pb.BLOCK_TIER_GPU,
    "CPU": pb.BLOCK_TIER_CPU,
    "COMPRESSED": pb.BLOCK_TIER_COMPRESSED,
}


def pin(value: Pin) -> pb.Pin:
    message = pb.Pin(
        name=f"{value.owner}/pins/{value.pin_id}",
        instance=names.instance_name(value.instance),
        prompt_tokens=value.prompt_tokens,
        pinned_blocks=value.pinned_blocks,
        state=_PIN_STATES[value.state],
        create_time=timestamp(value.created_at),
    )
    add_block_handles(message.blocks, value.blocks)
    return message


def signed_event_hash(content_hash: bytes | None) -> int:
    """vLLM's event hash (an unsigned 64-bit int) as the int64 the API carries: same bits."""
    if content_hash is None:
        return 0
    unsigned = event_hash(content_hash)
    return unsigned - (1 << 64) if unsigned >= 1 << 63 else unsigned


def block(value: Block) -> pb.Block:
    message = pb.Block(
        name=f"{names.instance_name(value.instance)}/blocks/{value.block_id}",
        generation=value.generation,
        state=_BLOCK_STATES[value.state],
        ref_count=value.ref_count,
        pin_count=value.pin_count,
        block_hash=signed_event_hash(value.content_hash),
        hash_scope=value.hash_scope or "",
        tier=_TIERS[value.tier],
    )
    if value.last_used_at is not None:
        message.last_use_time.CopyFrom(timestamp(value.last_used_at))
    return message


def block_state(
    value: pb.BlockState.ValueType, violations: list[FieldViolation]
) -> BlockState | None:
    """Unset means any state (None); a state this server does not know is a violation (a filter
    that filtered nothing would answer with every block)."""
    if value == pb.BLOCK_STATE_UNSPECIFIED:
        return None
    state = _BLOCK_STATE_VALUES.get(value)
    if state is None:
        violations.append(FieldViolation("state", "not a BlockState this server knows"))
    return state


def reclaim_tier(value: pb.ReclaimTier.ValueType) -> Tier | None:
    """The tier a request names (None when unspecified)."""
    # Proto enums are open: a number this server does not know is no tier either.
    known = {t.value for t in Tier}
    return Tier(int(value)) if int(value) in known else None


def _reservation_or_empty(key: tuple[str, str] | None) -> str:
    return "" if key is None else names.reservation_name(*key)


def reclaim_job(value: ReclaimJob) -> pb.ReclaimJob:
    steps = []
    for s in value.steps:
        step = pb.ReclaimStep(
            seq=s.seq,
            tier=pb.ReclaimTier.Value(f"RECLAIM_TIER_{s.planned.tier.name}"),
            reservation=_reservation_or_empty(s.planned.reservation),
            expected_blocks=s.planned.gpu_blocks,
            actual_blocks=-1 if s.actual_blocks is None else s.actual_blocks,
            cpu_bytes=s.planned.cpu_bytes,
            lossy=s.planned.lossy,
            state=pb.ReclaimStepState.Value(f"RECLAIM_STEP_STATE_{s.state.value}"),
            note=s.note or "",
        )
        if s.planned.block is not None:
            step.block.CopyFrom(block_handle(BlockHandle(*s.planned.block)))
        steps.append(step)
    return pb.ReclaimJob(
        name=names.reclaim_job_name(value.job_id),
        request_id=value.request_id,
        instance=names.instance_name(value.instance),
        tenant="" if value.target.tenant is None else names.tenant_name(value.target.tenant),
        target_blocks=value.target.target_blocks,
        max_tier=pb.ReclaimTier.Value(f"RECLAIM_TIER_{value.target.max_tier.name}"),
        min_tier=pb.ReclaimTier.Value(f"RECLAIM_TIER_{value.target.min_tier.name}"),
        dry_run=value.dry_run,
        state=pb.ReclaimJobState.Value(f"RECLAIM_JOB_STATE_{value.state.value}"),
        expected_blocks=value.expected_blocks,
        actual_blocks=value.actual_blocks,
        steps=steps,
        excluded=[
            pb.ReclaimExclusion(
                reason=e.reason.value,
                blocks=e.blocks,
                reservation=_reservation_or_empty(e.reservation),
            )
            for e in value.excluded
        ],
    )


def role(value: pb.Role.ValueType) -> Role | None:
    """The role a request names (None when unspecified or unknown)."""
    name = pb.Role.Name(value).removeprefix("ROLE_") if value in pb.Role.values() else ""
    return Role[name] if name in Role.__members__ else None


def api_key(value: ApiKey) -> pb.ApiKey:
    message = pb.ApiKey(
        name=value.name,
        display_name=value.display_name,
        role=pb.Role.Value(f"ROLE_{value.role.value}"),
        tenants=[names.tenant_name(t) for t in value.tenants],
        create_time=timestamp(value.created_at),
        creator=value.creator,
    )
    if value.revoked_at is not None:
        message.revoke_time.CopyFrom(timestamp(value.revoked_at))
    return message


def audit_event(value: AuditEvent) -> pb.AuditEvent:
    message = pb.AuditEvent(
        principal=value.principal,
        method=value.method,
        resource=value.resource,
        request_id=value.request_id,
        code=value.code,
    )
    if value.at is not None:
        message.time.CopyFrom(timestamp(value.at))
    return message
