"""Times that are hard to round to the microsecond, for the tests of how the journal records
times (tests/unit/test_journal_times.py, tests/integration/test_instance_owner.py)."""

from __future__ import annotations

import math
import random


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
        # Exactly an odd number of half microseconds (1/128 s is 7,812.5 µs, and a float near
        # 1.7e9 holds its fraction in steps of 2**-22 s).
        times.append(second + rng.randrange(1, 128, 2) / 128)
        times.append(rng.uniform(1_600_000_000, 1_900_000_000))
    return times
