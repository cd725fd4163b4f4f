"""The gateway's structured log events, in the one format every holdback component writes (`holdback.logs`:
JSON lines with the same field names), with the request id where it applies."""

from __future__ import annotations

import logging

from holdback import logs


def log_event(logger: logging.Logger, level: int, event: str, **fields: object) -> None:
    """Log one event with its fields; fields that are None are left out."""
    logs.log_event(logger, event, level, **fields)


def configure_logging(level: str = "INFO") -> None:
    logs.configure_json_logging("gateway", level, adopt=("aiohttp",))
