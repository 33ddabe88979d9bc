"""Offboarding stops what engines run before it frees their blocks, as a cancel does: the
tenant's requests an engine may be running are aborted there first, and when the engine does
not answer they keep their blocks (the tenant stays DELETING) until the abort is confirmed or
its hard timeout passes. The real vLLM side is tests/engines/test_vllm_contract.py."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from quota_service.api.server import HotPath
from quota_service.core import catalog
from quota_service.core.errors import Code, KvQuotaError
from quota_service.core.model import (
    EndReason,
    EngineEndpoints,
    ReservationState,
    TenantState,
)
from quota_service.enforcement.termination import Termination
from quota_service.engine.vllm.http import vllm_request_ids
from quota_service.owner.owned_offboarding import FORWARDING_SECONDS
from tests.integration.engine_stubs import abort_endpoint, closed_port
from tests.integration.invariants import assert_invariants
from tests.integration.ledger_fixtures import (
    add_instance,
    add_tenant,
    crash_after_batches,
    derived_counters,
    owned_offboarding,
    request,
)

RUNNING = ("r0", "r1", "r2")


async def tenant_on_engine(engine: AsyncEngine, owned: HotPath, url: str) -> None:
    """Tenant "gone" with three running reservations and a suspended one on "gpu-0", whose
    engine is at `url`, and one on "bare" (no engine); tenant "stay" runs one on "gpu-0"."""
    spec = catalog.instance_spec(
        "gpu-0", "m", None, 16, 8192, None, 256, engine=EngineEndpoints(url)
    )
    await owned.catalog.register_instance(spec)
    await add_instance(engine, "bare", 256)
    await add_tenant(engine, "gone")
    await add_tenant(engine, "stay")
    ledger = owned.ledger
    for request_id in (*RUNNING, "idle"):
        await ledger.admit(request(request_id, 100, 60, tenant="gone"))
    await ledger.suspend("gone", "idle", ())
    await ledger.admit(request("elsewhere", 100, 60, tenant="gone", instance="bare"))
    await ledger.admit(request("other", 100, 60, tenant="stay"))


async def test_the_engine_aborts_the_tenants_running_requests_before_their_blocks_are_freed(
    engine: AsyncEngine, owned: HotPath
) -> None:
    aborted: list[list[str]] = []
    states_at_abort: list[set[ReservationState]] = []
    aborted_at: list[datetime] = []
    ledger = owned.ledger

    async def on_abort(ids: list[str]) -> None:
        aborted.append(ids)
        aborted_at.append(datetime.now(UTC))
        states = {(await ledger.get("gone", r)).state for r in RUNNING}
        states_at_abort.append(states)

    async with abort_endpoint(on_abort) as url:
        await tenant_on_engine(engine, owned, url)
        termination = Termination(ledger, abort_timeout_seconds=30.0, hard_timeout_seconds=60.0)
        try:
            report = await owned.offboarding(engine, termination).delete_tenant("gone")
        finally:
            await termination.close()

    # Only the running ones, in one call (sent twice), and while they still held their blocks.
    expected = sorted(i for r in RUNNING for i in vllm_request_ids(r))
    assert [sorted(ids) for ids in aborted] == [expected, expected]
    assert states_at_abort == [{ReservationState.ADMITTED}] * 2
    # Admitted a moment ago, the requests may not have reached the engine yet: the abort waits
    # the gateway's forwarding time after the youngest admission.
    admitted = [(await ledger.get("gone", r)).admitted_at for r in RUNNING]
    youngest = max(a for a in admitted if a is not None)
    assert aborted_at[0] >= youngest + timedelta(seconds=FORWARDING_SECONDS)
    assert (report.awaiting_engine_aborts, report.finished) == (0, True)
    for request_id in (*RUNNING, "idle", "elsewhere"):
        ended = await ledger.get("gone", request_id)
        assert (ended.state, ended.end_reason) == (
            ReservationState.ENDED,
            EndReason.TENANT_DELETED,
        )
    assert (await ledger.get("stay", "other")).state is ReservationState.ADMITTED
    assert (await owned.catalog.get_tenant("gone")).state is TenantState.DELETED
    await assert_invariants(engine)


async def test_an_unreachable_engine_holds_the_offboarding_until_the_hard_timeout(
    engine: AsyncEngine, owned: HotPath
) -> None:
    await tenant_on_engine(engine, owned, f"http://127.0.0.1:{closed_port()}")
    ledger = owned.ledger
    termination = Termination(ledger, abort_timeout_seconds=0.5, hard_timeout_seconds=1.5)
    offboarding = owned.offboarding(engine, termination)
    try:
        report = await offboarding.delete_tenant("gone")
        # The engine may still be generating for the running ones: they keep their blocks.
        assert (report.awaiting_engine_aborts, report.finished) == (3, False)
        assert (await owned.catalog.get_tenant("gone")).state is TenantState.DELETING
        for request_id in RUNNING:
            assert (await ledger.get("gone", request_id)).state is ReservationState.ADMITTED
        for request_id in ("idle", "elsewhere"):  # nothing runs them
            assert (await ledger.get("gone", request_id)).end_reason is EndReason.TENANT_DELETED
        held = (await derived_counters(engine, owned))["tenant:gone"]["blocks_in_use"]
        assert held == 3 * 10  # ceil(160 / 16) blocks each
        assert await offboarding.resume_all() == 0  # still waiting, nothing re-sent by it
        await assert_invariants(engine)

        await asyncio.sleep(1.6)  # past the hard timeout: the blocks come back anyway
        assert await termination.sweep(10) == 3
        assert await offboarding.resume_all() == 1
    finally:
        await termination.close()
    for request_id in RUNNING:
        ended = await ledger.get("gone", request_id)
        assert ended.end_reason is EndReason.ENGINE_UNREACHABLE
    assert (await owned.catalog.get_tenant("gone")).state is TenantState.DELETED
    assert (await derived_counters(engine, owned))["tenant:gone"]["blocks_in_use"] == 0
    assert (await ledger.get("stay", "other")).state is ReservationState.ADMITTED
    await assert_invariants(engine)


async def test_an_idle_session_of_a_tenant_being_deleted_cannot_resume(
    engine: AsyncEngine, owned: HotPath, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Offboarding ends an idle session without an abort (nothing runs it): a resume between
    the start of the offboarding and its end must not start it again."""
    await add_instance(engine)
    await add_tenant(engine, "gone")
    ledger = owned.ledger
    await ledger.admit(request("idle", 100, 60, tenant="gone"))
    await ledger.suspend("gone", "idle", ())
    crashing = owned_offboarding(engine, owned)
    crash_after_batches(crashing, monkeypatch, 0)
    with pytest.raises(RuntimeError):
        await crashing.delete_tenant("gone")
    assert (await owned.catalog.get_tenant("gone")).state is TenantState.DELETING

    with pytest.raises(KvQuotaError) as refused:
        await ledger.resume("gone", "idle", 0.0)
    assert (refused.value.code, refused.value.reason) == (
        Code.FAILED_PRECONDITION,
        "TENANT_SUSPENDED",
    )
    assert refused.value.metadata["state"] == "DELETING"
    assert (await ledger.get("gone", "idle")).suspended_at is not None  # unchanged

    assert await owned_offboarding(engine, owned).resume_all() == 1
    assert (await ledger.get("gone", "idle")).end_reason is EndReason.TENANT_DELETED
    await assert_invariants(engine)


