from quota_service.core.backoff import Backoff


def test_waits_double_up_to_the_cap_and_a_success_resets_them() -> None:
    backoff = Backoff(0.5, 3.0)
    assert backoff.ready("e", 0.0)
    assert [backoff.failed("e", 0.0) for _ in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert not backoff.ready("e", 2.9) and backoff.ready("e", 3.0)
    assert backoff.ready("other", 0.0)  # per engine
    backoff.succeeded("e")
    assert backoff.ready("e", 0.0) and backoff.failed("e", 0.0) == 0.5
