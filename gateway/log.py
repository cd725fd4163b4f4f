"""The gateway's logging set-up, in the one format every holdback component writes (`holdback.logs`: JSON lines
with the same field names). Events are holdback's one `log_event(logger, event, level=..., **fields)`, re-exported
here for the gateway's modules, with the request id where it applies."""

from __future__ import annotations

from holdback import logs
from holdback.logs import log_event

__all__ = ["configure_logging", "log_event"]


def configure_logging(level: str = "INFO") -> None:
    logs.configure_json_logging("gateway", level, adopt=("aiohttp",))
