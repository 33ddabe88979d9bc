"""Mirroring pins onto LMCache's refcounted pins: what to send follows from the counts the
coordinator reports, so a pass replayed after a lost answer sends nothing twice."""

from __future__ import annotations

from quota_service.core.pin_mirror import PinChain, PinChange, pin_changes

SYSTEM = PinChain(("a", "b"), (1, 2), True)  # a two-chunk system prompt
LONGER = PinChain(("a", "b", "c"), (1, 2, 3), True)  # the same prompt and one more chunk
OTHER = PinChain(("x",), (9,), True)


def test_nothing_pinned_yet_pins_each_chain_once() -> None:
    assert pin_changes([SYSTEM, LONGER, OTHER], {}) == [
        PinChange(SYSTEM, 1),
        PinChange(LONGER, 1),
        PinChange(OTHER, 1),
    ]


def test_a_replay_after_everything_landed_sends_nothing() -> None:
    landed = {"a": 2, "b": 2, "c": 1, "x": 1}  # shared head chunks count both pins
    assert pin_changes([SYSTEM, LONGER, OTHER], landed) == []


def test_a_replay_after_part_landed_sends_only_the_rest() -> None:
    # LONGER's pin landed (a, b, c counted once); SYSTEM's and OTHER's did not.
    assert pin_changes([SYSTEM, LONGER, OTHER], {"a": 1, "b": 1, "c": 1}) == [
        PinChange(SYSTEM, 1),
        PinChange(OTHER, 1),
    ]


def test_a_removed_pin_is_unpinned_and_a_shared_head_stays() -> None:
    removed = PinChain(LONGER.keys, LONGER.token_ids, wanted=False)
    landed = {"a": 2, "b": 2, "c": 1}
    assert pin_changes([SYSTEM, removed], landed) == [PinChange(removed, -1)]
    assert pin_changes([SYSTEM, removed], {"a": 1, "b": 1}) == []  # already unpinned


def test_the_same_prefix_pinned_twice_counts_twice() -> None:
    twice = PinChain(SYSTEM.keys, SYSTEM.token_ids, True)
    assert pin_changes([SYSTEM, twice], {"a": 1, "b": 1}) == [PinChange(SYSTEM, 1)]


def test_a_prefix_shorter_than_a_chunk_is_never_sent() -> None:
    assert pin_changes([PinChain((), (1,), True)], {}) == []
