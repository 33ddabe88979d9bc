"""AdminService: tenants, quotas and instances, for operators."""

from __future__ import annotations

from typing import Any

import grpc

from kvquota.v1 import admin_pb2 as pb
from kvquota.v1 import admin_pb2_grpc, resources_pb2
from quota_service.api import convert
from quota_service.core import catalog, pagination
from quota_service.core.model import TenantState
from quota_service.core.names import instance_id, tenant_id
from quota_service.store.catalog import Catalog

Context = grpc.aio.ServicerContext[Any, Any]


class AdminServicer(admin_pb2_grpc.AdminServiceServicer):
    def __init__(self, catalog_store: Catalog) -> None:
        self._catalog = catalog_store

    async def CreateTenant(
        self, request: pb.CreateTenantRequest, context: Context
    ) -> resources_pb2.Tenant:
        given = request.tenant
        weight = given.weight or 1
        quota = convert.quota(given.quota)
        catalog.check_new_tenant(request.tenant_id, given.display_name, weight, quota)
        created = await self._catalog.create_tenant(
            request.tenant_id, given.display_name, weight, quota
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
        name = tenant_id(given.name, "tenant.name")
        changes = catalog.tenant_changes(
            list(request.update_mask.paths),
            given.display_name,
            given.weight,
            convert.quota(given.quota),
        )
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
        has_geometry = request.HasField("geometry")
        capacity = request.WhichOneof("capacity")
        spec = catalog.instance_spec(
            instance=request.instance_id,
            model=request.model,
            kv_geometry=convert.kv_geometry(request.geometry) if has_geometry else None,
            block_size=request.block_size,
            max_model_len=request.max_model_len,
            budget=(
                convert.memory_budget(request.memory_budget)
                if capacity == "memory_budget"
                else None
            ),
            num_gpu_blocks=request.num_gpu_blocks if capacity == "num_gpu_blocks" else None,
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
