"""The processor's Prometheus metrics, in a registry of its own (served with `--metrics-port`).

Labels are low-cardinality on purpose: statuses, validation codes and reconciliation kinds, never
batch or tenant ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from holdback.probes import component_registry


@dataclass
class ProcessorMetrics:
    registry: CollectorRegistry = field(default_factory=component_registry)

    def __post_init__(self) -> None:
        r = self.registry
        self.batch_transitions = Counter(
            "holdback_processor_batch_transitions_total", "Batch status transitions made by this processor.",
            ["status"], registry=r)
        self.batches_owned = Gauge(
            "holdback_processor_batches_owned", "Batches whose lease this processor holds.", registry=r)
        self.rows_enqueued = Counter(
            "holdback_processor_rows_enqueued_total", "Request rows moved pending to queued and handed to dispatch.",
            ["dispatch"], registry=r)
        self.rows_in_flight = Gauge(
            "holdback_processor_rows_in_flight", "Rows queued, running or waiting to retry in owned batches.",
            registry=r)
        self.batches_at_risk = Gauge(
            "holdback_processor_batches_at_risk", "Owned batches that will not finish inside their window at their "
            "pace so far (marked for the gateway's at-risk floor).", registry=r)
        self.queue_depth = Gauge(
            "holdback_processor_queue_depth", "Jobs waiting in the RQ requests queue.", registry=r)
        self.reconciled_rows = Counter(
            "holdback_processor_reconciled_rows_total", "Rows re-dispatched by reconciliation, by what was wrong.",
            ["kind"], registry=r)
        self.finalize_seconds = Histogram(
            "holdback_processor_finalize_seconds", "Time to write a batch's output and error files.",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120), registry=r)
        self.ingest_seconds = Histogram(
            "holdback_processor_ingest_seconds", "Time to validate and expand a batch input file into rows.",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60), registry=r)
        self.validation_failures = Counter(
            "holdback_processor_validation_failures_total", "Input validation errors, by code.",
            ["code"], registry=r)
        self.sync_concurrency_limit = Gauge(
            "holdback_processor_sync_concurrency_limit", "Current AIMD limit of the sync dispatcher.", registry=r)
        self.sync_requests = Counter(
            "holdback_processor_sync_requests_total", "Requests sent by the sync dispatcher, by outcome.",
            ["outcome"], registry=r)
        self.tick_errors = Counter(
            "holdback_processor_tick_errors_total", "Processing rounds that raised (database or Redis trouble).",
            registry=r)
