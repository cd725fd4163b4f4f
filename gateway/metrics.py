"""Prometheus metrics of the gateway, in its own CollectorRegistry.

Event metrics (counters, histograms) are updated where things happen, through label children bound once.
State gauges (queue sizes, in-flight, saturation, ceilings, replicas) are read from the flow controller at
scrape time by a collector, so the hot path never touches them.
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

from holdback.probes import component_registry

PREFIX = "holdback_gateway"
_RELEASE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5)
# From a tenth of a millisecond (a slot handed on by an eviction decision in the same cycle) to minutes.
_WAIT_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10,
                 30, 60)
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = component_registry(auto_describe=True)
        r = self.registry
        self.dispatches = Counter(f"{PREFIX}_dispatches", "Requests dispatched to a replica, by band and path "
                                  "(inline when nothing was queued, loop when the dispatch loop sent it).",
                                  ["pool", "band", "path"], registry=r)
        self.rejections = Counter(f"{PREFIX}_rejections", "Requests answered without a result, by drop reason.",
                                  ["pool", "reason", "band"], registry=r)
        self.evictions = Counter(f"{PREFIX}_evictions", "In-flight evictions by outcome: issued, confirmed "
                                 "(upstream closed), timed_out, mid_stream (response had begun streaming).",
                                 ["pool", "outcome"], registry=r)
        self.queue_wait = Histogram(f"{PREFIX}_queue_wait_seconds", "Arrival to dispatch, for requests that "
                                    "waited in a queue.", ["pool", "band"], buckets=_LATENCY_BUCKETS, registry=r)
        # llm-d's flow_control_request_queue_duration_seconds, under our prefix: every request that reached flow
        # control, inline dispatches (about zero) included, so the count per outcome is the request count.
        self.flow_queue_duration = Histogram(
            f"{PREFIX}_flow_control_request_queue_duration_seconds", "Arrival to the request's outcome in flow "
            "control, by fairness id, priority band and outcome (dispatched, or the drop reason: "
            "rejected-saturated, rejected-ttl-expired, rejected-context-cancelled, ...).",
            ["pool", "fairness_id", "priority", "outcome"], buckets=_LATENCY_BUCKETS, registry=r)
        self.eviction_confirmation = Histogram(
            f"{PREFIX}_eviction_confirmation_seconds", "Eviction decision to the victim's upstream connection "
            "closed.", ["pool"], buckets=_LATENCY_BUCKETS, registry=r)
        self.blocked_release = Histogram(
            f"{PREFIX}_blocked_release_seconds", "For a non-sheddable request that found no room on arrival (it "
            "queued for a request slot): its arrival to the release of the slot it was then dispatched into (a "
            "request's end, or an eviction decision that hands the victim's slot on), by band. A dispatch that "
            "no release made room for (a ceiling raised, a replica back) counts up to the dispatch.",
            ["pool", "band"], buckets=_WAIT_BUCKETS, registry=r)
        self.ttft = Histogram(f"{PREFIX}_ttft_seconds", "Arrival at the gateway to the first response body "
                              "byte from the replica, by objective and stream: for stream=\"true\" (an event "
                              "stream) the first token; for stream=\"false\" the whole answer arrives at once, "
                              "so it is end to end.", ["pool", "objective", "stream"], buckets=_LATENCY_BUCKETS, registry=r)
        self.kv_release = Histogram(
            f"{PREFIX}_kv_release_seconds", "From a request's end, cancellation, disconnect or eviction decision "
            "to its KV blocks released in the ledger, by cause.", ["pool", "cause"], buckets=_RELEASE_BUCKETS, registry=r)
        self.kv_rejected_tokens = Counter(f"{PREFIX}_kv_rejected_tokens", "Tokens (prompt + max new) of requests "
                                          "refused by KV admission, by drop reason.", ["pool", "reason"], registry=r)
        self.tokenizer_fallbacks = Counter(f"{PREFIX}_tokenizer_fallbacks", "Prompts counted by the character "
                                           "estimate because no replica tokenizer answered.", registry=r)
        self.prompt_counts = Counter(f"{PREFIX}_prompt_counts", "Prompts counted for KV admission, by how: "
                                     "simulator or tokenizer.json (in the gateway), replica (its /tokenize), "
                                     "cache, token_ids, estimate.", ["source"], registry=r)
        self.upstream_errors = Counter(f"{PREFIX}_upstream_errors", "Transport failures talking to a replica.",
                                       ["replica"], registry=r)
        self.upstream_moves = Counter(f"{PREFIX}_upstream_moves", "Requests sent to another replica before any "
                                      "byte of an answer, by why their replica failed: connect (refused), closed "
                                      "(died with the request), unauthorized (refused the gateway's key).",
                                      ["reason"], registry=r)
        self._children: dict[tuple, object] = {}

    def child(self, metric, *labels: str):
        key = (id(metric), labels)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = metric.labels(*labels)
        return c

    def watch(self, snapshot: Callable[[], dict]) -> None:
        """Export the state gauges from `snapshot()` (the /admin/state document) at each scrape."""
        self.registry.register(_StateCollector(snapshot))


class _StateCollector:
    def __init__(self, snapshot: Callable[[], dict]):
        self.snapshot = snapshot

    def describe(self):
        return []

    def collect(self):
        s = self.snapshot()
        # One section per model pool (gateway/pools.py); a controller's own document is one pool's.
        pools = s.get("pools") or {"default": s}
        sat = GaugeMetricFamily(f"{PREFIX}_saturation", "Pool saturation from the configured detector "
                                "(1.0 = set point).", labels=["pool"])
        queue = GaugeMetricFamily(f"{PREFIX}_queue_size", "Queued requests by band.", labels=["pool", "band"])
        inflight = GaugeMetricFamily(f"{PREFIX}_in_flight", "Dispatched requests not yet finished, by band.",
                                     labels=["pool", "band"])
        ceiling = GaugeMetricFamily(f"{PREFIX}_band_ceiling", "Holdback ceiling by band.", labels=["pool", "band"])
        flows = GaugeMetricFamily(f"{PREFIX}_flow_control_queue_size", "Queued requests by fairness id and "
                                  "priority band (llm-d's flow_control_queue_size).",
                                  labels=["pool", "fairness_id", "priority"])
        r_inflight = GaugeMetricFamily(f"{PREFIX}_replica_in_flight", "Gateway requests in flight per replica.",
                                       labels=["pool", "replica"])
        r_healthy = GaugeMetricFamily(f"{PREFIX}_replica_healthy", "1 when the replica passes health checks.",
                                      labels=["pool", "replica"])
        r_kv = GaugeMetricFamily(f"{PREFIX}_replica_kv_usage", "Scraped vllm:kv_cache_usage_perc per replica.",
                                 labels=["pool", "replica"])
        stale = GaugeMetricFamily(f"{PREFIX}_stale_replicas", "Replicas scored by the stale-metrics fallback.",
                                  labels=["pool"])
        pending = GaugeMetricFamily(f"{PREFIX}_eviction_pending", "Evictions issued and not yet confirmed.",
                                    labels=["pool"])
        reserved = GaugeMetricFamily(f"{PREFIX}_kv_reserved_blocks", "KV blocks reserved in the ledger per replica.",
                                     labels=["pool", "replica"])
        used = GaugeMetricFamily(f"{PREFIX}_kv_used_blocks", "KV blocks used (prompt + output relayed) by the "
                                 "ledger's reservations per replica.", labels=["pool", "replica"])
        total = GaugeMetricFamily(f"{PREFIX}_kv_total_blocks", "KV pool size per replica.",
                                  labels=["pool", "replica"])
        share = GaugeMetricFamily(f"{PREFIX}_tenant_reserved_share", "Share of the KV pool reserved per fairness id.",
                                  labels=["pool", "fairness_id"])
        waiting = GaugeMetricFamily(f"{PREFIX}_estimated_wait_seconds", "Queued work at or above the band over "
                                    "the recent dispatch rate.", labels=["pool", "band"])
        demand = GaugeMetricFamily(f"{PREFIX}_reserve_demand", "adaptive-reserve: protected bands' queued + "
                                   "in-flight requests as a share of the pool, by reading (demand now, ewma, "
                                   "peak in the window, forecast = max(ewma, peak)).", labels=["pool", "reading"])
        forecasts = False
        for pool, p in pools.items():
            sat.add_metric([pool], p["saturation"])
            for band in p["bands"]:
                label = [pool, str(band["priority"])]
                for fairness_id, n in band["queues"].items():
                    flows.add_metric([pool, fairness_id, label[1]], n)
                queue.add_metric(label, band["queued"])
                inflight.add_metric(label, band["in_flight"])
                ceiling.add_metric(label, band["ceiling"])
            for rep in p["replicas"]:
                r_inflight.add_metric([pool, rep["url"]], rep["in_flight"])
                r_healthy.add_metric([pool, rep["url"]], 1.0 if rep["healthy"] else 0.0)
                if rep["kv_usage"] is not None:
                    r_kv.add_metric([pool, rep["url"]], rep["kv_usage"])
            stale.add_metric([pool], p["stale_replicas"])
            pending.add_metric([pool], p["eviction"]["pending"])
            kv = p.get("kv") or {}
            for url, rep in kv.get("replicas", {}).items():
                reserved.add_metric([pool, url], rep["reserved_blocks"])
                used.add_metric([pool, url], rep["used_blocks"])
                total.add_metric([pool, url], rep["total_blocks"])
            for fid, tenant in kv.get("tenants", {}).items():
                share.add_metric([pool, fid], tenant["share"])
            for band, seconds in kv.get("estimated_wait_s_by_priority", {}).items():
                waiting.add_metric([pool, band], seconds)
            forecast = (p.get("holdback") or {}).get("forecast")
            if forecast is not None:
                forecasts = True
                for reading in ("demand", "ewma", "peak", "forecast"):
                    demand.add_metric([pool, reading], forecast[reading])
        yield from (reserved, used, total, share, waiting)
        if forecasts:
            yield demand
        info = GaugeMetricFamily(f"{PREFIX}_config_info", "The running config's digest.", labels=["digest"])
        info.add_metric([s["config"]["digest"]], 1.0)
        yield from (sat, queue, flows, inflight, ceiling, r_inflight, r_healthy, r_kv, stale, pending, info)


# -- several processes (`holdback gateway --workers N`) -----------------------------------------------------------
def metric_families(registry: CollectorRegistry) -> list[tuple]:
    """A registry's current samples as plain tuples, to send over the flow-control channel."""
    return [(m.name, m.documentation, m.type, m.unit, [(s.name, s.labels, s.value) for s in m.samples])
            for m in registry.collect()]


