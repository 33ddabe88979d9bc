"""Release follows the engine: a reservation an engine runs keeps its blocks until the engine
confirmed the abort, or until the hard timeout (ENGINE_UNREACHABLE)."""

from __future__ import annotations

import asyncio

from sqlalchemy.ext.asyncio import AsyncEngine

from quota_service.api.server import HotPath
from quota_service.core import catalog
from quota_service.core.model import EndReason, EngineEndpoints, ReservationState
from quota_service.enforcement.termination import Termination
from quota_service.engine.vllm.http import vllm_request_ids
from tests.integration.engine_stubs import abort_endpoint, closed_port
from tests.integration.invariants import assert_invariants
from tests.integration.ledger_fixtures import add_tenant, derived_counters, request


async def test_an_unreachable_engine_keeps_the_blocks_until_the_hard_timeout(
    engine: AsyncEngine, owned: HotPath
) -> None:
    unreachable = EngineEndpoints(f"http://127.0.0.1:{closed_port()}")
    spec = catalog.instance_spec("gpu-0", "m", None, 16, 8192, None, 64, engine=unreachable)
    await owned.catalog.register_instance(spec)
    await add_tenant(engine, "acme")
    ledger = owned.ledger
    termination = Termination(ledger, abort_timeout_seconds=0.5, hard_timeout_seconds=2.0)
    await ledger.admit(request("cancelled", 100, 50))
    await ledger.admit(request("lapsing", 100, 50, lease_ttl=1.0))

    kept = await termination.end("acme", "cancelled", EndReason.CANCELLED)
    assert kept.state is ReservationState.ADMITTED  # the engine may still be generating
    await asyncio.sleep(1.1)
    assert await ledger.reap_expired(10) == 0  # not the owner's alone to end: it has an engine
    assert await termination.sweep(10) == 0  # the lapsed lease's abort is now pending too
    assert (await derived_counters(engine, owned))["instance:gpu-0"][
        "blocks_in_use"
    ] == 20  # 10 each
    await asyncio.sleep(2.5)  # both aborts have been pending longer than the hard timeout
    assert await termination.sweep(10) == 2
    for name in ("cancelled", "lapsing"):
        ended = await ledger.get("acme", name)
        assert (ended.state, ended.end_reason) == (
            ReservationState.ENDED,
            EndReason.ENGINE_UNREACHABLE,
        )
    assert (await derived_counters(engine, owned))["instance:gpu-0"]["blocks_in_use"] == 0
    # A Release needs no abort: the engine has finished.
    await ledger.admit(request("done", 100, 50))
    released = await termination.end("acme", "done", EndReason.RELEASED, 3)
    assert released.end_reason is EndReason.RELEASED
    await termination.close()
    await assert_invariants(engine)


async def test_a_silent_engine_is_retried_with_backoff_not_for_every_request(
    engine: AsyncEngine, owned: HotPath
) -> None:
    """An engine that accepts connections but never answers: each abort costs a timeout, so after
    one fails the others on that engine wait for the backoff instead of piling up."""
    connections = 0

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        await reader.read()  # until the client gives up
        writer.close()
        await writer.wait_closed()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    spec = catalog.instance_spec(
        "gpu-0", "m", None, 16, 8192, None, 64, engine=EngineEndpoints(f"http://127.0.0.1:{port}")
    )
    await owned.catalog.register_instance(spec)
    await add_tenant(engine, "acme")
    ledger = owned.ledger
    termination = Termination(ledger, abort_timeout_seconds=0.2, hard_timeout_seconds=60.0)
    try:
        for name in ("a", "b", "c"):
            await ledger.admit(request(name, 100, 50))
        assert (await termination.end("acme", "a", EndReason.CANCELLED)).state is (
            ReservationState.ADMITTED
        )
        tried = connections
        assert tried >= 1
        for name in ("b", "c"):  # within the backoff: recorded as pending, the engine not called
            kept = await termination.end("acme", name, EndReason.CANCELLED)
            assert kept.state is ReservationState.ADMITTED
        assert await termination.sweep(10) == 0
        assert connections == tried
        await asyncio.sleep(0.6)  # past the first backoff (0.5 s): one more try, then 1 s
        assert await termination.sweep(10) == 0
        assert connections > tried
        assert [(await ledger.get("acme", n)).state for n in "abc"] == [
            ReservationState.ADMITTED
        ] * 3
    finally:
        await termination.close()
        server.close()
        await server.wait_closed()
    await assert_invariants(engine)


async def test_the_sweep_asks_each_engine_once_for_all_it_must_stop(
    engine: AsyncEngine, owned: HotPath
) -> None:
    """Lapsed leases and pending aborts on one engine are aborted in one call (sent twice, a
    moment apart), not one call per request; an idle session's lapsed lease needs none."""
    calls: list[list[str]] = []

    async def on_abort(ids: list[str]) -> None:
        calls.append(sorted(ids))

    async with abort_endpoint(on_abort) as url:
        spec = catalog.instance_spec(
            "gpu-0", "m", None, 16, 8192, None, 64, engine=EngineEndpoints(url)
        )
        await owned.catalog.register_instance(spec)
        await add_tenant(engine, "acme")
        ledger = owned.ledger
        termination = Termination(ledger, abort_timeout_seconds=30.0, hard_timeout_seconds=60.0)
        try:
            for name in ("a", "b", "c", "idle"):
                await ledger.admit(request(name, 100, 50, lease_ttl=1.0))
            await ledger.suspend("acme", "idle", ())
            await ledger.admit(request("pending", 100, 50))
            await ledger.request_aborts("acme", ["pending"], EndReason.CANCELLED)
            await asyncio.sleep(1.1)
            assert await termination.sweep(10) == 5
        finally:
            await termination.close()
    lapsed = sorted(i for r in "abc" for i in vllm_request_ids(r))
    pending = sorted(vllm_request_ids("pending"))
    assert calls == [lapsed, lapsed, pending, pending]
    ends = {n: (await ledger.get("acme", n)).end_reason for n in ("a", "idle", "pending")}
    assert ends == {
        "a": EndReason.LEASE_EXPIRED,
        "idle": EndReason.LEASE_EXPIRED,
        "pending": EndReason.CANCELLED,
    }
    await assert_invariants(engine)
