"""Tracing: OpenTelemetry spans for one batch request across every process, with W3C trace context.

The trace of a batch starts at the API's `POST /v1/batches`; its `traceparent` is stored on the batch row
(`batches.trace_context`). The processor's ingest span continues it and stores its own context there in
turn, so each worker attempt (which reads the batch's context once per batch and process) is a child of
the processor's span; the attempt sends `traceparent` to the gateway, whose span is the parent of the
replica's (the simulator's, or vLLM's when it traces).

`configure(service)` is called once per process by each component's command line, and decides:
- `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) set: spans go to that collector
  over OTLP/HTTP, in batches (`pip install 'holdback[otlp]'` brings the exporter);
- `HOLDBACK_TRACE_FILE` set: every finished span is appended to that file as one JSON line (several
  processes may share the file; each line is one append);
- neither, or `OTEL_SDK_DISABLED=true`: nothing is installed, and OpenTelemetry is not even imported. `span()`
  then hands back one shared no-op context, `inject()` adds no header and `current_trace_id()` is None, so the
  cost is a global read.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any, Iterator, Sequence, TypeVar

T = TypeVar("T")

TRACEPARENT = "traceparent"
TRACE_FILE_ENV = "HOLDBACK_TRACE_FILE"
_OTLP_ENV = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")

# Set by configure(); all None while tracing is off (OpenTelemetry is imported only when it is turned on).
_tracer: Any = None
_provider: Any = None
_propagator: Any = None
_trace: Any = None  # the opentelemetry.trace module


class _NoopSpan:
    """What `span()` yields while tracing is off: every call a span takes, doing nothing."""

    def set_attribute(self, key: str, value: object) -> None:
        return None

    def update_name(self, name: str) -> None:
        return None

    def is_recording(self) -> bool:
        return False


_NOOP = contextlib.nullcontext(_NoopSpan())


class TracingConfigError(RuntimeError):
    """Tracing was asked for but cannot be set up (the message says what to install or change)."""


def configure(service: str, environ: Mapping[str, str] | None = None) -> bool:
    """Set this process's exporter from the environment; returns whether tracing is on. Idempotent: a second
    call (a test building two apps) keeps the first provider."""
    global _tracer, _provider, _propagator, _trace
    env = os.environ if environ is None else environ
    if _tracer is not None:
        return True
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    otlp = next((env[name] for name in _OTLP_ENV if env.get(name, "").strip()), None)
    path = env.get(TRACE_FILE_ENV, "").strip() or None
    if otlp is None and path is None:
        return False
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    if otlp is not None:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            raise TracingConfigError(
                f"OTEL_EXPORTER_OTLP_ENDPOINT is set ({otlp}) but the OTLP exporter is not installed: "
                "pip install 'holdback[otlp]', or unset the variable to run without tracing.") from None
        # The exporter reads the endpoint, headers and timeout from the standard OTEL_EXPORTER_OTLP_* variables.
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    if path is not None:
        provider.add_span_processor(SimpleSpanProcessor(JsonLinesSpanExporter(path)))
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    _provider, _propagator, _trace = provider, TraceContextTextMapPropagator(), trace
    _tracer = provider.get_tracer("holdback")
    return True


def shutdown() -> None:
    """Flush and stop the exporter (tests; processes also flush at exit)."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer = _provider = None


def enabled() -> bool:
    return _tracer is not None


def span(name: str, *, parent: str | Mapping[str, str] | None = None, kind: str = "internal",
         attributes: Mapping[str, Any] | None = None) -> contextlib.AbstractContextManager:
    """A span made current for the `with` block, yielding it (a no-op span when tracing is off).

    `parent`: a `traceparent` value or a mapping of headers carrying one; None continues the current span
    (or starts a trace). A malformed `traceparent` starts a new trace, as W3C trace context says."""
    tracer = _tracer
    if tracer is None:
        return _NOOP
    ctx = None
    if parent is not None:
        carrier = {TRACEPARENT: parent} if isinstance(parent, str) else parent
        ctx = _propagator.extract(carrier)
    return tracer.start_as_current_span(name, context=ctx, kind=_trace.SpanKind[kind.upper()],
                                        attributes={k: v for k, v in (attributes or {}).items() if v is not None})


def inject(headers: MutableMapping[str, str]) -> MutableMapping[str, str]:
    """Add the current span's `traceparent` (and `tracestate`) to `headers`; nothing when tracing is off."""
    if _tracer is not None:
        _propagator.inject(headers)
    return headers


def current_traceparent() -> str | None:
    """The current span's `traceparent`, to store where a later process continues the trace."""
    if _tracer is None:
        return None
    carrier: dict[str, str] = {}
    _propagator.inject(carrier)
    return carrier.get(TRACEPARENT)


