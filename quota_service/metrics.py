"""Prometheus metrics, served on their own port from one registry per server: never the global
default registry, so that several servers in one process (the tests) never collide.

Two kinds of figures, told apart by how replicas add up:

- Ledger figures (`LedgerMetrics`): per instance, per tenant, and reclaim totals, read from the
  shared ledger by the maintenance loop every `metrics_refresh_seconds`. Every replica exports
  the same values (the ledger is shared): aggregate them across replicas with max, never sum.
  Scrapes run in prometheus-client's thread and never touch the database; they read the last
  snapshot, so a slow database cannot stall a scrape.
- Process figures (`ServiceMetrics`, `PoolMetrics`): RPC latency, admissions by outcome, queue
  waits, engine event lag, the database pool. Each replica counts what it did itself: sum them.
  The engine event lag comes only from the replica that follows the instance.

No label is ever derived from a cache salt, an API key or a request id.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, TypeVar
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector
from sqlalchemy.ext.asyncio import AsyncEngine

from quota_service.core.model import Instance, TenantHoldings
from quota_service.core.pagination import MAX_PAGE_SIZE, Page
from quota_service.core.reclaim import ReclaimTally, StepState
from quota_service.owner.instance_owner import JournalStats
from quota_service.store.catalog import Catalog
from quota_service.store.database import pool_usage
from quota_service.store.inspection import RecordedUsage
from quota_service.store.reclaim import ReclaimJobs

log = logging.getLogger(__name__)

RPC_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60,
)  # fmt: skip
QUEUE_WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
EVENT_LAG_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300,
)  # fmt: skip

_Metric = TypeVar("_Metric", bound=MetricWrapperBase)


class _Children(Generic[_Metric]):
    """A labelled metric whose child for each set of label values is looked up once:
    prometheus_client's labels() takes a lock and makes a tuple of their strings every time."""

    def __init__(self, metric: _Metric) -> None:
        self._metric = metric
        self._children: dict[tuple[str, ...], _Metric] = {}

    def labels(self, *values: str) -> _Metric:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self._metric.labels(*values)
        return child


