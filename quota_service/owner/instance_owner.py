"""One instance served from memory: its state machine, applied one operation at a time in
arrival order, and its journal written in group commits.

An operation runs synchronously on the machine the moment it arrives (no `await` inside it, so
operations never interleave); its answer is held until the batch it joined is committed. While
one batch is being written, the operations that arrive join the next, which is written as soon
as the first commits (a moment later when the replica is busy, together with its other owners'
batches: `Journal.gathered`): under load, many operations share one transaction. Nothing is
answered before it is durable, and nothing is answered from state that is not: a read, or a
refusal, waits for the batch that holds what it saw.

When a commit fails (PostgreSQL unreachable, a newer owner took the instance, or owners on other
replicas took a tenant's quota meanwhile) the machine may hold operations the record does not:
the owner stops serving at once, every waiting caller gets UNAVAILABLE with a retry delay, and
the instance is rebuilt from the record before it serves again (`Owners`). The owner also stops
the moment its lease on the instance may have lapsed (`lease_until`, on this process's monotonic
clock): a replica paused past its lease answers nothing from memory another owner may have
moved on from.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from quota_service.core.admission import AdmissionLimits
from quota_service.core.errors import KvQuotaError
from quota_service.core.hashing import DIGEST_BYTES
from quota_service.core.instance_machine import InstanceMachine
from quota_service.core.queueing import QueuePolicy
from quota_service.core.reasons import Reason
from quota_service.store.catalog import Catalog
from quota_service.store.journal import (
    BatchRows,
    Deposed,
    Journal,
    PinIdTaken,
    QuotaRaced,
    RequestIdsReused,
    Statement,
    batch_rows,
    totals_of,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

# Slot changes recorded in deltas before a checkpoint is due, however little is cached.
CHECKPOINT_MIN_SLOTS = 100_000
# What a caller of a failed batch is told to wait before retrying: the time a new owner takes
# to rebuild the instance, about.
RETRY_AFTER_FAILED_COMMIT_SECONDS = 0.2


@dataclass(slots=True)
class JournalStats:
    """How the group commit is doing, for metrics and benchmarks."""

    batches: int = 0
    operations: int = 0


def owner_unavailable(instance: str, why: str) -> KvQuotaError:
    return KvQuotaError(
        Reason.INSTANCE_MOVING,
        f"instances/{instance} is being taken over ({why}); retry shortly",
        retry_delay_seconds=RETRY_AFTER_FAILED_COMMIT_SECONDS,
    )


class InstanceOwner:
    """The machine of one instance and its journal, for the replica that owns it."""

    def __init__(
        self,
        machine: InstanceMachine,
        journal: Journal,
        epoch: int,
        clock: Callable[[], float] = time.time,
        checkpoint_min_slots: int = CHECKPOINT_MIN_SLOTS,
        lease_until: float = math.inf,
    ) -> None:
        self.machine = machine
        self.instance = machine.spec.instance
        self.epoch = epoch
        # Until when (time.monotonic) this owner's lease surely runs: moved on by renewals.
        self.lease_until = lease_until
        self.stats = JournalStats()
        self._journal = journal
        self._clock = clock
        # Each tenant's totals on this instance as the record has them (recovery starts from
        # the machine it rebuilt, which is what the record says).
        self._written = {name: totals_of(machine, name) for name in machine.tenants}
        # The callers waiting on the batch being gathered, and on the one being written.
        self._open: list[asyncio.Future[None]] | None = None
        self._writing: list[asyncio.Future[None]] | None = None
        # Statements the batch being gathered commits besides the machine's changes.
        self._statements: list[Statement] = []
        # Slot changes the deltas recorded since the last checkpoint, and how many call for
        # the next (recovery then replays at most about twice what is live).
        self._checkpoint_min_slots = checkpoint_min_slots
        self._recorded_since_checkpoint = 0
        self._checkpoint_after = checkpoint_min_slots
        self._writer: asyncio.Task[None] | None = None
        # The checkpoint being written after the batch it was taken with, if one is.
        self._checkpointing: asyncio.Task[None] | None = None
        self.failure: str | None = None
        # Told "tenant/request_id" of each reservation a committed batch changed (the waiters of
        # queued Admits and watches wake on it).
        self.on_committed: Callable[[str], None] | None = None
        # Told the request ids a batch found recorded already (reservations ended long ago):
        # their Admits must be answered from the record.
        self.on_reused: Callable[[list[tuple[str, str]]], None] | None = None

    async def apply(
        self,
        operation: Callable[[InstanceMachine, float], T],
        recorded_with: Callable[[T], Sequence[Statement]] | None = None,
    ) -> T:
        """Run `operation(machine, now)` now and answer once what it did, or saw, is durable.
        A KvQuotaError it raises changed nothing; it is raised after the same wait.
        `recorded_with` gives statements of the record's own (a reclaim step marked applied,
        say) that commit in the same transaction as what the operation did."""
        if self.failure is None and self.lease_lapsed():
            self.stop("its lease lapsed")
        if self.failure is not None:
            raise owner_unavailable(self.instance, self.failure)
        refusal: KvQuotaError | None = None
        try:
            result = operation(self.machine, self._clock())
            if recorded_with is not None:
                self._statements += recorded_with(result)
        except KvQuotaError as exc:
            refusal = exc
        await self._durable()
        if refusal is not None:
            raise refusal
        return result

    def lease_lapsed(self) -> bool:
        """Whether this owner's lease may have run out (on this process's clock)."""
        return time.monotonic() >= self.lease_until

    async def _durable(self) -> None:
        """Wait until the machine's state as it is now is committed: join the batch being
        gathered (a change, or a read of one not written yet), or the one being written."""
        changed = self.machine.changes_pending() or bool(self._statements)
        if changed or self._open is not None:
            batch = self._open
            if batch is None:
                batch = self._open = []
            if self._writer is None:
                self._writer = asyncio.create_task(self._write_batches())
        elif self._writing is not None:
            batch = self._writing
        else:
            return
        # One future per caller: a caller that gives up cancels its own wait only.
        waiter = asyncio.get_running_loop().create_future()
        batch.append(waiter)
        await waiter

    async def _write_batches(self) -> None:
        try:
            while self._open is not None:
                # A busy replica holds its owners' batches open a moment, to one moment for all
                # (Journal.gathered): then they share one transaction.
                await self._journal.gathered()
                if self._open is None:  # stopped meanwhile: its callers were told
                    return
                waiters = self._writing = self._open
                self._open = None
                rows = self._take_batch()
                try:
                    batch = await self._journal.write(self.instance, self.epoch, rows)
                except Exception as exc:  # any failure: the record and memory may differ
                    self._fail(exc)
                    return
                if rows.checkpoint is not None:
                    self._checkpointing = asyncio.create_task(
                        self._write_checkpoint(batch, rows.checkpoint)
                    )
                self.stats.batches += 1
                self.stats.operations += len(waiters)
                for waiter in waiters:
                    if not waiter.done():
                        waiter.set_result(None)
                self._writing = None
                if self.on_committed is not None:
                    for row in (*rows.new_reservations, *rows.reservations):
                        self.on_committed(f"{row['tenant']}/{row['request_id']}")
        finally:
            self._writer = None

    def _take_batch(self) -> BatchRows:
        changes = self.machine.drain_changes()
        self._recorded_since_checkpoint += len(changes.slots) + len(changes.dropped_slots)
        checkpoint = (
            self._recorded_since_checkpoint >= self._checkpoint_after
            and self._checkpointing is None
        )
        rows = batch_rows(self.machine, changes, self._written, checkpoint)
        if rows.checkpoint is not None:
            # The next one once the deltas after it record twice as many slots as it did.
            hashed = sum(len(chunk["digests"]) for chunk in rows.checkpoint) // DIGEST_BYTES
            self._checkpoint_after = max(self._checkpoint_min_slots, 2 * hashed)
            self._recorded_since_checkpoint = 0
        rows.statements, self._statements = self._statements, []
        return rows

    async def _write_checkpoint(self, batch: int, chunks: list[dict[str, Any]]) -> None:
        """Write a checkpoint taken with `batch`, now committed, beside the batches that follow
        (a large one took tens of milliseconds, which every operation of the next batch waited
        for when it was written with its batch). One that fails is taken again with the next
        batch; a newer owner stops this one, as a batch would."""
        try:
            await self._journal.write_checkpoint(self.instance, self.epoch, batch, chunks)
        except Deposed as exc:
            self._fail(exc)
        except Exception as exc:  # the deltas still record everything: only recovery is longer
            log.warning(
                "instances/%s: a checkpoint failed, taken again next (%s)", self.instance, exc
            )
            self._recorded_since_checkpoint = self._checkpoint_after
        finally:
            self._checkpointing = None

    def _fail(self, exc: BaseException) -> None:
        if isinstance(exc, Deposed):
            why = "a newer owner took it"
        elif isinstance(exc, RequestIdsReused):
            why = "a request id was reused"
            if self.on_reused is not None:
                self.on_reused(exc.keys)
        elif isinstance(exc, QuotaRaced):
            why = f"other replicas took the quota of tenants {exc} meanwhile"
        elif isinstance(exc, PinIdTaken):
            why = f"pin {exc} was made on another instance meanwhile"
        else:
            why = "its journal failed"
        log.warning("instances/%s: %s (%s)", self.instance, why, exc)
        self.stop(why)

    def stop(self, why: str) -> None:
        """Serve nothing more from this machine: every caller still waiting is told to retry
        (the batch being written, if any, may still commit; the record then has it)."""
        if self.failure is not None:
            return
        log.info("instances/%s: no longer served here: %s", self.instance, why)
        self.failure = why
        error = owner_unavailable(self.instance, why)
        for waiters in (self._writing, self._open):
            for waiter in waiters or ():
                if not waiter.done():
                    waiter.set_exception(error)
        self._writing = self._open = None

    async def retire(self, why: str) -> None:
        """Take no operation more, and wait until those taken are committed and answered."""
        if self.failure is None:
            self.failure = why
        writer = self._writer
        if writer is not None:
            await asyncio.wait([writer])
        checkpointing = self._checkpointing
        if checkpointing is not None:
            await asyncio.wait([checkpointing])


async def take_over(
    journal: Journal,
    catalog: Catalog,
    instance: str,
    limits: AdmissionLimits,
    queue_policy: QueuePolicy,
    owner: str,
    address: str = "",
    lease_seconds: float | None = None,
) -> InstanceOwner:
    """Claim an instance under a new epoch and rebuild its machine from the record. Raises
    InstanceHeld while another replica's lease on it runs. Without `lease_seconds` the owner
    keeps no lease: it serves until deposed, and any claim deposes it."""
    found = await catalog.get_instance(instance)
    tenants = await journal.tenants()
    claimed_at = time.monotonic()
    recorded = await journal.load(instance, owner, address, lease_seconds or 0.0)
    machine = InstanceMachine.recover(
        found.spec,
        limits,
        tenants,
        recorded.image,
        recorded.generation_floor,
        queue_policy,
        found.state,
    )
    lease_until = math.inf if lease_seconds is None else claimed_at + lease_seconds
    return InstanceOwner(machine, journal, recorded.epoch, lease_until=lease_until)
