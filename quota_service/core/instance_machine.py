"""One instance's live state as a deterministic state machine: its pool of slots, the block
tables of its reservations, its pins, its wait queue with the fair clocks, and what each tenant
holds on it. Pure and synchronous: no I/O, no clock (every transition is given `now`, in seconds
since the epoch), no `await`. The owner applies operations one at a time, in arrival order,
journals what changed (`drain_changes`) and answers callers once that is durable.

Invariants kept by construction (DESIGN.md numbers them):
- every slot is in exactly one state and the pool's counters add up to its capacity (1);
- a slot's reference count is the live table entries naming it plus its pins (2): tables and
  pins reference slots only through `BlockPool.reference` and give them back only through
  `BlockPool.unreference`, each entry once;
- a tenant's blocks here are the distinct slots its live tables and pins name (3): `held`
  counts entries per slot, and a slot leaves it with its last entry;
- a live table never names a stale handle (4): a referenced slot's contents are never dropped.
Cost: O(1) per block of a request, independent of the pool's size; a refusal adds a sort of the
live reservations (for its retry delay).
"""

from __future__ import annotations

from array import array
from bisect import insort
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from itertools import compress
from operator import itemgetter, not_

from quota_service.core import admission, block_table, geometry, pins, queueing
from quota_service.core.admission import (
    AdmissionLimits,
    AdmitRequest,
    Grant,
    PrefixHits,
    Shortfall,
)
from quota_service.core.block_pool import BlockPool, ContentColumns
from quota_service.core.block_table import BlockHandle, BlockHandles, CachedBlock, EntryLookup
from quota_service.core.errors import KvQuotaError, invalid_request, not_found, refuse_invalid
from quota_service.core.hashing import block_hashes
from quota_service.core.holdings import Holdings
from quota_service.core.kv_events import AllBlocksCleared, BlockStored, EventBatch
from quota_service.core.model import (
    AdmitParams,
    EndReason,
    Holding,
    InstancePool,
    InstanceSpec,
    InstanceState,
    Reservation,
    ReservationState,
    TenantAccount,
    TenantQuota,
    TenantState,
)
from quota_service.core.names import reservation_name
from quota_service.core.queueing import FairTags, QueuePolicy
from quota_service.core.reasons import Reason

# Weight of the newest observation in the mean holding time (an exponentially weighted mean, so
# it follows a changing workload within tens of requests).
HOLD_EWMA_ALPHA = 0.2
# Ended reservations kept whole, to answer repeated Admits, Releases and Gets without the record.
ENDED_RETAINED = 1_000
# Ended reservations whose ids alone are kept beyond those (a hash each, ~150 bytes where a
# whole one takes 600 or more): an Admit that repeats one is answered from the record's row
# (`EndedBeforeMemory`), not taken as new, which its batch would refuse (the id is recorded),
# stopping the owner. 10,000 whole ones, as kept before, took 6 MB per instance; these ~2 MB.
ENDED_IDS_RETAINED = 10_000


class EndedBeforeMemory(Exception):
    """An Admit repeats the id of a reservation that ended here which the machine kept only the
    id of: its caller reads the record's row (`remember_ended`) or, finding none (two ids with
    the same hash), forgets the id (`forget_ended_id`), and admits again. Nothing changed."""


@dataclass(frozen=True, slots=True)
class TenantSettings:
    """What the catalog says of a tenant, as the owner last heard it."""

    tenant: str
    state: TenantState
    quota: TenantQuota
    weight: int
    # The salt its prefixes are hashed under, and that salt's scope (`tenants/{t}` or a
    # shared `namespaces/{n}`).
    salt: str
    scope: str
    # Admit what its own limits would refuse, recording why (admission.judge).
    shadow_mode: bool = False


@dataclass(frozen=True, slots=True)
class Elsewhere:
    """What a tenant holds on other instances, for its fleet-wide quota."""

    blocks: int = 0
    tokens: int = 0
    pinned: int = 0


NOWHERE_ELSE = Elsewhere()


class HeldTable:
    """The slots a reservation or a pin references, in table order, with their generations.
    A released entry stays in place (positions never move) and references nothing."""

    __slots__ = ("blocks", "generations", "live_entries", "pinned", "released")

    def __init__(self, blocks: Sequence[int], generations: Sequence[int], pinned: bool) -> None:
        # Unsigned: built faster (block_pool.BlockPool's arrays).
        self.blocks = array("I", blocks)
        self.generations = array("Q", generations)
        self.released = bytearray(len(self.blocks))
        self.pinned = pinned
        self.live_entries = len(self.blocks)

    def copy(self) -> HeldTable:
        copied = HeldTable(self.blocks, self.generations, self.pinned)
        copied.released[:] = self.released
        copied.live_entries = self.live_entries
        return copied

    def live_blocks(self) -> list[int]:
        return list(self.live_columns()[0])

    def live_columns(self) -> tuple[Sequence[int], Sequence[int]]:
        """The live entries' blocks and generations, as two columns (the arrays themselves
        when nothing was released)."""
        if self.live_entries == len(self.blocks):
            return self.blocks, self.generations
        live = list(map(not_, self.released))
        return list(compress(self.blocks, live)), list(compress(self.generations, live))

    def live_handles(self) -> list[tuple[int, int]]:
        return list(zip(*self.live_columns(), strict=True))

    def handles(self) -> BlockHandles:
        return BlockHandles(*self.live_columns())


