"""Block tables: which blocks a request needs, in order, and which of them a cached prefix covers.

A reservation's table lists its full prompt blocks first (shared by its n sequences), then each
sequence's private tail (the partial last prompt block plus the output the engine computes).
With prompt token ids, the full prompt blocks carry vLLM's chained hashes, so identical prefixes
under the same salt land on the same blocks; without them every block is private.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple, overload

from quota_service.core import geometry
from quota_service.core.errors import FieldViolation, KvQuotaError, invalid_request
from quota_service.core.hashing import HashAlgo, block_hashes
from quota_service.core.reasons import Reason


class BlockHandle(NamedTuple):
    """A reference to one slot's contents: stale once the slot's generation moves on. A named
    tuple: every Admit answers a table of them (96 and more), and a tuple is made for a third
    less than a frozen dataclass, and read back by unpacking."""

    block_id: int
    generation: int


class BlockHandles(Sequence[BlockHandle]):
    """A table's handles as its two columns (block ids, generations), made into BlockHandles
    only when read one by one. Every Admit answers 96 and more, read as pairs (`pairs`): making
    a named tuple of each first cost as much as writing them into the answer. The columns are
    not copied: a table's never change once made."""

    __slots__ = ("_block_ids", "_generations")

    def __init__(self, block_ids: Sequence[int], generations: Sequence[int]) -> None:
        self._block_ids = block_ids
        self._generations = generations

    def pairs(self) -> Iterator[tuple[int, int]]:
        """(block id, generation) of each handle, in order."""
        return zip(self._block_ids, self._generations, strict=True)

    def __len__(self) -> int:
        return len(self._block_ids)

    @overload
    def __getitem__(self, index: int) -> BlockHandle: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[BlockHandle, ...]: ...

    def __getitem__(self, index: int | slice) -> BlockHandle | tuple[BlockHandle, ...]:
        if isinstance(index, slice):
            return tuple(self)[index]
        return BlockHandle(self._block_ids[index], self._generations[index])

    def __iter__(self) -> Iterator[BlockHandle]:
        return map(BlockHandle, self._block_ids, self._generations)

    def __eq__(self, other: object) -> bool:
        # Equal to any sequence of the same handles (a table read from the record is a tuple).
        if isinstance(other, Sequence) and not isinstance(other, str | bytes):
            return tuple(self) == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"BlockHandles({list(self)!r})"


@dataclass(frozen=True, slots=True)
class CachedBlock:
    """A block that holds a hash the request's prefix may reuse."""

    content_hash: bytes
    handle: BlockHandle
    # Cached and unreferenced: a hit takes it out of the evictable pool.
    evictable: bool
    # The requesting tenant already references it, so sharing costs it nothing more.
    held_by_tenant: bool
    # The requesting tenant already pins it, so pinning it again costs no pin budget.
    pinned_by_tenant: bool = False


@dataclass(frozen=True, slots=True)
class TableLayout:
    prompt_blocks: int
    tail_blocks_per_sequence: int
    n: int
    # One per full prompt block when the prompt's token ids are known, else empty.
    hashes: tuple[bytes, ...]
    # How many of them a prefix hit may cover. vLLM recomputes a prompt's last token for its
    # logits, so its KVCacheManager caps a hit at num_tokens - 1 tokens: a fully cached,
    # block-aligned prompt still gets a new block for its last one.
    max_hit_blocks: int = 0

    @property
    def hit_candidates(self) -> tuple[bytes, ...]:
        """The hashes a cached prefix may cover, in order."""
        return self.hashes[: self.max_hit_blocks]

    @property
    def total(self) -> int:
        return self.prompt_blocks + self.n * self.tail_blocks_per_sequence


