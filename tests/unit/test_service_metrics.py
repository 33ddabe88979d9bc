"""A replica's own metrics: the status and outcome the RPC interceptor records, and the engine
event lag, without a server."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
from sqlalchemy.exc import OperationalError

from kvquota.v1 import admission_pb2
from kvquota.v1 import resources_pb2 as pb
from quota_service.api import error_status, observability
from quota_service.core.errors import KvQuotaError
from quota_service.core.reasons import Reason
from quota_service.metrics import ServiceMetrics


class _Context:
    """Just enough of a servicer context: the code an abort set."""

    def __init__(self, code: grpc.StatusCode | None = None) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode | None:
        return self._code


def answered(exc: BaseException, code: grpc.StatusCode | None = None) -> tuple[str, str]:
    context: Any = _Context(code)
    return error_status.answered_with(exc, context)


def test_the_status_of_an_answer_is_the_domain_error_s_or_a_safe_default() -> None:
    quota = KvQuotaError(Reason.TENANT_QUOTA_EXCEEDED, "over")
    assert answered(quota) == ("RESOURCE_EXHAUSTED", "TENANT_QUOTA_EXCEEDED")
    down = OperationalError("SELECT 1", {}, Exception("connection refused"))
    assert answered(down) == ("UNAVAILABLE", "DATABASE_UNAVAILABLE")
    assert answered(RuntimeError("a bug")) == ("INTERNAL", "INTERNAL")
    assert answered(asyncio.CancelledError()) == ("CANCELLED", "")


def test_an_admission_s_outcome_comes_from_its_reservation() -> None:
    admitted = pb.Reservation(state=pb.RESERVATION_STATE_ADMITTED)
    response = admission_pb2.AdmitResponse(reservation=admitted, cache_salt="secret")
    fresh, waited = observability.CallNotes(), observability.CallNotes(queued=True)
    assert observability.admission_outcome(response, fresh) == ("admitted", "")
    assert observability.admission_outcome(response, waited) == ("queued", "")
    assert observability.admission_outcome(admitted, fresh) == ("admitted", "")  # Resume
    ended = pb.Reservation(state=pb.RESERVATION_STATE_ENDED)  # a repeat of a finished one
    assert observability.admission_outcome(ended, fresh) == ("ended", "")
    shadowed = pb.Reservation(
        state=pb.RESERVATION_STATE_ADMITTED, shadow_refusal="TENANT_QUOTA_EXCEEDED"
    )
    assert observability.admission_outcome(shadowed, waited) == (
        "shadow_admitted",
        "TENANT_QUOTA_EXCEEDED",
    )


def test_note_queued_marks_only_the_call_in_progress() -> None:
    observability.note_queued()  # outside any call: nothing to mark, no error
    call = observability.CallNotes()
    token = observability.call_notes.set(call)
    try:
        observability.note_queued()
    finally:
        observability.call_notes.reset(token)
    assert call.queued


def test_event_lag_is_the_time_from_the_engine_s_stamp_to_its_application() -> None:
    metrics = ServiceMetrics()
    metrics.observe_event_batch("gpu-0", 1000.0, 1000.25)
    metrics.observe_event_batch("gpu-0", 0.0, 1001.0)  # no stamp: not observed
    metrics.observe_event_batch("gpu-0", 1002.0, 1001.0)  # the engine's clock ahead: lag 0

    def sample(name: str, **labels: str) -> float | None:
        return metrics.registry.get_sample_value(name, {"engine_instance": "gpu-0", **labels})

    assert sample("kvquota_engine_event_lag_seconds_count") == 2
    assert sample("kvquota_engine_event_lag_seconds_sum") == 0.25
    assert sample("kvquota_engine_event_lag_seconds_bucket", le="0.25") == 2
    assert sample("kvquota_engine_event_lag_seconds_bucket", le="0.1") == 1
    assert sample("kvquota_engine_event_last_batch_timestamp_seconds") == 1002.0


def test_every_server_has_a_registry_of_its_own() -> None:
    first, second = ServiceMetrics(), ServiceMetrics()
    first.count_admission("Admit", "admitted")
    labels = {"method": "Admit", "outcome": "admitted", "reason": ""}
    assert first.registry.get_sample_value("kvquota_admissions_total", labels) == 1
    assert second.registry.get_sample_value("kvquota_admissions_total", labels) is None
