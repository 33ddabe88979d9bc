"""The client's retry decisions: the server's delay with jitter, within the caller's budget;
failover for a server that cannot answer; never a retry that waiting cannot help."""

from __future__ import annotations

import random

import grpc
import pytest

from kvquota.client.errors import KvquotaError, QuotaExceeded, ServerUnavailable, Unavailable
from kvquota.client.retrying import Retry, RetryPolicy, next_retry

POLICY = RetryPolicy(max_attempts=3, deadline_seconds=10, jitter=0.2)


class Fixed(random.Random):
    def __init__(self, value: float) -> None:
        super().__init__()
        self.value = value

    def random(self) -> float:
        return self.value


def refusal(kind: type[KvquotaError], reason: str, delay: float | None) -> KvquotaError:
    return kind(grpc.StatusCode.UNAVAILABLE, reason, "refused", retry_delay_seconds=delay)


def test_the_servers_delay_is_waited_never_less_and_at_most_jitter_more() -> None:
    busy = refusal(Unavailable, "INSTANCE_OVERLOADED", 2.0)
    assert next_retry(busy, "Admit", 1, 0.0, POLICY, Fixed(0.0)) == Retry(2.0, fail_over=False)
    assert next_retry(busy, "Admit", 1, 0.0, POLICY, Fixed(1.0)) == Retry(2.4, fail_over=False)


def test_the_budget_ends_retries() -> None:
    over = QuotaExceeded(grpc.StatusCode.RESOURCE_EXHAUSTED, "TENANT_QUOTA_EXCEEDED", "", None, 2.0)
    assert next_retry(over, "Admit", POLICY.max_attempts, 0.0, POLICY, Fixed(0.0)) is None
    # The answer would come after the deadline.
    assert next_retry(over, "Admit", 1, 8.5, POLICY, Fixed(0.0)) is None


@pytest.mark.parametrize(
    "reason", ["INVALID_REQUEST", "REQUEST_ID_REUSED", "INSTANCE_DRAINING", "LEASE_EXPIRED"]
)
def test_what_waiting_cannot_fix_is_not_retried(reason: str) -> None:
    error = refusal(KvquotaError, reason, None)
    assert next_retry(error, "Admit", 1, 0.0, POLICY, Fixed(0.0)) is None


def test_a_server_that_cannot_answer_is_left_for_the_next_address() -> None:
    shutting_down = refusal(ServerUnavailable, "SERVER_SHUTTING_DOWN", 0.1)
    retry = next_retry(shutting_down, "Admit", 1, 0.0, POLICY, Fixed(0.0))
    assert retry == Retry(0.1, fail_over=True)
    no_answer = refusal(ServerUnavailable, "", None)
    retry = next_retry(no_answer, "Release", 2, 0.0, POLICY, Fixed(1.0))
    assert retry == Retry(POLICY.first_backoff_seconds * 2, fail_over=True)


def test_a_call_that_may_have_landed_is_replayed_only_when_that_is_safe() -> None:
    no_answer = refusal(ServerUnavailable, "", None)
    assert next_retry(no_answer, "CreateApiKey", 1, 0.0, POLICY, Fixed(0.0)) is None
    assert next_retry(no_answer, "Admit", 1, 0.0, POLICY, Fixed(0.0)) is not None
    # Refused by kvquota itself: nothing happened, so even a create is retried.
    shutting_down = refusal(ServerUnavailable, "SERVER_SHUTTING_DOWN", 0.1)
    assert next_retry(shutting_down, "CreateApiKey", 1, 0.0, POLICY, Fixed(0.0)) is not None
