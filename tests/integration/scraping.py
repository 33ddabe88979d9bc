"""Reading the Prometheus exporter the way Prometheus does: over HTTP, parsed by
prometheus-client's own text parser; and a real server to scrape."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import replace

import grpc
import httpx
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from quota_service.api import server
from quota_service.config import Settings

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def key(name: str, **labels: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    return name, tuple(sorted(labels.items()))


async def body(url: str) -> str:
    async with httpx.AsyncClient() as client:
        return (await client.get(url)).text


def samples_of(text: str) -> Samples:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("kvquota_")
    }


async def scrape(url: str) -> Samples:
    return samples_of(await body(url))


def matching(samples: Samples, name: str, **labels: str) -> list[Sample]:
    """Every sample of `name` whose labels include `labels`."""
    return [
        Sample(n, dict(ls), v, None, None)
        for (n, ls), v in samples.items()
        if n == name and labels.items() <= dict(ls).items()
    ]


async def until(condition: Callable[[], Awaitable[bool]], seconds: float = 10.0) -> None:
    """Wait for a condition that must come true (the bound only stops a broken test)."""
    for _ in range(int(seconds * 20)):
        if await condition():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the condition never held")


@asynccontextmanager
async def serving(
    settings: Settings, database_url: str
) -> AsyncIterator[tuple[grpc.aio.Channel, str]]:
    """A real server whose ledger snapshot is always fresh and whose reclaim policy stays
    quiet (no job of its own among the test's); yields a channel and the /metrics URL."""
    quiet = replace(settings, metrics_refresh_seconds=0.01, reclaim_policy_max_tier="none")
    running = await server.start(quiet, database_url)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            yield channel, f"http://127.0.0.1:{running.metrics_port}/metrics"
    finally:
        await running.stop(0)
