"""Intervals around the study's figures and the verdict they allow against a goal.

Over repeats: the median with a percentile-bootstrap interval (repeats resampled with replacement). For a
tail percentile of one run: the distribution-free order-statistic interval. A verdict is `met` or `missed`
only when the whole interval is on one side of the goal, else `undecided`.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass

BOOTSTRAP_SAMPLES = 2000
BOOTSTRAP_SEED = 15  # fixed: the same records always give the same interval


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
    """Distribution-free interval for the q-quantile: order statistics around rank n·q (normal approximation)."""
    n = len(values)
    if n < 20:
        return None, None
    ordered = sorted(values)
    half = z * math.sqrt(n * q * (1 - q))
    lo, hi = max(0, math.floor(n * q - half) - 1), min(n - 1, math.ceil(n * q + half) - 1)
    return ordered[lo], ordered[hi]


def bootstrap_median(values: list[float], samples: int = BOOTSTRAP_SAMPLES, seed: int = BOOTSTRAP_SEED) -> Estimate:
    """Median of `values` (one per repeat) with a 95% percentile-bootstrap interval; one value has none."""
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return Estimate(None)
    med = statistics.median(vals)
    if len(vals) < 2:
        return Estimate(med, n=1, method="one repeat")
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(vals, k=len(vals))) for _ in range(samples))
    return Estimate(med, meds[int(0.025 * (samples - 1))], meds[int(math.ceil(0.975 * (samples - 1)))], len(vals),
                    "bootstrap over repeats")


def verdict(est: Estimate, goal: float, at_least: bool) -> str:
    """`met` / `missed` when the interval lies on one side of the goal, `undecided` when it straddles it or is
    unknown (then the text says which side the point estimate fell on)."""
    if est.value is None:
        return "not measured"
    if est.lo is None or est.hi is None:
        side = "meets" if (est.value >= goal if at_least else est.value <= goal) else "misses"
        return f"undecided (no interval: {est.method}; the point estimate {side} it)"
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
    return "undecided (the interval straddles the goal)"


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

    def quantile(values: list[float]) -> float:  # interpolated, as bench.report.percentile
        ordered = sorted(values)
        k = (len(ordered) - 1) * q
        lo, hi = math.floor(k), math.ceil(k)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)

    def ratio(drawn: list[tuple[list[float], list[float]]]) -> float:
        return (quantile([x for pair in drawn for x in pair[0]])
                / quantile([x for pair in drawn for x in pair[1]]))

    rng = random.Random(seed)
    draws = []
    for _ in range(samples):
        picked = [rounds[rng.randrange(len(rounds))] for _ in rounds]
        draws.append(ratio([(rng.choices(a, k=len(a)), rng.choices(b, k=len(b))) for a, b in picked]))
    draws.sort()
    return ratio(rounds), draws[int(0.025 * (samples - 1))], draws[int(math.ceil(0.975 * (samples - 1)))]
