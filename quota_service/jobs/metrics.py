"""Prometheus metrics per instance, from the ledger: every replica exports the same values (the
ledger is shared), refreshed by the maintenance loop and served on their own port.

Scrapes run in prometheus-client's thread and never touch the database; they read the last
snapshot, so a slow database cannot stall a scrape."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from quota_service.core.model import Instance
from quota_service.core.pagination import MAX_PAGE_SIZE, Page
from quota_service.store.catalog import Catalog

log = logging.getLogger(__name__)


class InstanceMetrics(Collector):
    def __init__(self, catalog: Catalog, refresh_seconds: float) -> None:
        self._catalog = catalog
        self._refresh_seconds = refresh_seconds
        self._instances: list[Instance] = []
        self._refreshed_at: float | None = None

    async def refresh(self) -> int:
        """Re-read every instance when the snapshot is older than the refresh interval."""
        now = asyncio.get_running_loop().time()
        if self._refreshed_at is not None and now - self._refreshed_at < self._refresh_seconds:
            return 0
        instances: list[Instance] = []
        while True:
            after = instances[-1].spec.instance if instances else None
            page = await self._catalog.list_instances(Page(MAX_PAGE_SIZE, after))
            instances += page
            if len(page) < MAX_PAGE_SIZE:
                break
        self._instances, self._refreshed_at = instances, now
        return 0  # a refresh ends nothing: the maintenance loop logs only work done

    def collect(self) -> Iterator[Metric]:
        instances = self._instances  # one snapshot for the whole scrape
        blocks = GaugeMetricFamily(
            "kvquota_instance_blocks",
            "Block slots of an instance by state in the ledger; they add up to its capacity.",
            labels=["instance", "state"],
        )
        live = GaugeMetricFamily(
            "kvquota_instance_live_reservations",
            "Reservations the ledger holds live on the instance.",
            labels=["instance"],
        )
        running = GaugeMetricFamily(
            "kvquota_instance_engine_requests_running",
            "vllm:num_requests_running as last read from the instance's engine.",
            labels=["instance"],
        )
        drift = CounterMetricFamily(
            "kvquota_instance_drift_blocks",
            "Blocks the engine evicted while the ledger still referenced them.",
            labels=["instance"],
        )
        resyncs = CounterMetricFamily(
            "kvquota_instance_engine_resyncs",
            "Times the ledger started the instance's cache again from empty (restart, gap).",
            labels=["instance"],
        )
        for i in instances:
            name = i.spec.instance
            for state, count in (
                ("in_use", i.blocks_in_use),
                ("cached", i.cached_blocks),
                ("free", i.free_blocks),
                ("pinned", i.pinned_blocks),
            ):
                blocks.add_metric([name, state], count)
            live.add_metric([name], i.live_reservations)
            if i.engine_requests_running is not None:
                running.add_metric([name], i.engine_requests_running)
            drift.add_metric([name], i.drift_blocks)
            resyncs.add_metric([name], i.engine_resyncs)
        yield from (blocks, live, running, drift, resyncs)


def serve_metrics(listen: str, collector: Collector) -> WSGIServer:
    """Serve /metrics on `listen` ("host:port"; port 0 picks a free one) in a thread."""
    host, port = listen.rsplit(":", 1)
    registry = CollectorRegistry()
    registry.register(collector)
    server, _ = start_http_server(int(port), host, registry)
    log.info("serving Prometheus metrics on %s:%d", host, server.server_port)
    return server
