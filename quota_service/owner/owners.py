"""The instances one replica serves from memory, and the ledger's calls served by them.

`Owners` takes over each instance on first use (claiming it under a new epoch and rebuilding its
machine from the record), keeps every machine's view of the tenants current, and says what a
tenant holds on the other instances for its fleet-wide quota. `OwnedLedger` answers the calls the
API, the queue waiters, the reaper and engine terminations make of the ledger: operations on a
reservation go to its instance's owner; reads of many rows (lapsed leases, pending aborts) stay
reads of the record, which is current for everything acknowledged.

Several replicas share a fleet: an instance is served by the replica holding its lease, which it
renews every third of the lease; a replica claims an instance on first use, or when its owner's
lease has lapsed. An owner whose lease lapsed on its own clock before a renewal came round (a
starved process) renews it under its epoch at its next call and serves on, unless another
replica claimed the instance meanwhile. A call for an instance another replica serves raises
`ServedElsewhere`, and the api layer forwards it there once (a forwarded call that finds its
instance moving again is told to retry instead). What a tenant holds on the instances other
replicas serve is read from the record, for its fleet-wide quota; each batch's transaction keeps
that quota exact.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Sequence
from contextlib import suppress
from contextvars import ContextVar
from typing import NoReturn, TypeVar

from sqlalchemy.ext.asyncio import AsyncEngine

from quota_service.core import admission
from quota_service.core.admission import AdmissionLimits, AdmitRequest
from quota_service.core.block_table import BlockHandle
from quota_service.core.errors import KvQuotaError, ServedElsewhere, not_found
from quota_service.core.instance_machine import (
    NOWHERE_ELSE,
    Elsewhere,
    EndedBeforeMemory,
    InstanceMachine,
    ReservationRecord,
    TenantSettings,
)
from quota_service.core.metering import METERED_REFUSALS
from quota_service.core.model import (
    EndReason,
    Instance,
    Reservation,
    ReservationState,
    Tenant,
    TenantQuota,
    TenantState,
)
from quota_service.core.names import reservation_name
from quota_service.core.queueing import QueuePolicy
from quota_service.core.reasons import Reason
from quota_service.owner.instance_owner import InstanceOwner, JournalStats, take_over
from quota_service.store.catalog import Catalog
from quota_service.store.journal import (
    WRITE_AT_ONCE,
    GroupCommit,
    InstanceHeld,
    Journal,
    Statement,
    TenantTotals,
)
from quota_service.store.reservations import LapsedOnEngine, PendingAbort, RecordedReservations

log = logging.getLogger(__name__)

T = TypeVar("T")

# Whether the call being served was forwarded here by another replica: it is not forwarded again.
forwarded_call: ContextVar[bool] = ContextVar("forwarded_call", default=False)
# What a forwarded call that finds its instance moving again is told to wait, at most.
MAX_MOVING_RETRY_SECONDS = 1.0
# How often a replica shutting down looks for the new owner of an instance it handed over.
HOLDER_POLL_SECONDS = 0.05


class Owners:
    """The instance owners of this replica."""

    def __init__(
        self,
        engine: AsyncEngine,
        limits: AdmissionLimits,
        queue_policy: QueuePolicy,
        name: str,
        address: str = "",
        on_changed: Callable[[str], None] | None = None,
        lease_seconds: float | None = None,
        group_commit: GroupCommit = WRITE_AT_ONCE,
    ) -> None:
        self._engine = engine
        self.journal = Journal(engine, group_commit)
        self._catalog = Catalog(engine)
        self._limits = limits
        self._queue_policy = queue_policy
        self._name = name
        self._address = address
        self._on_changed = on_changed
        self._owners: dict[str, InstanceOwner] = {}
        self._taking: dict[str, asyncio.Lock] = {}
        self._lookups = KeyLookups(self.journal)
        self._lease_seconds = lease_seconds
        # Instances other replicas serve, as last read, until (time.monotonic) their lease ends.
        self._held: dict[str, tuple[InstanceHeld, float]] = {}
        # What tenants hold on the instances not served here, as last read.
        self._totals_elsewhere: dict[str, Elsewhere] = {}
        # Request ids a batch found recorded already: their Admits are answered from the record.
        self.reused: set[tuple[str, str]] = set()
        self._tenants_stale = False
        self._refreshing: asyncio.Task[None] | None = None
        self._claiming: set[asyncio.Task[None]] = set()
        # Shutting down (hand_over): no instance is claimed any more.
        self._closing = False

    @property
    def name(self) -> str:
        return self._name

    def advertise(self, address: str) -> None:
        """Where other replicas reach this one (known once the server is bound)."""
        self._address = address

    async def owner(self, instance: str) -> InstanceOwner:
        """The instance's owner here, taken over first when it has none (or lost it). Raises
        ServedElsewhere when another replica's lease on it runs."""
        owner = self._owners.get(instance)
        if owner is not None and owner.failure is None and not owner.lease_lapsed():
            return owner
        self._raise_if_held(instance)
        if self._closing:
            await self._raise_holder(instance)
        lock = self._taking.setdefault(instance, asyncio.Lock())
        async with lock:
            owner = self._owners.get(instance)
            if owner is not None and owner.failure is None and owner.lease_lapsed():
                # Its lease lapsed on this clock before a renewal came round (a process starved
                # or paused for a while): renewed under its epoch, it serves on, unless another
                # replica claimed the instance meanwhile (a new epoch) and it stops. Shielded:
                # a caller that goes away leaves no transaction half done.
                await asyncio.shield(self._renew({instance: owner}))
            if owner is None or owner.failure is not None:
                self._raise_if_held(instance)
                owner = await self._take_over(instance)
            return owner

    async def _take_over(self, instance: str) -> InstanceOwner:
        try:
            owner = await take_over(
                self.journal,
                self._catalog,
                instance,
                self._limits,
                self._queue_policy,
                self._name,
                self._address,
                self._lease_seconds,
            )
        except InstanceHeld as held:
            self._held[instance] = (held, time.monotonic() + max(held.seconds_left, 0.0))
            self._raise_if_held(instance)
            raise
        self._held.pop(instance, None)
        owner.on_committed = self._on_changed
        owner.on_reused = self.reused.update
        self._owners[instance] = owner
        await self.refresh_totals_elsewhere()
        log.info("instances/%s: served from memory (epoch %d)", instance, owner.epoch)
        return owner

    def _raise_if_held(self, instance: str) -> None:
        found = self._held.get(instance)
        if found is None:
            return
        held, until = found
        left = until - time.monotonic()
        if left <= 0:
            del self._held[instance]
        elif forwarded_call.get():
            raise KvQuotaError(
                Reason.INSTANCE_MOVING,
                f"instances/{instance} is moving between replicas; retry shortly",
                retry_delay_seconds=min(left, MAX_MOVING_RETRY_SECONDS),
            )
        else:
            raise ServedElsewhere(instance, held.address)

    async def _raise_holder(self, instance: str) -> NoReturn:
        """A replica shutting down claims nothing: the instance's new owner serves the call
        (a call taken before the drain is served, not refused, while its instance moves).
        Another replica claims it as soon as it hears it was handed over, or at its next lease
        round; if none has by then, the caller is told to retry shortly."""
        until = time.monotonic() + (self._lease_seconds or 0.0) / 3
        while True:
            holder = await self.journal.holder(instance)
            if holder is not None and holder.owner != self._name:
                self._held[instance] = (holder, time.monotonic() + holder.seconds_left)
                self._raise_if_held(instance)
            if time.monotonic() >= until:
                break
            await asyncio.sleep(HOLDER_POLL_SECONDS)
        raise KvQuotaError(
            Reason.INSTANCE_MOVING,
            f"instances/{instance} is moving between replicas; retry shortly",
            retry_delay_seconds=MAX_MOVING_RETRY_SECONDS,
        )

    def forget_holder(self, instance: str) -> None:
        """The replica that held the instance did not answer: read its lease again next time
        (and take the instance over once it has lapsed)."""
        self._held.pop(instance, None)

    async def keep_leases(self) -> None:
        """Renew this replica's leases (an owner whose lease another replica took stops at
        once), read what tenants hold elsewhere, and take over the instances whose owner's
        lease lapsed. Every third of the lease."""
        await self._renew({o.instance: o for o in self.served()})
        # In case a notification of a tenant's change was lost.
        await self.refresh_tenants()
        await self.refresh_totals_elsewhere()
        await self.take_over_unowned()

    async def _renew(self, owners: dict[str, InstanceOwner]) -> None:
        """Extend these owners' leases; one whose instance another replica claimed stops."""
        asked_at = time.monotonic()
        lease = self._lease_seconds or 0.0
        renewed = await self.journal.renew(
            self._name, {name: o.epoch for name, o in owners.items()}, lease
        )
        for name, owner in owners.items():
            if name in renewed:
                owner.lease_until = asked_at + lease if self._lease_seconds else math.inf
            else:
                owner.stop("a newer owner took it")

    async def take_over_unowned(self) -> None:
        """Serve here the instances no replica's lease covers that have work waiting (an owner
        that died or stopped left reservations, a queue, an engine to follow)."""
        if self._closing:
            return
        for instance in await self.journal.unowned():
            if instance in self._owners and self._owners[instance].failure is None:
                continue
            with suppress(InstanceHeld, ServedElsewhere):
                await self.owner(instance)

    async def holdings_elsewhere(self) -> dict[str, dict[str, TenantTotals]]:
        """What each tenant holds on each instance not served here, as the record says now."""
        return await self.journal.holdings_elsewhere([o.instance for o in self.served()])

    async def refresh_totals_elsewhere(self) -> None:
        self._totals_elsewhere = {
            tenant: Elsewhere(
                sum(t.blocks for t in held.values()),
                sum(t.tokens for t in held.values()),
                sum(t.pinned for t in held.values()),
            )
            for tenant, held in (await self.holdings_elsewhere()).items()
        }

    async def hand_over(self) -> None:
        """Stop serving (a replica shutting down): take no operation more, let those taken
        commit and be answered, and give the leases up, so that other replicas take the
        instances over at once; calls for them that reach this replica from then on are
        forwarded to their new owners."""
        self._closing = True
        served = self.served()
        for owner in served:
            await owner.retire("this replica is stopping")
        await self.journal.release(self._name, {o.instance: o.epoch for o in served})

    async def close(self) -> None:
        """Close the owners' journal connections, once no claim is under way (one finishing
        later would open a connection nothing closes)."""
        self._closing = True
        for claiming in list(self._claiming):
            claiming.cancel()
        await asyncio.gather(*self._claiming, return_exceptions=True)
        # A refresh of the tenants under way ends first (cut short, its connection would be
        # left in a transaction).
        self._tenants_stale = False
        if self._refreshing is not None:
            await self._refreshing
        await self.journal.close()

    async def run(
        self,
        instance: str,
        operation: Callable[[InstanceMachine, float], T],
        recorded_with: Callable[[T], Sequence[Statement]] | None = None,
    ) -> T:
        """Apply an operation on the instance's machine (InstanceOwner.apply); a tenant the
        machine has not heard of yet is looked up in the catalog once."""
        owner = await self.owner(instance)
        try:
            return await owner.apply(operation, recorded_with)
        except KvQuotaError as refused:
            if refused.reason is not Reason.TENANT_NOT_FOUND:
                raise
        await self.refresh_tenants()
        return await owner.apply(operation, recorded_with)

    async def refresh_tenants(self) -> None:
        """Every machine learns the catalog's tenants as they are now (quotas, states, salts)."""
        settings = await self.journal.tenants()
        for owner in self._owners.values():
            for one in settings:
                owner.machine.set_tenant(one)

    async def tenant_changed(self, tenant: str) -> None:
        """A tenant (or a namespace's salt) changed through this replica: its machines learn it
        now, the other replicas' ones when the notification reaches them (or at their next
        lease renewal)."""
        await self.refresh_tenants()
        await self.journal.tell_tenant_changed(tenant)

    def on_notification(self, kind: str, subject: str) -> None:
        """A tenant changed through another replica: learn it (one refresh at a time, and one
        more if others changed meanwhile). An instance another replica handed over as it
        stops: claim it now."""
        if kind == "handed":
            claiming = asyncio.create_task(self._claim_handed(subject))
            self._claiming.add(claiming)
            claiming.add_done_callback(self._claiming.discard)
            return
        if kind != "tenants":
            return
        self._tenants_stale = True
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.create_task(self._refresh_while_stale())

    async def _claim_handed(self, instance: str) -> None:
        """Every replica that hears of it tries; one claims it, the others learn who did."""
        if self._closing:
            return
        try:
            await self.owner(instance)
        except (InstanceHeld, ServedElsewhere):
            pass
        except Exception:
            log.warning("instances/%s: claiming it failed", instance, exc_info=True)

    async def _refresh_while_stale(self) -> None:
        while self._tenants_stale:
            self._tenants_stale = False
            try:
                await self.refresh_tenants()
            except Exception:
                log.warning("reading the tenants' settings failed", exc_info=True)
                return

    async def tenant_settings(self, tenant: str) -> TenantSettings:
        """A tenant's settings as the catalog has them now."""
        for one in await self.journal.tenants(tenant):
            return one
        raise not_found(Reason.TENANT_NOT_FOUND, f"tenants/{tenant}")

    def settings(self, instance: str, tenant: str) -> TenantSettings | None:
        owner = self._owners.get(instance)
        here = owner.machine.tenants.get(tenant) if owner is not None else None
        return here.settings if here is not None else None

    def elsewhere(self, tenant: str, instance: str) -> Elsewhere:
        """What the tenant holds on the other instances: those served here as their machines
        say, the others as the record last said."""
        recorded = self._totals_elsewhere.get(tenant, NOWHERE_ELSE)
        blocks, tokens, pinned = recorded.blocks, recorded.tokens, recorded.pinned
        for owner in self.served():
            here = owner.machine.tenants.get(tenant)
            if owner.instance == instance or here is None:
                continue
            blocks += here.blocks
            tokens += here.tokens
            pinned += len(here.pinned)
        return Elsewhere(blocks, tokens, pinned)

    def holding(self, tenant: str, request_id: str) -> str | None:
        """The instance whose machine here knows the reservation, if one does."""
        key = (tenant, request_id)
        for owner in self.served():
            if owner.machine.knows(key):
                return owner.instance
        return None

    async def instance_of(self, tenant: str, request_id: str) -> str | None:
        """The instance a reservation is on: a machine here that knows it, else the record."""
        held = self.holding(tenant, request_id)
        if held is not None:
            return held
        return await self._lookups.instance_of((tenant, request_id))

    def served(self) -> list[InstanceOwner]:
        return [owner for owner in self._owners.values() if owner.failure is None]

    def journal_stats(self) -> dict[str, JournalStats]:
        """How the group commit does for each instance served here (for metrics)."""
        return {owner.instance: owner.stats for owner in self.served()}


