"""A study's figures over repeats: each scenario's medians with bootstrap intervals, the goals of issue 15 with
their verdicts, and what a batch place held costs realtime (the occupancy line)."""

from __future__ import annotations

import math
import random
import statistics

from bench.report.figures import run_harvest
from bench.stats import (BOOTSTRAP_SAMPLES, BOOTSTRAP_SEED, Estimate, bootstrap_median, central_95, ratio_of_runs,
                         verdict)


SWEEP = [("reserve_25_evict", 25), ("holdback_50_evict", 50), ("reserve_75_evict", 75)]
EVICTION_COST = ("evict_newest_restart", "evict_cost_resume", "evict_newest_restart_cache", "evict_cost_resume_cache")


def _median(values: list) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def _by_repeat(run_figs: list[dict], name: str) -> dict[int, dict]:
    return {f["repeat"]: f for f in run_figs if f["scenario"] == name}


def estimate(run_figs: list[dict], name: str, key: str) -> Estimate:
    """A scenario's figure over its repeats: the median with a bootstrap interval; one repeat's p95 TTFT gets its
    order-statistic interval."""
    runs = list(_by_repeat(run_figs, name).values())
    if len(runs) == 1 and key == "p95_ttft_ms":
        f = runs[0]
        return Estimate(f.get(key), f.get("p95_ttft_lo_ms"), f.get("p95_ttft_hi_ms"), f.get("realtime_ok", 0),
                        "order statistics of one run")
    return bootstrap_median([f.get(key) for f in runs])


def paired_ratio(run_figs: list[dict], num: str, den: str, key: str) -> Estimate:
    """num ÷ den for `key`, repeat by repeat (a repeat's scenarios share its traffic seed): the median of the
    per-repeat ratios with a bootstrap interval; with one repeat each, p95 TTFT gets the ratio of the two
    order-statistic intervals."""
    a, b = _by_repeat(run_figs, num), _by_repeat(run_figs, den)
    shared = sorted(set(a) & set(b))
    if len(shared) == 1 and key == "p95_ttft_ms":
        return ratio_of_runs(estimate([a[shared[0]]], num, key), estimate([b[shared[0]]], den, key))
    return bootstrap_median([a[r][key] / b[r][key] for r in shared
                             if a[r].get(key) is not None and b[r].get(key)])


def summarize(run_figs: list[dict]) -> dict[str, dict]:
    by: dict[str, list[dict]] = {}
    for f in run_figs:
        by.setdefault(f["scenario"], []).append(f)
    out = {}
    for name, runs in by.items():
        skip = ("scenario", "repeat", "evicted_all_done", "usage_limit")
        keys = sorted({k for r in runs for k in r if k not in skip})
        med = {k: _median([r.get(k) for r in runs]) for k in keys}
        med["usage_limit"] = next((r["usage_limit"] for r in runs if r.get("usage_limit")), None)
        # Counts that must hold in every run are summed, not medianed.
        for k in ("evictions", "evicted_requests", "evicted_completed", "duplicate_final_results",
                  "duplicates_suppressed", "realtime_errors"):
            if any(k in r for r in runs):
                med[f"{k}_sum"] = sum(r.get(k) or 0 for r in runs)
        med["evicted_all_done"] = all(r.get("evicted_all_done") is not False for r in runs)
        med["repeats"] = len(runs)
        for k in ("p95_ttft_ms", "batch_completions", "batch_output_tps"):
            if k in keys:
                e = estimate(run_figs, name, k)
                med[f"{k}_ci"] = [e.lo, e.hi]
        if name not in ("batch_alone", "realtime_only") and "batch_completions" in keys:
            e = bootstrap_median([run_harvest(run_figs, name, r["repeat"]) for r in runs])
            med["harvest"], med["harvest_ci"] = e.value, [e.lo, e.hi]
        out[name] = med
    return out


GOALS = {  # issue 15's goals: the figure, the bound and its direction (True: at least)
    "holdback": ("holdback (50%) realtime p95 TTFT ÷ realtime-only", 1.05, False),
    "no_controls": ("no-controls realtime p95 TTFT ÷ realtime-only (the problem reproduced)", 1.3, True),
    "eviction": ("batch completions, holdback (50%) + eviction ÷ holdback alone", 1.09, True),
    "adaptive_batch": ("adaptive reserve batch completions ÷ best fixed reserve", 1.25, True),
    "adaptive_p95": ("adaptive reserve realtime p95 TTFT ÷ realtime-only", 1.05, False),
    "harvest": ("harvest with the adaptive reserve", 0.8, True),
}


def best_fixed_reserve(summary: dict[str, dict]) -> str | None:
    """The sweep's fixed reserve with the most batch completions among those whose realtime p95 TTFT is within
    5% of realtime-only (the adaptive reserve's own bound); the most completions overall if none is."""
    fixed = [n for n, _ in SWEEP if (summary.get(n) or {}).get("batch_completions") is not None]
    base = (summary.get("realtime_only") or {}).get("p95_ttft_ms")
    within = [n for n in fixed if base and (summary[n].get("p95_ttft_ms") or math.inf) <= 1.05 * base]
    pool = within or fixed
    return max(pool, key=lambda n: summary[n]["batch_completions"]) if pool else None


# Single-replica runs at a fixed batch ceiling with realtime as the interactive class: with realtime-only runs (no
# batch place held) they show what each batch place held costs realtime's p95 TTFT at this calibration.
FIXED_RESERVE_RUNS = ("holdback_50", *(n for n, _ in SWEEP), "reserve_25_noevict", *EVICTION_COST)


