"""vLLM-compatible prefix-cache block hashes, so the ledger and the engine name the same blocks.

vLLM chains the hash of each full block onto its parent's:
    hash(block) = H((parent_digest or NONE_HASH, tuple(block_token_ids), extra_keys))
with H = SHA-256 of pickle (protocol 5) by default, or of canonical CBOR (`sha256_cbor`, portable).
NONE_HASH = H("vllm-none-hash") unless the engine sets PYTHONHASHSEED, then H(that seed). The
cache salt is an extra key of the first block only, so every later hash differs too. Only full
blocks are hashed. KV events carry the low 64 bits of the digest as an int.
"""

from __future__ import annotations

import enum
import hashlib
import pickle
from collections.abc import Callable, Sequence
from functools import cache, partial

import cbor2

NONE_HASH_SEED = "vllm-none-hash"
DIGEST_BYTES = 32


class HashAlgo(enum.Enum):
    """vLLM's --prefix-caching-hash-algo values we can reproduce (xxhash ones are seeded per
    process and cannot be)."""

    SHA256 = "sha256"
    SHA256_CBOR = "sha256_cbor"


def _encoder(algo: HashAlgo) -> Callable[[object], bytes]:
    if algo is HashAlgo.SHA256:
        return partial(pickle.dumps, protocol=pickle.HIGHEST_PROTOCOL)
    return partial(cbor2.dumps, canonical=True)


def _digest(value: object, algo: HashAlgo) -> bytes:
    return hashlib.sha256(_encoder(algo)(value)).digest()


# Digests made lately, by algorithm and by what was hashed (parent, block tokens, extra keys):
# a prefix many requests share (a system prompt) is hashed once, not again on every Admit that
# sends it (pickling and SHA-256 of 80 blocks were most of an Admit's cost in the state machine).
# Emptied when full: a few MB at most, and a shared prefix is hashed again once per refill.
MEMO_ENTRIES = 4096
_memos: dict[HashAlgo, dict[tuple[bytes, tuple[int, ...], object], bytes]] = {
    algo: {} for algo in HashAlgo
}


def forget_digests() -> None:
    """Empty the digests kept (a benchmark that must hash every block each time)."""
    for memo in _memos.values():
        memo.clear()


@cache
def none_hash(algo: HashAlgo, python_hash_seed: str | None = None) -> bytes:
    """The parent of a sequence's first block."""
    return _digest(python_hash_seed if python_hash_seed is not None else NONE_HASH_SEED, algo)


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None,
    algo: HashAlgo = HashAlgo.SHA256,
    python_hash_seed: str | None = None,
) -> list[bytes]:
    """The chained digests of every full block of token_ids; a partial tail gets none."""
    if block_size < 1:
        raise ValueError("block_size must be at least 1")
    sha256, dumps, protocol = hashlib.sha256, pickle.dumps, pickle.HIGHEST_PROTOCOL
    # Pickle is called here, not through `_encoder`: a Python call less per block.
    encode = None if algo is HashAlgo.SHA256 else _encoder(algo)
    parent = none_hash(algo, python_hash_seed)
    digests: list[bytes] = []
    append = digests.append
    # The salt is an extra key of the first block only.
    extra = (("cache_salt", cache_salt),) if cache_salt else None
    # zip over one iterator, block_size times: each full block as a tuple (the values hashed
    # are exactly vLLM's), cut in C; a partial tail is left out.
    memo = _memos[algo]
    for block in zip(*[iter(token_ids)] * block_size, strict=False):
        value = (parent, block, extra)
        digest = memo.get(value)
        if digest is None:
            digest = sha256(dumps(value, protocol) if encode is None else encode(value)).digest()
            if len(memo) >= MEMO_ENTRIES:
                memo.clear()
            memo[value] = digest
        parent = digest
        append(digest)
        extra = None
    return digests


def event_hash(digest: bytes) -> int:
    """The int a KV event carries for this digest: its low 64 bits, big-endian."""
    return int.from_bytes(digest[-8:], "big")
