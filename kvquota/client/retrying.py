"""When to try a failed call again, after how long, and where: the decisions, kept apart from
the I/O so that both clients share them.

- A refusal kvquota gave a retry delay (RetryInfo) is retried after that delay, plus up to
  `jitter` of it (never earlier: the delay is computed from when capacity comes back), within
  the caller's budget: `max_attempts` calls and `deadline_seconds` from the first.
- A refusal without one (INVALID_REQUEST, REQUEST_ID_REUSED, NOT_FOUND, ...) is not retried:
  waiting cannot fix it.
- A server that cannot answer (SERVER_SHUTTING_DOWN, DATABASE_UNAVAILABLE, or no answer at all)
  is left for the next address, when several are given. A call that may have taken effect
  before the answer was lost is replayed only when replaying it is safe: every AdmissionService
  call is (Admit is idempotent by its request_id; Release, Cancel and the rest by design).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvquota.client.errors import KvquotaError, ServerUnavailable

# Calls whose replay after a lost answer would do something twice, or answer ALREADY_EXISTS
# for what the first call created.
NOT_REPLAYABLE = frozenset(
    {"CreateApiKey", "RotateCacheSalt", "CreateTenant", "CreateNamespace", "RegisterInstance"}
)


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """The caller's budget for one call, retries included."""

    max_attempts: int = 4
    deadline_seconds: float = 10.0
    # Up to this fraction of the delay is added at random, so callers refused together do not
    # come back together.
    jitter: float = 0.2
    # Backoff for failures that carry no delay (a server that did not answer): doubling from
    # the first, at most the last.
    first_backoff_seconds: float = 0.05
    max_backoff_seconds: float = 2.0


DEFAULT_RETRY = RetryPolicy()
NO_RETRIES = RetryPolicy(max_attempts=1)


@dataclass(frozen=True, slots=True)
class Retry:
    delay_seconds: float
    # Ask the next address: this server cannot answer.
    fail_over: bool


def _answered(error: KvquotaError) -> bool:
    """kvquota refused the call itself: nothing it asked for happened."""
    return bool(error.reason) and error.reason != "DATABASE_UNAVAILABLE"


def next_retry(
    error: KvquotaError,
    method: str,
    attempt: int,
    elapsed_seconds: float,
    policy: RetryPolicy,
    rng: random.Random,
) -> Retry | None:
    """Whether attempt number `attempt` (from 1), which failed with `error` after
    `elapsed_seconds` of the whole call, is followed by another one; None: give up with it."""
    if attempt >= policy.max_attempts:
        return None
    server_down = isinstance(error, ServerUnavailable)
    if not server_down and error.retry_delay_seconds is None:
        return None  # waiting cannot fix it
    if server_down and not _answered(error) and method in NOT_REPLAYABLE:
        return None
    if error.retry_delay_seconds is not None:
        delay = error.retry_delay_seconds * (1 + policy.jitter * rng.random())
    else:
        ceiling = min(policy.max_backoff_seconds, policy.first_backoff_seconds * 2 ** (attempt - 1))
        delay = ceiling * rng.random()
    if elapsed_seconds + delay >= policy.deadline_seconds:
        return None  # the answer would come after the caller stopped waiting for it
    return Retry(delay, fail_over=server_down)
