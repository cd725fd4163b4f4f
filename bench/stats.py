"""The one place bench computes a percentile, an interval around a figure and the verdict it allows.

A percentile interpolates between the two order statistics around rank (n - 1)·q, and keeps an infinite value
(a request that never got its first token) infinite. A tail percentile of one run gets the distribution-free
order-statistic interval; a figure over repeats is their median with a percentile-bootstrap interval (repeats
resampled with replacement). A verdict is `met` or `missed` only when the whole interval lies on one side of
the goal, else `undecided`. Prometheus histograms are read here too, as the quantile or as its bucket's bound.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass

BOOTSTRAP_SAMPLES = 2000
BOOTSTRAP_SEED = 15  # fixed: the same records always give the same interval


def percentile(values: list[float], q: float) -> float | None:
    """The q-quantile of `values`, interpolated between order statistics (None without values)."""
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    if k == lo or ordered[hi] == ordered[lo]:
        return ordered[lo]  # also keeps an infinite value (a request that never got its token) infinite
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


@dataclass(frozen=True)
class Estimate:
    """A figure with its 95% interval (lo/hi None: not measurable from these records) and how it was made."""

    value: float | None
    lo: float | None = None
    hi: float | None = None
    n: int = 0  # repeats (or requests, for one run's order statistic) behind it
    method: str = "none"

    def as_dict(self) -> dict:
        return {"value": self.value, "lo": self.lo, "hi": self.hi, "n": self.n, "method": self.method}


def quantile_interval(values: list[float], q: float, z: float = 1.96) -> tuple[float | None, float | None]:
    """Distribution-free interval for the q-quantile: order statistics around rank n·q (normal approximation);
    (None, None) under 20 values."""
    n = len(values)
    if n < 20:
        return None, None
    ordered = sorted(values)
    half = z * math.sqrt(n * q * (1 - q))
    lo, hi = max(0, math.floor(n * q - half) - 1), min(n - 1, math.ceil(n * q + half) - 1)
    return ordered[lo], ordered[hi]


def quantile_upper_bound(values: list[float], q: float, confidence: float = 0.95) -> float | None:
    """A distribution-free one-sided upper confidence bound for the q-quantile: the smallest order statistic
    X(k) with P(Binomial(n, q) <= k - 1) >= confidence; None when n is too small for one (q = 0.99 at 95 %
    needs n >= 299)."""
    s = sorted(values)
    n = len(s)
    tail, term = 0.0, q ** n  # P(Binomial(n, q) = n); summed downwards, P(Bin >= j) stays accurate
    for j in range(n, 0, -1):
        if tail + term > 1 - confidence:
            return s[j] if j < n else None  # X(j + 1): P(Bin >= j + 1) <= 1 - confidence
        tail += term
        term *= j / (n - j + 1) * (1 - q) / q
    return s[0]


def central_95(draws: Iterable[float]) -> tuple[float | None, float | None]:
    """The 2.5th and 97.5th percentiles of bootstrap draws (the outer order statistics of the central 95%)."""
    ordered = sorted(draws)
    if not ordered:
        return None, None
    return ordered[int(0.025 * (len(ordered) - 1))], ordered[int(math.ceil(0.975 * (len(ordered) - 1)))]


def bootstrap(values: list[float], statistic: Callable[[list[float]], float], samples: int = BOOTSTRAP_SAMPLES,
              seed: int = BOOTSTRAP_SEED) -> tuple[float | None, float | None]:
    """95% percentile-bootstrap interval of `statistic` over `values` (resampled with replacement)."""
    rng = random.Random(seed)
    return central_95(statistic(rng.choices(values, k=len(values))) for _ in range(samples))


def bootstrap_median(values: list[float], samples: int = BOOTSTRAP_SAMPLES, seed: int = BOOTSTRAP_SEED) -> Estimate:
    """Median of `values` (one per repeat) with a 95% percentile-bootstrap interval; one value has none."""
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return Estimate(None)
    med = statistics.median(vals)
    if len(vals) < 2:
        return Estimate(med, n=1, method="one repeat")
    lo, hi = bootstrap(vals, statistics.median, samples, seed)
    return Estimate(med, lo, hi, len(vals), "bootstrap over repeats")


def bootstrap_percentile(values: list[float], q: float, samples: int = BOOTSTRAP_SAMPLES,
                         seed: int = BOOTSTRAP_SEED) -> Estimate:
    """The q-quantile of one run's `values` with a 95% percentile-bootstrap interval (requests resampled)."""
    if not values:
        return Estimate(None)
    lo, hi = bootstrap(values, lambda drawn: percentile(drawn, q), samples, seed)
    return Estimate(percentile(values, q), lo, hi, len(values), "bootstrap over requests")


