"""The journal writes a reservation's times as integer microseconds since the epoch
(store/journal.py, `_micros`): exactly the microseconds `datetime.fromtimestamp(seconds, UTC)`
makes of them, which the record held when they went as ISO 8601 and which recovery reads back
(tests/integration/test_journal_times.py writes them to PostgreSQL)."""

from __future__ import annotations

import math
import random
from datetime import UTC, datetime, timedelta

from hypothesis import given
from hypothesis import strategies as st

from quota_service.store.journal import _micros

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
MICROSECOND = timedelta(microseconds=1)


def as_datetime_makes_it(seconds: float) -> int:
    return (datetime.fromtimestamp(seconds, UTC) - EPOCH) // MICROSECOND


def tricky_times(count: int, seed: int = 0) -> list[float]:
    """Times around 1.7e9 where rounding to the microsecond could go either way: halves of a
    microsecond (exact ones and nearly) and the floats beside them, the last half microsecond of
    a second and the first, whole seconds and the float below them; and times anywhere."""
    rng = random.Random(seed)
    times: list[float] = []
    for _ in range(count):
        second = rng.randrange(1_600_000_000, 1_900_000_000)
        micro = rng.randrange(1_000_000)
        half = second + (micro + 0.5) / 1e6
        times += [half, math.nextafter(half, 0), math.nextafter(half, math.inf)]
        times += [second + (micro - 0.5) / 1e6, second + micro / 1e6]
        times += [second + 0.9999995, second + 0.99999949, second + 0.9999996, second + 5e-7]
        times += [float(second), math.nextafter(float(second), 0), second + 0.999999]
        # Exactly an odd number of half microseconds (see below).
        times.append(second + rng.randrange(1, 128, 2) / 128)
        times.append(rng.uniform(1_600_000_000, 1_900_000_000))
    return times


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
