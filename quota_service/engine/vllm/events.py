"""vLLM's KV-cache events, decoded tolerantly.

A message's payload is a msgpack batch `[ts, [event, ...], data_parallel_rank]`. Events are maps
tagged by "type" (vLLM since mid-2026) or, in older releases, positional arrays whose first item
is the tag; fields at their default may be missing, and unknown ones are ignored. Block hashes are
ints (the low 64 bits of the digest) unless the engine sends raw digests, which are reduced to the
same ints here. Media are normalised to upper case (some connectors send lower case).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from quota_service.core.hashing import event_hash
from quota_service.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
)

# Field order of the positional (array) forms, after the tag.
_POSITIONAL = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
    ),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}
DEFAULT_MEDIUM = "GPU"


class EventDecodeError(ValueError):
    """A payload that is not a vLLM KV event batch."""


def block_hash(value: object) -> int:
    if isinstance(value, bool):
        raise EventDecodeError(f"not a block hash: {value!r}")
    if isinstance(value, int):
        return value & (2**64 - 1)
    if isinstance(value, bytes):
        return event_hash(value)
    raise EventDecodeError(f"not a block hash: {value!r}")


def _medium(value: object) -> str:
    return str(value).upper() if value else DEFAULT_MEDIUM


def _fields(raw: object) -> tuple[str, Mapping[str, Any]]:
    if isinstance(raw, Mapping):
        tag = raw.get("type")
        if not isinstance(tag, str):
            raise EventDecodeError(f"event without a type tag: {raw!r}")
        return tag, raw
    if isinstance(raw, Sequence) and not isinstance(raw, (str, bytes)) and raw:
        tag, *values = raw
        if not isinstance(tag, str) or tag not in _POSITIONAL:
            raise EventDecodeError(f"unknown positional event: {raw!r}")
        return tag, dict(zip(_POSITIONAL[tag], values, strict=False))
    raise EventDecodeError(f"not an event: {raw!r}")


def decode_event(raw: object) -> Event | None:
    """One event, or None for a type this version does not know (ignored, not an error)."""
    tag, fields = _fields(raw)
    try:
        if tag == "BlockStored":
            parent = fields.get("parent_block_hash")
            return BlockStored(
                block_hashes=tuple(block_hash(h) for h in fields["block_hashes"]),
                parent_block_hash=None if parent is None else block_hash(parent),
                token_ids=tuple(int(t) for t in fields.get("token_ids") or ()),
                block_size=int(fields["block_size"]),
                medium=_medium(fields.get("medium")),
            )
        if tag == "BlockRemoved":
            return BlockRemoved(
                block_hashes=tuple(block_hash(h) for h in fields["block_hashes"]),
                medium=_medium(fields.get("medium")),
            )
        if tag == "AllBlocksCleared":
            return AllBlocksCleared()
    except (KeyError, TypeError, ValueError) as exc:
        raise EventDecodeError(f"malformed {tag}: {exc}") from exc
    return None


def decode_batch(payload: bytes) -> EventBatch:
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise EventDecodeError(f"not msgpack: {exc}") from exc
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise EventDecodeError(f"not an event batch: {raw!r}"[:200])
    ts, events = raw[0], raw[1]
    rank = raw[2] if len(raw) > 2 else None
    decoded = tuple(e for e in (decode_event(event) for event in events) if e is not None)
    return EventBatch(float(ts), decoded, rank if isinstance(rank, int) else None)
