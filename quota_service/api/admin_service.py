"""AdminService: tenants, quotas and instances, for operators."""

from __future__ import annotations

from typing import Any

import grpc
import httpx

from kvquota.v1 import admin_pb2 as pb
from kvquota.v1 import admin_pb2_grpc, resources_pb2
from quota_service.api import convert
from quota_service.api.auth import current_principal
from quota_service.core import access, catalog, names, pagination, pins, reclaim
from quota_service.core.errors import (
    FieldViolation,
    KvQuotaError,
    invalid_request,
    quoted,
    refuse_invalid,
)
from quota_service.core.model import DEFAULT_MAX_QUEUED_REQUESTS, QueueBounds, TenantState
from quota_service.core.names import instance_id, tenant_id
from quota_service.core.reasons import Reason
from quota_service.core.reclaim import ReclaimTarget, Tier
from quota_service.engine.vllm.http import EngineDescription, MetricsError, VllmHttp
from quota_service.owner.owned_inspection import OwnedInspection
from quota_service.owner.owned_offboarding import OwnedOffboarding
from quota_service.owner.owned_pins import OwnedPins
from quota_service.owner.owned_reclaim import OwnedReclaimJobs
from quota_service.store.access import ApiKeys, AuditLog
from quota_service.store.catalog import Catalog

Context = grpc.aio.ServicerContext[Any, Any]
# Principals and method names are far shorter; a longer filter can match nothing.
MAX_AUDIT_FILTER = 100
# Differences CheckInstance lists unless asked otherwise, and at most.
DEFAULT_DIFFERENCES = 100
MAX_DIFFERENCES = 1000


async def describe_engine(url: str) -> EngineDescription:
    http = VllmHttp(url)
    try:
        return await http.describe()
    except (httpx.HTTPError, MetricsError, KeyError, IndexError, ValueError) as exc:
        raise KvQuotaError(
            Reason.ENGINE_UNREACHABLE,
            f"cannot read the engine at {url}: {quoted(str(exc))}",
            metadata={"engineUrl": url},
            retry_delay_seconds=1.0,
        ) from None
    finally:
        await http.close()


