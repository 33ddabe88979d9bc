"""Log lines: one JSON object each, carrying the request id of the RPC they were written in."""

from __future__ import annotations

import json
import logging

from quota_service import logs


def _record(message: str) -> logging.LogRecord:
    return logging.LogRecord("kvquota.test", logging.WARNING, __file__, 1, message, None, None)


def test_json_lines_carry_the_request_id() -> None:
    formatter = logs.JsonFormatter()
    outside = json.loads(formatter.format(_record("idle")))
    assert outside["message"] == "idle" and "request_id" not in outside
    token = logs.request_id.set("req-42")
    try:
        inside = json.loads(formatter.format(_record('a "quoted"\nline')))
        text = logs.TextFormatter().format(_record("plain"))
    finally:
        logs.request_id.reset(token)
    assert inside["request_id"] == "req-42"
    assert inside["message"] == 'a "quoted"\nline'
    assert inside["level"] == "WARNING" and inside["logger"] == "kvquota.test"
    assert text.endswith("plain request_id=req-42")
