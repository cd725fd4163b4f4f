"""Saturation detectors: concurrency ratio, headroom on the filter only, utilization with the stale fallback."""

import pytest

from gateway.policies.saturation import ConcurrencyDetector, UtilizationDetector, saturation_detector
from gateway.replicas import Replica


def rep(in_flight=0, **kw):
    return Replica("http://r", healthy=True, in_flight=in_flight, **kw)


def test_concurrency_is_in_flight_over_pool_capacity():
    d = ConcurrencyDetector(max_concurrency=8)
    assert d.saturation([rep(4), rep(8)], now=0) == pytest.approx(12 / 16)


def test_empty_pool_is_saturated():
    assert ConcurrencyDetector(8).saturation([], 0) == 1.0
    assert UtilizationDetector().saturation([], 0) == 1.0


def test_headroom_raises_the_replica_filter_but_not_saturation():
    d = ConcurrencyDetector(max_concurrency=8, headroom=0.5)
    r = rep(10)
    assert d.saturation([r], 0) == pytest.approx(10 / 8)
    assert d.has_room(r, 0)  # limit 12
    assert not d.has_room(rep(12), 0)
    assert not ConcurrencyDetector(8).has_room(rep(8), 0)


def test_utilization_uses_the_larger_of_queue_depth_and_kv():
    d = UtilizationDetector(queue_depth_threshold=5, kv_util_threshold=0.8, staleness=2.0)
    r = rep(0, kv_usage=0.4, waiting=4, metrics_at=10.0)
    assert d.replica_score(r, now=10.5) == pytest.approx(0.8)  # waiting 4/5 beats kv 0.4/0.8
    r2 = rep(0, kv_usage=0.72, waiting=0, metrics_at=10.0)
    assert d.saturation([r, r2], now=10.5) == pytest.approx((0.8 + 0.9) / 2)


def test_utilization_counts_dispatches_since_the_scrape():
    d = UtilizationDetector(max_concurrency=10, staleness=2.0)
    r = rep(0, kv_usage=0.4, waiting=0, metrics_at=10.0, dispatches=7, dispatches_at_scrape=4)
    assert d.replica_score(r, now=10.1) == pytest.approx(0.5 + 0.3)


def test_stale_replica_falls_back_to_its_concurrency_ratio_instead_of_halting():
    d = UtilizationDetector(max_concurrency=10, staleness=2.0)
    stale = rep(3, kv_usage=0.99, waiting=50, metrics_at=1.0)
    never = rep(5)
    assert d.replica_score(stale, now=10.0) == pytest.approx(0.3)
    assert d.saturation([stale, never], now=10.0) == pytest.approx(0.4)
    assert d.stale_count([stale, never], now=10.0) == 2
    assert d.has_room(stale, now=10.0)


def test_factory_refuses_unknown_detector():
    with pytest.raises(ValueError, match="concurrency or utilization"):
        saturation_detector("magic", max_concurrency=1, headroom=0, queue_depth_threshold=1,
                            kv_util_threshold=1, staleness=1, scrape_interval=1)
