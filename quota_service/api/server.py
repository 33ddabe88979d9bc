"""The gRPC server: services, health (NOT_SERVING until the ledger is reachable and migrated, and
again while shutting down), reflection for grpcurl, and SIGTERM draining in-flight RPCs."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import socket
from collections.abc import Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast
from wsgiref.simple_server import WSGIServer

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from sqlalchemy.ext.asyncio import AsyncEngine

from kvquota.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    admission_pb2,
    admission_pb2_grpc,
    billing_pb2,
    billing_pb2_grpc,
)
from quota_service.api.admin_service import AdminServicer
from quota_service.api.admission_service import AdmissionServicer
from quota_service.api.auth import AccessInterceptor, Authenticator
from quota_service.api.billing_service import BillingServicer
from quota_service.api.error_status import ErrorInterceptor, Interceptors
from quota_service.api.forwarding import ForwardingInterceptor
from quota_service.api.observability import MetricsInterceptor
from quota_service.api.payload import PayloadInterceptor
from quota_service.api.waiting import Waiters
from quota_service.config import Settings
from quota_service.core.reclaim import CpuWatermarks
from quota_service.enforcement.cpu_tier_mirror import CpuTierMirror
from quota_service.enforcement.termination import Termination
from quota_service.jobs import maintenance
from quota_service.jobs.dispatcher import Dispatcher
from quota_service.jobs.follower import Followers
from quota_service.jobs.reclaim_executor import ReclaimExecutor
from quota_service.jobs.reclaim_policy import ReclaimPolicy
from quota_service.metrics import (
    JournalMetrics,
    LedgerMetrics,
    PoolMetrics,
    ServiceMetrics,
    serve_metrics,
)
from quota_service.owner.owned_inspection import OwnedInspection
from quota_service.owner.owned_offboarding import OwnedOffboarding
from quota_service.owner.owned_pins import OwnedPins
from quota_service.owner.owned_reclaim import OwnedReclaimJobs
from quota_service.owner.owned_reconcile import OwnedReconciler
from quota_service.owner.owners import OwnedCatalog, OwnedLedger, Owners
from quota_service.store import migrate
from quota_service.store.access import ApiKeys, AuditLog
from quota_service.store.cpu_tier import CpuTierBooks
from quota_service.store.database import connect, unavailable_error
from quota_service.store.journal import GroupCommit
from quota_service.store.notifications import Listener
from quota_service.store.offboarding import RESERVATION_BATCH
from quota_service.store.usage import UsageBook, UsageRollup

log = logging.getLogger(__name__)

# The collector's generation thresholds while serving (Python's defaults are 700, 10, 10).
# grpc aio leaves a small reference cycle behind every call (its handler lookup), so young
# collections cannot be avoided, only shaped: every 2,000 allocations each pause stays near
# 1-2 ms, where every 20,000 made fewer pauses of 11-22 ms. The total collector time per call
# is the same either way (measured with gc.callbacks).
GC_THRESHOLDS = (2_000, 100, 20)

SERVICE_NAMES = (
    admission_pb2.DESCRIPTOR.services_by_name["AdmissionService"].full_name,
    admin_pb2.DESCRIPTOR.services_by_name["AdminService"].full_name,
    billing_pb2.DESCRIPTOR.services_by_name["BillingService"].full_name,
)
# Prompt token ids of a 128k-token context fit comfortably; anything larger is refused by gRPC.
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
MIN_CLIENT_PING_INTERVAL_MS = 10_000
LISTEN_TIMEOUT_SECONDS = 30
MAX_READY_DELAY_SECONDS = 10.0
# What the end of the shutdown grace leaves callers still waiting to get their answer in.
HANDBACK_SECONDS = 1.0


class _GenericHandlersOnly:
    """The server as the generated `add_*Servicer_to_server` functions see it: each service's
    handlers are added as a generic handler only, not as registered methods. For every call
    it accepts, grpc.aio's server waits on one pending task per registered method (44 here:
    `asyncio.wait` over all of them, each one's callback added and removed), where a generic
    handler finds the method by its path in a dict; the bare gRPC floor registers none. That
    wait cost 63 µs of CPU over 44 tasks against 14 µs over one (uvloop, this machine). The
    generated functions call only these two methods (hence the cast where it is passed)."""

    def __init__(self, server: grpc.aio.Server) -> None:
        self._server = server

    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        self._server.add_generic_rpc_handlers(handlers)

    def add_registered_method_handlers(
        self, service: str, handlers: Mapping[str, grpc.RpcMethodHandler[Any, Any]]
    ) -> None:
        """Left out (see the class); the generic handler added with them serves them."""


@dataclass
class RunningServer:
    """A started server: its bound port, and how to stop it gracefully."""

    port: int
    _server: grpc.aio.Server
    _health: health.aio.HealthServicer
    _engine: AsyncEngine
    _stop: asyncio.Event
    _maintenance: asyncio.Task[None]
    _listener: Listener
    _dispatcher: Dispatcher
    _termination: Termination
    _cpu_tier: CpuTierMirror
    _followers: Followers
    _metrics: WSGIServer | None
    _waiters: Waiters
    _owners: Owners
    _forwarding: ForwardingInterceptor
    _leases: asyncio.Task[None]

    @property
    def metrics_port(self) -> int | None:
        return None if self._metrics is None else self._metrics.server_port

    @property
    def owners(self) -> Owners:
        """The instances this replica serves from memory."""
        return self._owners

    async def _hand_over(self) -> None:
        """The instances served here go to other replicas: calls still in flight, and those of
        a queued Admit woken later, are forwarded to their new owners."""
        await self._leases  # its last round ends: self._stop is set
        await self._owners.hand_over()

    async def stop(self, grace_seconds: float) -> None:
        log.info("shutting down: draining in-flight RPCs for up to %ss", grace_seconds)
        await self._health.enter_graceful_shutdown()
        self._stop.set()
        # Calls in flight run on. Those still waiting when the grace is nearly over (a queued
        # Admit, a watch) are answered then, UNAVAILABLE: ask another replica (a queued
        # request keeps its place), rather than cancelled with no answer when it ends.
        loop = asyncio.get_running_loop()
        handback = loop.call_later(
            grace_seconds - min(HANDBACK_SECONDS, grace_seconds / 4), self._waiters.close
        )
        # Begins once the server refuses new calls: a call sent after the drain began is
        # refused, never taken while the instances move.
        handing_over = asyncio.ensure_future(self._hand_over())
        try:
            # Refuses new calls before its first await, so before a health watcher can be
            # told NOT_SERVING.
            await self._server.stop(grace_seconds)
        finally:
            handback.cancel()
        await handing_over
        await self._maintenance
        await self._listener.stop()
        await self._dispatcher.stop()
        await self._termination.close()
        await self._cpu_tier.close()
        await self._followers.stop()
        await self._forwarding.close()
        await self._owners.close()
        if self._metrics is not None:
            await asyncio.to_thread(self._metrics.shutdown)
            self._metrics.server_close()
        await self._engine.dispose()


@dataclass(frozen=True)
class HotPath:
    """What decides reservations and pins: the instances' owners in this replica, and the
    services over them (the catalog keeps them told of tenants' changes)."""

    ledger: OwnedLedger
    catalog: OwnedCatalog
    pins: OwnedPins
    owners: Owners

    def reconciler(self, engine: AsyncEngine) -> OwnedReconciler:
        return OwnedReconciler(engine, self.ledger, self.owners)

    def reclaim(self, engine: AsyncEngine, watermarks: CpuWatermarks) -> OwnedReclaimJobs:
        return OwnedReclaimJobs(engine, self.owners, watermarks)

    def inspection(self, engine: AsyncEngine) -> OwnedInspection:
        return OwnedInspection(engine, self.owners)

    def offboarding(
        self,
        engine: AsyncEngine,
        termination: Termination,
        reservation_batch: int = RESERVATION_BATCH,
    ) -> OwnedOffboarding:
        return OwnedOffboarding(
            engine, self.ledger, self.pins, termination, self.owners, reservation_batch
        )


def make_hot_path(
    settings: Settings, engine: AsyncEngine, waiters: Waiters, name: str | None = None
) -> HotPath:
    """What decides for this replica, named `name` among replicas (default: host and pid)."""
    limits = settings.admission_limits
    owners = Owners(
        engine,
        limits,
        settings.queue_policy,
        name or f"{socket.gethostname()}:{os.getpid()}",
        on_changed=lambda key: waiters.on_notification("changed", key),
        lease_seconds=settings.owner_lease_seconds,
        group_commit=GroupCommit(
            settings.group_commit_wait_seconds, settings.group_commit_busy_operations
        ),
    )
    return HotPath(
        OwnedLedger(engine, owners, limits),
        OwnedCatalog(engine, owners),
        OwnedPins(engine, owners),
        owners,
    )


async def _set_health(servicer: health.aio.HealthServicer, serving: bool) -> None:
    """Every service at once: each needs the ledger. (Ignored once shutting down.)"""
    status = (
        health_pb2.HealthCheckResponse.SERVING
        if serving
        else health_pb2.HealthCheckResponse.NOT_SERVING
    )
    for name in ("", *SERVICE_NAMES):
        await servicer.set(name, status)


async def _until_ledger_ready(database_url: str) -> None:
    """Wait, NOT_SERVING, until the database answers and is migrated: a database starting up or
    a migration job still running is a reason to wait, not to crash."""
    delay = 1.0
    while True:
        try:
            if not await asyncio.to_thread(migrate.pending, database_url):
                return
            log.warning("the database is not migrated: waiting (run `kvquota migrate`)")
        except Exception as exc:
            if unavailable_error(exc) is None:
                raise
            # Only the error's kind: its text may name the host and user.
            log.warning("the database cannot be reached (%s): waiting", type(exc).__name__)
        await asyncio.sleep(delay)
        delay = min(2 * delay, MAX_READY_DELAY_SECONDS)


async def keep_leases(owners: Owners, every_seconds: float, stop: asyncio.Event) -> None:
    """Renew this replica's leases, and take over instances whose owner's lease lapsed, until
    `stop` is set. Stopped between rounds, never cancelled inside one: a round cut short in a
    transaction leaves its connection there, for the garbage collector to find."""
    while not stop.is_set():
        try:
            await owners.keep_leases()
        except Exception:
            # The database may be restarting: leases not renewed lapse, and the owners stop.
            log.warning("renewing the instances' leases failed", exc_info=True)
        with suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every_seconds)


