"""How many examples a property-based test runs: the count it names for the default suite, times
KVQUOTA_EXAMPLES_SCALE. `make test` runs the counts as named; `make test-long`, which CI runs
too, runs ten times as many."""

from __future__ import annotations

import os


def examples(default_suite: int) -> int:
    return default_suite * int(os.environ.get("KVQUOTA_EXAMPLES_SCALE", "1"))
