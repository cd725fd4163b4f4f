"""bench.stats, the one percentile, interval and verdict every benchmark and report uses, on hand-made values."""

import math

import pytest

from bench.stats import (Estimate, bootstrap, bootstrap_median, bootstrap_percentile, central_95, decide,
                         histogram_bound, histogram_quantile, percentile, quantile_interval, quantile_upper_bound,
                         ratio_of_runs, verdict)


def test_percentile_interpolates_between_order_statistics_and_keeps_a_missing_first_token_infinite():
    assert percentile([], 0.95) is None
    assert percentile([4.0, 1.0, 3.0, 2.0], 0.5) == 2.5
    assert percentile([float(i) for i in range(101)], 0.95) == 95.0
    assert percentile([1.0, 2.0], 0.99) == pytest.approx(1.99)
    assert percentile([1.0, math.inf, math.inf], 0.95) == math.inf


def test_verdict_is_decided_only_when_the_interval_is_on_one_side():
    assert verdict(Estimate(1.0, 0.98, 1.04, 3, "b"), 1.05, at_least=False) == "met"
    assert verdict(Estimate(1.2, 1.1, 1.3, 3, "b"), 1.05, at_least=False) == "missed"
    assert verdict(Estimate(1.04, 1.0, 1.1, 3, "b"), 1.05, at_least=False).startswith("undecided")
    assert verdict(Estimate(1.5, 1.31, 1.7, 3, "b"), 1.3, at_least=True) == "met"
    assert verdict(Estimate(1.2, 1.1, 1.29, 3, "b"), 1.3, at_least=True) == "missed"
    one = verdict(Estimate(1.5, None, None, 1, "one repeat"), 1.3, at_least=True)
    assert one.startswith("undecided") and "meets" in one
    assert verdict(Estimate(None), 1.3, at_least=True) == "not measured"


def test_bootstrap_median_spans_the_repeats_and_is_reproducible():
    est = bootstrap_median([10.0, 12.0, 30.0])
    assert est.value == 12.0 and est.n == 3
    assert 10.0 <= est.lo <= 12.0 <= est.hi <= 30.0 and est.lo < est.hi
    assert bootstrap_median([10.0, 12.0, 30.0]) == est
    single = bootstrap_median([7.0, None])
    assert single.value == 7.0 and single.lo is None and single.method == "one repeat"


def test_order_statistic_interval_brackets_the_p95_and_ratio_of_runs_is_the_widest():
    values = [float(i) for i in range(1, 281)]
    lo, hi = quantile_interval(values, 0.95)
    assert lo < 266 < hi and hi - lo <= 16  # about ±7 ranks
    assert quantile_interval(values[:10], 0.95) == (None, None)
    r = ratio_of_runs(Estimate(200.0, 180.0, 220.0), Estimate(100.0, 90.0, 110.0))
    assert r.value == 2.0 and r.lo == pytest.approx(180 / 110) and r.hi == pytest.approx(220 / 90)


def test_decide_is_the_rule_verdict_explains():
    assert decide(Estimate(1.0, 0.98, 1.04), 1.05, at_least=False) == "met"
    assert decide(Estimate(1.04, 1.0, 1.1), 1.05, at_least=False) == "undecided"
    assert decide(Estimate(1.5), 1.3, at_least=True) == "undecided"  # no interval
    assert decide(Estimate(None), 1.3, at_least=True) == "not measured"


def test_bootstrap_intervals_are_the_central_95_of_their_draws_and_reproducible():
    assert central_95([]) == (None, None)
    assert central_95(float(i) for i in range(2000)) == (49.0, 1950.0)
    values = [float(i) for i in range(1, 201)]
    est = bootstrap_percentile(values, 0.95)
    assert est.value == percentile(values, 0.95) and est.lo < est.value < est.hi and est.n == 200
    assert bootstrap_percentile(values, 0.95) == est
    assert bootstrap_percentile([], 0.95).value is None
    assert bootstrap([5.0] * 30, lambda v: percentile(v, 0.5)) == (5.0, 5.0)


def test_the_upper_bound_of_a_p99_needs_enough_samples():
    assert quantile_upper_bound([float(i) for i in range(100)], 0.99) is None
    values = [float(i) for i in range(1000)]
    bound = quantile_upper_bound(values, 0.99)
    assert percentile(values, 0.99) < bound <= 999.0


def test_histogram_quantile_reads_only_the_asked_band():
    name = "holdback_gateway_blocked_release_seconds"
    metrics = {f'{name}_bucket{{band="100",le="0.01"}}': 0.0, f'{name}_bucket{{band="100",le="0.1"}}': 10.0,
               f'{name}_bucket{{band="100",le="+Inf"}}': 10.0,
               f'{name}_bucket{{band="0",le="0.01"}}': 10.0, f'{name}_bucket{{band="0",le="0.1"}}': 10.0,
               f'{name}_bucket{{band="0",le="+Inf"}}': 10.0}
    assert 0.01 < histogram_quantile(metrics, name, 0.5, band="100") <= 0.1
    assert histogram_quantile(metrics, name, 0.5, band="0") <= 0.01
    assert histogram_quantile(metrics, name, 0.5, band="-10") is None


def test_histogram_bound_is_the_bucket_that_holds_the_quantile():
    name = "holdback_gateway_kv_release_seconds"
    text = "\n".join([f'{name}_bucket{{cause="cancel",le="0.001"}} 50', f'{name}_bucket{{cause="cancel",le="0.01"}} 99',
                      f'{name}_bucket{{cause="cancel",le="0.1"}} 100', f'{name}_bucket{{cause="cancel",le="+Inf"}} 100',
                      f'{name}_bucket{{cause="evict",le="+Inf"}} 0'])
    assert histogram_bound(text, name, 0.99, 'cause="cancel"') == (0.01, 100)
    assert histogram_bound(text, name, 0.5, 'cause="cancel"') == (0.001, 100)
    assert histogram_bound(text, name, 0.99, 'cause="evict"') == (None, 0)
