"""The worker's logger and its set-up, in the one format every holdback component writes (`holdback.logs`:
JSON lines with the same field names); events are `holdback.logs.log_event(logger, event, level=..., **fields)`
with the batch id and request id wherever an event is about a request."""

from __future__ import annotations

import logging

from holdback import logs

logger = logging.getLogger("async_processor")


def configure(level: str = "INFO") -> None:
    logs.configure_json_logging("async_processor", level, adopt=("rq",))