def layout(
    prompt_tokens: int,
    max_output_tokens: int,
    n: int,
    block_size: int,
    prompt_token_ids: Sequence[int],
    cache_salt: str,
    algo: HashAlgo,
) -> TableLayout:
    full = prompt_tokens // block_size
    # The last output token never gets a slot in vLLM (geometry.output_kv_tokens): a prompt of
    # 64 full blocks and one output token holds 64 blocks in the engine, not 65.
    tail = geometry.blocks_for_tokens(
        prompt_tokens % block_size + geometry.output_kv_tokens(max_output_tokens), block_size
    )
    hashes = (
        block_hashes(prompt_token_ids, block_size, cache_salt, algo) if prompt_token_ids else []
    )
    assert len(hashes) in (0, full)
    # Total agrees with geometry.blocks_for_request by construction.
    return TableLayout(full, tail, n, tuple(hashes), (prompt_tokens - 1) // block_size)


def new_block_hashes(table: TableLayout, hits: int) -> list[bytes | None]:
    """What each newly allocated block holds, in table order: the prompt blocks past the cached
    prefix register their hashes (when known); tails are private."""
    hashed = list(table.hashes[hits:])
    return [*hashed, *([None] * (table.total - hits - len(hashed)))]


# More entries than a block table has (a 128k-token context in 16-token blocks, 16 sequences).
MAX_RELEASED_HANDLES = 1 << 17


def release_violation(handles: Sequence[BlockHandle]) -> FieldViolation | None:
    """A ReleaseBlocks names at least one handle, and at most as many as a table has."""
    if 1 <= len(handles) <= MAX_RELEASED_HANDLES:
        return None
    return FieldViolation("handles", f"name 1 to {MAX_RELEASED_HANDLES} block handles")


@dataclass(frozen=True, slots=True)
class EntryLookup:
    """A handle a ReleaseBlocks names, and what the reservation's table and the pool say of it."""

    handle: BlockHandle
    # The table entry naming exactly this handle, if any, and whether it was released already.
    position: int | None
    released: bool | None
    # The slot's generation now (None: no such slot on the instance).
    current_generation: int | None


# Handles an error names: enough to find the fault, never enough to outgrow a status.
MAX_NAMED_HANDLES = 8


def _named(handles: Sequence[BlockHandle]) -> str:
    named = ", ".join(f"{h.block_id}@{h.generation}" for h in handles[:MAX_NAMED_HANDLES])
    more = len(handles) - MAX_NAMED_HANDLES
    return f"{named} and {more} more" if more > 0 else named


def positions_to_release(reservation: str, lookups: Sequence[EntryLookup]) -> list[int]:
    """The table positions to release for these handles, or the refusal that changes nothing.

    A handle is stale whoever names it, this reservation too, once its slot's generation is not
    the handle's: the block was freed (its contents dropped; the slot may hold someone else's
    data now), or the generation never existed. Releasing an entry of this table again while
    its block is still at that generation changes nothing. A handle neither stale nor in the
    table is not this reservation's to release."""
    positions: list[int] = []
    stale: list[BlockHandle] = []
    unborn: list[BlockHandle] = []
    foreign: list[BlockHandle] = []
    for lookup in lookups:
        current, generation = lookup.current_generation, lookup.handle.generation
        if current is not None and generation > current:
            unborn.append(lookup.handle)
        elif current is not None and generation < current:
            stale.append(lookup.handle)
        elif lookup.position is None:
            foreign.append(lookup.handle)
        elif not lookup.released:
            positions.append(lookup.position)
    if stale or unborn:
        what = []
        if stale:
            what.append(f"{_named(stale)} were freed since: their contents were dropped")
        if unborn:
            what.append(f"{_named(unborn)} name generations their blocks never had")
        raise KvQuotaError(
            Reason.STALE_BLOCK_HANDLE,
            f"block handles are not current, nothing was released: {'; '.join(what)}",
            metadata={
                "name": reservation,
                "staleHandles": _named([*stale, *unborn]),
                "staleHandleCount": str(len(stale) + len(unborn)),
            },
        )
    if foreign:
        raise invalid_request(
            [
                FieldViolation(
                    "handles", f"{_named(foreign)} are not in the block table of {reservation}"
                )
            ]
        )
    return sorted(set(positions))
