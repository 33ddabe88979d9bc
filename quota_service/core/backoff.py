"""Exponential backoff per key (an engine's address): after a failed call, the next waits twice
as long as the last, up to a cap; one success resets it. Pure: callers pass the clock."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Backoff:
    initial_seconds: float
    max_seconds: float
    _failures: dict[str, int] = field(default_factory=dict)
    _not_before: dict[str, float] = field(default_factory=dict)

    def ready(self, key: str, now: float) -> bool:
        """Whether a call to `key` may be made at `now`."""
        return now >= self._not_before.get(key, now)

    def failed(self, key: str, now: float) -> float:
        """Record a failed call; returns how long the next must wait."""
        failures = self._failures.get(key, 0)
        delay = min(self.initial_seconds * 2.0**failures, self.max_seconds)
        self._failures[key] = failures + 1
        self._not_before[key] = now + delay
        return delay

    def succeeded(self, key: str) -> None:
        self._failures.pop(key, None)
        self._not_before.pop(key, None)