class ReservationRecord:
    """One reservation as its owner holds it. Mutable: only the machine changes it."""

    __slots__ = (
        "admitted_at",
        "arrival",
        "compress_after_bytes",
        "compress_before_bytes",
        "compressed_bytes",
        "end_reason",
        "ended_at",
        "freed_blocks",
        "lease_expires_at",
        "lease_ttl_seconds",
        "offloaded_bytes",
        "output_tokens",
        "params",
        "prefix_hit_blocks",
        "prompt_digest",
        "prompt_token_ids",
        "queued_at",
        "reserved_blocks",
        "shadow_refusal",
        "state",
        "suspended_at",
        "table",
        "tags",
        "tokens",
        "wait_deadline",
        "written",
    )

    def __init__(
        self,
        request: AdmitRequest,
        blocks: int,
        tokens: int,
        ttl: float,
        prompt_digest: bytes | None = None,
    ) -> None:
        """`prompt_digest`: the prompt's, when the caller has it already (from validating it)."""
        self.params = request.params
        self.prompt_token_ids = request.prompt_token_ids
        self.prompt_digest = prompt_digest or admission.prompt_digest(request.prompt_token_ids)
        self.state = ReservationState.QUEUED
        self.end_reason: EndReason | None = None
        self.table: HeldTable | None = None
        self.reserved_blocks = blocks
        self.tokens = tokens
        self.prefix_hit_blocks = 0
        self.lease_ttl_seconds = ttl
        self.lease_expires_at: float | None = None
        self.admitted_at: float | None = None
        self.ended_at: float | None = None
        self.output_tokens: int | None = None
        self.queued_at: float | None = None
        self.wait_deadline: float | None = None
        self.tags = FairTags(0.0, 0.0)
        self.arrival = 0
        self.suspended_at: float | None = None
        self.offloaded_bytes: int | None = None
        # Tier COMPRESSED: the bytes its demoted chunks hold compressed, and what LMCache
        # measured of them before and after (their ratio).
        self.compressed_bytes: int | None = None
        self.compress_before_bytes: int | None = None
        self.compress_after_bytes: int | None = None
        # Preempted by a reclaim: the blocks its end gave back (their last references).
        self.freed_blocks: int | None = None
        # Whether the record has a row of it yet (a new one's first row must not replace an
        # old reservation's under the same request id).
        self.written = False
        self.shadow_refusal: str | None = None

    @property
    def key(self) -> tuple[str, str]:
        return self.params.tenant, self.params.request_id

    def copy(self) -> ReservationRecord:
        copied = ReservationRecord.__new__(ReservationRecord)
        for name in ReservationRecord.__slots__:
            setattr(copied, name, getattr(self, name))
        copied.table = self.table.copy() if self.table is not None else None
        return copied

    @property
    def name(self) -> str:
        return reservation_name(self.params.tenant, self.params.request_id)

    @property
    def on_gpu(self) -> bool:
        """Admitted and holding its blocks (not offloaded to the CPU tier)."""
        return self.state is ReservationState.ADMITTED and self.table is not None

    def snapshot(self, queue_position: int | None = None) -> Reservation:
        p = self.params
        return Reservation(
            tenant=p.tenant,
            request_id=p.request_id,
            instance=p.instance,
            prompt_tokens=p.prompt_tokens,
            max_output_tokens=p.max_output_tokens,
            n=p.n,
            priority=p.priority,
            state=self.state,
            reserved_blocks=self.reserved_blocks,
            reserved_tokens=self.tokens,
            prefix_hit_blocks=self.prefix_hit_blocks,
            lease_ttl_seconds=self.lease_ttl_seconds,
            lease_expires_at=_time(self.lease_expires_at),
            admitted_at=_time(self.admitted_at),
            ended_at=_time(self.ended_at),
            end_reason=self.end_reason,
            output_tokens=self.output_tokens,
            block_table=self.table.handles() if self.table is not None else (),
            queued_at=_time(self.queued_at),
            wait_deadline=_time(self.wait_deadline),
            queue_position=queue_position,
            suspended_at=_time(self.suspended_at),
            offloaded_bytes=self.offloaded_bytes,
            compressed_bytes=self.compressed_bytes,
            compression_ratio=(
                self.compress_after_bytes / self.compress_before_bytes
                if self.compress_after_bytes is not None and self.compress_before_bytes
                else None
            ),
            prompt_digest=self.prompt_digest,
            shadow_refusal=self.shadow_refusal,
        )


class PinRecord:
    """A pinned prefix as its owner holds it; `token_ids` and `salt`, known when it is made, are
    what the instance's CPU tier must pin too (a rebuilt machine does not need them)."""

    __slots__ = (
        "created_at",
        "owner",
        "pin_id",
        "prefix",
        "prompt_tokens",
        "salt",
        "table",
        "tenant",
        "token_ids",
    )

    def __init__(
        self,
        owner: str,
        pin_id: str,
        tenant: str | None,
        prefix: bytes,
        prompt_tokens: int,
        table: HeldTable,
        created_at: float,
        token_ids: tuple[int, ...] = (),
        salt: str = "",
    ) -> None:
        self.owner = owner
        self.pin_id = pin_id
        self.tenant = tenant
        self.prefix = prefix
        self.prompt_tokens = prompt_tokens
        self.table = table
        self.created_at = created_at
        self.token_ids = token_ids
        self.salt = salt

    def copy(self) -> PinRecord:
        return PinRecord(
            self.owner,
            self.pin_id,
            self.tenant,
            self.prefix,
            self.prompt_tokens,
            self.table.copy(),
            self.created_at,
            self.token_ids,
            self.salt,
        )


