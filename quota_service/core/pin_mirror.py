"""Mirroring kvquota's pins onto LMCache's refcounted pins, so that a replay sends nothing twice.

Pinning a prefix in LMCache adds one to the pin count of every chunk of it; the call has no id
and may be lost after it landed. kvquota knows each of its pinned prefixes as a chain of chunk
keys, and the coordinator knows each key's count. The pins that *end* at a key are its count less
its children's counts (chains that share a head share those keys), so comparing the pins that
should end at each key with those that do says exactly what to pin or unpin now, whatever part of
an earlier pass already landed. Only kvquota pins under a tenant's salt (the salt is secret), so
every pinned key of a salt is on one of its chains.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PinChain:
    keys: tuple[str, ...]  # the prefix's whole chunks, first to last
    token_ids: tuple[int, ...]  # the prefix (LMCache pins its whole chunks, the keys)
    wanted: bool  # an active pin; False: removed, still to unpin


@dataclass(frozen=True, slots=True)
class PinChange:
    chain: PinChain
    delta: int  # > 0: pin that many times; < 0: unpin


def pin_changes(chains: Sequence[PinChain], counts: Mapping[str, int]) -> list[PinChange]:
    """What makes the coordinator's counts match the wanted chains."""
    children: dict[str, set[str]] = defaultdict(set)
    ending: dict[str, PinChain] = {}
    wanted: Counter[str] = Counter()
    for chain in chains:
        if not chain.keys:
            continue  # shorter than a chunk: LMCache cannot pin it
        for parent, child in zip(chain.keys, chain.keys[1:], strict=False):
            children[parent].add(child)
        end = chain.keys[-1]
        ending.setdefault(end, chain)
        wanted[end] += chain.wanted
    changes = []
    for end, chain in ending.items():
        pinned = counts.get(end, 0) - sum(counts.get(child, 0) for child in children[end])
        if wanted[end] != pinned:
            changes.append(PinChange(chain, wanted[end] - pinned))
    return changes
