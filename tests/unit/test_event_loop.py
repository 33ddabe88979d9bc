"""The server's event loop is the one its settings name."""

from __future__ import annotations

import asyncio

import pytest

from quota_service import event_loop


@pytest.mark.parametrize("loop", event_loop.LOOPS)
def test_runs_on_the_loop_named(loop: str) -> None:
    async def running_loop() -> str:
        return type(asyncio.get_running_loop()).__module__

    assert event_loop.run(running_loop(), loop).split(".")[0] == loop
