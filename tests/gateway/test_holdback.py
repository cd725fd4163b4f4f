"""Holdback ceilings: rank and value domains, static threshold, explicit overrides."""

import pytest

from gateway.policies.holdback import PriorityHoldbackPolicy, StaticPolicy, band_ceilings, holdback_policy


def test_rank_domain_spaces_ceilings_evenly_from_max_to_min():
    c = PriorityHoldbackPolicy(0.5, 1.0, "rank").ceilings([100, 0, -10])
    assert c == pytest.approx({100: 1.0, 0: 0.75, -10: 0.5})


def test_rank_domain_ignores_priority_values():
    c = PriorityHoldbackPolicy(0.2, 0.8, "rank").ceilings([1000, 1, -5, -6])
    assert c == pytest.approx({1000: 0.8, 1: 0.6, -5: 0.4, -6: 0.2})


def test_value_domain_follows_numeric_priority():
    c = PriorityHoldbackPolicy(0.5, 1.0, "value").ceilings([100, 0, -10])
    assert c[100] == pytest.approx(1.0)
    assert c[-10] == pytest.approx(0.5)
    assert c[0] == pytest.approx(0.5 + 10 / 110 * 0.5)


def test_single_band_gets_max_ceiling():
    assert PriorityHoldbackPolicy(0.3, 0.9).ceilings([5]) == {5: 0.9}


def test_static_policy_same_threshold_everywhere():
    assert StaticPolicy(0.7).ceilings([100, 0, -10]) == {100: 0.7, 0: 0.7, -10: 0.7}


def test_overrides_win_and_unset_overrides_are_ignored():
    c = band_ceilings(PriorityHoldbackPolicy(0.5), [100, 0, -10], {-10: 0.25, 0: None})
    assert c == pytest.approx({100: 1.0, 0: 0.75, -10: 0.25})


def test_bad_parameters_are_refused():
    with pytest.raises(ValueError):
        PriorityHoldbackPolicy(0.9, 0.5)
    with pytest.raises(ValueError):
        PriorityHoldbackPolicy(0.1, 1.0, "log")
    with pytest.raises(ValueError):
        holdback_policy("wfq", min_ceiling=0.5, max_ceiling=1, domain="rank", threshold=1)