class KeyLookups:
    """Where reservations unknown here are recorded, looked up together: keys asked while a
    lookup is in flight go in the next one (a new Admit's request id must be checked against
    the record once, and under load one query answers many of them)."""

    def __init__(self, journal: Journal) -> None:
        self._journal = journal
        self._waiting: dict[tuple[str, str], asyncio.Future[str | None]] = {}
        self._looking: asyncio.Task[None] | None = None

    async def instance_of(self, key: tuple[str, str]) -> str | None:
        found = self._waiting.get(key)
        if found is None:
            found = self._waiting[key] = asyncio.get_running_loop().create_future()
        if self._looking is None:
            self._looking = asyncio.create_task(self._look_up())
        return await asyncio.shield(found)

    async def _look_up(self) -> None:
        try:
            while self._waiting:
                asked, self._waiting = self._waiting, {}
                try:
                    recorded = await self._journal.instances_of(list(asked))
                except Exception as exc:
                    for waiter in asked.values():
                        waiter.set_exception(exc)
                        waiter.exception()  # callers that went away leave it unread
                    continue
                for key, waiter in asked.items():
                    waiter.set_result(recorded.get(key))
        finally:
            self._looking = None


def _answer(machine: InstanceMachine, record: ReservationRecord) -> Reservation:
    """The reservation as a caller sees it now (queued ones with their place)."""
    return record.snapshot(machine.queue_position(record))


