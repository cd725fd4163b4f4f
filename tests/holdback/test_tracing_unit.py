"""holdback.tracing in one process: off by default and free of effects, spans to a file when asked, W3C
traceparent in and out, a clear error when OTLP is asked for without its exporter, trace ids in log lines."""

from __future__ import annotations

import json
import logging
import sys
import threading

import pytest

from holdback import tracing
from holdback.logs import JsonLines

CALLER = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture(autouse=True)
def _fresh_provider():
    tracing.shutdown()
    yield
    tracing.shutdown()


def test_off_without_an_exporter_and_leaves_no_trace():
    assert tracing.configure("holdback-test", environ={}) is False
    assert not tracing.enabled()
    with tracing.span("x", parent=CALLER) as span:
        assert not span.is_recording()
        assert tracing.current_trace_id() is None
        assert tracing.current_traceparent() is None
        assert tracing.inject({"a": "b"}) == {"a": "b"}


def test_sdk_disabled_wins_over_a_trace_file(tmp_path):
    env = {tracing.TRACE_FILE_ENV: str(tmp_path / "s.jsonl"), "OTEL_SDK_DISABLED": "true"}
    assert tracing.configure("holdback-test", environ=env) is False


def test_spans_continue_the_callers_traceparent_and_are_written_as_json_lines(tmp_path):
    path = tmp_path / "spans.jsonl"
    assert tracing.configure("holdback-test", environ={tracing.TRACE_FILE_ENV: str(path)})
    with tracing.span("outer", parent={"traceparent": CALLER}, kind="server", attributes={"batch_id": "b1"}):
        outer_parent = tracing.current_traceparent()
        with tracing.span("inner"):
            headers = tracing.inject({"x-request-id": "r1"})
            assert tracing.current_trace_id() == "0af7651916cd43dd8448eb211c80319c"
    # A stored context (a batch row's) is the parent of a later span, in another "process".
    with tracing.span("later", parent=outer_parent):
        pass
    with tracing.span("fresh", parent="not-a-traceparent"):
        fresh_trace = tracing.current_trace_id()
    spans = {s["name"]: s for s in tracing.read_spans(str(path))}
    assert set(spans) == {"outer", "inner", "later", "fresh"}
    outer, inner, later = spans["outer"], spans["inner"], spans["later"]
    assert outer["trace_id"] == inner["trace_id"] == later["trace_id"] == "0af7651916cd43dd8448eb211c80319c"
    assert outer["parent_span_id"] == "b7ad6b7169203331"
    assert inner["parent_span_id"] == later["parent_span_id"] == outer["span_id"]
    assert outer["kind"] == "server" and outer["service"] == "holdback-test"
    assert outer["attributes"] == {"batch_id": "b1"}
    # The header sent on is the inner span's own context.
    assert headers["traceparent"] == f"00-{inner['trace_id']}-{inner['span_id']}-01"
    # A malformed traceparent starts a new trace, as W3C trace context says.
    assert fresh_trace != outer["trace_id"] and spans["fresh"]["parent_span_id"] is None


def test_otlp_without_its_exporter_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.http.trace_exporter", None)
    with pytest.raises(tracing.TracingConfigError, match=r"holdback\[otlp\]"):
        tracing.configure("holdback-test", environ={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"})
    assert not tracing.enabled()


def test_otlp_endpoint_sends_spans_to_the_collector(monkeypatch):
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    received: list[tuple[str, bytes]] = []

    class Collector(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - the http.server hook's name
            received.append((self.path, self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{server.server_port}")
        assert tracing.configure("holdback-test")
        with tracing.span("exported", attributes={"batch_id": "b1"}):
            pass
        tracing.shutdown()  # flushes the batch processor
    finally:
        server.shutdown()
    assert [path for path, _ in received] == ["/v1/traces"]
    export = ExportTraceServiceRequest.FromString(received[0][1])
    (resource_spans,) = export.resource_spans
    service = {a.key: a.value.string_value for a in resource_spans.resource.attributes}["service.name"]
    names = [span.name for scope in resource_spans.scope_spans for span in scope.spans]
    assert (service, names) == ("holdback-test", ["exported"])


def test_log_lines_inside_a_span_carry_its_trace_id(tmp_path):
    record = logging.makeLogRecord({"name": "t", "msg": "event", "levelno": logging.INFO, "levelname": "INFO"})
    assert "trace_id" not in json.loads(JsonLines().format(record))
    tracing.configure("holdback-test", environ={tracing.TRACE_FILE_ENV: str(tmp_path / "s.jsonl")})
    assert "trace_id" not in json.loads(JsonLines().format(record))  # no span open
    with tracing.span("s", parent=CALLER):
        assert json.loads(JsonLines().format(record))["trace_id"] == "0af7651916cd43dd8448eb211c80319c"


def test_trace_id_of_reads_a_traceparent_and_refuses_anything_else():
    assert tracing.trace_id_of("00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01") == \
        "4bf92f3577b34da6a3ce929d0e0e4736"
    for bad in (None, "", "00-abc-def-01", "00-" + "0" * 32 + "-00f067aa0ba902b7-01", "not a traceparent"):
        assert tracing.trace_id_of(bad) is None
