"""The worker's structured log events, in the one format every holdback component writes (`holdback.logs`:
JSON lines with the same field names), with the batch id and request id wherever an event is about a request."""

from __future__ import annotations

import logging

from holdback import logs

logger = logging.getLogger("async_processor")


def event(level: int, name: str, /, *, exc_info: bool = False, **fields: object) -> None:
    """Log event `name` with its fields; fields that are None are left out."""
    logs.log_event(logger, name, level, exc_info=exc_info, **fields)


def configure(level: str = "INFO") -> None:
    logs.configure_json_logging("async_processor", level, adopt=("rq",))