class OwnedLedger:
    """The ledger's reservation calls, served by the instances' owners."""

    def __init__(
        self,
        engine: AsyncEngine,
        owners: Owners,
        limits: AdmissionLimits,
    ) -> None:
        self._owners = owners
        self._limits = limits
        self._recorded = RecordedReservations(engine)

    @property
    def limits(self) -> AdmissionLimits:
        """The server's bounds, for checking a request whole before it reaches an owner."""
        return self._limits

    @property
    def min_retry_delay_seconds(self) -> float:
        return self._limits.min_retry_delay_seconds

    async def engine_url(self, tenant: str, request_id: str) -> str | None:
        """The engine that runs this reservation's request, if kvquota follows one."""
        return await self._recorded.engine_url(tenant, request_id)

    async def request_aborts(
        self, tenant: str, request_ids: Sequence[str], reason: EndReason
    ) -> None:
        """Remember that these reservations must end with `reason` once their engine confirms
        the abort (they keep their blocks until then)."""
        await self._recorded.request_aborts(tenant, request_ids, reason)

    async def _on_reservation(
        self,
        tenant: str,
        request_id: str,
        operation: Callable[[InstanceMachine, float], T],
    ) -> T:
        instance = await self._owners.instance_of(tenant, request_id)
        if instance is None:
            raise_not_found(tenant, request_id)
        try:
            return await self._owners.run(instance, operation)
        except KvQuotaError as missing:
            if missing.reason is not Reason.RESERVATION_NOT_FOUND:
                raise
        # The record has it, but this machine does not: it ended before the machine was rebuilt
        # (a takeover loads the live ones only), or long ago. A Release committed by an owner
        # that died before answering is retried here: it must find it ended, not unknown.
        recorded = await self._owners.journal.ended_reservation(instance, tenant, request_id)
        if recorded is None:
            raise_not_found(tenant, request_id)

        def on_recorded(machine: InstanceMachine, now: float) -> T:
            machine.remember_ended(recorded)
            return operation(machine, now)

        return await self._owners.run(instance, on_recorded)

    async def admit(self, request: AdmitRequest) -> tuple[Reservation, str]:
        p = request.params
        owners = self._owners
        instance = owners.holding(p.tenant, p.request_id)
        if instance is None and (p.tenant, p.request_id) in owners.reused:
            # Its request id names a reservation that ended before any machine here knew it.
            recorded = await self._recorded.get(p.tenant, p.request_id)
            salt = (await owners.tenant_settings(p.tenant)).salt
            return admission.check_replay(request, recorded), salt
        # An id no machine here knows is new, or the batch finds it recorded (RequestIdsReused).
        instance = instance or p.instance

        def admit(machine: InstanceMachine, now: float) -> Reservation:
            elsewhere = owners.elsewhere(p.tenant, instance)
            return _answer(machine, machine.admit(request, now, elsewhere))

        try:
            try:
                reservation = await owners.run(instance, admit)
            except EndedBeforeMemory:
                # It ended here, and the machine kept only its id: the record has the rest.
                key = (p.tenant, p.request_id)
                ended = await owners.journal.ended_reservation(instance, *key)

                def admit_again(machine: InstanceMachine, now: float) -> Reservation:
                    if ended is None:
                        machine.forget_ended_id(key)
                    else:
                        machine.remember_ended(ended)
                    return admit(machine, now)

                reservation = await owners.run(instance, admit_again)
        except KvQuotaError as refused:
            if refused.reason in METERED_REFUSALS:
                reason = refused.reason
                await owners.run(instance, lambda m, now: m.meter_refusal(p.tenant, reason))
            raise
        here = owners.settings(instance, p.tenant)
        assert here is not None
        return reservation, here.salt

    async def get(self, tenant: str, request_id: str) -> Reservation:
        return await self._on_reservation(
            tenant, request_id, lambda m, now: _answer(m, m.get(tenant, request_id))
        )

    async def follow(self, tenant: str, request_id: str) -> Reservation:
        """From its owner here or, once its instance moved (handed over by this replica as it
        stops, or taken by another), from the record, which holds all its new owner
        acknowledged: a wait begun here is answered here, never restarted at the new owner
        (where a forwarded wait could meet its own end as RESERVATION_ENDED, or a watch see
        its current state twice)."""
        try:
            return await self.get(tenant, request_id)
        except (ServedElsewhere, KvQuotaError) as error:
            if not _moved(error):
                raise
        return await self._recorded.get(tenant, request_id)

    async def end(
        self,
        tenant: str,
        request_id: str,
        reason: EndReason,
        output_tokens: int | None = None,
        *,
        lapsed_only: bool = False,
    ) -> Reservation:
        def end(machine: InstanceMachine, now: float) -> Reservation:
            record = machine.get(tenant, request_id)
            if lapsed_only and not _lapsed(record, now):
                return _answer(machine, record)  # a renewal won
            return _answer(machine, machine.end(tenant, request_id, reason, now, output_tokens))

        return await self._on_reservation(tenant, request_id, end)

    async def stop_waiting(
        self, tenant: str, request_id: str, reason: EndReason
    ) -> tuple[Reservation, float]:
        def stop(machine: InstanceMachine, now: float) -> tuple[Reservation, float]:
            record = machine.get(tenant, request_id)
            if record.state is ReservationState.QUEUED:
                machine.end(tenant, request_id, reason, now)
            return _answer(machine, record), machine.queue_delay_at(record.params.priority)

        try:
            return await self._on_reservation(tenant, request_id, stop)
        except (ServedElsewhere, KvQuotaError) as error:
            if not _moved(error):
                raise
        # Its owner is elsewhere now, and ends the request at its wait deadline (or admits it
        # first): it may still be queued.
        return await self._recorded.get(tenant, request_id), self.min_retry_delay_seconds

    async def renew(self, tenant: str, request_id: str, ttl_seconds: float | None) -> Reservation:
        return await self._on_reservation(
            tenant,
            request_id,
            lambda m, now: _answer(m, m.renew(tenant, request_id, ttl_seconds, now)),
        )

    async def suspend(
        self, tenant: str, request_id: str, session_token_ids: Sequence[int]
    ) -> Reservation:
        return await self._on_reservation(
            tenant,
            request_id,
            lambda m, now: _answer(m, m.suspend(tenant, request_id, now, session_token_ids)),
        )

    async def resume(self, tenant: str, request_id: str, wait_seconds: float) -> Reservation:
        owners = self._owners

        def resume(machine: InstanceMachine, now: float) -> Reservation:
            elsewhere = owners.elsewhere(tenant, machine.spec.instance)
            resumed = machine.resume(tenant, request_id, wait_seconds, now, elsewhere)
            return _answer(machine, resumed)

        return await self._on_reservation(tenant, request_id, resume)

    async def release_blocks(
        self, tenant: str, request_id: str, handles: Sequence[BlockHandle]
    ) -> Reservation:
        return await self._on_reservation(
            tenant,
            request_id,
            lambda m, now: _answer(m, m.release_blocks(tenant, request_id, handles, now)),
        )

    async def reap_expired(self, batch: int) -> int:
        """End, on the instances served here, up to `batch` reservations whose lease ran out
        (LEASE_EXPIRED; on an instance with an engine, Termination has it abort them first)
        and queued ones whose wait budget did (QUEUE_TIMEOUT): each owner reaps its own."""
        ended = 0
        for owner in self._owners.served():

            def reap(machine: InstanceMachine, now: float, budget: int = batch - ended) -> int:
                return machine.reap(now, budget)

            if ended < batch:
                ended += await self._owners.run(owner.instance, reap)
        return ended

    async def lapsed_on_engines(self, batch: int) -> list[LapsedOnEngine]:
        """Those of the instances served here (their owner asks their engine to abort)."""
        found = await self._recorded.lapsed_on_engines(batch)
        return [r for r in found if self._owners.holding(r.tenant, r.request_id)]

    async def pending_aborts(self, batch: int) -> list[PendingAbort]:
        """Those of the instances served here."""
        found = await self._recorded.pending_aborts(batch)
        return [p for p in found if self._owners.holding(p.tenant, p.request_id)]

    async def dispatch(self, instance: str) -> int:
        owners = self._owners

        def dispatch(machine: InstanceMachine, now: float) -> int:
            elsewhere = {t: owners.elsewhere(t, instance) for t in machine.tenants}
            return machine.dispatch(now, elsewhere)

        return await owners.run(instance, dispatch)

    async def dispatch_all(self) -> int:
        return sum([await self.dispatch(o.instance) for o in self._owners.served()])


