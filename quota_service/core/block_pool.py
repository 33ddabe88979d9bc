"""One instance's block slots in memory, shaped like vLLM's `BlockPool`, with flat storage.

A slot is FREE (no contents), CACHED (contents kept for prefix hits, unreferenced), IN_USE
(referenced by block tables, maybe pins too) or PINNED (referenced by pins alone). Counters are
kept symmetric with the transitions, so `counts()` is O(1) and always adds up to the capacity.

Everything per slot lives in flat arrays (generation, references, pins, engine copies, hash
scope, LRU links, digests): a 1,000,000-slot pool costs about 40 MB and no Python object per
slot. Only slots that hold a hash cost a dictionary entry, in the index from hash to slot.

Order, as the ledger has always had it (and the reference model states it):
- never-hashed free slots are used first, lowest id first, before any cached block is evicted;
- cached blocks are evicted least recently released first (the LRU list's head); a released
  table appends its blocks tail first, so a table's tail goes before its head;
- when a slot's contents are dropped its generation moves on, so old handles are stale.

Eviction for a private block (an output block, or a prompt's partial last block) is deferred
while the engine still holds the contents it displaces: a reservation takes its whole output at
admission, and vLLM allocates those blocks only as it generates, evicting then. The displaced
contents are remembered beside the slot that took them: when the engine evicts them (a KV event)
they are forgotten, and when the slot comes back unused (a request cut short) they are cached in
it again, at the LRU place they had. The memory is a hint the record does not keep: a replica
that takes the instance over evicts at once, as the ledger always did.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import repeat
from operator import itemgetter, mul
from typing import Any, NamedTuple

from quota_service.core.hashing import DIGEST_BYTES, event_hash

# Free slots sit in a two-level bitmap of Python ints: a chunk's bits, and which chunks have any.
_CHUNK_BITS = 1024
_CHUNK_SHIFT = 10
_CHUNK_MASK = _CHUNK_BITS - 1
NO_SCOPE = -1
# What a lookup by key gives for a key no slot holds.
_NO_SLOT = -1


@dataclass(frozen=True, slots=True)
class ContentColumns:
    """The slots holding a hash, as columns: slot ids in order, and each one's fields."""

    blocks: list[int]
    generations: list[int]
    digests: bytes
    scopes: list[int]
    engine_copies: list[int]
    lru_seqs: list[int]

    @classmethod
    def empty(cls) -> ContentColumns:
        return cls([], [], b"", [], [], [])

    def __len__(self) -> int:
        return len(self.blocks)


class Displaced(NamedTuple):
    """Contents a private block's allocation evicted while the engine still held them."""

    digest: bytes
    scope: int
    engine_copies: int
    lru_seq: int


def _read(values: array[int], blocks: Sequence[int]) -> tuple[int, ...]:
    if len(blocks) < 2:
        return tuple(values[block] for block in blocks)
    read: tuple[int, ...] = itemgetter(*blocks)(values)
    return read


def _picked(pick: itemgetter[Any], values: array[int], count: int) -> list[int]:
    picked = pick(values)
    return [picked] if count == 1 else list(picked)


