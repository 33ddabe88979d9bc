"""Conversions to protobuf that the hot path makes by hand must say what protobuf's own would."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

from google.protobuf.timestamp_pb2 import Timestamp
from hypothesis import given, settings
from hypothesis import strategies as st

from kvquota.v1 import resources_pb2 as pb
from quota_service.api import convert
from quota_service.core.block_table import BlockHandle
from quota_service.core.model import Reservation, ReservationState
from tests.examples import examples

ZONES = [None, UTC, timezone(timedelta(hours=5, minutes=30)), timezone(-timedelta(hours=8))]


@settings(max_examples=examples(200))
@given(st.datetimes(datetime(1, 1, 2), datetime(9999, 12, 30)), st.sampled_from(ZONES))
def test_timestamps_are_protobufs_own(value: datetime, zone: timezone | None) -> None:
    value = value.replace(tzinfo=zone)
    expected = Timestamp()
    expected.FromDatetime(value)
    assert convert.timestamp(value) == expected


def test_a_reservations_block_table_in_order() -> None:
    handles = tuple(BlockHandle(b, 7 << 40 | b) for b in range(1_000_000, 1_000_096))
    reservation = Reservation(
        *("acme", "r1", "gpu-0", 1280, 256, 1, 0, ReservationState.ADMITTED, 96, 1536, 0, 60.0),
        *(None, None, None, None, None),
        block_table=handles,
    )
    message = convert.reservation(reservation)
    expected = [pb.BlockHandle(block_id=h.block_id, generation=h.generation) for h in handles]
    assert list(message.block_table) == expected
