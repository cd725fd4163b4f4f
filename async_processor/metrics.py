"""Prometheus metrics of one worker process, in its own registry, served on `--metrics-port` (holdback.probes).

Several worker processes export the same names, so every gauge sums right across them: the per-process gauges
carry a `worker` label (the worker's name, which holds its pid), and the queue depth, which every worker
would see alike, is exported only by the worker that holds the scheduler role (one at a time).
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from holdback.probes import component_registry


class WorkerMetrics:
    def __init__(self, worker: str) -> None:
        self.registry = component_registry()
        r = self.registry
        self.queue_depth = Gauge(
            "holdback_worker_queue_depth", "Jobs in the request queue and its RQ registries, exported by the one "
            "worker holding the scheduler role (so a sum over workers counts each job once).", ["state"], registry=r)
        self.in_flight = Gauge("holdback_worker_in_flight", "Requests this process has in flight.", ["worker"],
                               registry=r).labels(worker)
        self.attempts = Counter(
            "holdback_worker_attempts_total", "Finished attempts by outcome class.", ["outcome"], registry=r)
        self.retries = Counter(
            "holdback_worker_retries_total", "Rows parked for a retry, by the outcome that caused it.", ["outcome"],
            registry=r)
        self.evictions = Counter(
            "holdback_worker_evictions_total", "429 answers with drop reason `evicted`.", registry=r)
        self.results = Counter(
            "holdback_worker_results_recorded_total", "Final results this process recorded.", ["status"], registry=r)
        self.duplicates = Counter(
            "holdback_worker_duplicates_suppressed_total",
            "Deliveries of a row that was already final (stage=delivery) and final results that lost the "
            "compare-and-set (stage=result).", ["stage"], registry=r)
        self.left_for_expiry = Counter(
            "holdback_worker_left_for_expiry_total", "Rows whose next try would land past the batch deadline.",
            registry=r)
        self.cancelled = Counter(
            "holdback_worker_cancelled_total", "In-flight requests aborted by a batch cancel or expiry.", registry=r)
        self.internal_errors = Counter(
            "holdback_worker_internal_errors_total", "Jobs put back because the database or Redis failed.",
            registry=r)
        self.requeued_abandoned = Counter(
            "holdback_worker_requeued_abandoned_total", "Jobs of dead workers put back on the queue.", registry=r)
        self.circuit_open = Gauge(
            "holdback_worker_circuit_open", "1 while this worker sees the shared gateway circuit open and claims no "
            "new jobs (a sum counts the workers held).", ["worker"], registry=r).labels(worker)
        self.circuit_probes = Counter(
            "holdback_worker_circuit_probes_total", "Probes of the gateway by result (up, down).", ["result"],
            registry=r)
        self.attempt_seconds = Histogram(
            "holdback_worker_attempt_seconds", "Gateway request time of one attempt.", ["outcome"], registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))
