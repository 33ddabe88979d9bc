"""Release follows the engine: a reservation an engine runs keeps its blocks until the engine
confirmed the abort, or until the hard timeout (ENGINE_UNREACHABLE)."""

from __future__ import annotations

import asyncio
import socket

from sqlalchemy.ext.asyncio import AsyncEngine

from quota_service.config import Settings
from quota_service.core import catalog
from quota_service.core.model import EndReason, EngineEndpoints, ReservationState
from quota_service.jobs.termination import Termination
from quota_service.store.catalog import Catalog
from quota_service.store.ledger import Ledger
from tests.integration.invariants import assert_invariants
from tests.integration.ledger_fixtures import add_tenant, counters, request


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # nothing listens there once it is closed


async def test_an_unreachable_engine_keeps_the_blocks_until_the_hard_timeout(
    engine: AsyncEngine, settings: Settings
) -> None:
    unreachable = EngineEndpoints(f"http://127.0.0.1:{closed_port()}")
    spec = catalog.instance_spec("gpu-0", "m", None, 16, 8192, None, 64, engine=unreachable)
    await Catalog(engine).register_instance(spec)
    await add_tenant(engine, "acme")
    ledger = Ledger(engine, settings.admission_limits)
    termination = Termination(ledger, abort_timeout_seconds=0.5, hard_timeout_seconds=2.0)
    await ledger.admit(request("cancelled", 100, 50))
    await ledger.admit(request("lapsing", 100, 50, lease_ttl=1.0))

    kept = await termination.end("acme", "cancelled", EndReason.CANCELLED)
    assert kept.state is ReservationState.ADMITTED  # the engine may still be generating
    await asyncio.sleep(1.1)
    assert await ledger.reap_expired(10) == 0  # not the ledger's alone to end: it has an engine
    assert await termination.sweep(10) == 0  # the lapsed lease's abort is now pending too
    assert (await counters(engine))["instance:gpu-0"]["blocks_in_use"] == 20  # 10 each
    await asyncio.sleep(2.5)  # both aborts have been pending longer than the hard timeout
    assert await termination.sweep(10) == 2
    for name in ("cancelled", "lapsing"):
        ended = await ledger.get("acme", name)
        assert (ended.state, ended.end_reason) == (
            ReservationState.ENDED,
            EndReason.ENGINE_UNREACHABLE,
        )
    assert (await counters(engine))["instance:gpu-0"]["blocks_in_use"] == 0
    # A Release needs no abort: the engine has finished.
    await ledger.admit(request("done", 100, 50))
    released = await termination.end("acme", "done", EndReason.RELEASED, 3)
    assert released.end_reason is EndReason.RELEASED
    await termination.close()
    await assert_invariants(engine)


async def test_a_silent_engine_is_retried_with_backoff_not_for_every_request(
    engine: AsyncEngine, settings: Settings
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
    await Catalog(engine).register_instance(spec)
    await add_tenant(engine, "acme")
    ledger = Ledger(engine, settings.admission_limits)
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
