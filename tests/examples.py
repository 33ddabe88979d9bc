"""How many examples a property-based test runs: the count it names for the default suite, times
KVQUOTA_EXAMPLES_SCALE. `make test` runs the counts as named; `make test-long`, which CI runs
too, runs ten times as many. And how often the model tests run their expensive checks."""

from __future__ import annotations

import os

# In `make test`, the model tests' expensive checks (the record checked whole, a machine
# recovered from what was written) run after every fifth step and after the last one: after
# each step they took up to half the suite's longest test. Scaled up, they run after each step.
THOROUGH_EVERY = 5


def _scale() -> int:
    return int(os.environ.get("KVQUOTA_EXAMPLES_SCALE", "1"))


def examples(default_suite: int) -> int:
    return default_suite * _scale()


def thorough_after(step: int) -> bool:
    """Whether the expensive checks run after this step (counted from 1)."""
    return _scale() > 1 or step % THOROUGH_EVERY == 0
