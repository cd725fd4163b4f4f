"""Structured logs for the processor: one JSON event per line, with the batch id where it applies.

`log_event(log, "batch_expanded", batch_id=..., total=...)` writes
`{"ts":..,"level":"info","logger":"batch_processor.ingest","event":"batch_expanded","batch_id":..,"total":..}`.
"""

from __future__ import annotations

import json
import logging
import sys

_RECORD_KEYS = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "fields"}


class JsonLines(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        event = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": record.getMessage(),
        }
        event.update(getattr(record, "fields", None) or {})
        if record.exc_info:
            event["exception"] = self.formatException(record.exc_info)
        return json.dumps(event, default=str, separators=(",", ":"))


def configure_logging(level: str = "info") -> None:
    """Send the processor's loggers to stderr as JSON lines (RQ's own logger stays quiet)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLines())
    root = logging.getLogger("batch_processor")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


def log_event(logger: logging.Logger, event: str, level: int = logging.INFO, **fields: object) -> None:
    if logger.isEnabledFor(level):
        logger.log(level, event, extra={"fields": {k: v for k, v in fields.items() if v is not None}})
