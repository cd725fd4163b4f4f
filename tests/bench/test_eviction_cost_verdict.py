"""The eviction-cost bench's cross-round p95 TTFT verdict: a two-level bootstrap and a non-inferiority margin."""

import random

from bench.eviction_cost import TTFT_MARGIN, non_inferiority
from bench.stats import pooled_quantile_ratio


def pooled_p95_ratio(rounds):  # noqa: ANN001, ANN201
    return pooled_quantile_ratio(rounds, 0.95)


def _round(rng: random.Random, scale: float, n: int = 280) -> list[float]:
    return [rng.gauss(300, 30) * scale for _ in range(n)]


def test_equal_arms_are_no_worse_within_the_margin():
    rng = random.Random(1)
    rounds = [(_round(rng, 1.0), _round(rng, 1.0)) for _ in range(5)]
    estimate = pooled_p95_ratio(rounds)
    assert estimate is not None
    ratio, lo, hi = estimate
    assert lo <= ratio <= hi
    assert lo < 1.0 < hi <= TTFT_MARGIN
    assert non_inferiority(estimate).startswith("met (no worse")


def test_a_clearly_slower_candidate_is_not_met():
    rng = random.Random(2)
    rounds = [(_round(rng, 1.3), _round(rng, 1.0)) for _ in range(5)]
    assert non_inferiority(pooled_p95_ratio(rounds)).startswith("not met")


def test_a_clearly_faster_candidate_is_better():
    rng = random.Random(3)
    rounds = [(_round(rng, 0.8), _round(rng, 1.0)) for _ in range(4)]
    assert non_inferiority(pooled_p95_ratio(rounds)).startswith("met (better")


def test_a_candidate_at_the_margin_with_run_to_run_spread_is_undecided():
    # Each round's level moves by ±8% for both arms together and the candidate is 5% slower, right at the
    # margin: with three rounds of 60 requests the interval must straddle it.
    rng = random.Random(4)
    rounds = [(_round(rng, level * 1.05, 60), _round(rng, level, 60)) for level in (0.92, 1.0, 1.08)]
    _, lo, hi = pooled_p95_ratio(rounds)
    assert lo < TTFT_MARGIN < hi
    assert non_inferiority((1.0, lo, hi)).startswith("undecided")


def test_one_round_cannot_decide():
    rng = random.Random(5)
    assert pooled_p95_ratio([(_round(rng, 1.0), _round(rng, 1.0))]) is None
    assert non_inferiority(None).startswith("undecided")
