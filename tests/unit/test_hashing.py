"""Hash parity with vLLM: vectors produced by vLLM's own request block hasher
(scripts/vllm_hash_vectors.py) must equal what kvquota computes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from quota_service.core import hashing
from quota_service.core.hashing import (
    MEMO_ENTRIES,
    HashAlgo,
    block_hashes,
    event_hash,
    forget_digests,
    none_hash,
)

VECTORS = json.loads((Path(__file__).parents[1] / "data" / "vllm_block_hashes.json").read_text())


@pytest.mark.parametrize(
    "vector",
    VECTORS["vectors"],
    ids=lambda v: f"{v['algo']}-{v['block_size']}-{v['sequence']}-{v['cache_salt']}",
)
def test_matches_vllm(vector: dict[str, object]) -> None:
    tokens = vector["token_ids"]
    block_size = vector["block_size"]
    assert isinstance(tokens, list) and isinstance(block_size, int)
    salt = vector["cache_salt"]
    given = (tokens, block_size, salt if isinstance(salt, str) else None, HashAlgo(vector["algo"]))
    forget_digests()
    ours = block_hashes(*given)
    assert [h.hex() for h in ours] == vector["hashes"]
    assert block_hashes(*given) == ours  # again, from the digests kept


def test_vectors_cover_salts_block_sizes_and_algorithms() -> None:
    vectors = VECTORS["vectors"]
    assert {v["algo"] for v in vectors} == {"sha256", "sha256_cbor"}
    assert {v["block_size"] for v in vectors} == {16, 32}
    assert None in {v["cache_salt"] for v in vectors}
    assert len({v["cache_salt"] for v in vectors}) > 2


def test_salt_changes_every_block_and_partial_tail_is_not_hashed() -> None:
    tokens = list(range(50))
    plain = block_hashes(tokens, 16, None)
    salted = block_hashes(tokens, 16, "tenant-a")
    other = block_hashes(tokens, 16, "tenant-b")
    assert len(plain) == 3  # 50 tokens: three full blocks, the last 2 tokens are not hashed
    assert all(a != b != c for a, b, c in zip(plain, salted, other, strict=True))
    assert block_hashes(tokens[:48], 16, None) == plain
    assert block_hashes(tokens[:15], 16, None) == []


def test_chain_depends_on_every_earlier_token() -> None:
    tokens = list(range(64))
    changed = [*tokens[:3], 999, *tokens[4:]]
    a, b = block_hashes(tokens, 16, None), block_hashes(changed, 16, None)
    assert all(x != y for x, y in zip(a, b, strict=True))
    assert block_hashes(tokens[:32], 16, None) == a[:2]


def test_python_hash_seed_changes_the_root() -> None:
    assert none_hash(HashAlgo.SHA256) != none_hash(HashAlgo.SHA256, "0")
    assert block_hashes([1] * 16, 16, None, python_hash_seed="0") != block_hashes(
        [1] * 16, 16, None
    )


def test_event_hash_is_the_low_64_bits() -> None:
    digest = bytes(range(32))
    assert event_hash(digest) == int.from_bytes(bytes(range(24, 32)), "big")


@pytest.mark.parametrize("algo", list(HashAlgo))
def test_digests_kept_for_a_shared_prefix_are_the_digests_made(algo: HashAlgo) -> None:
    shared = list(range(1000, 1064))
    forget_digests()
    made = block_hashes([*shared, *range(16)], 16, "salt", algo)
    # The shared blocks come from what was kept, the new one is made: the same chain either way.
    kept = block_hashes([*shared, *range(16, 32)], 16, "salt", algo)
    assert kept[:4] == made[:4] and kept[4] != made[4]
    forget_digests()
    assert block_hashes([*shared, *range(16, 32)], 16, "salt", algo) == kept
    # What was kept under one salt, seed or algorithm is never another's.
    assert block_hashes(shared, 16, "other", algo)[0] != made[0]
    assert block_hashes(shared, 16, "salt", algo, python_hash_seed="0")[0] != made[0]
    other = next(a for a in HashAlgo if a is not algo)
    assert block_hashes(shared, 16, "salt", other)[0] != made[0]


def test_the_digests_kept_stay_bounded() -> None:
    forget_digests()
    first = block_hashes(range(64), 16, None)
    for start in range(64, 64 * (MEMO_ENTRIES // 4 + 8), 64):
        block_hashes(range(start, start + 64), 16, None)
        assert len(hashing._memos[HashAlgo.SHA256]) <= MEMO_ENTRIES
    assert block_hashes(range(64), 16, None) == first
