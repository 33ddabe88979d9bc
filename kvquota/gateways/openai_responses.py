"""What a gateway reads from vLLM's answers (the `usage` that says how many tokens were
generated, from a server-sent event stream or a JSON body, however the bytes are cut into
chunks) and the OpenAI-style error it answers with when kvquota refuses a request.
"""

from __future__ import annotations

import json
from typing import Any

from kvquota.client import KvquotaError

# A JSON answer is kept only this far to find its usage; a larger one is metered as 0 tokens.
MAX_JSON_BYTES = 8 << 20
_DATA = b"data:"

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    429: "rate_limit_error",
    499: "request_cancelled",
    503: "service_unavailable_error",
    504: "timeout_error",
}


def error_body(status: int, message: str, code: str) -> bytes:
    """An OpenAI-style error: {"error": {"message", "type", "param", "code"}}."""
    error = {
        "message": message,
        "type": _ERROR_TYPES.get(status, "server_error"),
        "param": None,
        "code": code,
    }
    return json.dumps({"error": error}).encode()


def refusal_body(refused: KvquotaError) -> bytes:
    """kvquota's refusal as the gateway's client sees it; `code` is kvquota's reason."""
    return error_body(refused.http_status, refused.message, refused.reason or refused.code.name)


class UsageReader:
    """Fed an answer's body chunk by chunk; `completion_tokens` and `prompt_tokens` are those of
    the last `usage` seen (None until one is)."""

    def __init__(self, event_stream: bool) -> None:
        self.event_stream = event_stream
        self.completion_tokens: int | None = None
        self.prompt_tokens: int | None = None
        self._pending = b""

    def feed(self, chunk: bytes) -> None:
        if not self.event_stream:
            if len(self._pending) + len(chunk) <= MAX_JSON_BYTES:
                self._pending += chunk
            return
        lines = (self._pending + chunk).split(b"\n")
        self._pending = lines.pop()  # an event cut in two: its rest is in the next chunk
        for line in lines:
            self._event_line(line.strip())

    def finish(self) -> None:
        """The body ended: read what is left."""
        pending, self._pending = self._pending.strip(), b""
        if self.event_stream:
            self._event_line(pending)
        elif pending:
            self._read(pending)

    def _event_line(self, line: bytes) -> None:
        if line.startswith(_DATA):
            self._read(line[len(_DATA) :].strip())

    def _read(self, payload: bytes) -> None:
        if not payload.startswith(b"{"):
            return  # [DONE], or not ours to read
        try:
            document: Any = json.loads(payload)
        except (UnicodeDecodeError, json.JSONDecodeError):
            return
        usage = document.get("usage") if isinstance(document, dict) else None
        if isinstance(usage, dict):
            self.completion_tokens = _count(usage.get("completion_tokens"))
            self.prompt_tokens = _count(usage.get("prompt_tokens"))


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
