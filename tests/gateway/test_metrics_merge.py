"""/metrics of `holdback gateway --workers N`: flow control's metrics and its relays' in one exposition."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import GatewayMetrics, merged_exposition, metric_families


def _samples(text: bytes) -> dict[tuple, float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text.decode()) for s in family.samples}


def test_counters_and_histograms_are_summed_over_processes_and_gauges_are_flow_controls():
    flow, relay_a, relay_b = GatewayMetrics(), GatewayMetrics(), GatewayMetrics()
    flow.watch(lambda: {"saturation": 0.5, "bands": [], "replicas": [], "stale_replicas": 0,
                        "eviction": {"pending": 0}, "config": {"digest": "d1"}})
    flow.child(flow.evictions, "default", "issued").inc(3)
    relay_a.child(relay_a.ttft, "default", "batch", "true").observe(0.02)
    relay_b.child(relay_b.ttft, "default", "batch", "true").observe(0.2)
    relay_b.child(relay_b.upstream_errors, "http://r0").inc()
    merged = _samples(merged_exposition(metric_families(flow.registry),
                                        [metric_families(relay_a.registry), metric_families(relay_b.registry)]))
    labels = (("objective", "batch"), ("pool", "default"), ("stream", "true"))
    assert merged[("holdback_gateway_ttft_seconds_count", labels)] == 2
    assert merged[("holdback_gateway_ttft_seconds_bucket", (("le", "0.025"),) + labels)] == 1
    assert merged[("holdback_gateway_ttft_seconds_bucket", (("le", "0.25"),) + labels)] == 2
    assert merged[("holdback_gateway_upstream_errors_total", (("replica", "http://r0"),))] == 1
    assert merged[("holdback_gateway_evictions_total", (("outcome", "issued"), ("pool", "default")))] == 3
    assert merged[("holdback_gateway_saturation", (("pool", "default"),))] == 0.5  # a gauge: flow control's only
    own_cpu = _samples(merged_exposition(metric_families(flow.registry), []))[("process_cpu_seconds_total", ())]
    assert merged[("process_cpu_seconds_total", ())] >= own_cpu  # the relays' CPU is added to it
    assert ("process_resident_memory_bytes", ()) in merged