def current_trace_id() -> str | None:
    """The current trace's id (32 hex digits) for log lines; None when tracing is off or no span is open."""
    if _tracer is None:
        return None
    ctx = _trace.get_current_span().get_span_context()
    return _trace.format_trace_id(ctx.trace_id) if ctx.is_valid else None


def trace_id_of(traceparent: str | None) -> str | None:
    """The trace id of a W3C `traceparent` (`00-<32 hex trace id>-<16 hex span id>-<flags>`), or None: for log
    lines written outside a span about work that belongs to a stored trace (a worker's outcome of an attempt)."""
    parts = (traceparent or "").split("-")
    if len(parts) != 4 or len(parts[1]) != 32 or parts[1] == "0" * 32:
        return None
    return parts[1].lower()


async def in_span(awaitable: Awaitable[T], name: str, *, parent: str | None, kind: str = "internal",
                  attributes: Mapping[str, Any] | None = None,
                  describe: Callable[[T], Mapping[str, Any]] | None = None) -> T:
    """Await `awaitable` inside a span (callers skip this wrapper when tracing is off); `describe(result)`
    adds attributes from the result."""
    with span(name, parent=parent, kind=kind, attributes=attributes) as s:
        result = await awaitable
        if describe is not None:
            for key, value in describe(result).items():
                if value is not None:
                    s.set_attribute(key, value)
        return result


async def traced_attempt(sending: Awaitable[T], attempt: Any, contexts: "BatchContexts",
                         load: Callable[[str], Awaitable[str | None]]) -> T:
    """One attempt's send in an `attempt` span, a child of its batch's stored context (`load(batch_id)` reads
    it when `contexts` does not know it yet); the send injects `traceparent` from this span."""
    known, parent = contexts.cached(attempt.batch_id)
    if not known:
        parent = await load(attempt.batch_id)
    return await in_span(
        sending, "attempt", parent=parent, kind="client",
        attributes={"request_id": attempt.request_id, "batch_id": attempt.batch_id, "attempt": attempt.number},
        describe=lambda sent: {"http.response.status_code": getattr(getattr(sent, "reply", sent), "status", None)})


class BatchContexts:
    """The stored trace context (`batches.trace_context`) of each batch this process works on, read from the
    database once per batch: a worker continues its batch's trace without a query per attempt."""

    def __init__(self, size: int = 4096):
        self.size = size
        self._known: OrderedDict[str, str | None] = OrderedDict()
        self._lock = threading.Lock()

    def cached(self, batch_id: str) -> tuple[bool, str | None]:
        with self._lock:
            if batch_id in self._known:
                return True, self._known[batch_id]
        return False, None

    def load(self, session: Any, batch_id: str) -> str | None:
        """Read the batch's context in `session` (a SQLAlchemy session) and remember it."""
        from sqlalchemy import select

        from holdback.models import Batch

        value = session.scalar(select(Batch.trace_context).where(Batch.id == batch_id))
        with self._lock:
            self._known[batch_id] = value
            while len(self._known) > self.size:
                self._known.popitem(last=False)
        return value


class JsonLinesSpanExporter:
    """Appends each finished span to a file as one JSON object per line (`HOLDBACK_TRACE_FILE`): for a look
    at traces without a collector, and for the test that follows one batch across processes."""

    def __init__(self, path: str):
        self.path = path
        self._lock = threading.Lock()

    def export(self, spans: Sequence[Any]):
        from opentelemetry.sdk.trace.export import SpanExportResult

        lines = "".join(json.dumps(_span_record(s), separators=(",", ":"), default=str) + "\n" for s in spans)
        with self._lock:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, lines.encode())
            finally:
                os.close(fd)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def _span_record(s: Any) -> dict:
    from opentelemetry import trace

    ctx = s.get_span_context()
    return {
        "trace_id": trace.format_trace_id(ctx.trace_id),
        "span_id": trace.format_span_id(ctx.span_id),
        "parent_span_id": trace.format_span_id(s.parent.span_id) if s.parent is not None else None,
        "name": s.name,
        "kind": s.kind.name.lower(),
        "service": s.resource.attributes.get("service.name"),
        "start_ns": s.start_time,
        "end_ns": s.end_time,
        "status": s.status.status_code.name.lower(),
        "attributes": dict(s.attributes or {}),
    }


def read_spans(path: str) -> Iterator[dict]:
    """The spans a `HOLDBACK_TRACE_FILE` holds, in the order they finished."""
    with open(path) as f:
        for line in f:
            if line.strip():
                yield json.loads(line)