def _moved(error: Exception) -> bool:
    """The instance is served by another replica now, or on its way to one."""
    if isinstance(error, KvQuotaError):
        return error.reason is Reason.INSTANCE_MOVING
    return isinstance(error, ServedElsewhere)


def _lapsed(record: ReservationRecord, now: float) -> bool:
    if record.state is ReservationState.ADMITTED:
        return record.lease_expires_at is not None and record.lease_expires_at <= now
    if record.state is ReservationState.QUEUED:
        return record.wait_deadline is not None and record.wait_deadline <= now
    return False


def raise_not_found(tenant: str, request_id: str) -> NoReturn:
    raise not_found(Reason.RESERVATION_NOT_FOUND, reservation_name(tenant, request_id))


class OwnedCatalog(Catalog):
    """The catalog, with every change of a tenant or an instance's state told to the machines
    here before the caller is answered (a suspended tenant admits nothing from then on)."""

    def __init__(self, engine: AsyncEngine, owners: Owners) -> None:
        super().__init__(engine)
        self._owners = owners

    async def create_tenant(
        self,
        tenant: str,
        display_name: str,
        weight: int,
        quota: TenantQuota,
        shadow_mode: bool = False,
    ) -> Tenant:
        created = await super().create_tenant(tenant, display_name, weight, quota, shadow_mode)
        await self._owners.tenant_changed(tenant)
        return created

    async def update_tenant(self, tenant: str, changes: dict[str, object]) -> Tenant:
        updated = await super().update_tenant(tenant, changes)
        await self._owners.tenant_changed(tenant)
        return updated

    async def set_tenant_state(self, tenant: str, state: TenantState) -> Tenant:
        updated = await super().set_tenant_state(tenant, state)
        await self._owners.tenant_changed(tenant)
        return updated

    async def rotate_salt(self, collection: str, owner_id: str) -> None:
        await super().rotate_salt(collection, owner_id)
        # A namespace's salt is its tenants' too: every replica rereads them all anyway.
        await self._owners.tenant_changed(owner_id)

    async def drain_instance(self, instance: str) -> Instance:
        # The owner first: a call for an instance served elsewhere is forwarded there before
        # anything changed here.
        owner = await self._owners.owner(instance)
        drained = await super().drain_instance(instance)
        owner.machine.state = drained.state
        return drained