def advertised_address(settings: Settings, port: int) -> str:
    """Where other replicas reach this one (settings.advertise_address, else the listen
    address with this host's name for a wildcard host and the bound port)."""
    if settings.advertise_address:
        return settings.advertise_address
    host = settings.grpc_listen.rsplit(":", 1)[0]
    if host in ("", "0.0.0.0", "[::]"):
        host = socket.getfqdn()
    return f"{host}:{port}"


def peer_credentials(settings: Settings) -> grpc.ChannelCredentials | None:
    """How this replica calls the others (to forward calls): TLS when it serves TLS, showing
    its own certificate (for replicas that require clients' certificates)."""
    if not settings.tls_cert_file:
        return None
    ca_file = settings.tls_peer_ca_file or settings.tls_client_ca_file
    return grpc.ssl_channel_credentials(
        root_certificates=Path(ca_file).read_bytes() if ca_file else None,
        private_key=Path(settings.tls_key_file).read_bytes(),
        certificate_chain=Path(settings.tls_cert_file).read_bytes(),
    )


def server_credentials(settings: Settings) -> grpc.ServerCredentials | None:
    """TLS (mutual, with a client CA) from the configured PEM files; None: plaintext."""
    if not settings.tls_cert_file:
        return None
    client_ca = None
    if settings.tls_client_ca_file:
        client_ca = Path(settings.tls_client_ca_file).read_bytes()
    chain = Path(settings.tls_cert_file).read_bytes()
    key = Path(settings.tls_key_file).read_bytes()
    return grpc.ssl_server_credentials(
        [(key, chain)], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


async def start(settings: Settings, database_url: str) -> RunningServer:
    """Bind and start serving; health turns SERVING once the ledger is reachable and migrated
    and this replica hears the others' notifications."""
    engine = connect(database_url, settings.db_pool_size)
    observed = ServiceMetrics()
    observed.registry.register(PoolMetrics(engine))
    waiters = Waiters(settings.queue_poll_seconds)
    hot_path = make_hot_path(settings, engine, waiters)
    observed.registry.register(JournalMetrics(hot_path.owners.journal_stats))
    ledger, catalog, pins = hot_path.ledger, hot_path.catalog, hot_path.pins
    dispatcher = Dispatcher(ledger)
    listener = Listener(database_url)
    listener.subscribe(waiters.on_notification)
    listener.subscribe(dispatcher.on_notification)
    listener.subscribe(hot_path.owners.on_notification)
    api_keys = ApiKeys(engine)
    audit = AuditLog(engine)
    authenticator = Authenticator(api_keys, settings.auth_required, settings.auth_cache_seconds)
    if not settings.auth_required:
        log.warning("authentication is off (KVQUOTA_AUTH_REQUIRED=false): every caller is admin")
    forwarding = ForwardingInterceptor(
        hot_path.owners,
        peer_credentials(settings),
        MAX_MESSAGE_BYTES,
        waiters,
        ledger.min_retry_delay_seconds,
    )
    server = grpc.aio.server(
        interceptors=[
            Interceptors(
                [
                    ErrorInterceptor(),
                    forwarding,
                    MetricsInterceptor(observed),
                    PayloadInterceptor(),
                    AccessInterceptor(authenticator, audit),
                ]
            )
        ],
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            # Clients' keepalive pings (kvquota.client sends one every 30 s) are welcome, also
            # on idle connections, instead of being answered with GOAWAY (too_many_pings).
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", MIN_CLIENT_PING_INTERVAL_MS),
        ],
    )
    termination = Termination(
        ledger, settings.engine_abort_timeout_seconds, settings.engine_abort_hard_timeout_seconds
    )
    cpu_tier = CpuTierMirror(CpuTierBooks(engine))
    services = cast(grpc.aio.Server, _GenericHandlersOnly(server))
    admission_pb2_grpc.add_AdmissionServiceServicer_to_server(
        AdmissionServicer(ledger, waiters, termination, cpu_tier, observed, catalog), services
    )
    offboarding = hot_path.offboarding(engine, termination)
    inspection = hot_path.inspection(engine)
    reclaim = hot_path.reclaim(engine, settings.cpu_watermarks)
    admin = AdminServicer(catalog, pins, offboarding, inspection, reclaim, api_keys, audit)
    admin_pb2_grpc.add_AdminServiceServicer_to_server(admin, services)
    billing_pb2_grpc.add_BillingServiceServicer_to_server(
        BillingServicer(UsageBook(engine)), services
    )
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, services)
    reflection.enable_server_reflection(
        (*SERVICE_NAMES, health.SERVICE_NAME, reflection.SERVICE_NAME), services
    )
    await _set_health(health_servicer, False)
    credentials = server_credentials(settings)
    if credentials is None:
        port = server.add_insecure_port(settings.grpc_listen)
    else:
        port = server.add_secure_port(settings.grpc_listen, credentials)
    await server.start()
    hot_path.owners.advertise(advertised_address(settings, port))
    await _until_ledger_ready(database_url)
    listener.start()
    await asyncio.wait_for(listener.connected.wait(), LISTEN_TIMEOUT_SECONDS)
    await _set_health(health_servicer, True)
    stop = asyncio.Event()
    # Instances whose owner died wait for no call: their engines are followed from now.
    await hot_path.owners.keep_leases()
    followers = Followers(database_url, hot_path.reconciler(engine), metrics=observed)
    await followers.scan()
    metrics = LedgerMetrics(catalog, inspection, reclaim, settings.metrics_refresh_seconds)
    await metrics.refresh()
    observed.registry.register(metrics)
    metrics_server = None
    if settings.metrics_listen:
        metrics_server = serve_metrics(settings.metrics_listen, observed.registry)
    jobs = maintenance.Maintenance(
        ledger,
        offboarding,
        termination,
        followers,
        metrics,
        ReclaimExecutor(reclaim, termination, cpu_tier),
        ReclaimPolicy(
            reclaim,
            settings.reclaim_policy_tier,
            settings.reclaim_policy_watermark,
            settings.reclaim_policy_cooldown_seconds,
        ),
        cpu_tier,
        UsageRollup(engine),
        settings,
        engine,
        lambda up: _set_health(health_servicer, up),
    )
    running = asyncio.create_task(maintenance.run(jobs, stop))
    every = settings.owner_lease_seconds / 3
    leases = asyncio.create_task(keep_leases(hot_path.owners, every, stop))
    return RunningServer(
        port,
        server,
        health_servicer,
        engine,
        stop,
        running,
        listener,
        dispatcher,
        termination,
        cpu_tier,
        followers,
        metrics_server,
        waiters,
        hot_path.owners,
        forwarding,
        leases,
    )


async def serve(settings: Settings, database_url: str) -> None:
    """Serve until SIGTERM or SIGINT, then drain in-flight RPCs within the grace period."""
    running = await start(settings, database_url)
    # Every call makes a few hundred short-lived objects (block handles, messages): with the
    # collector's default threshold it runs every few calls and rescans everything the server
    # keeps. What exists once serving began is frozen out of its scans, and GC_THRESHOLDS says
    # how the young collections that remain are paced.
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
    host = settings.grpc_listen.rsplit(":", 1)[0]
    # Tests and scripts read this line to find a port chosen by the OS (":0").
    print(f"kvquota serving gRPC on {host}:{running.port}", flush=True)
    if running.metrics_port is not None:
        metrics = f"{settings.metrics_listen.rsplit(':', 1)[0]}:{running.metrics_port}"
        print(f"kvquota serving metrics on http://{metrics}/metrics", flush=True)
    print("kvquota: Ctrl-C or SIGTERM stops it, after in-flight calls finish", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    await running.stop(settings.shutdown_grace_seconds)