def ratio_of_runs(num: Estimate, den: Estimate) -> Estimate:
    """Ratio of two single-run figures with intervals: the widest ratio their intervals allow."""
    if num.value is None or not den.value:
        return Estimate(None)
    value = num.value / den.value
    if None in (num.lo, num.hi, den.lo, den.hi) or not den.lo:
        return Estimate(value, n=1, method=num.method if num.lo is None else den.method)
    return Estimate(value, num.lo / den.hi, num.hi / den.lo, 1, "order statistics of one run each")


def pooled_quantile_ratio(rounds: list[tuple[list[float], list[float]]], q: float, samples: int = BOOTSTRAP_SAMPLES,
                          seed: int = BOOTSTRAP_SEED) -> tuple[float, float, float] | None:
    """The q-quantile of a candidate's values pooled over every round ÷ the baseline's, with a 95% interval from
    a two-level bootstrap: rounds drawn with replacement, then each drawn round's values, so the interval covers
    the run-to-run spread as well as the spread within a run. `rounds` holds each round's (candidate values,
    baseline values), paired because they ran in the same round. None with fewer than two usable rounds."""
    rounds = [(a, b) for a, b in rounds if len(a) >= 20 and len(b) >= 20]
    if len(rounds) < 2:
        return None

    def ratio(drawn: list[tuple[list[float], list[float]]]) -> float:
        return (percentile([x for pair in drawn for x in pair[0]], q)
                / percentile([x for pair in drawn for x in pair[1]], q))

    rng = random.Random(seed)
    draws = []
    for _ in range(samples):
        picked = [rounds[rng.randrange(len(rounds))] for _ in rounds]
        draws.append(ratio([(rng.choices(a, k=len(a)), rng.choices(b, k=len(b))) for a, b in picked]))
    lo, hi = central_95(draws)
    return ratio(rounds), lo, hi


def decide(est: Estimate, goal: float, at_least: bool) -> str:
    """`met` / `missed` when the interval lies on one side of the goal, `undecided` when it straddles it or there
    is none, `not measured` without a figure."""
    if est.value is None:
        return "not measured"
    if est.lo is None or est.hi is None:
        return "undecided"
    if at_least:
        if est.lo >= goal:
            return "met"
        if est.hi < goal:
            return "missed"
    else:
        if est.hi <= goal:
            return "met"
        if est.lo > goal:
            return "missed"
    return "undecided"


def verdict(est: Estimate, goal: float, at_least: bool) -> str:
    """`decide`, and for an undecided figure why (then the text says which side the point estimate fell on)."""
    decided = decide(est, goal, at_least)
    if decided != "undecided":
        return decided
    if est.lo is None or est.hi is None:
        side = "meets" if (est.value >= goal if at_least else est.value <= goal) else "misses"
        return f"undecided (no interval: {est.method}; the point estimate {side} it)"
    return "undecided (the interval straddles the goal)"


def histogram_quantile(metrics: dict[str, float], name: str, q: float, **labels: str) -> float | None:
    """The q-quantile of a Prometheus histogram's buckets summed over the series whose labels match `labels`,
    interpolated within the bucket it falls in."""
    buckets = []
    want = [f'{k}="{v}"' for k, v in labels.items()]
    for key, value in metrics.items():
        if key.startswith(f"{name}_bucket{{") and all(w in key for w in want):
            le = key.split('le="', 1)[1].split('"', 1)[0]
            buckets.append((math.inf if le == "+Inf" else float(le), value))
    if not buckets:
        return None
    merged: dict[float, float] = {}
    for le, v in buckets:
        merged[le] = merged.get(le, 0.0) + v
    ordered = sorted(merged.items())
    total = ordered[-1][1]
    if total <= 0:
        return None
    rank = q * total
    prev_le, prev_c = 0.0, 0.0
    for le, c in ordered:
        if c >= rank:
            if math.isinf(le):
                return prev_le
            return prev_le + (le - prev_le) * ((rank - prev_c) / (c - prev_c) if c > prev_c else 0)
        prev_le, prev_c = le, c
    return prev_le


def histogram_bound(metrics_text: str, name: str, q: float, label: str = "") -> tuple[float | None, int]:
    """The upper bound (`le`) of the bucket that holds a Prometheus histogram's q-quantile, read from the text
    exposition (the series whose line contains `label`), and the histogram's count: "p99 <= le"."""
    buckets: list[tuple[float, float]] = []
    for line in metrics_text.splitlines():
        if line.startswith(name + "_bucket") and label in line:
            le = line.split('le="', 1)[1].split('"', 1)[0]
            buckets.append((float("inf") if le == "+Inf" else float(le), float(line.rsplit(" ", 1)[1])))
    if not buckets or buckets[-1][1] == 0:
        return None, 0
    total = buckets[-1][1]
    for le, count in buckets:
        if count >= q * total:
            return le, int(total)
    return None, int(total)
