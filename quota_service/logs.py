"""Logging: one JSON object per line (for log pipelines) or plain text, each record carrying the
request id of the RPC it was written in."""

from __future__ import annotations

import json
import logging
from contextvars import ContextVar
from datetime import UTC, datetime

# Set by the API for the duration of each RPC; "" outside of one.
request_id: ContextVar[str] = ContextVar("request_id", default="")

FORMATS = ("json", "text")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        rid = request_id.get()
        if rid:
            entry["request_id"] = rid
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        rid = request_id.get()
        return f"{line} request_id={rid}" if rid else line


def configure(level: str, log_format: str) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    logging.basicConfig(level=level, handlers=[handler], force=True)
    logging.getLogger("alembic").setLevel(logging.WARNING)
    # Which migrations run, and the progress of those that carry a large table.
    logging.getLogger("alembic.runtime.migration").setLevel(logging.INFO)
    # grpc's DEBUG says "Loaded running loop" once per call, drowning ours.
    logging.getLogger("grpc").setLevel(max(logging.getLevelName(level), logging.INFO))
    # httpx logs every request's URL, and LMCache's URLs carry cache salts.
    logging.getLogger("httpx").setLevel(logging.WARNING)
