"""The journal writes a reservation's times as integer microseconds since the epoch
(store/journal.py, `_micros`): exactly the microseconds `datetime.fromtimestamp(seconds, UTC)`
makes of them, which the record held when they went as ISO 8601 and which recovery reads back
(`test_times_read_back_as_iso_8601_recorded_them` in tests/integration/test_instance_owner.py
writes them to PostgreSQL)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from hypothesis import given
from hypothesis import strategies as st

from quota_service.store.journal import _micros
from tests.times import tricky_times

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
MICROSECOND = timedelta(microseconds=1)


def as_datetime_makes_it(seconds: float) -> int:
    return (datetime.fromtimestamp(seconds, UTC) - EPOCH) // MICROSECOND


def test_the_microseconds_are_those_fromtimestamp_makes() -> None:
    times = [*tricky_times(20_000), 0.0, 5e-7, 1.5e-6, 2.5e-6, 1.0, 4e9 + 5e-7]
    wrong = [t for t in times if _micros(t) != as_datetime_makes_it(t)]
    assert not wrong, [(t, _micros(t), as_datetime_makes_it(t)) for t in wrong[:5]]


def test_the_halves_round_to_even_as_fromtimestamp_does() -> None:
    # A float near 1.7e9 holds its fraction in steps of 2**-22 s: an odd number of 128ths of a
    # second is an odd number of half microseconds (1/128 s is 7,812.5 µs), exactly.
    second = 1_700_000_000
    assert _micros(second + 1 / 128) == second * 1_000_000 + 7_812
    assert _micros(second + 3 / 128) == second * 1_000_000 + 23_438
    for t in (second + k / 128 for k in range(128)):
        assert _micros(t) == as_datetime_makes_it(t)
    for t in (second + k / 2**22 for k in range(0, 2**22, 997)):
        assert _micros(t) == as_datetime_makes_it(t)


@given(st.floats(min_value=0.0, max_value=4e9))
def test_any_time_since_the_epoch(seconds: float) -> None:
    assert _micros(seconds) == as_datetime_makes_it(seconds)


def test_no_time_is_none() -> None:
    assert _micros(None) is None