class AdminServicer(admin_pb2_grpc.AdminServiceServicer):
    def __init__(
        self,
        catalog_store: Catalog,
        pins: OwnedPins,
        offboarding: OwnedOffboarding,
        inspection: OwnedInspection,
        reclaim: OwnedReclaimJobs,
        api_keys: ApiKeys,
        audit: AuditLog,
    ) -> None:
        self._catalog = catalog_store
        self._pins = pins
        self._offboarding = offboarding
        self._inspection = inspection
        self._reclaim = reclaim
        self._api_keys = api_keys
        self._audit = audit

    async def CreateTenant(
        self, request: pb.CreateTenantRequest, context: Context
    ) -> resources_pb2.Tenant:
        given = request.tenant
        weight = given.weight or 1
        quota = convert.quota(given.quota)
        catalog.check_new_tenant(request.tenant_id, given.display_name, weight, quota)
        created = await self._catalog.create_tenant(
            request.tenant_id, given.display_name, weight, quota, given.shadow_mode
        )
        return convert.tenant(created)

    async def GetTenant(
        self, request: pb.GetTenantRequest, context: Context
    ) -> resources_pb2.Tenant:
        return convert.tenant(await self._catalog.get_tenant(tenant_id(request.name)))

    async def ListTenants(
        self, request: pb.ListTenantsRequest, context: Context
    ) -> pb.ListTenantsResponse:
        page = pagination.page(request.page_size, request.page_token)
        tenants = await self._catalog.list_tenants(page)
        return pb.ListTenantsResponse(
            tenants=[convert.tenant(t) for t in tenants],
            next_page_token=pagination.next_token([t.tenant for t in tenants], page.size),
        )

    async def UpdateTenant(
        self, request: pb.UpdateTenantRequest, context: Context
    ) -> resources_pb2.Tenant:
        given = request.tenant
        name, violation = names.parse_child(given.name, "tenants", "tenant.name")
        changes = catalog.tenant_changes(
            list(request.update_mask.paths),
            given.display_name,
            given.weight,
            convert.quota(given.quota),
            given.shared_namespace,
            given.shadow_mode,
            found=[violation] if violation else [],
        )
        assert name is not None
        return convert.tenant(await self._catalog.update_tenant(name, changes))

    async def SuspendTenant(
        self, request: pb.SuspendTenantRequest, context: Context
    ) -> resources_pb2.Tenant:
        name = tenant_id(request.name)
        return convert.tenant(await self._catalog.set_tenant_state(name, TenantState.SUSPENDED))

    async def ResumeTenant(
        self, request: pb.ResumeTenantRequest, context: Context
    ) -> resources_pb2.Tenant:
        name = tenant_id(request.name)
        return convert.tenant(await self._catalog.set_tenant_state(name, TenantState.ACTIVE))

    async def RegisterInstance(
        self, request: pb.RegisterInstanceRequest, context: Context
    ) -> resources_pb2.Instance:
        # Every field is checked before anything is refused: the caller hears of every fault.
        found: list[FieldViolation] = []
        capacity = request.WhichOneof("capacity")
        engine = None
        if request.HasField("engine"):
            engine = convert.engine_endpoints(request.engine, found)
        kv_geometry = None
        if request.HasField("geometry"):
            kv_geometry = convert.kv_geometry(request.geometry, found)
        budget = None
        if capacity == "memory_budget":
            budget = convert.memory_budget(request.memory_budget, found)
        target_ttft = convert.seconds(request.target_ttft, "target_ttft", found)
        model, block_size, max_model_len = request.model, request.block_size, request.max_model_len
        num_gpu_blocks = request.num_gpu_blocks if capacity == "num_gpu_blocks" else None
        hash_algo = convert.hash_algo(request.hash_algo, found)
        if capacity is None and engine is not None and not found:
            # A live engine: what it really has, rather than what the operator thinks it has.
            described = await describe_engine(engine.url)
            model = model or described.model
            block_size = described.metrics.block_size
            max_model_len = max_model_len or described.max_model_len
            num_gpu_blocks = described.metrics.usable_blocks
            hash_algo = convert.engine_hash_algo(described.metrics.prefix_caching_hash_algo)
        spec = catalog.instance_spec(
            instance=request.instance_id,
            model=model,
            kv_geometry=kv_geometry,
            block_size=block_size,
            max_model_len=max_model_len,
            budget=budget,
            num_gpu_blocks=num_gpu_blocks,
            hash_algo=hash_algo,
            engine=engine,
            queue=QueueBounds(
                max_queued_requests=request.max_queued_requests or DEFAULT_MAX_QUEUED_REQUESTS,
                target_ttft_seconds=target_ttft or 0.0,
                prefill_tokens_per_second=request.prefill_tokens_per_second,
            ),
            found=found,
        )
        return convert.instance(await self._catalog.register_instance(spec))

    async def GetInstance(
        self, request: pb.GetInstanceRequest, context: Context
    ) -> resources_pb2.Instance:
        return convert.instance(await self._catalog.get_instance(instance_id(request.name)))

    async def ListInstances(
        self, request: pb.ListInstancesRequest, context: Context
    ) -> pb.ListInstancesResponse:
        page = pagination.page(request.page_size, request.page_token)
        instances = await self._catalog.list_instances(page)
        return pb.ListInstancesResponse(
            instances=[convert.instance(i) for i in instances],
            next_page_token=pagination.next_token([i.spec.instance for i in instances], page.size),
        )

    async def DrainInstance(
        self, request: pb.DrainInstanceRequest, context: Context
    ) -> resources_pb2.Instance:
        return convert.instance(await self._catalog.drain_instance(instance_id(request.name)))

    async def DeleteTenant(
        self, request: pb.DeleteTenantRequest, context: Context
    ) -> pb.DeleteTenantResponse:
        tenant = tenant_id(request.name)
        report = await self._offboarding.delete_tenant(tenant)
        return pb.DeleteTenantResponse(
            tenant=convert.tenant(await self._catalog.get_tenant(tenant)),
            report=pb.OffboardingReport(
                freed_blocks=report.freed_blocks,
                shared_blocks=report.shared_blocks,
                pinned_by_others=report.pinned_by_others,
                awaiting_engine_aborts=report.awaiting_engine_aborts,
            ),
        )

    async def RotateCacheSalt(
        self, request: pb.RotateCacheSaltRequest, context: Context
    ) -> pb.RotateCacheSaltResponse:
        collection, owner_id = names.owner(request.name, "name")
        await self._catalog.rotate_salt(collection, owner_id)
        return pb.RotateCacheSaltResponse()

    async def GetTenantUsage(
        self, request: pb.GetTenantUsageRequest, context: Context
    ) -> pb.TenantUsageReport:
        tenant = tenant_id(request.name)
        current = convert.tenant(await self._catalog.get_tenant(tenant))
        per_instance = await self._inspection.tenant_usage(tenant)
        return pb.TenantUsageReport(
            tenant=current.name,
            usage=current.usage,
            quota=current.quota,
            instances=[
                pb.InstanceUsage(
                    instance=names.instance_name(u.instance),
                    blocks_in_use=u.blocks_in_use,
                    pinned_blocks=u.pinned_blocks,
                    shared_blocks=u.shared_blocks,
                    live_reservations=u.live_reservations,
                    tokens_in_flight=u.tokens_in_flight,
                )
                for u in per_instance
            ],
        )

    async def CreateNamespace(
        self, request: pb.CreateNamespaceRequest, context: Context
    ) -> resources_pb2.Namespace:
        violation = names.check_resource_id(request.namespace_id, "namespace_id")
        if violation:
            raise invalid_request([violation])
        namespace, created = await self._catalog.create_namespace(request.namespace_id)
        return resources_pb2.Namespace(
            name=names.namespace_name(namespace), create_time=convert.timestamp(created)
        )

    async def ListNamespaces(
        self, request: pb.ListNamespacesRequest, context: Context
    ) -> pb.ListNamespacesResponse:
        page = pagination.page(request.page_size, request.page_token)
        found = await self._catalog.list_namespaces(page)
        return pb.ListNamespacesResponse(
            namespaces=[
                resources_pb2.Namespace(
                    name=names.namespace_name(n), create_time=convert.timestamp(created)
                )
                for n, created in found
            ],
            next_page_token=pagination.next_token([n for n, _ in found], page.size),
        )

    async def PinPrefix(self, request: pb.PinPrefixRequest, context: Context) -> resources_pb2.Pin:
        instance, violation = names.parse_child(request.instance, "instances", "instance")
        refuse_invalid(
            [
                names.owner_violation(request.parent),
                names.check_resource_id(request.pin_id, "pin_id"),
                violation,
                *pins.token_violations(request.token_ids),
            ]
        )
        assert instance is not None
        pinned = await self._pins.pin(
            request.parent, request.pin_id, instance, list(request.token_ids)
        )
        return convert.pin(pinned)

    async def UnpinPrefix(
        self, request: pb.UnpinPrefixRequest, context: Context
    ) -> resources_pb2.Pin:
        owner, pin_id = names.pin_key(request.name)
        return convert.pin(await self._pins.unpin(owner, pin_id))

    async def ListPins(self, request: pb.ListPinsRequest, context: Context) -> pb.ListPinsResponse:
        page, violations = pagination.parse_page(request.page_size, request.page_token)
        refuse_invalid([names.owner_violation(request.parent), *violations])
        assert page is not None
        found = await self._pins.list_pins(request.parent, page)
        return pb.ListPinsResponse(
            pins=[convert.pin(p) for p in found],
            next_page_token=pagination.next_token([p.pin_id for p in found], page.size),
        )

    async def ListBlocks(
        self, request: pb.ListBlocksRequest, context: Context
    ) -> pb.ListBlocksResponse:
        instance, instance_violation = names.parse_child(request.parent, "instances", "parent")
        tenant, tenant_violation = names.parse_filter(request.tenant, "tenants", "tenant")
        # Blocks are paged by their ids: a token carries a number.
        page, violations = pagination.parse_page(
            request.page_size, request.page_token, numeric=True
        )
        state = convert.block_state(request.state, violations)
        refuse_invalid([instance_violation, tenant_violation, *violations])
        assert instance is not None and page is not None
        found = await self._inspection.list_blocks(instance, tenant, state, page)
        return pb.ListBlocksResponse(
            blocks=[convert.block(b) for b in found],
            next_page_token=pagination.next_token([str(b.block_id) for b in found], page.size),
        )

    async def CheckInstance(
        self, request: pb.CheckInstanceRequest, context: Context
    ) -> pb.CheckInstanceResponse:
        instance, name_violation = names.parse_child(request.name, "instances", "name")
        limit = request.max_differences or DEFAULT_DIFFERENCES
        limit_violation = None
        if not 1 <= limit <= MAX_DIFFERENCES:
            limit_violation = FieldViolation(
                "max_differences", f"must be 1 to {MAX_DIFFERENCES}, got {limit}"
            )
        refuse_invalid([name_violation, limit_violation])
        assert instance is not None
        epoch, found = await self._inspection.check_instance(instance)
        return pb.CheckInstanceResponse(
            name=names.instance_name(instance),
            epoch=epoch,
            differences=[
                pb.InstanceDifference(subject=d.subject, memory=d.memory, record=d.record)
                for d in found[:limit]
            ],
            more_differences=len(found) > limit,
        )

    async def CreateReclaimJob(
        self, request: pb.CreateReclaimJobRequest, context: Context
    ) -> resources_pb2.ReclaimJob:
        instance, instance_violation = names.parse_child(request.instance, "instances", "instance")
        tenant, tenant_violation = names.parse_filter(request.tenant, "tenants", "tenant")
        max_tier = convert.reclaim_tier(request.max_tier)
        # Unset, the job may start with freeing cached blocks.
        min_tier = convert.reclaim_tier(request.min_tier) if request.min_tier else Tier.FREE
        refuse_invalid(
            [
                instance_violation,
                tenant_violation,
                names.check_request_id(request.request_id, "request_id"),
                *reclaim.request_violations(
                    request.target_blocks, request.target_bytes, max_tier, min_tier
                ),
            ]
        )
        assert instance is not None and max_tier is not None and min_tier is not None
        target_blocks = request.target_blocks
        if request.target_bytes:
            spec = (await self._catalog.get_instance(instance)).spec
            if spec.bytes_per_block is None:
                raise invalid_request(
                    [FieldViolation("target_bytes", "the instance has no geometry; give blocks")]
                )
            target_blocks = -(-request.target_bytes // spec.bytes_per_block)
        target = ReclaimTarget(target_blocks, max_tier, tenant, min_tier)
        job = await self._reclaim.create(request.request_id, instance, target, request.dry_run)
        return convert.reclaim_job(job)

    async def GetReclaimJob(
        self, request: pb.GetReclaimJobRequest, context: Context
    ) -> resources_pb2.ReclaimJob:
        return convert.reclaim_job(await self._reclaim.get(names.reclaim_job_id(request.name)))

    async def ListReclaimJobs(
        self, request: pb.ListReclaimJobsRequest, context: Context
    ) -> pb.ListReclaimJobsResponse:
        instance, violation = names.parse_filter(request.instance, "instances", "instance")
        page, violations = pagination.parse_page(request.page_size, request.page_token)
        refuse_invalid([violation, *violations])
        assert page is not None
        jobs = await self._reclaim.list_jobs(page, instance)
        return pb.ListReclaimJobsResponse(
            reclaim_jobs=[convert.reclaim_job(j) for j in jobs],
            next_page_token=pagination.next_token([j.job_id for j in jobs], page.size),
        )

    async def CancelReclaimJob(
        self, request: pb.CancelReclaimJobRequest, context: Context
    ) -> resources_pb2.ReclaimJob:
        job_id = names.reclaim_job_id(request.name)
        return convert.reclaim_job(await self._reclaim.cancel(job_id))

    async def CreateApiKey(
        self, request: pb.CreateApiKeyRequest, context: Context
    ) -> pb.CreateApiKeyResponse:
        role = convert.role(request.role)
        tenants = access.new_key_tenants(request.display_name, role, request.tenants)
        assert role is not None
        key, secret = await self._api_keys.create(
            request.display_name, role, tenants, current_principal.get().name
        )
        return pb.CreateApiKeyResponse(api_key=convert.api_key(key), secret=secret)

    async def ListApiKeys(
        self, request: pb.ListApiKeysRequest, context: Context
    ) -> pb.ListApiKeysResponse:
        page = pagination.page(request.page_size, request.page_token)
        keys = await self._api_keys.list(page, request.show_revoked)
        return pb.ListApiKeysResponse(
            api_keys=[convert.api_key(k) for k in keys],
            next_page_token=pagination.next_token([k.key_id for k in keys], page.size),
        )

    async def RevokeApiKey(
        self, request: pb.RevokeApiKeyRequest, context: Context
    ) -> resources_pb2.ApiKey:
        key_id = names.api_key_id(request.name)
        return convert.api_key(await self._api_keys.revoke(key_id))

    async def ListAuditEvents(
        self, request: pb.ListAuditEventsRequest, context: Context
    ) -> pb.ListAuditEventsResponse:
        # Events are paged by their ids: a token carries a number.
        page, violations = pagination.parse_page(
            request.page_size, request.page_token, numeric=True
        )
        violations += [
            FieldViolation(field, f"at most {MAX_AUDIT_FILTER} characters")
            for field, value in (("principal", request.principal), ("method", request.method))
            if len(value) > MAX_AUDIT_FILTER
        ]
        refuse_invalid(violations)
        assert page is not None
        events = await self._audit.list(page, request.principal, request.method)
        return pb.ListAuditEventsResponse(
            audit_events=[convert.audit_event(e) for _, e in events],
            next_page_token=pagination.next_token([str(i) for i, _ in events], page.size),
        )