async def test_blocks_cached_by_an_abort_confirmed_mid_pass_are_freed_before_it_finishes(
    engine: AsyncEngine, owned: HotPath, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sweep may end a pending reservation while an offboarding pass is between freeing the
    tenant's cache and finishing: its blocks are then cached under the tenant's salt, and the
    tenant must not become DELETED with them."""
    spec = catalog.instance_spec(
        "gpu-0",
        "m",
        None,
        16,
        8192,
        None,
        64,
        engine=EngineEndpoints(f"http://127.0.0.1:{closed_port()}"),
    )
    await owned.catalog.register_instance(spec)
    await add_tenant(engine, "gone")
    ledger = owned.ledger
    prompt = tuple(range(1, 65))  # 4 full blocks, hashed under the tenant's salt
    await ledger.admit(replace(request("r0", 64, 16, tenant="gone"), prompt_token_ids=prompt))
    offboarding = owned_offboarding(engine, owned)
    assert (await offboarding.delete_tenant("gone")).awaiting_engine_aborts == 1

    free_own_cache = offboarding._free_own_cache

    async def then_the_sweep_ends_it(scope: str) -> None:
        await free_own_cache(scope)
        await ledger.end("gone", "r0", EndReason.ENGINE_UNREACHABLE)

    monkeypatch.setattr(offboarding, "_free_own_cache", then_the_sweep_ends_it)
    report = await offboarding.delete_tenant("gone")
    assert (report.awaiting_engine_aborts, report.finished) == (0, False)
    assert (await derived_counters(engine, owned))["instance:gpu-0"]["cached_blocks"] == 4
    monkeypatch.undo()
    assert await offboarding.resume_all() == 1
    assert (await owned.catalog.get_tenant("gone")).state is TenantState.DELETED
    assert (await derived_counters(engine, owned))["instance:gpu-0"]["cached_blocks"] == 0
    await assert_invariants(engine)