@dataclass(slots=True)
class TenantHere:
    """A tenant's holdings on this instance."""

    settings: TenantSettings
    # Its number in the machine's `Holdings` (where its live table entries per slot are), and
    # how many slots it holds.
    holder: int
    blocks: int = 0
    # Pin entries per slot (pins are few).
    pinned: dict[int, int] = field(default_factory=dict)
    tokens: int = 0
    queued: int = 0
    mean_hold_seconds: float | None = None
    # Start-time fair queueing: the finish tag of its last request, per priority class.
    last_finish: dict[int, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class TenantClocks:
    """What a tenant's fairness and retry delays remember on an instance."""

    last_finish: dict[int, float]
    mean_hold_seconds: float | None


@dataclass(frozen=True, slots=True)
class InstanceImage:
    """An instance's live state as the record keeps it: everything a new owner needs to rebuild
    the machine (history is not part of it, so recovery costs what is live)."""

    slots: ContentColumns
    scopes: tuple[str, ...]
    # Live reservations (admitted, offloaded and queued) and pins, copied.
    reservations: tuple[ReservationRecord, ...]
    pins: tuple[PinRecord, ...]
    virtual_time: dict[int, float]
    tenants: dict[str, TenantClocks]
    mean_hold_seconds: float | None
    drift_blocks: int


@dataclass(frozen=True, slots=True)
class EngineReport:
    """What applying a batch of KV events did: slots whose last copy the engine evicted and
    that were freed, and references to evicted contents (drift)."""

    freed: int = 0
    drift: int = 0


@dataclass(slots=True)
class Usage:
    """What changed of a tenant's use of the instance since the journal last took it, as
    core/metering.py counts it: blocks it started (+) or stopped (-) holding by how many tenants
    shared each then, and counters."""

    blocks: Counter[int] = field(default_factory=Counter)
    pinned: int = 0
    cpu_bytes: int = 0
    compressed_bytes: int = 0
    tokens_reserved: int = 0
    output_tokens: int = 0
    admitted: int = 0
    queued: int = 0
    refused: Counter[str] = field(default_factory=Counter)
    shadow_refused: Counter[str] = field(default_factory=Counter)


@dataclass(slots=True)
class Changes:
    """What operations changed since the journal last took them: whole records to write, and
    the slots whose recorded contents changed (`BlockPool.drain_dirty`)."""

    reservations: dict[tuple[str, str], ReservationRecord] = field(default_factory=dict)
    pins: dict[tuple[str, str], PinRecord | None] = field(default_factory=dict)
    slots: ContentColumns = field(default_factory=ContentColumns.empty)
    dropped_slots: list[int] = field(default_factory=list)
    usage: dict[str, Usage] = field(default_factory=dict)


class InstanceMachine:
    """The state machine of one instance. Refusals raise KvQuotaError and change nothing."""

    def __init__(
        self,
        spec: InstanceSpec,
        limits: AdmissionLimits,
        queue_policy: QueuePolicy | None = None,
        state: InstanceState = InstanceState.ACTIVE,
        pool: BlockPool | None = None,
    ) -> None:
        self.spec = spec
        self.state = state
        self.limits = limits
        self.queue_policy = queue_policy or QueuePolicy()
        self.pool = pool if pool is not None else BlockPool(spec.capacity_blocks)
        self.mean_hold_seconds: float | None = None
        self.tenants: dict[str, TenantHere] = {}
        self.reservations: dict[tuple[str, str], ReservationRecord] = {}
        # In the order they ended: an OrderedDict pops its oldest at once, where a dict's first
        # key is found by a scan of the keys deleted before it (~25 us a Release with 10,000).
        self.ended: OrderedDict[tuple[str, str], ReservationRecord] = OrderedDict()
        # The ids kept beyond them.
        self._ended_ids: set[int] = set()
        self._ended_ids_order: deque[int] = deque()
        self.pins: dict[tuple[str, str], PinRecord] = {}
        # The wait queue in dispatch order: (-priority, start tag, arrival) keys, kept sorted.
        self._queue: list[tuple[int, float, int, tuple[str, str]]] = []
        # Queued requests per priority class, so that "how many wait ahead" costs no scan.
        self._queued_at: Counter[int] = Counter()
        self._arrivals = 0
        self.virtual_time: dict[int, float] = {}
        self.queued_prompt_tokens = 0
        self._scope_ids: dict[str, int] = {}
        self.scopes: list[str] = []
        self.changes = Changes()
        self.drift_blocks = 0
        # How many tenants hold each slot (metering charges a block shared k ways 1/k to each):
        # the one that does when it is one, the set of them when it is more.
        self._holder_names: list[str] = []
        self.holdings = Holdings(
            spec.capacity_blocks, lambda holder: self.usage(self._holder_names[holder]).blocks
        )

    # Recovery.

    def image(self) -> InstanceImage:
        return InstanceImage(
            self.pool.contents_columns(),
            tuple(self.scopes),
            tuple(r.copy() for r in self.reservations.values()),
            tuple(p.copy() for p in self.pins.values()),
            dict(self.virtual_time),
            {
                name: TenantClocks(dict(here.last_finish), here.mean_hold_seconds)
                for name, here in self.tenants.items()
            },
            self.mean_hold_seconds,
            self.drift_blocks,
        )

    @classmethod
    def recover(
        cls,
        spec: InstanceSpec,
        limits: AdmissionLimits,
        tenants: Iterable[TenantSettings],
        image: InstanceImage,
        generation_floor: int,
        queue_policy: QueuePolicy | None = None,
        state: InstanceState = InstanceState.ACTIVE,
    ) -> InstanceMachine:
        """The machine an image describes. Free slots start at `generation_floor`, which the
        caller takes above every generation issued before (the new owner's epoch does)."""
        reservations = [r.copy() for r in image.reservations]
        pins = [p.copy() for p in image.pins]
        tables = [r.table for r in reservations if r.table is not None]
        tables += [p.table for p in pins]
        references = [(b, g, t.pinned) for t in tables for b, g in t.live_handles()]
        # The machine is made with the rebuilt pool: an empty one made first and then replaced
        # held a 1,000,000-slot instance's arrays twice for a moment (~75 MB).
        pool = BlockPool.rebuild(spec.capacity_blocks, generation_floor, image.slots, references)
        machine = cls(spec, limits, queue_policy, state, pool)
        for settings in tenants:
            machine.set_tenant(settings)
        for scope in image.scopes:
            machine._scope_id(scope)
        for record in reservations:
            here = machine.tenants[record.key[0]]
            machine.reservations[record.key] = record
            if record.table is not None:
                machine._hold(here, record.table.live_blocks(), False)
                here.tokens += record.tokens
            if record.state is ReservationState.QUEUED:
                machine._queue_insert(record)
                here.queued += 1
                machine.queued_prompt_tokens += record.params.prompt_tokens
            machine._arrivals = max(machine._arrivals, record.arrival)
        for pin in pins:
            machine.pins[(pin.owner, pin.pin_id)] = pin
            if pin.tenant is not None:
                machine._hold(machine.tenants[pin.tenant], pin.table.live_blocks(), True)
        machine.virtual_time = dict(image.virtual_time)
        for name, clocks in image.tenants.items():
            here = machine.tenants[name]
            here.last_finish = dict(clocks.last_finish)
            here.mean_hold_seconds = clocks.mean_hold_seconds
        machine.mean_hold_seconds = image.mean_hold_seconds
        machine.drift_blocks = image.drift_blocks
        # Rebuilding what tenants hold is not a change of it.
        machine.changes.usage.clear()
        return machine

    # Catalog input.

    def set_tenant(self, settings: TenantSettings) -> None:
        here = self.tenants.get(settings.tenant)
        if here is None:
            self.tenants[settings.tenant] = TenantHere(settings, len(self._holder_names))
            self._holder_names.append(settings.tenant)
        else:
            here.settings = settings

    def changes_pending(self) -> bool:
        """Whether anything changed since the journal last took the changes."""
        changes = self.changes
        return bool(changes.reservations or changes.pins or changes.usage or self.pool.dirty)

    def drain_changes(self) -> Changes:
        taken, self.changes = self.changes, Changes()
        taken.slots, taken.dropped_slots = self.pool.drain_dirty()
        return taken

    # Reads.

    def view(self) -> InstancePool:
        """The pool as admission decisions see it."""
        return InstancePool(
            self.spec.instance,
            self.state,
            self.spec.block_size,
            self.spec.capacity_blocks,
            self.spec.max_model_len,
            self.pool.free_count,
            self.pool.cached_count,
            self.spec.hash_algo,
            self.mean_hold_seconds,
        )

    def account(self, tenant: str, elsewhere: Elsewhere = NOWHERE_ELSE) -> TenantAccount:
        here = self._tenant(tenant)
        return TenantAccount(
            tenant,
            here.settings.state,
            here.settings.quota,
            elsewhere.blocks + here.blocks,
            elsewhere.tokens + here.tokens,
            here.mean_hold_seconds,
            elsewhere.pinned + len(here.pinned),
            here.settings.shadow_mode,
        )

    def held(self, tenant: str) -> dict[int, int]:
        """The slots the tenant holds here, with its live table entries on each (a scan)."""
        here = self.tenants.get(tenant)
        return {} if here is None else self.holdings.held_by(here.holder)

    def get(self, tenant: str, request_id: str) -> ReservationRecord:
        key = (tenant, request_id)
        record = self.reservations.get(key) or self.ended.get(key)
        if record is None:
            raise not_found(Reason.RESERVATION_NOT_FOUND, reservation_name(tenant, request_id))
        return record

    def knows(self, key: tuple[str, str]) -> bool:
        """Whether a reservation of this id is live here, or ended here lately (maybe: a kept
        id is a hash)."""
        return key in self.reservations or key in self.ended or hash(key) in self._ended_ids

    def forget_ended_id(self, key: tuple[str, str]) -> None:
        """The record has no reservation ended here under this id: its hash was another's."""
        self._ended_ids.discard(hash(key))

    def remember_ended(self, record: ReservationRecord) -> None:
        """Retain a reservation the record says ended on this instance that the machine does not
        know (it ended before the machine was rebuilt, which loads only live ones, or was
        forgotten since): operations on it then answer as for one that ended here, and ending
        it again (a Release whose answer was lost) returns it unchanged, not unknown."""
        if (
            record.state is not ReservationState.ENDED
            or record.params.instance != self.spec.instance
            or record.key in self.reservations
            or record.key in self.ended
        ):
            return
        self._retain_ended(record)

    def queue_position(self, record: ReservationRecord) -> int | None:
        """How many queued requests are ahead of it (0: the next to be considered); None unless
        it is queued."""
        if record.state is not ReservationState.QUEUED:
            return None
        for position, entry in enumerate(self._queue):
            if entry[3] == record.key:
                return position
        return None

    @property
    def queue_length(self) -> int:
        return len(self._queue)

    def queued(self) -> Iterator[ReservationRecord]:
        """Queued reservations in dispatch order."""
        for entry in self._queue:
            yield self.reservations[entry[3]]

    # Admission.

    def admit(
        self, request: AdmitRequest, now: float, elsewhere: Elsewhere = NOWHERE_ELSE
    ) -> ReservationRecord:
        """Reserve a block table now, queue the request when it has a wait budget, or refuse it.
        A repeated Admit (same tenant and request_id) answers the reservation as it is."""
        digest = admission.validate(request, self.limits)
        p = request.params
        key = (p.tenant, p.request_id)
        existing = self.reservations.get(key) or self.ended.get(key)
        if existing is not None:
            return self._replay(request, existing, now)
        if self._ended_ids and hash(key) in self._ended_ids:
            raise EndedBeforeMemory(key)
        here = self._tenant(p.tenant)
        table = self._layout(p, request.prompt_token_ids, here.settings)
        hit_blocks = self.pool_prefix(table.hit_candidates, here)
        verdict = admission.judge(
            request,
            self.view(),
            self.account(p.tenant, elsewhere),
            self.limits,
            table.total,
            self._hit_counts(hit_blocks, here),
        )
        ahead = self._queued_ahead(p.priority)
        # Requests already waiting go first: nobody jumps the queue, however small.
        if isinstance(verdict, Grant) and ahead == 0:
            record = ReservationRecord(request, verdict.blocks, verdict.tokens, 0.0, digest)
            self._charge_fair_share(record, here)
            self._grant(record, verdict, hit_blocks, table, here, now)
            return record
        shortfall = (
            verdict
            if isinstance(verdict, Shortfall)
            else Shortfall("instance", table.total, 0, self.view().allocatable_blocks, 0)
        )
        if shortfall.scope == "instance":
            shortfall = replace(shortfall, queued_ahead=ahead)
        if request.wait_timeout_seconds <= 0:
            raise self.refusal(shortfall, p.tenant, now, ahead)
        delay = self.queue_delay(ahead)
        load = queueing.QueueLoad(
            queued_requests=len(self._queue),
            queued_prompt_tokens=self.queued_prompt_tokens,
            max_queued_requests=self.spec.queue.max_queued_requests,
            max_queued_prompt_tokens=queueing.max_queued_prompt_tokens(
                self.spec.queue.target_ttft_seconds, self.spec.queue.prefill_tokens_per_second
            ),
            tenant_queued_requests=here.queued,
            tenant_max_queued_requests=here.settings.quota.max_queued_requests,
        )
        shadow_refusal = queueing.check_bounds(
            load, p.prompt_tokens, p.instance, p.tenant, delay, here.settings.shadow_mode
        )
        tokens = geometry.tokens_in_flight(p.prompt_tokens, p.max_output_tokens, p.n)
        ttl = request.lease_ttl_seconds or self.limits.default_lease_ttl_seconds
        record = ReservationRecord(request, table.total, tokens, ttl, digest)
        record.shadow_refusal = shadow_refusal
        self._enqueue(record, here, now, request.wait_timeout_seconds)
        self.dispatch(now)
        return record

    def _replay(
        self, request: AdmitRequest, existing: ReservationRecord, now: float
    ) -> ReservationRecord:
        admission.check_replay(request, existing.snapshot())
        if existing.state is ReservationState.QUEUED and request.wait_timeout_seconds > 0:
            # A retry keeps its place, and waits at least as long as this call will.
            assert existing.wait_deadline is not None
            existing.wait_deadline = max(existing.wait_deadline, now + request.wait_timeout_seconds)
            self._touch(existing)
        return existing

    def _layout(
        self, p: AdmitParams, token_ids: Sequence[int], settings: TenantSettings
    ) -> block_table.TableLayout:
        return block_table.layout(
            p.prompt_tokens,
            p.max_output_tokens,
            p.n,
            self.spec.block_size,
            token_ids,
            settings.salt,
            self.spec.hash_algo,
        )

    def pool_prefix(self, hashes: Sequence[bytes], tenant: TenantHere | None) -> list[int]:
        """The slots of the longest cached prefix of `hashes`. Where a hash is on several slots:
        the tenant's own copy, then one in use, then the lowest id."""
        pool = self.pool
        if tenant is None:

            def prefer(slots: list[int]) -> int:
                return min(slots, key=lambda b: (pool.ref_count(b) == 0, b))

        else:
            holds, holder = self.holdings.holds, tenant.holder

            def prefer(slots: list[int]) -> int:
                return min(slots, key=lambda b: (not holds(holder, b), pool.ref_count(b) == 0, b))

        return pool.cached_prefix(hashes, prefer)

    def _hit_counts(self, hit_blocks: Sequence[int], here: TenantHere | None) -> PrefixHits:
        distinct = list(dict.fromkeys(hit_blocks))
        new = len(distinct)
        if here is not None:
            new -= self.holdings.count_held(here.holder, distinct)
        return PrefixHits(len(hit_blocks), self.pool.unreferenced(hit_blocks), new)

    def _grant(
        self,
        record: ReservationRecord,
        grant: Grant,
        hit_blocks: Sequence[int],
        table: block_table.TableLayout,
        here: TenantHere,
        now: float,
    ) -> None:
        """Reference the cached prefix, allocate the rest, and make the reservation live."""
        record.table = self._take(hit_blocks, table, here, here.settings.scope, pinned=False)
        # The prompt was needed to hash it; the record keeps its digest only.
        record.prompt_token_ids = ()
        record.state = ReservationState.ADMITTED
        record.reserved_blocks = grant.blocks
        record.tokens = grant.tokens
        record.prefix_hit_blocks = len(hit_blocks)
        record.lease_ttl_seconds = grant.lease_ttl_seconds
        record.shadow_refusal = record.shadow_refusal or grant.shadow_refusal
        record.admitted_at = now
        record.lease_expires_at = now + grant.lease_ttl_seconds
        here.tokens += grant.tokens
        self.reservations[record.key] = record
        self._touch(record)
        usage = self.usage(here.settings.tenant)
        usage.admitted += 1
        usage.tokens_reserved += grant.tokens
        if record.shadow_refusal is not None:
            usage.shadow_refused[record.shadow_refusal] += 1

    def _take(
        self,
        hit_blocks: Sequence[int],
        table: block_table.TableLayout,
        here: TenantHere | None,
        scope: str,
        *,
        pinned: bool,
    ) -> HeldTable:
        """Reference the cached prefix and allocate the rest of a table; new hashed blocks are
        recorded under `scope`. `here` is the tenant charged (None: a namespace's pin)."""
        pool = self.pool
        pool.reference_all(hit_blocks, pinned)
        new = pool.allocate(
            block_table.new_block_hashes(table, len(hit_blocks)), self._scope_id(scope), pinned
        )
        blocks = [*hit_blocks, *new]
        held = HeldTable(blocks, pool.generations(blocks), pinned)
        if here is not None:
            self._hold(here, blocks, pinned)
        return held

    def _hold(self, here: TenantHere, blocks: Sequence[int], pinned: bool) -> None:
        here.blocks += self.holdings.hold(here.holder, blocks)
        if pinned:
            self.usage(here.settings.tenant).pinned += len(_count(here.pinned, blocks))

    def _drop(self, table: HeldTable, positions: Sequence[int], here: TenantHere | None) -> None:
        """Give back the table's entries at `positions` (ascending), tail first, so that a
        table's tail is evicted before its head."""
        blocks, released = table.blocks, table.released
        if len(positions) == len(blocks):  # the whole table
            tail_first = blocks[::-1].tolist()
            released[:] = b"\x01" * len(released)
        else:
            tail_first = [blocks[position] for position in reversed(positions)]
            for position in positions:
                released[position] = 1
        table.live_entries -= len(positions)
        self.pool.unreference_all(tail_first, table.pinned)
        if here is not None:
            here.blocks -= self.holdings.release(here.holder, tail_first)
            if table.pinned:
                self.usage(here.settings.tenant).pinned -= len(_unhold(here.pinned, tail_first))

    def _drop_all(self, table: HeldTable, here: TenantHere | None) -> None:
        released = table.released
        if table.live_entries == len(released):
            self._drop(table, range(len(released)), here)
        else:
            self._drop(table, [i for i in range(len(released)) if not released[i]], here)

    # Retry delays.

    def refusal(
        self, shortfall: Shortfall, tenant: str | None, now: float, ahead: int = 0
    ) -> KvQuotaError:
        """The refusal for a shortfall, with a retry delay from the live holdings: the time until
        enough of them are expected to end; with requests queued ahead, at least what Little's
        law gives for those to be served."""
        here = self.tenants.get(tenant) if tenant is not None else None
        if shortfall.scope == "tenant":
            assert here is not None
            mean_hold = here.mean_hold_seconds
            live = [r for r in self.reservations.values() if r.on_gpu and r.key[0] == tenant]
        else:
            mean_hold = self.mean_hold_seconds
            live = [r for r in self.reservations.values() if r.on_gpu]
        holdings = [
            Holding(
                admission.expected_end(
                    _moment(r.admitted_at), _moment(r.lease_expires_at), mean_hold
                ),
                r.reserved_blocks,
                r.tokens,
            )
            for r in live
        ]
        delay = admission.retry_delay(shortfall, holdings, _moment(now), self.limits)
        if ahead:
            by_queue = queueing.queue_delay(ahead, mean_hold, len(live), self.limits)
            delay = max(delay, by_queue) if by_queue is not None else delay
        return admission.shortfall_error(shortfall, delay, tenant or "", self.spec.instance)

    def queue_delay_at(self, priority: int) -> float:
        """The retry delay for a caller leaving the queue at `priority`: what those still
        waiting at or above it are expected to take."""
        return self.queue_delay(self._queued_ahead(priority))

    def queue_delay(self, ahead: int) -> float:
        live = sum(1 for r in self.reservations.values() if r.on_gpu)
        delay = queueing.queue_delay(ahead, self.mean_hold_seconds, live, self.limits)
        return delay if delay is not None else self.limits.min_retry_delay_seconds

    # The wait queue.

    def _queued_ahead(self, priority: int) -> int:
        """Requests queued at this priority or higher."""
        return sum(count for queued, count in self._queued_at.items() if queued >= priority)

    def _charge_fair_share(self, record: ReservationRecord, here: TenantHere) -> None:
        """Every admission is charged to its tenant's fair clock, queued or not: a tenant whose
        requests are admitted straight away must not find its next queued one at the front."""
        self._tag(record, here)
        self._advance_virtual_time(record)

    def _advance_virtual_time(self, record: ReservationRecord) -> None:
        """The class's virtual time is the start tag of the request admitted last."""
        priority = record.params.priority
        self.virtual_time[priority] = max(self.virtual_time.get(priority, 0.0), record.tags.start)

    def _tag(self, record: ReservationRecord, here: TenantHere) -> None:
        """Its start and finish tags; its tenant's next request starts after this one."""
        priority = record.params.priority
        record.tags = queueing.fair_tags(
            self.virtual_time.get(priority, 0.0),
            here.last_finish.get(priority, 0.0),
            record.tokens,
            here.settings.weight,
        )
        here.last_finish[priority] = record.tags.finish

    def _enqueue(
        self, record: ReservationRecord, here: TenantHere, now: float, wait: float
    ) -> None:
        self._tag(record, here)
        record.state = ReservationState.QUEUED
        record.queued_at = now
        record.wait_deadline = now + wait
        self._arrivals += 1
        record.arrival = self._arrivals
        self._queue_insert(record)
        here.queued += 1
        self.queued_prompt_tokens += record.params.prompt_tokens
        self.reservations[record.key] = record
        self._touch(record)
        self.usage(here.settings.tenant).queued += 1

    def _queue_insert(self, record: ReservationRecord) -> None:
        insort(self._queue, _queue_entry(record))
        self._queued_at[record.params.priority] += 1

    def _dequeue(self, record: ReservationRecord) -> None:
        self._queue.remove(_queue_entry(record))
        self._queued_at[record.params.priority] -= 1
        here = self.tenants[record.key[0]]
        here.queued -= 1
        self.queued_prompt_tokens -= record.params.prompt_tokens

    def dispatch(self, now: float, elsewhere: dict[str, Elsewhere] | None = None) -> int:
        """Admit what fits from the head of the queue, in order (core.queueing's rules); a
        request whose wait budget ran out leaves it (QUEUE_TIMEOUT). Returns how many."""
        admitted = 0
        rules = queueing.DispatchPass(self.queue_policy.max_bypass_wait_seconds)
        batch = self._queue[: self.queue_policy.dispatch_batch]
        head = [self.reservations[entry[3]] for entry in batch]
        for record in head:
            assert record.wait_deadline is not None and record.queued_at is not None
            if record.wait_deadline <= now:
                self.end(*record.key, EndReason.QUEUE_TIMEOUT, now)
                continue
            here = self.tenants[record.key[0]]
            p = record.params
            token_ids = admission.prompt_of(record.prompt_token_ids, p.prompt_tokens)
            request = AdmitRequest(p, token_ids, 0.0, record.lease_ttl_seconds)
            table = self._layout(p, token_ids, here.settings)
            hit_blocks = self.pool_prefix(table.hit_candidates, here)
            other = (elsewhere or {}).get(p.tenant, NOWHERE_ELSE)
            try:
                verdict = admission.judge(
                    request,
                    self.view(),
                    self.account(p.tenant, other),
                    self.limits,
                    table.total,
                    self._hit_counts(hit_blocks, here),
                )
            except KvQuotaError:
                # Suspended, draining, or a quota cut below it: it waits (or times out) in place.
                continue
            step = rules.step(p.priority, record.tags, verdict, now - record.queued_at)
            if step is queueing.Step.ADMIT:
                assert isinstance(verdict, Grant)
                self._dequeue(record)
                self._advance_virtual_time(record)
                if record.offloaded_bytes is not None:
                    self._back_from_cpu_tier(record)
                self._grant(record, verdict, hit_blocks, table, here, now)
                admitted += 1
            elif step is queueing.Step.HOLD:
                break
        return admitted

    # Ending and changing reservations.

    def end(
        self,
        tenant: str,
        request_id: str,
        reason: EndReason,
        now: float,
        output_tokens: int | None = None,
    ) -> ReservationRecord:
        """End a live reservation: a queued one leaves the queue, an admitted one gives back its
        table, tail first. Ending an ended reservation returns it unchanged. A resumed session
        whose wait ran out is not ended: it goes back to the CPU tier, suspended."""
        record = self.get(tenant, request_id)
        if record.state is ReservationState.ENDED:
            return record
        here = self.tenants[tenant]
        usage = self.usage(tenant)
        if record.state is ReservationState.QUEUED:
            self._dequeue(record)
            if reason is EndReason.QUEUE_TIMEOUT:
                if record.offloaded_bytes is not None:
                    record.state = ReservationState.ADMITTED
                    record.suspended_at = now
                    self._touch(record)
                    return record
                usage.refused[Reason.QUEUE_TIMEOUT.value] += 1
        else:
            if record.table is not None:
                if reason is EndReason.PREEMPTED:
                    # What the reclaim that preempted it really freed: the slots it held last.
                    pool = self.pool
                    record.freed_blocks = sum(
                        1 for b in record.table.live_blocks() if pool.ref_count(b) == 1
                    )
                self._drop_all(record.table, here)
                here.tokens -= record.tokens
            if reason is EndReason.RELEASED:
                assert record.admitted_at is not None
                held_for = max(now - record.admitted_at, 0.0)
                here.mean_hold_seconds = _ewma(here.mean_hold_seconds, held_for)
                self.mean_hold_seconds = _ewma(self.mean_hold_seconds, held_for)
        if record.offloaded_bytes is not None:
            usage.cpu_bytes -= record.offloaded_bytes
            usage.compressed_bytes -= record.compressed_bytes or 0
        usage.output_tokens += output_tokens or 0
        record.state = ReservationState.ENDED
        record.end_reason = reason
        record.ended_at = now
        record.output_tokens = output_tokens
        record.table = None
        del self.reservations[record.key]
        self._retain_ended(record)
        self._touch(record)
        if self._queue:
            self.dispatch(now)
        return record

    def release_blocks(
        self, tenant: str, request_id: str, handles: Sequence[BlockHandle], now: float
    ) -> ReservationRecord:
        """Give back chosen entries of a live table early; repeating one changes nothing."""
        record = self.get(tenant, request_id)
        if record.state is not ReservationState.ADMITTED:
            raise admission.not_live(record.snapshot())
        table = record.table  # None while offloaded: nothing of it is on the GPU
        entries = zip(table.blocks, table.generations, strict=True) if table is not None else ()
        positions = {(b, g): i for i, (b, g) in enumerate(entries)}
        lookups = []
        for handle in handles:
            position = positions.get((handle.block_id, handle.generation))
            known = 0 <= handle.block_id < self.pool.capacity
            lookups.append(
                EntryLookup(
                    handle,
                    position,
                    table is not None and position is not None and bool(table.released[position]),
                    self.pool.generation(handle.block_id) if known else None,
                )
            )
        chosen = block_table.positions_to_release(record.name, lookups)
        if chosen:
            assert table is not None
            self._drop(table, chosen, self.tenants[tenant])
            record.reserved_blocks -= len(chosen)
            self._touch(record)
            if self._queue:
                self.dispatch(now)
        return record

    def renew(
        self, tenant: str, request_id: str, ttl_seconds: float | None, now: float
    ) -> ReservationRecord:
        record = self.get(tenant, request_id)
        self._check_admitted(record, now)
        violation = admission.check_lease_ttl(ttl_seconds, self.limits)
        if violation:
            raise invalid_request([violation])
        if ttl_seconds is not None:
            record.lease_ttl_seconds = ttl_seconds
        record.lease_expires_at = now + record.lease_ttl_seconds
        self._touch(record)
        return record

    def _check_admitted(self, record: ReservationRecord, now: float) -> None:
        """A live admitted reservation whose lease has not run out, or why not."""
        if record.state is ReservationState.ADMITTED and (
            record.lease_expires_at is not None and record.lease_expires_at > now
        ):
            return
        raise admission.not_live(record.snapshot())

    def reap(self, now: float, limit: int | None = None) -> int:
        """End (up to `limit`) reservations whose lease ran out and queued ones whose wait
        budget did. On an instance with an engine, a lapsed lease is ended once the engine
        aborted its request (enforcement/termination.py), not here."""
        aborted_first = self.spec.engine is not None
        lapsed = [
            r
            for r in self.reservations.values()
            if (
                r.state is ReservationState.ADMITTED
                and not aborted_first
                and (r.lease_expires_at or now) <= now
            )
            or (r.state is ReservationState.QUEUED and (r.wait_deadline or now) <= now)
        ][:limit]
        for record in lapsed:
            reason = (
                EndReason.LEASE_EXPIRED
                if record.state is ReservationState.ADMITTED
                else EndReason.QUEUE_TIMEOUT
            )
            self.end(*record.key, reason, now)
        return len(lapsed)

    # Sessions idle between turns, and the CPU tier.

    def suspend(
        self, tenant: str, request_id: str, now: float, session_token_ids: Sequence[int] = ()
    ) -> ReservationRecord:
        """Mark an admitted reservation idle between turns (a reclaim may then offload it); the
        session's tokens, when given, say what the CPU tier holds of it. Idempotent."""
        record = self.get(tenant, request_id)
        self._check_admitted(record, now)
        refuse_invalid(admission.check_session_tokens(record.snapshot(), session_token_ids))
        if record.suspended_at is None:
            record.suspended_at = now
        if session_token_ids:
            record.prompt_token_ids = tuple(session_token_ids)
        self._touch(record)
        return record

    def offload(self, tenant: str, request_id: str, offloaded_bytes: int) -> int | None:
        """A suspended reservation's blocks leave the GPU (the CPU tier holds its contents) and
        its tokens leave the tenant's tokens in flight; it stays live. Returns how many of its
        slots left the GPU (referenced by nothing now: a slot another table shares, or a pin
        holds, stays), or None when it is not suspended on the GPU."""
        record = self.reservations.get((tenant, request_id))
        if record is None or not record.on_gpu or record.suspended_at is None:
            return None
        table = record.table
        assert table is not None
        here = self.tenants[tenant]
        held = set(table.live_blocks())
        self._drop_all(table, here)
        here.tokens -= record.tokens
        record.table = None
        record.offloaded_bytes = offloaded_bytes
        self.usage(tenant).cpu_bytes += offloaded_bytes
        self._touch(record)
        return sum(1 for block in held if self.pool.ref_count(block) == 0)

    def compress(
        self, tenant: str, request_id: str, kept: int, compressed: int, before: int, after: int
    ) -> bool:
        """A COMPRESS step's session demoted in the CPU tier: `kept` bytes stay as they are,
        `compressed` are held compressed (LMCache measured `before` and `after` of them). False
        when it is no longer offloaded and suspended, or was compressed already."""
        record = self.reservations.get((tenant, request_id))
        if (
            record is None
            or record.state is not ReservationState.ADMITTED
            or record.suspended_at is None
            or record.offloaded_bytes is None
            or record.compressed_bytes is not None
        ):
            return False
        usage = self.usage(tenant)
        usage.cpu_bytes += kept - record.offloaded_bytes
        usage.compressed_bytes += compressed
        record.offloaded_bytes = kept
        record.compressed_bytes = compressed
        record.compress_before_bytes = before
        record.compress_after_bytes = after
        self._touch(record)
        return True

    def _back_from_cpu_tier(self, record: ReservationRecord) -> None:
        """An offloaded session admitted again: the CPU tier no longer holds it for it."""
        assert record.offloaded_bytes is not None
        usage = self.usage(record.key[0])
        usage.cpu_bytes -= record.offloaded_bytes
        usage.compressed_bytes -= record.compressed_bytes or 0
        record.offloaded_bytes = None
        record.compressed_bytes = None
        record.compress_before_bytes = record.compress_after_bytes = None
        record.suspended_at = None

    def resume(
        self,
        tenant: str,
        request_id: str,
        wait_seconds: float,
        now: float,
        elsewhere: Elsewhere = NOWHERE_ELSE,
    ) -> ReservationRecord:
        """End a suspension. An offloaded reservation goes back through the queue: admitted at
        once when it fits and nobody waits ahead; otherwise it waits (with a budget) or is
        refused and stays offloaded (without one)."""
        record = self.get(tenant, request_id)
        resuming = record.offloaded_bytes is not None
        if record.state is ReservationState.QUEUED and resuming:
            return record  # a retried resume waits where the first one queued it
        self._check_admitted(record, now)
        here = self.tenants[tenant]
        if here.settings.state in (TenantState.DELETING, TenantState.DELETED):
            # Offboarding ends an idle session without asking its engine to abort it: it must
            # not start running again.
            raise admission.tenant_not_active(tenant, here.settings.state)
        if not resuming:
            record.suspended_at = None
            self._touch(record)
            return record
        p = record.params
        # The session's tokens, when its suspension gave them, find what is still cached of it.
        token_ids = admission.prompt_of(record.prompt_token_ids, p.prompt_tokens)
        request = AdmitRequest(p, token_ids, 0.0, record.lease_ttl_seconds)
        table = self._layout(p, token_ids, here.settings)
        hit_blocks = self.pool_prefix(table.hit_candidates, here)
        verdict = admission.judge(
            request,
            self.view(),
            self.account(tenant, elsewhere),
            self.limits,
            table.total,
            self._hit_counts(hit_blocks, here),
        )
        ahead = self._queued_ahead(p.priority)
        if isinstance(verdict, Grant) and ahead == 0:
            self._back_from_cpu_tier(record)
            self._charge_fair_share(record, here)
            self._grant(record, verdict, hit_blocks, table, here, now)
            return record
        if wait_seconds <= 0:
            shortfall = (
                verdict
                if isinstance(verdict, Shortfall)
                else Shortfall("instance", table.total, 0, 0, 0, queued_ahead=ahead)
            )
            raise self.refusal(shortfall, tenant, now, ahead)
        self._enqueue(record, here, now, wait_seconds)
        return record

    # Pins.

    def pin(
        self,
        owner: str,
        pin_id: str,
        token_ids: Sequence[int],
        salt: str,
        scope: str,
        tenant: str | None,
        now: float,
        elsewhere: Elsewhere = NOWHERE_ELSE,
    ) -> PinRecord:
        """Hold a prefix's blocks resident. The same pin again is answered as it is; another
        prefix under the same id is refused (PIN_ID_REUSED)."""
        pins.check_prefix(token_ids, self.spec.block_size)
        hashes = block_hashes(token_ids, self.spec.block_size, salt, self.spec.hash_algo)
        existing = self.pins.get((owner, pin_id))
        if existing is not None:
            if existing.prefix != hashes[-1]:
                raise pins.pin_id_reused(owner, pin_id)
            return existing
        here = self.tenants[tenant] if tenant is not None else None
        hit_blocks = self.pool_prefix(hashes, here)
        hits = [self._cached_block(hashes[i], b, here) for i, b in enumerate(hit_blocks)]
        account = self.account(tenant, elsewhere) if tenant is not None else None
        plan = pins.decide(hashes, hits, self.view(), account)
        if isinstance(plan, Shortfall):
            raise self.refusal(plan, tenant, now)
        layout = block_table.TableLayout(len(hashes), 0, 1, tuple(hashes), len(hashes))
        table = self._take(hit_blocks, layout, here, scope, pinned=True)
        record = PinRecord(
            owner, pin_id, tenant, hashes[-1], len(token_ids), table, now, tuple(token_ids), salt
        )
        self.pins[(owner, pin_id)] = record
        self.changes.pins[(owner, pin_id)] = record
        return record

    def _cached_block(self, digest: bytes, block: int, here: TenantHere | None) -> CachedBlock:
        return CachedBlock(
            digest,
            BlockHandle(block, self.pool.generation(block)),
            self.pool.ref_count(block) == 0,
            here is not None and self.holdings.holds(here.holder, block),
            here is not None and block in here.pinned,
        )

    def unpin(self, owner: str, pin_id: str, now: float) -> PinRecord | None:
        """Let a prefix go; unpinning twice changes nothing."""
        record = self.pins.pop((owner, pin_id), None)
        if record is None:
            return None
        here = self.tenants.get(record.tenant) if record.tenant is not None else None
        self._drop_all(record.table, here)
        self.changes.pins[(owner, pin_id)] = None
        if self._queue:
            self.dispatch(now)
        return record

    # Reclaim and offboarding.

    def free_cached(
        self, limit: int, scope: str | None = None, keep: frozenset[str] = frozenset()
    ) -> int:
        """Drop up to `limit` cached, unreferenced blocks (only a scope's when given), least
        recently used first, those of the scopes in `keep` (whose tenants have work here) after
        all others; returns how many."""
        pool = self.pool
        order = pool.lru_order()
        if scope is not None:
            scope_id = self._scope_ids.get(scope)
            order = [b for b in order if pool.scope_id(b) == scope_id]
        if keep:
            kept = {self._scope_ids[k] for k in keep if k in self._scope_ids}
            order.sort(key=lambda b: pool.scope_id(b) in kept)  # stable: LRU within each
        chosen = order[:limit]
        for block in chosen:
            pool.drop_contents(block)
        return len(chosen)

    def active_scopes(self) -> frozenset[str]:
        """The scopes (own and namespace salts) of tenants with admitted reservations here."""
        scopes = set()
        for (tenant, _), record in self.reservations.items():
            if record.state is ReservationState.ADMITTED:
                scopes.add(f"tenants/{tenant}")
                scopes.add(self.tenants[tenant].settings.scope)
        return frozenset(scopes)

    def cached_in_scope(self, scope: str) -> int:
        """Cached blocks whose hash was made under `scope` (a tenant's or a namespace's)."""
        scope_id = self._scope_ids.get(scope)
        if scope_id is None:
            return 0
        pool = self.pool
        return sum(1 for b in pool.lru_order() if pool.scope_id(b) == scope_id)

    def scope_id(self, scope: str) -> int | None:
        """The id slots carry for `scope`, if any slot was ever hashed under it."""
        return self._scope_ids.get(scope)

    def preempt(self, tenant: str, request_id: str, now: float) -> ReservationRecord:
        """A reclaim's EVICT step: the engine aborted the request; its blocks come back."""
        return self.end(tenant, request_id, EndReason.PREEMPTED, now)

    def offboard(self, tenant: str, now: float) -> None:
        """End everything a tenant has here: its reservations (TENANT_DELETED), its pins, and the
        cached contents of its own scope."""
        for key in [k for k in self.reservations if k[0] == tenant]:
            self.end(*key, EndReason.TENANT_DELETED, now)
        for key in [k for k, pin in self.pins.items() if pin.tenant == tenant]:
            self.unpin(*key, now)
        scope = f"tenants/{tenant}"
        self.free_cached(self.pool.capacity, scope)
        scope_id = self.scope_id(scope)
        if scope_id is not None:  # nor are its contents cached again later
            self.pool.forget_displaced_scope(scope_id)

    # The engine.

    def apply_engine_events(self, batch: EventBatch) -> EngineReport:
        """Follow what the engine reports it holds (GPU events only). Neither the engine nor the
        ledger de-duplicates identical blocks, and an event names a hash, not a block, so each
        event's copies of a hash land on one slot: a stored copy on the slot with the fewest
        copies (a referenced one first, then the lowest id); an evicted copy comes off an
        unreferenced slot first (the engine evicts only those), one with counted copies before
        one without. A slot whose last copy went is freed if nothing references it, else it is
        drift. Contents an allocation displaced lose their copies before any slot does (they
        were the engine's least recently used). A cleared cache frees every cached slot."""
        freed = drift = 0
        pool = self.pool
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                freed += self.engine_forgotten()
                continue
            if event.medium not in (None, "GPU"):
                continue
            for key, copies in Counter(event.block_hashes).items():
                slots = pool.holding_key(key)
                if isinstance(event, BlockStored):
                    if slots:
                        chosen = min(
                            slots, key=lambda b: (pool.engine_copies(b), pool.ref_count(b) == 0, b)
                        )
                        pool.add_copies(chosen, copies)
                    continue
                copies -= pool.evicted_displaced(key, copies)
                if not copies:
                    continue
                candidates = [
                    b for b in slots if pool.engine_copies(b) > 0 or pool.ref_count(b) == 0
                ]
                if not candidates:
                    continue
                chosen = min(
                    candidates,
                    key=lambda b: (pool.ref_count(b) > 0, pool.engine_copies(b) == 0, b),
                )
                if pool.remove_copies(chosen, copies):
                    continue
                if pool.ref_count(chosen) == 0:
                    pool.drop_contents(chosen)
                    freed += 1
                else:
                    drift += 1
        self.drift_blocks += drift
        return EngineReport(freed, drift)

    def engine_forgotten(self) -> int:
        """The engine holds nothing (a cleared cache, a resynchronisation): no copies anywhere,
        and every cached block is freed. Returns how many were."""
        self.pool.clear_copies()
        return self.free_cached(self.pool.capacity)

    # Metering.

    def usage(self, tenant: str) -> Usage:
        """The tenant's use changed since the journal last took it (the counters add to it)."""
        found = self.changes.usage.get(tenant)
        if found is None:
            found = self.changes.usage[tenant] = Usage()
        return found

    def meter_refusal(self, tenant: str, reason: Reason) -> None:
        """A refused admission, counted (the refusal itself changed nothing)."""
        if tenant in self.tenants:
            self.usage(tenant).refused[reason.value] += 1

    # Mechanics.

    def _tenant(self, tenant: str) -> TenantHere:
        here = self.tenants.get(tenant)
        if here is None:
            raise not_found(Reason.TENANT_NOT_FOUND, f"tenants/{tenant}")
        return here

    def _scope_id(self, scope: str) -> int:
        known = self._scope_ids.get(scope)
        if known is None:
            known = self._scope_ids[scope] = len(self.scopes)
            self.scopes.append(scope)
        return known

    def _retain_ended(self, record: ReservationRecord) -> None:
        self.ended[record.key] = record
        if len(self.ended) <= ENDED_RETAINED:
            return
        oldest, _ = self.ended.popitem(last=False)
        forgotten = hash(oldest)
        self._ended_ids.add(forgotten)
        self._ended_ids_order.append(forgotten)
        if len(self._ended_ids_order) > ENDED_IDS_RETAINED:
            self._ended_ids.discard(self._ended_ids_order.popleft())

    def _touch(self, record: ReservationRecord) -> None:
        self.changes.reservations[record.key] = record


def _queue_entry(record: ReservationRecord) -> tuple[int, float, int, tuple[str, str]]:
    """Its key in the queue's dispatch order: priority (highest first), start tag, arrival."""
    return -record.params.priority, record.tags.start, record.arrival, record.key


def _count(held: dict[int, int], blocks: Sequence[int]) -> Sequence[int]:
    """One entry more per block (a table names each block once); returns the blocks that were
    not held before."""
    if held.keys().isdisjoint(blocks):
        # The common case, done in C: none of them held yet.
        held.update(dict.fromkeys(blocks, 1))
        return blocks
    new = []
    for block in blocks:
        count = held.get(block, 0)
        if not count:
            new.append(block)
        held[block] = count + 1
    return new


def _unhold(held: dict[int, int], blocks: Sequence[int]) -> Sequence[int]:
    """One entry fewer per block; a block leaves with its last entry. Returns the blocks that
    left."""
    if len(blocks) > 1 and max(itemgetter(*blocks)(held)) == 1:
        # The common case, done in C: each was held by this one entry.
        deque(map(held.pop, blocks), maxlen=0)
        return blocks
    gone = []
    for block in blocks:
        left = held[block] - 1
        if left:
            held[block] = left
        else:
            del held[block]
            gone.append(block)
    return gone


def _ewma(mean: float | None, observed: float) -> float:
    if mean is None:
        return observed
    return (1 - HOLD_EWMA_ALPHA) * mean + HOLD_EWMA_ALPHA * observed


def _time(seconds: float | None) -> datetime | None:
    return None if seconds is None else datetime.fromtimestamp(seconds, UTC)


def _moment(seconds: float | None) -> datetime:
    """A time that is always set where it is read (a live reservation's admission, say)."""
    assert seconds is not None
    return datetime.fromtimestamp(seconds, UTC)