def merged_exposition(own: list[tuple], others: list[list[tuple]]) -> bytes:
    """One exposition of the flow-control process's metrics and its relays': counters and histograms are summed
    over processes (`process_cpu_seconds_total` is the CPU of the whole gateway), `_created` is the earliest;
    gauges are the flow-control process's own (its state, its memory)."""
    families: dict[str, tuple[str, str, str, dict]] = {}

    def add(fams: list[tuple], gauges: bool) -> None:
        for name, doc, typ, unit, samples in fams:
            if typ not in ("counter", "histogram", "summary") and not gauges:
                continue
            values = families.setdefault(name, (doc, typ, unit, {}))[3]
            for sample, labels, value in samples:
                key = (sample, tuple(sorted(labels.items())))
                if sample.endswith("_created"):
                    values[key] = min(values.get(key, value), value)
                else:
                    values[key] = values.get(key, 0.0) + value

    add(own, True)
    for fams in others:
        add(fams, False)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(families))
    return generate_latest(registry)


class _Merged:
    def __init__(self, families: dict[str, tuple[str, str, str, dict]]):
        self.families = families

    def describe(self):
        return []

    def collect(self):
        for name, (doc, typ, unit, values) in self.families.items():
            metric = Metric(name, doc, typ, unit)
            for (sample, labels), value in values.items():
                metric.add_sample(sample, dict(labels), value)
            yield metric
