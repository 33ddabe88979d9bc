"""A pure in-memory reference model of the ledger's block pools: what every operation must do to
every block, written independently of the SQL that does it. The stateful test runs both side by
side and compares them block by block after every step.

It shares only the pure decisions with the service (`core`: table layout, admission and pin
checks, which have their own unit tests); allocation, references, eviction order, tombstoning
and counting are modelled here from DESIGN.md and vLLM's block pool semantics.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from quota_service.core import admission, block_table, pins
from quota_service.core.admission import AdmissionLimits, AdmitRequest, Shortfall
from quota_service.core.block_table import BlockHandle, CachedBlock, EntryLookup
from quota_service.core.errors import KvQuotaError
from quota_service.core.hashing import HashAlgo, block_hashes
from quota_service.core.model import (
    AdmitParams,
    InstancePool,
    InstanceState,
    TenantAccount,
    TenantQuota,
    TenantState,
)

LRU_SPAN = 1 << 20


@dataclass
class Slot:
    generation: int = 0
    ref_count: int = 0
    pin_count: int = 0
    content_hash: bytes | None = None
    hash_scope: str | None = None
    lru: int | None = None

    @property
    def state(self) -> str:
        if self.ref_count == 0:
            return "FREE" if self.content_hash is None else "CACHED"
        return "PINNED" if self.ref_count == self.pin_count else "IN_USE"


@dataclass
class Entry:
    position: int
    block_id: int
    generation: int
    pinned: bool
    released: bool = False


@dataclass
class Holder:
    """A reservation or a pin: its entries, and the tenant charged for them (None: a namespace)."""

    instance: str
    tenant: str | None
    entries: list[Entry]
    live: bool = True
    tokens: int = 0
    params: AdmitParams | None = None
    token_ids: tuple[int, ...] = ()  # a reservation's prompt as its Admit gave it
    prefix: bytes | None = None


@dataclass
class Tenant:
    salt: str
    quota: TenantQuota
    namespace: str | None = None
    state: TenantState = TenantState.ACTIVE


@dataclass
class Model:
    limits: AdmissionLimits
    block_size: int
    slots: dict[str, list[Slot]] = field(default_factory=dict)
    tenants: dict[str, Tenant] = field(default_factory=dict)
    namespaces: dict[str, str] = field(default_factory=dict)
    reservations: dict[tuple[str, str], Holder] = field(default_factory=dict)
    pins: dict[tuple[str, str], Holder] = field(default_factory=dict)
    lru_clock: int = 0

    # What the service's counters must say.

    def counts(self, instance: str) -> dict[str, int]:
        found = {"FREE": 0, "CACHED": 0, "IN_USE": 0, "PINNED": 0}
        for slot in self.slots[instance]:
            found[slot.state] += 1
        return found

    def tenant_blocks(self, tenant: str) -> tuple[int, int]:
        """Distinct blocks its live entries reference, and how many of them it pins."""
        held: set[tuple[str, int]] = set()
        pinned: set[tuple[str, int]] = set()
        for holder in self._live_holders():
            if holder.tenant != tenant:
                continue
            for e in holder.entries:
                if not e.released:
                    held.add((holder.instance, e.block_id))
                    if e.pinned:
                        pinned.add((holder.instance, e.block_id))
        return len(held), len(pinned)

    def tokens(self, tenant: str) -> int:
        return sum(h.tokens for (t, _), h in self.reservations.items() if t == tenant and h.live)

    # Operations: each returns the refusal reason, or None when it took effect.

    def admit(self, params: AdmitParams, token_ids: Sequence[int]) -> str | None:
        request = AdmitRequest(params, tuple(token_ids), 0.0, None)
        try:
            admission.validate(request, self.limits)
            existing = self.reservations.get((params.tenant, params.request_id))
            if existing is not None:
                assert existing.params is not None
                if (existing.params, existing.token_ids) != (params, tuple(token_ids)):
                    return "REQUEST_ID_REUSED"
                # A repeat after it ended is refused: an OK would read as admitted.
                return None if existing.live else "RESERVATION_ENDED"
            tenant = self.tenants[params.tenant]
            salt, scope = self._salt(params.tenant)
            table = block_table.layout(
                params.prompt_tokens,
                params.max_output_tokens,
                params.n,
                self.block_size,
                token_ids,
                salt,
                HashAlgo.SHA256,
            )
            hits = self._prefix(params.instance, params.tenant, table.hit_candidates)
            plan = admission.decide(
                request,
                self._pool(params.instance),
                self._account(params.tenant, tenant),
                self.limits,
                table,
                hits,
            )
        except KvQuotaError as refusal:
            return refusal.reason
        if isinstance(plan, Shortfall):
            return "TENANT_QUOTA_EXCEEDED" if plan.scope == "tenant" else "INSTANCE_OVERLOADED"
        entries = self._allocate(params.instance, hits, plan.new_hashes, scope, pinned=False)
        self.reservations[(params.tenant, params.request_id)] = Holder(
            params.instance,
            params.tenant,
            entries,
            tokens=plan.tokens,
            params=params,
            token_ids=tuple(token_ids),
        )
        return None

    def end(self, tenant: str, request_id: str) -> None:
        holder = self.reservations.get((tenant, request_id))
        if holder is None or not holder.live:
            return
        holder.live = False
        self._drop(holder, [e for e in holder.entries if not e.released])

    def release_blocks(
        self, tenant: str, request_id: str, handles: Sequence[BlockHandle]
    ) -> str | None:
        holder = self.reservations[(tenant, request_id)]
        if not holder.live:
            return "RESERVATION_ENDED"
        lookups = []
        for handle in handles:
            entry = next(
                (
                    e
                    for e in holder.entries
                    if (e.block_id, e.generation) == (handle.block_id, handle.generation)
                ),
                None,
            )
            slot = self.slots[holder.instance][handle.block_id]
            lookups.append(
                EntryLookup(
                    handle,
                    entry.position if entry else None,
                    entry.released if entry else None,
                    slot.generation,
                )
            )
        try:
            positions = block_table.positions_to_release(f"{tenant}/{request_id}", lookups)
        except KvQuotaError as refusal:
            return refusal.reason
        dropped = [e for e in holder.entries if e.position in positions and not e.released]
        for e in dropped:
            e.released = True
        self._drop(holder, dropped)
        return None

    def pin(self, owner: str, pin_id: str, instance: str, token_ids: Sequence[int]) -> str | None:
        collection, owner_id = owner.split("/", 1)
        tenant = owner_id if collection == "tenants" else None
        salt, scope = self._salt(tenant) if tenant else (self.namespaces[owner_id], owner)
        hashes = block_hashes(token_ids, self.block_size, salt, HashAlgo.SHA256)
        existing = self.pins.get((owner, pin_id))
        if existing is not None and existing.live:
            same = existing.prefix == hashes[-1] and existing.instance == instance
            return None if same else "PIN_ID_REUSED"
        hits = self._prefix(instance, tenant, hashes)
        account = self._account(tenant, self.tenants[tenant]) if tenant else None
        try:
            plan = pins.decide(hashes, hits, self._pool(instance), account)
        except KvQuotaError as refusal:
            return refusal.reason
        if isinstance(plan, Shortfall):
            return "TENANT_QUOTA_EXCEEDED" if plan.scope == "tenant" else "INSTANCE_OVERLOADED"
        entries = self._allocate(instance, hits, plan.new_hashes, scope, pinned=True)
        self.pins[(owner, pin_id)] = Holder(instance, tenant, entries, prefix=hashes[-1])
        return None

    def unpin(self, owner: str, pin_id: str) -> None:
        holder = self.pins.get((owner, pin_id))
        if holder is None or not holder.live:
            return
        holder.live = False
        self._drop(holder, list(holder.entries))

    def offboard(self, tenant: str) -> None:
        model = self.tenants[tenant]
        if model.state is TenantState.DELETED:
            return
        model.state = TenantState.DELETING
        for (t, request_id), holder in list(self.reservations.items()):
            if t == tenant and holder.live:
                self.end(t, request_id)
        for (owner, pin_id), holder in list(self.pins.items()):
            if holder.tenant == tenant and holder.live:
                self.unpin(owner, pin_id)
        scope = f"tenants/{tenant}"
        for slots in self.slots.values():
            for slot in slots:
                if slot.state == "CACHED" and slot.hash_scope == scope:
                    slot.generation += 1
                    slot.content_hash = slot.hash_scope = slot.lru = None
        model.state = TenantState.DELETED
        model.namespace = None

    # Mechanics.

    def _live_holders(self) -> list[Holder]:
        return [h for h in (*self.reservations.values(), *self.pins.values()) if h.live]

    def _salt(self, tenant: str) -> tuple[str, str]:
        model = self.tenants[tenant]
        if model.namespace is not None:
            return self.namespaces[model.namespace], f"namespaces/{model.namespace}"
        return model.salt, f"tenants/{tenant}"

    def _pool(self, instance: str) -> InstancePool:
        counts = self.counts(instance)
        return InstancePool(
            instance,
            InstanceState.ACTIVE,
            self.block_size,
            len(self.slots[instance]),
            8192,
            counts["FREE"],
            counts["CACHED"],
            HashAlgo.SHA256,
            None,
        )

    def _account(self, name: str, tenant: Tenant) -> TenantAccount:
        blocks, pinned = self.tenant_blocks(name)
        return TenantAccount(
            name, tenant.state, tenant.quota, blocks, self.tokens(name), None, pinned
        )

    def _prefix(
        self, instance: str, tenant: str | None, hashes: Sequence[bytes]
    ) -> list[CachedBlock]:
        """The longest cached prefix. Where a hash is on several slots: the tenant's own copy,
        then one in use, then the lowest id."""
        mine = [
            e
            for h in self._live_holders()
            if tenant is not None and h.tenant == tenant and h.instance == instance
            for e in h.entries
            if not e.released
        ]
        held = {e.block_id for e in mine}
        pinned_by = {e.block_id for e in mine if e.pinned}
        cached: dict[bytes, CachedBlock] = {}
        slots = self.slots[instance]
        candidates = sorted(
            (i for i, slot in enumerate(slots) if slot.content_hash is not None),
            key=lambda i: (i not in held, slots[i].state == "CACHED", i),
        )
        for block_id in candidates:
            slot = slots[block_id]
            if slot.content_hash not in cached:
                assert slot.content_hash is not None
                cached[slot.content_hash] = CachedBlock(
                    slot.content_hash,
                    BlockHandle(block_id, slot.generation),
                    slot.state == "CACHED",
                    block_id in held,
                    block_id in pinned_by,
                )
        # Chained hashes make a gap final: a block past a missing one is not the same prefix.
        prefix = []
        for content_hash in hashes:
            if content_hash not in cached:
                break
            prefix.append(cached[content_hash])
        return prefix

    def _allocate(
        self,
        instance: str,
        hits: Sequence[CachedBlock],
        new_hashes: Sequence[bytes | None],
        scope: str,
        *,
        pinned: bool,
    ) -> list[Entry]:
        slots = self.slots[instance]
        entries = []
        for position, hit in enumerate(hits):
            slot = slots[hit.handle.block_id]
            slot.ref_count += 1
            slot.pin_count += pinned
            slot.lru = None
            entries.append(Entry(position, hit.handle.block_id, slot.generation, pinned))
        hit_ids = {h.handle.block_id for h in hits}
        free = [i for i, s in enumerate(slots) if s.state == "FREE"]
        cached = sorted(
            (i for i, s in enumerate(slots) if s.state == "CACHED" and i not in hit_ids),
            key=lambda i: slots[i].lru or 0,
        )
        chosen = (free + cached)[: len(new_hashes)]
        assert len(chosen) == len(new_hashes)
        for offset, (block_id, content_hash) in enumerate(zip(chosen, new_hashes, strict=True)):
            slot = slots[block_id]
            if slot.state == "CACHED":
                slot.generation += 1
            slot.content_hash = content_hash
            slot.hash_scope = scope if content_hash is not None else None
            slot.ref_count, slot.pin_count, slot.lru = 1, int(pinned), None
            entries.append(Entry(len(hits) + offset, block_id, slot.generation, pinned))
        return entries

    def _drop(self, holder: Holder, dropped: Sequence[Entry]) -> None:
        if not dropped:
            return
        self.lru_clock += 1
        slots = self.slots[holder.instance]
        last_position: dict[int, int] = {}
        for e in dropped:
            last_position[e.block_id] = max(last_position.get(e.block_id, -1), e.position)
        for e in dropped:
            slot = slots[e.block_id]
            slot.ref_count -= 1
            slot.pin_count -= e.pinned
            if slot.ref_count == 0:
                if slot.content_hash is None:
                    slot.generation += 1
                else:
                    slot.lru = self.lru_clock * LRU_SPAN + (
                        LRU_SPAN - 1 - last_position[e.block_id]
                    )