class BlockPool:
    """The slots of one instance. Preconditions are the caller's (the instance state machine's):
    it references only slots it was given, and frees only what it referenced."""

    def __init__(self, capacity: int, generation_floor: int = 0) -> None:
        if capacity < 1:
            raise ValueError("a pool has at least one slot")
        self.capacity = capacity
        # Unsigned typecodes wherever no value is negative: array converts an int for them without
        # PyArg_Parse, a third faster per write (and builds an array from a list twice as fast).
        self._generation = array("Q", [generation_floor]) * capacity
        self._refs = array("I", bytes(4 * capacity))
        self._pins = array("I", bytes(4 * capacity))
        # Copies the engine reports holding of a slot's contents (KV events).
        self._copies = array("i", bytes(4 * capacity))
        # The scope (a tenant's or a namespace's salt) a slot's hash was made under; NO_SCOPE
        # means the slot holds no hash.
        self._scope = array("i", [NO_SCOPE]) * capacity
        self._digests = bytearray(DIGEST_BYTES * capacity)
        # Slots by digest key (the low 64 bits KV events name them by); a second slot with the
        # same key (the same prefix block allocated again after its parent was evicted) goes to
        # `_more_by_key`.
        self._by_key: dict[int, int] = {}
        self._more_by_key: dict[int, list[int]] = {}
        # The LRU list of cached slots, doubly linked through the arrays; index `capacity` is
        # the sentinel: its next is the head (evicted first), its prev the tail.
        sentinel = capacity
        self._next = array("I", [sentinel]) * (capacity + 1)
        self._prev = array("I", [sentinel]) * (capacity + 1)
        # Each slot's place in that order as a number, so that the record can keep the order
        # as one value per slot that changed (not as a list rewritten on every release).
        self._lru_seq = array("Q", bytes(8 * capacity))
        self._lru_clock = 0
        # Slots whose recorded contents (hash, generation, copies, LRU place) changed since the
        # journal last took them (`drain_dirty`).
        self._dirty: set[int] = set()
        # Contents evicted for a private block while the engine held them, by the slot that took
        # them, and those slots by the digest key KV events name (module docstring).
        self._displaced: dict[int, Displaced] = {}
        self._displaced_by_key: dict[int, list[int]] = {}
        self._free_chunks = [
            (1 << min(_CHUNK_BITS, capacity - start)) - 1
            for start in range(0, capacity, _CHUNK_BITS)
        ]
        self._free_nonempty = (1 << len(self._free_chunks)) - 1
        self.free_count = capacity
        self.cached_count = 0
        self.pinned_only_count = 0

    # Reading a slot.

    def generation(self, block: int) -> int:
        return self._generation[block]

    def generations(self, blocks: Sequence[int]) -> array[int]:
        if len(blocks) < 2:
            return array("Q", [self._generation[b] for b in blocks])
        return array("Q", itemgetter(*blocks)(self._generation))

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    def pin_count(self, block: int) -> int:
        return self._pins[block]

    def engine_copies(self, block: int) -> int:
        return self._copies[block]

    def scope_id(self, block: int) -> int:
        return self._scope[block]

    def content_hash(self, block: int) -> bytes | None:
        if self._scope[block] == NO_SCOPE:
            return None
        return bytes(self._digests[block * DIGEST_BYTES : (block + 1) * DIGEST_BYTES])

    def state(self, block: int) -> str:
        refs = self._refs[block]
        if refs == 0:
            return "FREE" if self._scope[block] == NO_SCOPE else "CACHED"
        return "PINNED" if refs == self._pins[block] else "IN_USE"

    @property
    def in_use_count(self) -> int:
        return self.capacity - self.free_count - self.cached_count - self.pinned_only_count

    def counts(self) -> dict[str, int]:
        return {
            "FREE": self.free_count,
            "CACHED": self.cached_count,
            "IN_USE": self.in_use_count,
            "PINNED": self.pinned_only_count,
        }

    def holding(self, digest: bytes) -> list[int]:
        """The slots whose contents are `digest` (usually none or one)."""
        key = event_hash(digest)
        first = self._by_key.get(key)
        if first is None:
            return []
        candidates = [first, *self._more_by_key.get(key, ())]
        return [b for b in candidates if self._digest_is(b, digest)]

    def cached_prefix(
        self, digests: Sequence[bytes], prefer: Callable[[list[int]], int]
    ) -> list[int]:
        """The slots holding the longest prefix of `digests`; `prefer` picks among several slots
        holding the same digest. Chained hashes make a gap final: a block past a missing one
        cannot be the same prefix."""
        if not digests:
            return []
        # Each digest's key (its low 64 bits, big-endian: `event_hash`), unpacked in one call.
        keys = struct.unpack(f">{'24xQ' * len(digests)}", b"".join(digests))
        by_key, more_by_key = self._by_key, self._more_by_key
        if more_by_key.keys().isdisjoint(keys):
            # The common case, done in C: each key names one slot at most, which holds the
            # digest if all its bytes match.
            found = list(map(by_key.get, keys, repeat(_NO_SLOT)))
            if _NO_SLOT in found:
                del found[found.index(_NO_SLOT) :]
            starts = map(mul, found, repeat(DIGEST_BYTES))
            matched = list(map(self._digests.startswith, digests, starts))
            if False in matched:
                del found[matched.index(False) :]
            return found
        found = []
        for digest, key in zip(digests, keys, strict=True):
            block = by_key.get(key)
            if block is None:
                break
            if key in more_by_key:
                candidates = self.holding(digest)
                if not candidates:
                    break
                block = prefer(candidates) if len(candidates) > 1 else candidates[0]
            elif not self._digest_is(block, digest):
                break
            found.append(block)
        return found

    def unreferenced(self, blocks: Sequence[int]) -> int:
        """How many of `blocks` nothing references (cached: evictable until referenced)."""
        return self.ref_counts(blocks).count(0)

    def ref_counts(self, blocks: Sequence[int]) -> tuple[int, ...]:
        """Each block's reference count, read in one call (not one per block)."""
        return _read(self._refs, blocks)

    def pin_counts(self, blocks: Sequence[int]) -> tuple[int, ...]:
        return _read(self._pins, blocks)

    def holding_key(self, key: int) -> list[int]:
        """The slots whose digest's low 64 bits are `key` (what a KV event names)."""
        first = self._by_key.get(key)
        if first is None:
            return []
        return [first, *self._more_by_key.get(key, ())]

    def lru_order(self) -> list[int]:
        """Cached slots, the next to be evicted first."""
        order = []
        block = self._next[self.capacity]
        while block != self.capacity:
            order.append(block)
            block = self._next[block]
        return order

    # Transitions.

    def reference_all(self, blocks: Iterable[int], pinned: bool) -> None:
        """`reference` each; the common cases (a cached or in-use block joining a table) are
        done here without a call each."""
        if pinned:
            for block in blocks:
                self.reference(block, pinned)
            return
        refs, pins, nxt, prev = self._refs, self._pins, self._next, self._prev
        uncached = 0  # taken off the cached count once, not per block
        for block in blocks:
            count = refs[block]
            if count == 0:
                before, after = prev[block], nxt[block]
                nxt[before] = after
                prev[after] = before
                uncached += 1
                refs[block] = 1
            elif count != pins[block]:
                refs[block] = count + 1
            else:
                self.reference(block, pinned)
        self.cached_count -= uncached

    def unreference_all(self, blocks: Iterable[int], pinned: bool) -> None:
        """`unreference` each, in order (callers give a table's entries tail first); the common
        cases (a shared block, a last reference to a hashed or a private block) are done here
        without a call each."""
        refs, pins, scopes = self._refs, self._pins, self._scope
        nxt, prev, sentinel = self._next, self._prev, self.capacity
        lru_seq, dirty, displaced = self._lru_seq, self._dirty, self._displaced
        generations, free_chunks = self._generation, self._free_chunks
        # Counted here and added once. The LRU clock and tail are kept in locals too: a block
        # appended links to the tail, and the last one to the sentinel once, after the loop (or
        # before a call, which finds the list whole).
        freed = cached = 0
        clock, tail = self._lru_clock, prev[sentinel]
        # The chunk last marked as holding a free slot: a table's blocks are mostly in a few
        # chunks, and marking one is a new int as long as the pool has chunks (1,000,000 slots:
        # 2 kB) each time.
        marked = -1
        for block in blocks:
            count = refs[block]
            if count > 1 and count != pins[block] and count - 1 != pins[block] - pinned:
                # Still in use after this entry: the common case of a shared prefix.
                refs[block] = count - 1
                pins[block] -= pinned
            elif count != 1 or pinned or (displaced and block in displaced):
                # Anything else goes through `unreference`, the list made whole first.
                nxt[tail] = sentinel
                prev[sentinel] = tail
                self._lru_clock = clock
                self.unreference(block, pinned)
                clock, tail = self._lru_clock, prev[sentinel]
            elif scopes[block] == NO_SCOPE:
                # A private tail block: freed at once (`_mark_free`, without a call).
                refs[block] = 0
                generations[block] += 1
                chunk = block >> _CHUNK_SHIFT
                free_chunks[chunk] |= 1 << (block & _CHUNK_MASK)
                if chunk != marked:
                    self._free_nonempty |= 1 << chunk
                    marked = chunk
                freed += 1
            else:
                # A hashed block: cached at the LRU tail (`_append_lru`, without a call).
                refs[block] = 0
                nxt[tail] = block
                prev[block] = tail
                tail = block
                cached += 1
                clock += 1
                lru_seq[block] = clock
                dirty.add(block)
        nxt[tail] = sentinel
        prev[sentinel] = tail
        self._lru_clock = clock
        self.free_count += freed
        self.cached_count += cached

    def reference(self, block: int, pinned: bool) -> None:
        """One more table entry (or pin) names the slot; a cached slot leaves the LRU list."""
        refs = self._refs[block]
        pins = self._pins[block]
        if refs == 0:
            # Only cached slots are referenced from zero (free ones go through allocate).
            self._unlink(block)
            self.cached_count -= 1
        elif refs == pins:
            self.pinned_only_count -= 1
        refs += 1
        pins += pinned
        self._refs[block] = refs
        self._pins[block] = pins
        if refs == pins:
            self.pinned_only_count += 1

    def unreference(self, block: int, pinned: bool) -> None:
        """One entry (or pin) naming the slot went. At zero references a hashed slot is cached
        at the LRU tail and an unhashed one is freed (its generation moves on)."""
        refs = self._refs[block]
        pins = self._pins[block]
        if refs == pins:
            self.pinned_only_count -= 1
        refs -= 1
        pins -= pinned
        self._refs[block] = refs
        self._pins[block] = pins
        if refs == 0:
            if self._scope[block] != NO_SCOPE:
                self._append_lru(block)
                self.cached_count += 1
            elif block in self._displaced:
                self._restore(block)
            else:
                self._generation[block] += 1
                self._mark_free(block)
        elif refs == pins:
            self.pinned_only_count += 1

    def allocate(self, digests: Sequence[bytes | None], scope: int, pinned: bool) -> list[int]:
        """Slots for new contents, referenced once each: free slots lowest id first, then cached
        ones evicted from the LRU head. The caller checked that enough are allocatable."""
        free = min(len(digests), self.free_count)
        chosen = self._pop_free_lowest(free)
        refs, pins = self._refs, self._pins
        pin = int(pinned)
        for block in chosen:
            refs[block] = 1
            pins[block] = pin
        # Indexing a hash moves no slot in or out of the free set or the LRU list, so the free
        # slots' hashes can go in before any eviction, as if taken one by one.
        self._hold_contents(chosen, digests, scope)
        for digest in digests[free:]:
            block = self._next[self.capacity]
            assert block != self.capacity, "allocate beyond what the pool holds"
            if digest is None and self._copies[block]:
                self._displace(block)
            self.drop_contents(block)
            self._pop_free_slot(block)
            refs[block] = 1
            pins[block] = pin
            self._hold_contents((block,), (digest,), scope)
            chosen.append(block)
        if pinned:
            self.pinned_only_count += len(chosen)
        return chosen

    def _hold_contents(
        self, blocks: Sequence[int], digests: Sequence[bytes | None], scope: int
    ) -> None:
        """New slots take the hashes they hold (None: a private block, holding none)."""
        scopes = self._scope
        for block, digest in zip(blocks, digests, strict=False):
            if digest is not None:
                scopes[block] = scope
                self._index(block, digest)
                self._dirty.add(block)

    def drop_contents(self, block: int) -> None:
        """Forget a cached (unreferenced) slot's contents: it becomes free, its generation
        moves on (evicted, freed by reclaim, or gone from the engine)."""
        assert self._refs[block] == 0 and self._scope[block] != NO_SCOPE
        self._unlink(block)
        self.cached_count -= 1
        self._unindex(block)
        self._scope[block] = NO_SCOPE
        self._copies[block] = 0
        self._generation[block] += 1
        self._mark_free(block)
        self._dirty.add(block)

    def add_copies(self, block: int, copies: int) -> None:
        self._copies[block] += copies
        self._dirty.add(block)

    def remove_copies(self, block: int, copies: int) -> int:
        """Copies left after the engine evicted `copies` of them (never below zero)."""
        left = max(self._copies[block] - copies, 0)
        self._copies[block] = left
        self._dirty.add(block)
        return left

    def evicted_displaced(self, key: int, copies: int) -> int:
        """The engine evicted `copies` copies of the contents KV events name by `key`: those
        displaced first (the engine's oldest: they left the LRU head). Returns how many of the
        copies they account for."""
        slots = self._displaced_by_key.get(key)
        taken = 0
        while slots and taken < copies:
            block = slots[0]
            entry = self._displaced[block]
            used = min(entry.engine_copies, copies - taken)
            taken += used
            if used == entry.engine_copies:
                self._forget_displaced(block)
            else:
                self._displaced[block] = entry._replace(engine_copies=entry.engine_copies - used)
        return taken

    def forget_displaced_scope(self, scope: int) -> None:
        """Contents hashed under `scope` are never cached again (its tenant is gone)."""
        for block in [b for b, entry in self._displaced.items() if entry.scope == scope]:
            self._forget_displaced(block)

    @property
    def displaced_count(self) -> int:
        """Contents the engine still holds that allocations for private blocks displaced."""
        return len(self._displaced)

    def _displace(self, block: int) -> None:
        """Remember a cached slot's contents as displaced before an allocation evicts them."""
        start = block * DIGEST_BYTES
        digest = bytes(self._digests[start : start + DIGEST_BYTES])
        self._displaced[block] = Displaced(
            digest, self._scope[block], self._copies[block], self._lru_seq[block]
        )
        self._displaced_by_key.setdefault(event_hash(digest), []).append(block)

    def _forget_displaced(self, block: int) -> Displaced:
        entry = self._displaced.pop(block)
        key = event_hash(entry.digest)
        slots = self._displaced_by_key[key]
        slots.remove(block)
        if not slots:
            del self._displaced_by_key[key]
        return entry

    def _restore(self, block: int) -> None:
        """A slot that displaced contents came back unused (its refs are zero, it holds no
        hash): the contents are cached in it again at their old LRU place, or, when another
        slot holds them meanwhile, the engine's copies are counted there and the slot is freed."""
        entry = self._forget_displaced(block)
        self._generation[block] += 1
        holders = self.holding(entry.digest)
        if holders:
            self.add_copies(min(holders), entry.engine_copies)
            self._mark_free(block)
            return
        self._scope[block] = entry.scope
        self._index(block, entry.digest)
        self._copies[block] = entry.engine_copies
        self._lru_seq[block] = entry.lru_seq
        self._link_in_order(block)
        self.cached_count += 1
        self._dirty.add(block)

    @property
    def dirty(self) -> bool:
        """Whether any slot's recorded contents changed since `drain_dirty`."""
        return bool(self._dirty)

    def clear_copies(self) -> None:
        """The engine holds no copy of anything (it cleared its cache, or is being
        resynchronised): every slot's count of engine copies goes to zero."""
        copies = self._copies
        hashed = [*self._by_key.values(), *(b for more in self._more_by_key.values() for b in more)]
        for block in hashed:
            if copies[block]:
                copies[block] = 0
                self._dirty.add(block)
        self._displaced.clear()
        self._displaced_by_key.clear()

    def drain_dirty(self) -> tuple[ContentColumns, list[int]]:
        """What the record must learn since the last call: the slots that hold contents now,
        in slot order, as columns, and the slots whose contents were dropped."""
        dirty, self._dirty = sorted(self._dirty), set()
        scopes = self._scope
        held = [b for b in dirty if scopes[b] != NO_SCOPE]
        dropped = [b for b in dirty if scopes[b] == NO_SCOPE]
        return self._columns(held), dropped

    @classmethod
    def rebuild(
        cls,
        capacity: int,
        generation_floor: int,
        contents: ContentColumns,
        references: Iterable[tuple[int, int, bool]],
    ) -> BlockPool:
        """Recovery: the pool a record describes. `contents` are the slots holding a hash, in
        any order (cached ones go back in the order of their `lru_seq`); `references` the live
        table entries and pins, as (slot, generation, pinned): a referenced slot without a hash
        takes its generation from them. Every other slot is free, with a generation of
        `generation_floor`: above any handle issued before, so all of those are stale."""
        pool = cls(capacity, generation_floor)
        hashed = contents.blocks
        width = DIGEST_BYTES
        digests = contents.digests
        for block, generation, scope, copies, lru_seq, start in zip(
            hashed,
            contents.generations,
            contents.scopes,
            contents.engine_copies,
            contents.lru_seqs,
            range(0, len(digests), width),
            strict=True,
        ):
            pool._pop_free_slot(block)
            pool._generation[block] = generation
            pool._copies[block] = copies
            pool._lru_seq[block] = lru_seq
            pool._scope[block] = scope
            pool._index(block, digests[start : start + width])
        refs, pins, scopes = pool._refs, pool._pins, pool._scope
        referenced = set()
        for block, generation, pinned in references:
            if not refs[block] and scopes[block] == NO_SCOPE:
                pool._pop_free_slot(block)
                pool._generation[block] = generation
            refs[block] += 1
            pins[block] += pinned
            referenced.add(block)
        pool.pinned_only_count = sum(1 for b in referenced if refs[b] == pins[b])
        cached = [b for b in hashed if not refs[b]]
        lru_seq = pool._lru_seq
        cached.sort(key=lru_seq.__getitem__)
        for block in cached:
            pool._link_tail(block)
        pool.cached_count = len(cached)
        pool._lru_clock = max((lru_seq[b] for b in hashed), default=0)
        return pool

    def contents_columns(self) -> ContentColumns:
        """What `rebuild` needs of the slots besides the tables: every slot holding a hash, in
        slot order, field by field (no object per slot). Costs what is hashed, not the pool's
        size."""
        return next(self.contents_chunks(self.capacity), ContentColumns.empty())

    def contents_chunks(self, per_chunk: int) -> Iterator[ContentColumns]:
        """`contents_columns` in chunks of at most `per_chunk` slots, in slot order: a caller
        that turns each into something compact before taking the next never holds the
        columns of a large pool whole. Each chunk is read as it is taken: take them all before
        the pool changes."""
        hashed = sorted(
            [*self._by_key.values(), *(b for more in self._more_by_key.values() for b in more)]
        )
        for start in range(0, len(hashed), per_chunk):
            yield self._columns(hashed[start : start + per_chunk])

    def _columns(self, blocks: list[int]) -> ContentColumns:
        """The contents of slots that hold a hash, field by field, each field read in C (a
        batch's changed slots were an object each: a fifth of an Admit+Release of a prompt
        with a cached prefix)."""
        if not blocks:
            return ContentColumns.empty()
        pick, count, width, digests = itemgetter(*blocks), len(blocks), DIGEST_BYTES, self._digests
        return ContentColumns(
            blocks,
            _picked(pick, self._generation, count),
            b"".join([digests[b * width : (b + 1) * width] for b in blocks]),
            _picked(pick, self._scope, count),
            _picked(pick, self._copies, count),
            _picked(pick, self._lru_seq, count),
        )

    # Mechanics.

    def _digest_is(self, block: int, digest: bytes) -> bool:
        start = block * DIGEST_BYTES
        return self._digests[start : start + DIGEST_BYTES] == digest

    def _index(self, block: int, digest: bytes) -> None:
        start = block * DIGEST_BYTES
        self._digests[start : start + DIGEST_BYTES] = digest
        key = event_hash(digest)
        if self._by_key.setdefault(key, block) != block:
            self._more_by_key.setdefault(key, []).append(block)

    def _unindex(self, block: int) -> None:
        start = block * DIGEST_BYTES
        key = event_hash(bytes(self._digests[start : start + DIGEST_BYTES]))
        more = self._more_by_key.get(key)
        if self._by_key[key] == block:
            if more:
                self._by_key[key] = more.pop(0)
            else:
                del self._by_key[key]
        else:
            assert more is not None
            more.remove(block)
        if more is not None and not more:
            del self._more_by_key[key]

    def _append_lru(self, block: int) -> None:
        self._lru_clock += 1
        self._lru_seq[block] = self._lru_clock
        self._dirty.add(block)
        self._link_tail(block)

    def _link_tail(self, block: int) -> None:
        sentinel = self.capacity
        tail = self._prev[sentinel]
        self._next[tail] = block
        self._prev[block] = tail
        self._next[block] = sentinel
        self._prev[sentinel] = block

    def _link_in_order(self, block: int) -> None:
        """Link a slot at its `lru_seq`'s place. The list is in `lru_seq` order and restored
        contents are older than all but other restored ones, so the walk from the head is short."""
        sentinel, nxt, seqs = self.capacity, self._next, self._lru_seq
        seq = seqs[block]
        after = nxt[sentinel]
        while after != sentinel and seqs[after] < seq:
            after = nxt[after]
        before = self._prev[after]
        nxt[before] = block
        self._prev[block] = before
        nxt[block] = after
        self._prev[after] = block

    def _unlink(self, block: int) -> None:
        prev, nxt = self._prev[block], self._next[block]
        self._next[prev] = nxt
        self._prev[nxt] = prev

    def _mark_free(self, block: int) -> None:
        chunk = block >> _CHUNK_SHIFT
        self._free_chunks[chunk] |= 1 << (block & _CHUNK_MASK)
        self._free_nonempty |= 1 << chunk
        self.free_count += 1

    def _pop_free_lowest(self, count: int) -> list[int]:
        """The `count` lowest free slots, taken out of the free set. Free slots lie in runs
        (a released table's private blocks are consecutive), taken a run at a time."""
        chosen: list[int] = []
        chunks = self._free_chunks
        nonempty = self._free_nonempty
        while len(chosen) < count:
            chunk = (nonempty & -nonempty).bit_length() - 1
            bits = chunks[chunk]
            base = chunk << _CHUNK_SHIFT
            while bits and len(chosen) < count:
                start = (bits & -bits).bit_length() - 1
                shifted = bits >> start
                # The run of set bits from `start`: the lowest clear bit above it ends it.
                run = (~shifted & (shifted + 1)).bit_length() - 1
                taken = min(run, count - len(chosen))
                chosen.extend(range(base + start, base + start + taken))
                bits &= ~(((1 << taken) - 1) << start)
            chunks[chunk] = bits
            if not bits:
                nonempty ^= 1 << chunk
        self._free_nonempty = nonempty
        self.free_count -= count
        return chosen

    def _pop_free_slot(self, block: int) -> None:
        """Take one given free slot out of the free set."""
        chunk = block >> _CHUNK_SHIFT
        bit = 1 << (block & _CHUNK_MASK)
        bits = self._free_chunks[chunk]
        assert bits & bit, f"slot {block} is not free"
        bits ^= bit
        self._free_chunks[chunk] = bits
        if not bits:
            self._free_nonempty ^= 1 << chunk
        self.free_count -= 1
