"""The one log format of every holdback process (API server, processor, workers, gateway, simulator):
one JSON event per line.

`log_event(log, "batch_expanded", batch_id=..., total=...)` (`level=logging.WARNING` and `exc_info=True` where
they apply) writes
`{"ts":..,"level":"info","logger":"batch_processor.ingest","event":"batch_expanded","batch_id":..,"total":..}`.
Fields that are None are left out. The same names are used for the same things everywhere: `request_id`,
`batch_id`, `tenant`, `worker`, `replica`, `error`, and `trace_id` while a span is open (holdback.tracing).
It is the standard library's logging with this one formatter rather than a structured-logging package:
uvicorn, aiohttp and RQ already log through the standard library, so their records come out in the same
format with no bridge, and there is nothing else to install.
"""

from __future__ import annotations

import json
import logging
import sys

from holdback import tracing

# Standard LogRecord attributes; anything else passed via `extra` is an event field.
_RECORD_KEYS = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "fields", "color_message"}


class JsonLines(logging.Formatter):
    """`{"ts", "level", "logger", "event", ...fields}` on one line."""

    def format(self, record: logging.LogRecord) -> str:
        event = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": record.getMessage(),
        }
        trace_id = tracing.current_trace_id()
        if trace_id is not None:
            event["trace_id"] = trace_id
        event.update(getattr(record, "fields", None) or {})
        event.update({k: v for k, v in vars(record).items() if k not in _RECORD_KEYS})
        if record.exc_info:
            event["exception"] = self.formatException(record.exc_info)
        return json.dumps(event, default=str, separators=(",", ":"))


def configure_json_logging(logger_name: str | None, level: str = "info", adopt: tuple[str, ...] = ()) -> None:
    """Send `logger_name` (None: the root logger) to stderr as JSON lines; loggers named in `adopt`
    (e.g. uvicorn's) drop their own handlers and propagate to it."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLines())
    target = logging.getLogger(logger_name)
    target.handlers[:] = [handler]
    target.setLevel(level.upper())
    if logger_name is not None:
        target.propagate = False
    for name in adopt:
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True


def log_event(logger: logging.Logger, event: str, *, level: int = logging.INFO, exc_info: bool = False,
              **fields: object) -> None:
    """Log `event` with its fields (None ones left out). The one log call of every component: `level` is a keyword,
    so a call with the level before the event fails at once instead of logging a number as the event."""
    if logger.isEnabledFor(level):
        logger.log(level, event, exc_info=exc_info,
                   extra={"fields": {k: v for k, v in fields.items() if v is not None}})