def _line(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """Least-squares intercept and slope of y on x; None when x does not vary."""
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx <= 0:
        return None
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    return my - slope * mx, slope


def occupancy_cost(run_figs: list[dict], bound: float = 1.05) -> dict | None:
    """Realtime p95 TTFT against the batch places held (the gateway's batch band in flight, mean over the window),
    a least-squares line over the realtime-only and fixed-reserve runs, with a bootstrap interval for its slope
    (runs resampled). From it: the places at which p95 reaches `bound` × realtime-only, the batch completions
    the fixed reserves made per place, and where the adaptive reserve's runs sit against the line (the line is
    fitted without them)."""
    points = [(0.0 if f["scenario"] == "realtime_only" else f["batch_in_flight_mean"], f["p95_ttft_ms"])
              for f in run_figs
              if f["scenario"] in ("realtime_only", *FIXED_RESERVE_RUNS) and f.get("p95_ttft_ms") is not None
              and (f["scenario"] == "realtime_only" or f.get("batch_in_flight_mean") is not None)]
    fit = _line(points) if len(points) >= 3 else None
    base = _median([f.get("p95_ttft_ms") for f in run_figs if f["scenario"] == "realtime_only"])
    if fit is None or base is None:
        return None
    intercept, slope = fit

    def crossing(a: float, b: float) -> float | None:
        return (bound * base - a) / b if b > 0 else None

    rng = random.Random(BOOTSTRAP_SEED)
    draws = [d for d in (_line(rng.choices(points, k=len(points))) for _ in range(BOOTSTRAP_SAMPLES)) if d is not None]
    slope_lo, slope_hi = central_95(b for _, b in draws)
    # A draw whose line does not rise never reaches the bound: it counts as unbounded places.
    at_lo, at_hi = central_95(math.inf if (c := crossing(a, b)) is None else c for a, b in draws)
    per_place = _median([f["batch_completions"] / f["batch_in_flight_mean"] for f in run_figs
                         if f["scenario"] in FIXED_RESERVE_RUNS and f.get("batch_completions")
                         and f.get("batch_in_flight_mean")])
    at_bound = crossing(intercept, slope)
    adaptive = [f for f in run_figs if f["scenario"] == "adaptive_evict" and f.get("p95_ttft_ms") is not None
                and f.get("batch_in_flight_mean") is not None]
    residual = _median([f["p95_ttft_ms"] - (intercept + slope * f["batch_in_flight_mean"]) for f in adaptive])
    return {"runs": len(points), "intercept_ms": intercept, "slope_ms": slope,
            "slope_lo_ms": slope_lo, "slope_hi_ms": slope_hi,
            "realtime_only_ms": base, "bound": bound, "places_at_bound": at_bound,
            "places_at_bound_lo": at_lo, "places_at_bound_hi": at_hi,
            "completions_per_place": per_place,
            "completions_at_bound": at_bound * per_place if at_bound is not None and per_place else None,
            "adaptive_residual_ms": residual}


def goals(summary: dict[str, dict], run_figs: list[dict]) -> list[dict]:
    """Each goal of issue 15 with its estimate, 95% interval and verdict (met / missed / undecided)."""
    out: list[dict] = []

    def add(key: str, est: Estimate, note: str = "") -> None:
        text, bound, at_least = GOALS[key]
        out.append({"goal": key, "text": text, "bound": bound, "at_least": at_least, **est.as_dict(),
                    "verdict": verdict(est, bound, at_least), "note": note})

    add("holdback", paired_ratio(run_figs, "holdback_50", "realtime_only", "p95_ttft_ms"))
    add("no_controls", paired_ratio(run_figs, "no_controls", "realtime_only", "p95_ttft_ms"))
    add("eviction", paired_ratio(run_figs, "holdback_50_evict", "holdback_50", "batch_completions"))
    best = best_fixed_reserve(summary)
    add("adaptive_batch", paired_ratio(run_figs, "adaptive_evict", best, "batch_completions") if best else
        Estimate(None), f"best fixed reserve: {best}" if best else "no fixed reserve of the sweep was run")
    add("adaptive_p95", paired_ratio(run_figs, "adaptive_evict", "realtime_only", "p95_ttft_ms"))
    a = summary.get("adaptive_evict") or {}
    add("harvest", Estimate(a.get("harvest"), *(a.get("harvest_ci") or (None, None)), a.get("repeats", 0),
                            "bootstrap over repeats" if (a.get("repeats") or 0) > 1 else "one repeat"))
    evicted = sum(v.get("evicted_requests_sum") or 0 for v in summary.values())
    done = sum(v.get("evicted_completed_sum") or 0 for v in summary.values())
    dup = sum(v.get("duplicate_final_results_sum") or 0 for v in summary.values())
    waited = all(v.get("evicted_all_done", True) for v in summary.values())
    out.append({"goal": "retries", "text": "every evicted request completed, zero duplicate final results",
                "bound": None, "at_least": None, "value": None, "lo": None, "hi": None, "n": evicted,
                "method": "counts over every run",
                "verdict": ("not measured (no evictions)" if not evicted else
                            "met" if done == evicted and dup == 0 and waited else "missed"),
                "note": f"{done} of {evicted} evicted requests completed; {dup} duplicate final results"
                        + "".join(f"; {n}: {v.get('evicted_completed_sum')} of {v.get('evicted_requests_sum')}"
                                  + ("" if v.get("evicted_all_done", True) else
                                     " (the wait for their retries after the window ran out)")
                                  for n, v in summary.items()
                                  if (v.get("evicted_completed_sum") or 0) < (v.get("evicted_requests_sum") or 0))})
    return out
