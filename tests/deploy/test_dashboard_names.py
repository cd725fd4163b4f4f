"""The PromQL name reader that checks the dashboard (the check itself runs against live `/metrics` pages in
tests/e2e/test_up.py), and the dashboard's coverage of what an operator needs to see."""

from __future__ import annotations

from tests.deploy.dashboard_names import dashboard_expressions, exported_names, promql_metric_names, unknown_names


def test_names_are_read_from_selectors_not_from_functions_labels_or_ranges():
    expr = ('histogram_quantile(0.95, sum by (le, objective) (rate(holdback_gateway_ttft_seconds_bucket'
            '{stream="true", objective=~"real.*"}[5m]))) / on (band) group_left (x) max without (pod) '
            '(vllm:kv_cache_usage_perc offset 5m) > bool 0.5 and sum(rate(a_total[$__rate_interval]))')
    assert promql_metric_names(expr) == {"holdback_gateway_ttft_seconds_bucket", "vllm:kv_cache_usage_perc",
                                         "a_total"}
    assert promql_metric_names('sum(x{a="sum(y)"}) or z') == {"x", "z"}


def test_exported_names_include_families_without_samples_yet():
    text = ("# HELP c_total A counter.\n# TYPE c_total counter\n"
            "# HELP h A histogram.\n# TYPE h histogram\n"
            "# HELP g A gauge.\n# TYPE g gauge\ng{worker=\"w\"} 1.0\n")
    names = exported_names(text)
    assert {"c_total", "h_bucket", "h_count", "h_sum", "g"} <= names
    assert "c" not in names and "h" not in names


def test_the_dashboard_covers_batches_queues_workers_bands_evictions_kv_and_ttft():
    names = {n for e in dashboard_expressions() for n in promql_metric_names(e)}
    for needed in ("holdback_processor_batch_transitions_total", "holdback_worker_queue_depth",
                   "holdback_worker_in_flight", "holdback_gateway_queue_size",
                   "holdback_gateway_flow_control_request_queue_duration_seconds_bucket",
                   "holdback_gateway_evictions_total", "holdback_gateway_kv_reserved_blocks",
                   "vllm:kv_cache_usage_perc", "holdback_gateway_ttft_seconds_bucket"):
        assert needed in names, needed


def test_a_name_no_component_exports_is_reported_with_its_expressions():
    exported = exported_names("# HELP a A counter.\n# TYPE a counter\n")
    assert unknown_names(["sum(rate(a_total[1m]))", "sum(a) + b"], exported) == {"a": ["sum(a) + b"],
                                                                                   "b": ["sum(a) + b"]}
