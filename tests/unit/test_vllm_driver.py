"""Decoding vLLM's KV events in every form they come in, and reading /metrics."""

from __future__ import annotations

import msgspec
import pytest

from quota_service.core.hashing import block_hashes, event_hash
from quota_service.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from quota_service.engine.vllm.events import EventDecodeError, decode_batch
from quota_service.engine.vllm.http import MetricsError, parse_metrics, vllm_request_ids

STORED = {
    "type": "BlockStored",
    "block_hashes": [11149786846783383691, 17061008231098362534],
    "parent_block_hash": None,
    "token_ids": list(range(1, 65)),
    "block_size": 32,
    "lora_id": None,
    "medium": "GPU",
    "lora_name": None,
    "extra_keys": [["tenantA"], None],
    "group_idx": 0,
    "kv_cache_spec_kind": "full_attention",
    "a_field_from_the_future": {"x": 1},
}


def encode(batch: object) -> bytes:
    return msgspec.msgpack.encode(batch)


def test_tagged_maps_as_vllm_sends_them() -> None:
    payload = encode(
        [
            1795959607.7,
            [
                STORED,
                {"type": "BlockRemoved", "block_hashes": [5], "medium": "cpu"},
                {"type": "AllBlocksCleared"},
            ],
            0,
        ]
    )
    batch = decode_batch(payload)
    stored, removed, cleared = batch.events
    assert isinstance(stored, BlockStored) and isinstance(removed, BlockRemoved)
    assert stored.block_hashes == (11149786846783383691, 17061008231098362534)
    assert stored.block_size == 32 and stored.medium == "GPU"
    assert removed.medium == "CPU"  # normalised
    assert isinstance(cleared, AllBlocksCleared)
    assert batch.data_parallel_rank == 0
    # The captured event is the tenant's salted prompt, hashed as kvquota hashes it.
    ours = [event_hash(h) for h in block_hashes(list(range(1, 70)), 32, "tenantA")]
    assert list(stored.block_hashes) == ours


def test_positional_events_of_older_releases() -> None:
    old = ["BlockStored", [1, 2], None, [7] * 32, 16, None, "gpu"]
    batch = decode_batch(encode([1.0, [old, ["BlockRemoved", [2], None], ["AllBlocksCleared"]]]))
    assert batch.events == (
        BlockStored((1, 2), None, (7,) * 32, 16, "GPU"),
        BlockRemoved((2,), "GPU"),
        AllBlocksCleared(),
    )
    assert batch.data_parallel_rank is None


def test_raw_digests_become_event_ints_and_unknown_types_are_skipped() -> None:
    digest = bytes(range(32))
    batch = decode_batch(
        encode(
            [1.0, [{"type": "BlockRemoved", "block_hashes": [digest]}, {"type": "SomethingNew"}]]
        )
    )
    assert batch.events == (BlockRemoved((event_hash(digest),), "GPU"),)


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",
        encode({"not": "a batch"}),
        encode([1.0, [{"no": "type"}]]),
        encode([1.0, [{"type": "BlockStored"}]]),
    ],
)
def test_what_is_not_an_event_batch(payload: bytes) -> None:
    with pytest.raises(EventDecodeError):
        decode_batch(payload)


CONFIG_LABELS = 'block_size="32",engine="0",num_gpu_blocks="64",prefix_caching_hash_algo="sha256"'
METRICS = "\n".join(
    [
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
        "# TYPE vllm:cache_config_info gauge",
        "vllm:cache_config_info{" + CONFIG_LABELS + "} 1.0",
        "# TYPE vllm:num_requests_running gauge",
        'vllm:num_requests_running{engine="0",model_name="m"} 2.0',
        "# TYPE vllm:num_requests_waiting gauge",
        'vllm:num_requests_waiting{engine="0",model_name="m"} 1.0',
        "# TYPE vllm:kv_cache_usage_perc gauge",
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25',
        "",
    ]
)


def test_metrics() -> None:
    metrics = parse_metrics(METRICS)
    assert (metrics.num_gpu_blocks, metrics.block_size, metrics.prefix_caching_hash_algo) == (
        64,
        32,
        "sha256",
    )
    assert (metrics.requests_running, metrics.requests_waiting, metrics.kv_cache_usage) == (
        2,
        1,
        0.25,
    )
    with pytest.raises(MetricsError):
        parse_metrics("# nothing here\n")


def test_the_ids_vllm_gives_a_request() -> None:
    assert vllm_request_ids("req-1") == ("cmpl-req-1-0", "chatcmpl-req-1")
