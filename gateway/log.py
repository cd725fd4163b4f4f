"""Structured logging: one event per line as key=value pairs (logfmt), with the request id where it applies."""

from __future__ import annotations

import logging
import sys
import time


def _fmt(value: object) -> str:
    text = str(value)
    if text == "" or any(c in text for c in ' "=\n\t'):
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    return text


def log_event(logger: logging.Logger, level: int, event: str, **fields: object) -> None:
    """Log `event=NAME key=value ...` when the level is enabled; field order is kept."""
    if logger.isEnabledFor(level):
        parts = [f"event={event}"]
        parts += [f"{k}={_fmt(v)}" for k, v in fields.items() if v is not None]
        logger.log(level, " ".join(parts))


class LogfmtFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        line = f"ts={ts} level={record.levelname.lower()} logger={record.name} {record.getMessage()}"
        if record.exc_info:
            line += " exc=" + _fmt(self.formatException(record.exc_info))
        return line


def configure_logging(level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(LogfmtFormatter())
    root = logging.getLogger("gateway")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
