"""Which tenants hold each slot of an instance, and by how many table entries, without a Python
object per slot: a 1,000,000-slot instance filled to 90% held its tenants' slots in dicts of
~100 bytes an entry (two of them, ~150 MiB); here a slot costs 8 bytes.

Nearly every held slot has one holder: its number and its entries beyond the first (nearly
always none) are kept in two arrays. The few slots several tenants hold (a namespace's shared
prefix) are kept in a dict, slot by slot.

Metering charges a slot shared k ways 1/k to each holder (core/metering.py): as holders join
and leave a slot, each holder's count of slots by sharing ways (`Shares`) moves with it.
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from operator import itemgetter

# The holder of a slot no tenant holds, and of one several tenants hold (`_shared` has them).
NOBODY = -1
SEVERAL = -2

# A holder's count of slots by the number of tenants sharing each.
Shares = Counter[int]


class Holdings:
    def __init__(self, capacity: int, shares_of: Callable[[int], Shares]) -> None:
        """`shares_of(holder)`: the counter that holder's slots by sharing ways are kept in."""
        self._sole = array("i", [NOBODY]) * capacity
        # The sole holder's entries beyond its first, zero for any other slot: a table taking
        # or giving back a slot it alone holds writes only its holder. Unsigned: written faster
        # (block_pool.BlockPool's arrays).
        self._more_entries = array("I", bytes(4 * capacity))
        self._shared: dict[int, dict[int, int]] = {}
        self._shares_of = shares_of

    def holds(self, holder: int, block: int) -> bool:
        sole = self._sole[block]
        return sole == holder or (sole == SEVERAL and holder in self._shared[block])

    def count_held(self, holder: int, blocks: Sequence[int]) -> int:
        """How many of `blocks` (distinct) `holder` holds: read in C, slot by slot, but for the
        few slots several tenants hold."""
        if not blocks:
            return 0
        sole = self._sole
        holders = itemgetter(*blocks)(sole) if len(blocks) > 1 else (sole[blocks[0]],)
        held: int = holders.count(holder)
        if SEVERAL in holders:
            shared = self._shared
            held += sum(
                1
                for block, h in zip(blocks, holders, strict=True)
                if h == SEVERAL and holder in shared[block]
            )
        return held

    def hold(self, holder: int, blocks: Iterable[int]) -> int:
        """One entry more of `holder` (a number >= 0) on each block (a table names each block
        once). Returns how many of them it did not hold before."""
        sole, more_entries, shared = self._sole, self._more_entries, self._shared
        alone = 0  # blocks no one held before: the common case, counted once
        joined = 0
        for block in blocks:
            current = sole[block]
            if current == NOBODY:
                sole[block] = holder
                alone += 1
                continue
            if current == holder:
                more_entries[block] += 1
                continue
            if current == SEVERAL:
                holders = shared[block]
                mine = holders.get(holder)
                if mine is not None:
                    holders[holder] = mine + 1
                    continue
            else:
                holders = shared[block] = {current: more_entries[block] + 1}
                sole[block] = SEVERAL
                more_entries[block] = 0
            ways = len(holders)
            for other in holders:
                theirs = self._shares_of(other)
                theirs[ways] -= 1
                theirs[ways + 1] += 1
            holders[holder] = 1
            self._shares_of(holder)[ways + 1] += 1
            joined += 1
        if alone:
            self._shares_of(holder)[1] += alone
        return alone + joined

    def release(self, holder: int, blocks: Iterable[int]) -> int:
        """One entry fewer of `holder` on each block; it stops holding a block with its last.
        Returns how many it stopped holding."""
        sole, more_entries, shared = self._sole, self._more_entries, self._shared
        alone = 0  # blocks it held alone: the common case, counted once
        left = 0
        for block in blocks:
            if sole[block] == holder:
                more = more_entries[block]
                if more:
                    more_entries[block] = more - 1
                else:
                    sole[block] = NOBODY
                    alone += 1
                continue
            holders = shared[block]
            remaining = holders[holder] - 1
            if remaining:
                holders[holder] = remaining
                continue
            ways = len(holders)
            del holders[holder]
            self._shares_of(holder)[ways] -= 1
            for other in holders:
                theirs = self._shares_of(other)
                theirs[ways] -= 1
                theirs[ways - 1] += 1
            if ways == 2:
                ((last, its_entries),) = holders.items()
                sole[block] = last
                more_entries[block] = its_entries - 1
                del shared[block]
            left += 1
        if alone:
            self._shares_of(holder)[1] -= alone
        return alone + left

    def held_by(self, holder: int) -> dict[int, int]:
        """The blocks `holder` holds, with its entries on each (a scan of the pool)."""
        more_entries = self._more_entries
        found = {
            block: more_entries[block] + 1
            for block, sole in enumerate(self._sole)
            if sole == holder
        }
        for block, holders in self._shared.items():
            if holder in holders:
                found[block] = holders[holder]
        return found
