"""The event loop a server process runs on.

uvloop (libuv) by default: every call's way through gRPC, the owners' commits and PostgreSQL's
replies is event-loop work, and uvloop's costs less (about a tenth of the server's CPU per
Admit+Release, and of the bare gRPC floor's, in bench.suite). asyncio's own loop is the
fall-back (KVQUOTA_EVENT_LOOP=asyncio), for a platform without uvloop or to rule it out.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

LOOPS = ("uvloop", "asyncio")


def run(main: Coroutine[Any, Any, T], loop: str) -> T:
    """Run `main` to its end on a new loop of the kind named (one of LOOPS)."""
    factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    if loop == "uvloop":
        import uvloop

        factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)
