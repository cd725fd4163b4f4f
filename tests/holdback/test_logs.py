"""Every component logs in one format: JSON lines with the same field names (holdback.logs)."""

from __future__ import annotations

import io
import json
import logging

import pytest

from async_processor import log as worker_log
from gateway.log import configure_logging as configure_gateway, log_event as gateway_event
from holdback.logs import configure_json_logging, log_event


def _capture(logger_name: str) -> io.StringIO:
    stream = io.StringIO()
    logging.getLogger(logger_name).handlers[0].setStream(stream)
    return stream


def test_gateway_worker_and_processor_events_have_the_same_shape():
    configure_gateway("INFO")
    worker_log.configure("INFO")
    configure_json_logging("batch_processor", "info")
    streams = [_capture("gateway"), _capture("async_processor"), _capture("batch_processor")]
    gateway_event(logging.getLogger("gateway.proxy"), "rejected", level=logging.WARNING, request_id="r1",
                  tenant="acme", reason="rejected-saturated", skipped=None)
    log_event(worker_log.logger, "request_final", level=logging.WARNING, request_id="r1", batch_id="b1",
              outcome="client_error")
    log_event(logging.getLogger("batch_processor.ingest"), "batch_expanded", batch_id="b1", total=3)
    lines = [json.loads(s.getvalue()) for s in streams]
    assert [set(line) >= {"ts", "level", "logger", "event"} for line in lines] == [True, True, True]
    gateway, worker, processor = lines
    assert gateway == {**gateway, "level": "warning", "logger": "gateway.proxy", "event": "rejected",
                       "request_id": "r1", "tenant": "acme"} and "skipped" not in gateway
    assert (worker["event"], worker["request_id"], worker["batch_id"]) == ("request_final", "r1", "b1")
    assert (processor["event"], processor["batch_id"], processor["level"]) == ("batch_expanded", "b1", "info")


def test_an_exception_is_one_json_line_too():
    configure_json_logging("async_processor", "info")
    stream = _capture("async_processor")
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        log_event(worker_log.logger, "job_error", level=logging.ERROR, exc_info=True, request_id="r2")
    [line] = stream.getvalue().splitlines()
    event = json.loads(line)
    assert event["event"] == "job_error" and "RuntimeError: boom" in event["exception"]


def test_every_component_logs_through_the_one_log_event():
    assert gateway_event is log_event  # the gateway re-exports holdback's, so a call reads the same everywhere
    with pytest.raises(TypeError):
        log_event(logging.getLogger("batch_processor"), logging.INFO, "level_first")  # the level is a keyword