class ServiceMetrics:
    """This process's own figures, and the registry /metrics serves (with the collectors of
    the ledger snapshot and the database pool registered into it)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._rpc_duration = _Children(
            Histogram(
                "kvquota_rpc_duration_seconds",
                "Time to answer an RPC (a server stream: until it ended), by gRPC method and "
                "status.",
                ["service", "method", "code"],
                buckets=RPC_BUCKETS,
                registry=self.registry,
            )
        )
        self._admissions = _Children(
            Counter(
                "kvquota_admissions",
                "Answers to Admit and ResumeReservation: outcome admitted (at once), queued "
                "(admitted after waiting in the instance's queue), refused (with the error's "
                "reason), abandoned (the caller went away), or the state a repeat found.",
                ["method", "outcome", "reason"],
                registry=self.registry,
            )
        )
        self._queue_wait = _Children(
            Histogram(
                "kvquota_queue_wait_seconds",
                "How long a caller waited in an instance's queue for its answer, by how the wait "
                "ended: admitted, timeout, ended (cancelled or offboarded), abandoned, error.",
                ["engine_instance", "result"],
                buckets=QUEUE_WAIT_BUCKETS,
                registry=self.registry,
            )
        )
        self._event_lag = _Children(
            Histogram(
                "kvquota_engine_event_lag_seconds",
                "From an engine's KV-event batch timestamp to its application to the ledger.",
                ["engine_instance"],
                buckets=EVENT_LAG_BUCKETS,
                registry=self.registry,
            )
        )
        self._event_applied = _Children(
            Gauge(
                "kvquota_engine_event_last_batch_timestamp_seconds",
                "The engine's timestamp of the last KV-event batch this replica applied.",
                ["engine_instance"],
                registry=self.registry,
            )
        )

    def observe_rpc(self, service: str, method: str, code: str, seconds: float) -> None:
        self._rpc_duration.labels(service, method, code).observe(seconds)

    def count_admission(self, method: str, outcome: str, reason: str = "") -> None:
        self._admissions.labels(method, outcome, reason).inc()

    def observe_queue_wait(self, instance: str, result: str, seconds: float) -> None:
        self._queue_wait.labels(instance, result).observe(seconds)

    def observe_event_batch(self, instance: str, engine_timestamp: float, now: float) -> None:
        """A batch stamped `engine_timestamp` (the engine's wall clock) was applied at `now`.
        A batch without a timestamp (0) is not observed; clock skew never makes lag negative."""
        if engine_timestamp <= 0:
            return
        self._event_lag.labels(instance).observe(max(0.0, now - engine_timestamp))
        self._event_applied.labels(instance).set(engine_timestamp)


class PoolMetrics(Collector):
    """The ledger engine's connection pool, read at scrape time."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine

    def collect(self) -> Iterator[Metric]:
        usage = pool_usage(self._engine)
        if usage is None:
            return
        for name, help_text, value in (
            ("size", "Connections the ledger's pool keeps open.", usage.size),
            ("checked_out", "Pool connections in use now.", usage.checked_out),
            ("idle", "Pool connections open and waiting to be used.", usage.idle),
            ("overflow", "Connections open beyond the pool's size now.", usage.overflow),
        ):
            yield GaugeMetricFamily(f"kvquota_db_pool_{name}", help_text, value=value)


class JournalMetrics(Collector):
    """This replica's group commits, per instance it owns, read at scrape time: operations over
    batches is how many operations a commit carries (what KVQUOTA_GROUP_COMMIT_* tune). Counted
    from when this replica took the instance over."""

    def __init__(self, stats: Callable[[], Mapping[str, JournalStats]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        batches = CounterMetricFamily(
            "kvquota_journal_batches",
            "Batches (one transaction each) this replica committed for an instance it owns.",
            labels=["engine_instance"],
        )
        operations = CounterMetricFamily(
            "kvquota_journal_operations",
            "Operations those batches carried.",
            labels=["engine_instance"],
        )
        for instance, stats in sorted(self._stats().items()):
            batches.add_metric([instance], stats.batches)
            operations.add_metric([instance], stats.operations)
        yield batches
        yield operations


class LedgerMetrics(Collector):
    """Snapshot of the ledger's figures: instances, tenants, reclaim totals."""

    def __init__(
        self,
        catalog: Catalog,
        inspection: RecordedUsage,
        reclaim: ReclaimJobs,
        refresh_seconds: float,
    ) -> None:
        self._catalog = catalog
        self._inspection = inspection
        self._reclaim = reclaim
        self._refresh_seconds = refresh_seconds
        self._snapshot: tuple[list[Instance], list[TenantHoldings], list[ReclaimTally]] = (
            [],
            [],
            [],
        )
        self._refreshed_at: float | None = None
        self._refreshed_wall: float | None = None

    async def refresh(self) -> int:
        """Re-read the ledger when the snapshot is older than the refresh interval."""
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
        tenants = await self._inspection.tenant_holdings()
        tallies = await self._reclaim.tallies()
        # One assignment: a scrape sees the old snapshot or the new one, never a mix.
        self._snapshot = (instances, tenants, tallies)
        self._refreshed_at, self._refreshed_wall = now, time.time()
        return 0  # a refresh ends nothing: the maintenance loop logs only work done

    def collect(self) -> Iterator[Metric]:
        instances, tenants, tallies = self._snapshot  # one snapshot for the whole scrape
        yield from _instance_families(instances)
        yield from _tenant_families(tenants)
        yield from _reclaim_families(tallies)
        if self._refreshed_wall is not None:
            yield GaugeMetricFamily(
                "kvquota_ledger_snapshot_timestamp_seconds",
                "When this replica last read the ledger's figures (instances, tenants, reclaim).",
                value=self._refreshed_wall,
            )


def _instance_families(instances: list[Instance]) -> Iterator[Metric]:
    blocks = GaugeMetricFamily(
        "kvquota_instance_blocks",
        "Block slots of an instance by state in the ledger; they add up to its capacity.",
        labels=["engine_instance", "state"],
    )
    live = GaugeMetricFamily(
        "kvquota_instance_live_reservations",
        "Reservations the ledger holds live on the instance.",
        labels=["engine_instance"],
    )
    queued = GaugeMetricFamily(
        "kvquota_instance_queued_requests",
        "Requests waiting in the instance's queue.",
        labels=["engine_instance"],
    )
    queued_tokens = GaugeMetricFamily(
        "kvquota_instance_queued_prompt_tokens",
        "Prompt tokens of the requests waiting in the instance's queue.",
        labels=["engine_instance"],
    )
    max_queued = GaugeMetricFamily(
        "kvquota_instance_max_queued_requests",
        "The instance's queue bound: beyond it an Admit is refused QUEUE_FULL.",
        labels=["engine_instance"],
    )
    cpu_used = GaugeMetricFamily(
        "kvquota_instance_cpu_tier_used_bytes",
        "Bytes the instance's CPU tier (LMCache L1) held when last read.",
        labels=["engine_instance"],
    )
    cpu_capacity = GaugeMetricFamily(
        "kvquota_instance_cpu_tier_capacity_bytes",
        "Capacity of the instance's CPU tier (LMCache L1) when last read.",
        labels=["engine_instance"],
    )
    running = GaugeMetricFamily(
        "kvquota_instance_engine_requests_running",
        "vllm:num_requests_running as last read from the instance's engine.",
        labels=["engine_instance"],
    )
    drift = CounterMetricFamily(
        "kvquota_instance_drift_blocks",
        "Blocks the engine evicted while the ledger still referenced them.",
        labels=["engine_instance"],
    )
    resyncs = CounterMetricFamily(
        "kvquota_instance_engine_resyncs",
        "Times the ledger started the instance's cache again from empty (restart, gap).",
        labels=["engine_instance"],
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
        queued.add_metric([name], i.queued_requests)
        queued_tokens.add_metric([name], i.queued_prompt_tokens)
        max_queued.add_metric([name], i.spec.queue.max_queued_requests)
        if i.cpu_used_bytes is not None:
            cpu_used.add_metric([name], i.cpu_used_bytes)
        if i.cpu_capacity_bytes is not None:
            cpu_capacity.add_metric([name], i.cpu_capacity_bytes)
        if i.engine_requests_running is not None:
            running.add_metric([name], i.engine_requests_running)
        drift.add_metric([name], i.drift_blocks)
        resyncs.add_metric([name], i.engine_resyncs)
    yield from (blocks, live, queued, queued_tokens, max_queued, cpu_used, cpu_capacity)
    yield from (running, drift, resyncs)


def _tenant_families(tenants: list[TenantHoldings]) -> Iterator[Metric]:
    families = {
        name: GaugeMetricFamily(f"kvquota_tenant_{name}", help_text, labels=["tenant"])
        for name, help_text in (
            ("gpu_blocks", "Distinct GPU blocks the tenant's reservations and pins hold."),
            ("pinned_blocks", "GPU blocks the tenant's pins hold resident (within gpu_blocks)."),
            (
                "cpu_tier_bytes",
                "Bytes the tenant's offloaded sessions hold in the CPU tier, compressed or not "
                "(what max_cpu_tier_bytes bounds).",
            ),
            (
                "cpu_tier_compressed_bytes",
                "Of cpu_tier_bytes, the bytes held compressed (the COMPRESS tier).",
            ),
            ("tokens_in_flight", "Tokens (prompt + max output, times n) of its live requests."),
            ("queued_requests", "The tenant's requests waiting in instance queues."),
            ("live_reservations", "The tenant's admitted reservations."),
            ("max_gpu_blocks", "The tenant's quota of GPU blocks."),
            ("max_pinned_blocks", "The tenant's quota of pinned blocks."),
            ("max_cpu_tier_bytes", "The tenant's quota of CPU-tier bytes."),
            ("max_tokens_in_flight", "The tenant's quota of tokens in flight."),
            ("max_queued_requests", "The tenant's quota of queued requests."),
        )
    }
    for t in tenants:
        for name, value in (
            ("gpu_blocks", t.gpu_blocks),
            ("pinned_blocks", t.pinned_blocks),
            ("cpu_tier_bytes", t.cpu_tier_bytes),
            ("cpu_tier_compressed_bytes", t.compressed_bytes),
            ("tokens_in_flight", t.tokens_in_flight),
            ("queued_requests", t.queued_requests),
            ("live_reservations", t.live_reservations),
            ("max_gpu_blocks", t.quota.max_blocks),
            ("max_pinned_blocks", t.quota.max_pinned_blocks),
            ("max_cpu_tier_bytes", t.quota.max_cpu_tier_bytes),
            ("max_tokens_in_flight", t.quota.max_tokens_in_flight),
            ("max_queued_requests", t.quota.max_queued_requests),
        ):
            families[name].add_metric([t.tenant], value)
    yield from families.values()


def _reclaim_families(tallies: list[ReclaimTally]) -> Iterator[Metric]:
    steps = CounterMetricFamily(
        "kvquota_reclaim_steps",
        "Reclaim job steps finished, by tier and state (applied, or skipped: the pool changed "
        "since the plan).",
        labels=["engine_instance", "tier", "state"],
    )
    blocks = CounterMetricFamily(
        "kvquota_reclaimed_blocks",
        "GPU blocks reclaim jobs gave back, by tier (free, offload, compress, evict).",
        labels=["engine_instance", "tier"],
    )
    gpu_bytes = CounterMetricFamily(
        "kvquota_reclaimed_bytes",
        "GPU KV bytes reclaim jobs gave back, by tier (instances with a known geometry).",
        labels=["engine_instance", "tier"],
    )
    for t in tallies:
        tier = t.tier.name.lower()
        steps.add_metric([t.instance, tier, t.state.value.lower()], t.steps)
        if t.state is StepState.APPLIED:
            blocks.add_metric([t.instance, tier], t.blocks)
            if t.bytes is not None:
                gpu_bytes.add_metric([t.instance, tier], t.bytes)
    yield from (steps, blocks, gpu_bytes)


class _Unlogged(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not logged."""


class _MetricsServer(ThreadingWSGIServer):
    def __init__(self, host: str, port: int) -> None:
        # An IPv6 host needs its own address family, as in prometheus_client's server.
        family, *_, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        self.address_family = family
        super().__init__((str(address[0]), port), _Unlogged)


def serve_metrics(listen: str, registry: CollectorRegistry) -> WSGIServer:
    """Serve `registry` on /metrics at `listen` ("host:port"; port 0 picks one) in a thread."""
    host, port = listen.rsplit(":", 1)
    server = _MetricsServer(host, int(port))
    server.set_app(make_wsgi_app(registry))
    # prometheus_client's start_http_server but for the poll: shutdown() waits for the serving
    # loop's next one, half a second there, which every stop of a server paid.
    threading.Thread(target=server.serve_forever, args=(0.05,), name="metrics", daemon=True).start()
    log.info("serving Prometheus metrics on %s:%d", host, server.server_port)
    return server
