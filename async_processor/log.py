"""Structured logs of the worker: one event per line as key=value pairs (logfmt), like the gateway's,
with the batch id and request id wherever an event is about a request."""

from __future__ import annotations

import logging
import sys
import time

logger = logging.getLogger("async_processor")


def _fmt(value: object) -> str:
    if isinstance(value, float):
        value = f"{value:.3f}"
    text = str(value)
    if text == "" or any(c in text for c in ' "=\n\t'):
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    return text


def event(level: int, name: str, /, *, exc_info: bool = False, **fields: object) -> None:
    """Log `event=NAME key=value ...`; fields that are None are left out, order is kept."""
    if logger.isEnabledFor(level):
        parts = [f"event={name}"]
        parts += [f"{k}={_fmt(v)}" for k, v in fields.items() if v is not None]
        logger.log(level, " ".join(parts), exc_info=exc_info)


class LogfmtFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        line = f"ts={ts} level={record.levelname.lower()} logger={record.name} {record.getMessage()}"
        if record.exc_info:
            line += " exc=" + _fmt(self.formatException(record.exc_info))
        return line


def configure(level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(LogfmtFormatter())
    logger.handlers[:] = [handler]
    logger.setLevel(level.upper())
    logger.propagate = False
