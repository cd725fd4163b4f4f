"""Turn a study's raw records into its figures, summary JSON, Markdown report and PNG plots.

Nothing here is typed in by hand except the seed's own published numbers (SEED), which the report
prints beside ours. Run `holdback bench report DIR` to regenerate everything from DIR/raw/*.json.
"""

from __future__ import annotations

import json
import math
import random
import statistics
from pathlib import Path

from bench.stats import (BOOTSTRAP_SAMPLES, BOOTSTRAP_SEED, Estimate, bootstrap_median, central_95,
                         histogram_quantile, percentile, quantile_interval, ratio_of_runs, verdict)
from bench.lib.prometheus import metric_sum

# The published medians of the study this benchmark reproduces.
SEED = {
    "realtime_only": {"p95_ttft_ms": 342},
    "no_controls": {"p95_ttft_ms": 561},
    "holdback_50": {"p95_ttft_ms": 341, "batch_completions": 1648},
    "holdback_50_evict": {"p95_ttft_ms": 348, "batch_completions": 1798, "evictions": 38, "evicted_completed": 38},
    "reserve_25_evict": {"p95_ttft_ms": 1055, "evictions": 25, "recomputed_tokens": 9076, "batch_p95_e2e_s": 12.24},
    "reserve_75_evict": {"p95_ttft_ms": 1019},
    "reserve_25_noevict": {"p95_ttft_ms": 1350, "batch_p95_e2e_s": 8.51},
}
BURST_SETTLE_S = 10.0
OBJECTIVE_PRIORITY = {"realtime": 100, "standard": 0}
BATCH_BAND = -10  # the batch band's priority in the study's gateway config
SHORT = {
    "realtime_only": "realtime\nonly", "no_controls": "no\ncontrols", "holdback_50": "holdback\n50%",
    "holdback_50_evict": "holdback 50%\n+ eviction", "reserve_25_evict": "reserve 25%\n+ eviction",
    "reserve_75_evict": "reserve 75%\n+ eviction", "reserve_25_noevict": "reserve 25%\neviction off",
    "two_replicas": "two replicas\n50% + evict", "standard_check": "standard\nreclaims",
    "adaptive_evict": "adaptive\n+ eviction", "batch_alone": "batch\nalone",
    "evict_newest_restart": "newest\nrestart", "evict_cost_resume": "cost-ranked\nresume",
    "evict_newest_restart_cache": "newest restart\n+ cache", "evict_cost_resume_cache": "cost resume\n+ cache",
}
SWEEP = [("reserve_25_evict", 25), ("holdback_50_evict", 50), ("reserve_75_evict", 75)]
EVICTION_COST = ("evict_newest_restart", "evict_cost_resume", "evict_newest_restart_cache", "evict_cost_resume_cache")


def _completed_at(samples: list[dict], t: float) -> float | None:
    """Completed count at time t, interpolated between the two samples around it."""
    pts = [(s["t"], s["completed"]) for s in samples if "completed" in s]
    if not pts:
        return None
    before = [p for p in pts if p[0] <= t]
    after = [p for p in pts if p[0] >= t]
    if not before:
        return after[0][1]
    if not after:
        return before[-1][1]
    (t0, c0), (t1, c1) = before[-1], after[0]
    return c0 if t1 == t0 else c0 + (c1 - c0) * (t - t0) / (t1 - t0)


def figures(record: dict) -> dict:
    """Every figure of one run, derived from its raw record."""
    rt = record.get("realtime", [])
    ok = [r for r in rt if r["status"] == 200 and r["ttft_s"] is not None]
    ttfts = [r["ttft_s"] * 1000 for r in ok]
    rows = record.get("rows") or []
    samples = record.get("samples") or []
    win = record.get("window") or {}
    f: dict = {
        "scenario": record["scenario"]["name"],
        "repeat": record["repeat"],
        "replicas": record["scenario"].get("replicas", 1),
        "realtime_requests": len(rt),
        "realtime_ok": len(ok),
        "realtime_errors": len(rt) - len(ok),
        "p95_ttft_ms": percentile(ttfts, 0.95),
        # 95% order-statistic interval of this run's p95 (about ±7 ranks over 280 requests, ±15 over 1,230).
        **dict(zip(("p95_ttft_lo_ms", "p95_ttft_hi_ms"), quantile_interval(ttfts, 0.95))),
        "p50_ttft_ms": percentile(ttfts, 0.50),
        # Diagnostic only (never a headline): p95 over requests sent after the opening burst has drained.
        # A short window makes the burst's aftermath a large share of all requests; this shows how much.
        "p95_ttft_after_burst_ms": percentile([r["ttft_s"] * 1000 for r in ok if r["sent_s"] >= BURST_SETTLE_S], 0.95),
        "realtime_queued_p95_ms": percentile([r["queue_ms"] for r in rt if r.get("queue_ms") is not None], 0.95),
        "realtime_output_tps": sum(r.get("output_tokens") or 0 for r in ok) / win["window_s"] if win.get("window_s") else None,
        # Mean interactive requests in flight over the window (Little's law: their summed lifetimes ÷ the window),
        # the places of the pool interactive traffic needs on average.
        "realtime_in_flight_mean": sum(r.get("e2e_s") or 0 for r in ok) / win["window_s"] if win.get("window_s") else None,
        # The gateway's holdback policy as the run configured it (records before it was kept have none).
        "usage_limit": (record.get("gateway_overrides") or {}).get("usageLimit"),
    }
    f["preemptions"] = int(sum(metric_sum(m, "vllm:num_preemptions_total") for m in record.get("sim_metrics") or []))
    if not record["scenario"]["batch"]:
        return f
    start = win.get("realtime_start", 0.0)
    c0, c1 = _completed_at(samples, start), _completed_at(samples, start + win.get("window_s", 0.0))
    f["batch_completions"] = None if c0 is None or c1 is None else round(c1 - c0)
    f["batch_output_tps"] = _batch_output_tps(rows, win)
    ceilings = [x["batch_ceiling"] for x in samples
                if x.get("batch_ceiling") is not None and start <= x["t"] <= start + win.get("window_s", 0.0)]
    f["batch_ceiling_mean"] = statistics.fmean(ceilings) if ceilings else None
    # How far the ceiling moved in the window (a fixed reserve: not at all; an adaptive one: with its forecast).
    f["batch_ceiling_p10"] = percentile(ceilings, 0.10)
    f["batch_ceiling_p90"] = percentile(ceilings, 0.90)
    f["batch_in_flight_mean"] = band_in_flight_mean(record, BATCH_BAND)
    evicted_rows = [r for r in rows if r.get("evictions", 0) > 0]
    f["evictions"] = sum(r.get("evictions", 0) for r in rows)
    f["evicted_requests"] = len(evicted_rows)
    f["evicted_completed"] = sum(1 for r in evicted_rows if r["status"] == "succeeded")
    ids = record.get("output_custom_ids") or []
    f["duplicate_final_results"] = len(ids) - len(set(ids))
    f["duplicates_suppressed"] = sum(r.get("duplicates", 0) for r in rows)
    f["gateway_evictions"] = metric_sum(record.get("gateway_metrics", {}), "holdback_gateway_evictions_total",
                                        outcome="issued")
    # Work the replicas computed and then threw away because the gateway evicted the request (the
    # simulator counts computed tokens of aborted requests; the batch is cancelled only after this read).
    sim = record.get("sim_metrics") or []
    f["recomputed_tokens"] = int(sum(metric_sum(m, "sim:aborted_computed_tokens_total") for m in sim))
    e2e = [r["finished_at"] - r["first_attempt_at"] for r in rows
           if r["status"] == "succeeded" and r.get("first_attempt_at") and r.get("finished_at")]
    f["batch_p95_e2e_s"] = percentile(e2e, 0.95)
    gm = record.get("gateway_metrics", {})
    # Blocked arrival -> capacity released: interactive requests that found no room, from their arrival to the
    # release of the slot they were dispatched into (the gateway's blocked_release histogram, the scenario's
    # interactive band). Records from a gateway without that histogram show none.
    band = str(OBJECTIVE_PRIORITY.get(record["scenario"].get("objective", "realtime"), 100))
    for q, key in ((0.5, "release_p50_ms"), (0.99, "release_p99_ms")):
        f[key] = _ms(histogram_quantile(gm, "holdback_gateway_blocked_release_seconds", q, band=band))
    f["blocked_arrivals"] = int(metric_sum(gm, "holdback_gateway_blocked_release_seconds_count", band=band))
    # Diagnostic: eviction decision -> the victim's upstream closed.
    f["eviction_confirm_p99_ms"] = _ms(histogram_quantile(gm, "holdback_gateway_eviction_confirmation_seconds", 0.99))
    f["evicted_all_done"] = record.get("evicted_all_done")
    return f


def band_in_flight_mean(record: dict, priority: int) -> float | None:
    """Mean requests of one priority band in flight at the gateway over the realtime window (the run's samples,
    twice a second): how many of the pool's places the band held."""
    win = record.get("window") or {}
    start = win.get("realtime_start", 0.0)
    end = start + win.get("window_s", 0.0)
    values = [x["bands"][str(priority)]["in_flight"] for x in record.get("samples") or []
              if start <= x["t"] <= end and str(priority) in (x.get("bands") or {})]
    return statistics.fmean(values) if values else None


def _batch_output_tps(rows: list[dict], win: dict) -> float | None:
    """Output tokens/s of batch requests that finished inside the realtime window (None: no wall-clock anchor,
    which records written before the anchor was added lack)."""
    start, length = win.get("realtime_start_wall"), win.get("window_s")
    if start is None or not length:
        return None
    tokens = sum(r.get("output_tokens") or 0 for r in rows
                 if r["status"] == "succeeded" and r.get("finished_at") and start <= r["finished_at"] <= start + length)
    return tokens / length


def run_harvest(run_figs: list[dict], name: str, repeat: int) -> float | None:
    """Batch output tokens/s under mixed load ÷ (pool output tokens/s with batch alone − realtime's alone), the
    three read from the same repeat of the same study: the share of the capacity realtime leaves spare that
    batch actually used."""
    def get(scenario: str, key: str) -> float | None:
        return next((f.get(key) for f in run_figs if f["scenario"] == scenario and f["repeat"] == repeat), None)

    mixed, alone, rt = get(name, "batch_output_tps"), get("batch_alone", "batch_output_tps"), \
        get("realtime_only", "realtime_output_tps")
    if mixed is None or alone is None or rt is None or alone - rt <= 0:
        return None
    # batch_alone and realtime_only run one replica; a scenario with more is compared per replica (its realtime
    # traffic is scaled by the replica count too).
    return mixed / (get(name, "replicas") or 1) / (alone - rt)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


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


def load(out_dir: Path) -> tuple[dict, list[dict], list[dict]]:
    meta = json.loads((out_dir / "study.json").read_text()) if (out_dir / "study.json").exists() else {}
    from bench.study import read_record, record_paths

    records = [read_record(p) for p in record_paths(out_dir)]
    return meta, records, [figures(r) for r in records]


def _fmt(v, digits: int = 0, suffix: str = "") -> str:  # noqa: ANN001
    if v is None:
        return "—"
    if isinstance(v, float) and digits == 0:
        return f"{v:,.0f}{suffix}"
    if isinstance(v, float):
        return f"{v:,.{digits}f}{suffix}"
    return f"{v:,}{suffix}"


def _pct(a, b) -> str:  # noqa: ANN001
    if a is None or b in (None, 0):
        return "—"
    return f"{(a / b - 1) * 100:+.0f}%"


def render(out_dir: Path) -> Path:
    meta, records, run_figs = load(out_dir)
    summary = summarize(run_figs)
    judged = goals(summary, run_figs)
    (out_dir / "summary.json").write_text(json.dumps({"meta": meta, "scenarios": summary, "runs": run_figs,
                                                      "goals": judged}, indent=2))
    occ = occupancy_cost(run_figs)
    plots = make_plots(out_dir, records, summary, run_figs, occ)
    md = report_markdown(meta, summary, run_figs, plots, judged, occ)
    path = out_dir / "report.md"
    path.write_text(md)
    return path


def _interval(lo, hi, digits: int = 2) -> str:  # noqa: ANN001
    return "—" if lo is None or hi is None else f"[{lo:,.{digits}f}, {hi:,.{digits}f}]"


def goals_table(judged: list[dict]) -> list[str]:
    out = ["| goal | ours [95% interval] | bound | verdict | how the interval was made |", "|---|---|---|---|---|"]
    for g in judged:
        if g["bound"] is None:
            out.append(f"| {g['text']} | {g['note']} | — | {g['verdict']} | {g['method']} |")
            continue
        value = "—" if g["value"] is None else f"{g['value']:.2f} {_interval(g['lo'], g['hi'])}"
        note = f" ({g['note']})" if g["note"] else ""
        n = f", n={g['n']}" if g["n"] else ""
        out.append(f"| {g['text']}{note} | {value} | {'≥' if g['at_least'] else '≤'} {g['bound']} | {g['verdict']} "
                   f"| {g['method']}{n} |")
    return out


def report_markdown(meta: dict, summary: dict[str, dict], run_figs: list[dict], plots: list[str],
                    judged: list[dict], occ: dict | None = None) -> str:
    from bench.study import SCENARIOS

    w = meta.get("workload", {})
    s = lambda name, k: (summary.get(name) or {}).get(k)  # noqa: E731
    lines = ["# Holdback and eviction study: ours beside the seed", ""]
    lines += [f"Mode: {'quick' if w.get('window_s', 300) < 300 else 'full'} — window {w.get('window_s')} s per "
              f"scenario, batch lead {w.get('lead_s')} s, {meta.get('repeats')} repeat(s), seed {meta.get('seed')}. "
              f"Figures are medians over repeats; every number below is computed by `bench/report.py` from "
              f"the raw records in `raw/`.", ""]
    lines += ["## Goals (issue 15)", "",
              "Each ratio is the median over repeats of the per-repeat ratio (a repeat's scenarios share one traffic "
              "seed) with a 95% bootstrap interval over repeats; with one repeat, a p95 ratio takes the widest ratio "
              "the two runs' order-statistic intervals allow, and a count has no interval. A verdict is met or "
              "missed only when the whole interval lies on one side of the bound.", ""] + goals_table(judged)
    base = s("realtime_only", "p95_ttft_ms")
    lines += ["", "## Realtime result (seed: table 'Realtime latency was preserved under mixed load')", "",
              "| scenario | seed p95 TTFT | ours p95 TTFT [95% interval] | seed vs baseline | ours vs baseline | "
              "realtime errors | ours p95 after the burst (diagnostic) |",
              "|---|---|---|---|---|---|---|"]
    for name in ("realtime_only", "no_controls", "holdback_50", "holdback_50_evict"):
        seed_v = SEED.get(name, {}).get("p95_ttft_ms")
        ours = s(name, "p95_ttft_ms")
        ci = _interval(*(s(name, "p95_ttft_ms_ci") or (None, None)), 0)
        lines.append(f"| {SCENARIOS[name].title} | {_fmt(seed_v, suffix=' ms')} | {_fmt(ours, suffix=' ms')} {ci} | "
                     f"{_pct(seed_v, SEED['realtime_only']['p95_ttft_ms'])} | {_pct(ours, base)} | "
                     f"{_fmt(s(name, 'realtime_errors_sum'))} | {_fmt(s(name, 'p95_ttft_after_burst_ms'), suffix=' ms')} |")
    lines += ["", f"The diagnostic column leaves out requests sent in the first {BURST_SETTLE_S:.0f} s, while the opening "
              "burst drains; the goals always use every request."]
    lines += ["", "## Eviction result (seed: 'Eviction and retry completed 9% more batch requests')", "",
              "| figure | seed holdback | seed + eviction | ours holdback | ours + eviction |", "|---|---|---|---|---|",
              f"| batch completions in window | 1,648 | 1,798 (+9%) | {_fmt(s('holdback_50', 'batch_completions'))} | "
              f"{_fmt(s('holdback_50_evict', 'batch_completions'))} "
              f"({_pct(s('holdback_50_evict', 'batch_completions'), s('holdback_50', 'batch_completions'))}) |",
              f"| realtime p95 TTFT | 341 ms | 348 ms | {_fmt(s('holdback_50', 'p95_ttft_ms'), suffix=' ms')} | "
              f"{_fmt(s('holdback_50_evict', 'p95_ttft_ms'), suffix=' ms')} |",
              f"| evicted requests completed after retry | — | 38 of 38 | — | "
              f"{_fmt(s('holdback_50_evict', 'evicted_completed_sum'))} of {_fmt(s('holdback_50_evict', 'evicted_requests_sum'))} |",
              f"| batch p95 end-to-end | — | — | {_fmt(s('holdback_50', 'batch_p95_e2e_s'), 2, ' s')} | "
              f"{_fmt(s('holdback_50_evict', 'batch_p95_e2e_s'), 2, ' s')} |"]
    lines += ["", "## Reserve sweep with eviction (seed: 1,055 / 967 / 1,019 ms)", "",
              "| reserve | batch ceiling | seed p95 TTFT | ours p95 TTFT | ours batch completions | ours evictions |",
              "|---|---|---|---|---|---|"]
    for name, reserve in SWEEP:
        lines.append(f"| {reserve}% | {100 - reserve}% | {_fmt(SEED[name]['p95_ttft_ms'], suffix=' ms')} | "
                     f"{_fmt(s(name, 'p95_ttft_ms'), suffix=' ms')} | {_fmt(s(name, 'batch_completions'))} | "
                     f"{_fmt(s(name, 'evictions'))} |")
    lines += ["", "## Eviction off versus on at 25% reserve (seed: 1,350 → 1,055 ms, 25 evictions, 9,076 tokens, "
              "batch p95 8.51 → 12.24 s)", "",
              "| figure | seed off | seed on | ours off | ours on |", "|---|---|---|---|---|",
              f"| realtime p95 TTFT | 1,350 ms | 1,055 ms | {_fmt(s('reserve_25_noevict', 'p95_ttft_ms'), suffix=' ms')} | "
              f"{_fmt(s('reserve_25_evict', 'p95_ttft_ms'), suffix=' ms')} |",
              f"| evictions | 0 | 25 | {_fmt(s('reserve_25_noevict', 'evictions'))} | {_fmt(s('reserve_25_evict', 'evictions'))} |",
              f"| recomputed or unreturned tokens | — | 9,076 | {_fmt(s('reserve_25_noevict', 'recomputed_tokens'))} | "
              f"{_fmt(s('reserve_25_evict', 'recomputed_tokens'))} |",
              f"| batch p95 end-to-end | 8.51 s | 12.24 s | {_fmt(s('reserve_25_noevict', 'batch_p95_e2e_s'), 2, ' s')} | "
              f"{_fmt(s('reserve_25_evict', 'batch_p95_e2e_s'), 2, ' s')} |",
              f"| blocked arrival → capacity released, p50 / p99 | — | — | "
              f"{_fmt(s('reserve_25_noevict', 'release_p50_ms'), 1, ' ms')} / {_fmt(s('reserve_25_noevict', 'release_p99_ms'), 1, ' ms')} | "
              f"{_fmt(s('reserve_25_evict', 'release_p50_ms'), 1, ' ms')} / {_fmt(s('reserve_25_evict', 'release_p99_ms'), 1, ' ms')} |"]
    lines += ["", "## Two replicas and the standard-priority check", "",
              "| scenario | p95 TTFT | batch completions | evictions | evicted completed | duplicates |",
              "|---|---|---|---|---|---|"]
    for name in ("holdback_50_evict", "two_replicas", "standard_check"):
        lines.append(f"| {SCENARIOS[name].title} | {_fmt(s(name, 'p95_ttft_ms'), suffix=' ms')} | "
                     f"{_fmt(s(name, 'batch_completions'))} | {_fmt(s(name, 'evictions_sum'))} | "
                     f"{_fmt(s(name, 'evicted_completed_sum'))} of {_fmt(s(name, 'evicted_requests_sum'))} | "
                     f"{_fmt(s(name, 'duplicate_final_results_sum'))} |")
    lines += ["", "## Adaptive reserve with eviction", ""] + adaptive_section(summary)
    lines += ["", "## What a batch place costs realtime", ""] + occupancy_section(occ)
    lines += ["", "## Harvest", ""] + harvest_section(summary)
    lines += ["", "## KV pressure", ""] + kv_section(summary)
    lines += ["", "## Eviction cost: newest-first restart against cost-ranked resume, prefix caching off and on", ""]
    lines += eviction_cost_section(summary)
    lines += ["", "## Every run", "",
              "| run | p95 TTFT ms [95%] | batch done | evictions | evicted → completed | dup | recomputed tok | "
              "preemptions | batch p95 e2e s | blocked → released p50 / p99 ms | eviction confirmed p99 ms |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for f in run_figs:
        lines.append(f"| {f['scenario']} r{f['repeat']} | {_fmt(f.get('p95_ttft_ms'))} "
                     f"{_interval(f.get('p95_ttft_lo_ms'), f.get('p95_ttft_hi_ms'), 0)} | {_fmt(f.get('batch_completions'))} | "
                     f"{_fmt(f.get('evictions'))} | {_fmt(f.get('evicted_completed'))}/{_fmt(f.get('evicted_requests'))} | "
                     f"{_fmt(f.get('duplicate_final_results'))} | {_fmt(f.get('recomputed_tokens'))} | "
                     f"{_fmt(f.get('preemptions'))} | {_fmt(f.get('batch_p95_e2e_s'), 2)} | "
                     f"{_fmt(f.get('release_p50_ms'), 1)} / {_fmt(f.get('release_p99_ms'), 1)} | "
                     f"{_fmt(f.get('eviction_confirm_p99_ms'), 1)} |")
    lines += ["", "## Where ours differs from the seed, and why", ""] + differences(meta, summary, run_figs, occ)
    lines += ["", "## Calibration", "", CALIBRATION.format(
        base=_fmt(s("realtime_only", "p95_ttft_ms")), after=_fmt(s("realtime_only", "p95_ttft_after_burst_ms")),
        args=" ".join(w.get("sim_args", [])))]
    lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in plots]
    lines += ["", "## Workload", "", "```json", json.dumps(w, indent=2), "```", ""]
    return "\n".join(lines)


def _ratio(a, b, digits: int = 2) -> str:  # noqa: ANN001
    return "—" if a is None or b in (None, 0) else f"{a / b:.{digits}f}"


def adaptive_section(summary: dict[str, dict]) -> list[str]:
    """The adaptive reserve against the fixed reserves measured in the same study, as ratios."""
    from bench.study import SCENARIOS

    s = lambda name, k: (summary.get(name) or {}).get(k)  # noqa: E731
    if "adaptive_evict" not in summary:
        return ["Not run in this study (scenario `adaptive_evict`)."]
    usage = s("adaptive_evict", "usage_limit")
    out = [f"Gateway `usageLimit: {json.dumps(usage) if usage else '(not kept in these records)'}`"
           ": the batch ceiling is 1 − forecast − margin, never below the 50% reserve's ceiling. Its ratios and "
           f"verdicts are in the goals table; the fixed reserve it is compared with is "
           f"`{best_fixed_reserve(summary)}` (the sweep's most batch completions within 5% of realtime-only p95).", "",
           "| scenario | p95 TTFT | p95 after the burst (diagnostic) | batch completions | evictions | "
           "mean batch ceiling in window |", "|---|---|---|---|---|---|"]
    for name in [n for n in ("realtime_only", *[n for n, _ in SWEEP], "adaptive_evict") if n in summary]:
        out.append(f"| {SCENARIOS[name].title} | {_fmt(s(name, 'p95_ttft_ms'), suffix=' ms')} | "
                   f"{_fmt(s(name, 'p95_ttft_after_burst_ms'), suffix=' ms')} | {_fmt(s(name, 'batch_completions'))} | {_fmt(s(name, 'evictions'))} | "
                   f"{_fmt(s(name, 'batch_ceiling_mean'), 3)} |")
    return out


def occupancy_section(occ: dict | None) -> list[str]:
    """The line from batch places held to realtime p95 TTFT (occupancy_cost), and what it allows at the p95 goal."""
    if not occ:
        return ["Not computed: it needs realtime-only runs and at least two fixed-reserve runs."]
    at = occ["places_at_bound"]
    return [f"Realtime p95 TTFT against the batch requests in flight at the gateway (mean over the window, sampled "
            f"twice a second), a least-squares line over {occ['runs']} runs: the realtime-only runs at 0 places and "
            f"every single-replica fixed-reserve run ({', '.join(f'`{n}`' for n in FIXED_RESERVE_RUNS)}). The "
            f"adaptive reserve's runs are left out of the fit and compared with it. Intervals: 95% bootstrap over "
            f"runs.", "",
            "| figure | value |", "|---|---|",
            f"| realtime p95 at 0 places (fitted; measured realtime-only median) | {occ['intercept_ms']:.0f} ms "
            f"({occ['realtime_only_ms']:.0f} ms) |",
            f"| p95 per batch place held | {occ['slope_ms']:.2f} ms [{occ['slope_lo_ms']:.2f}, "
            f"{occ['slope_hi_ms']:.2f}] |",
            f"| places at which p95 reaches {occ['bound']}× realtime-only | "
            + (f"{at:.1f} [{occ['places_at_bound_lo']:.1f}, {occ['places_at_bound_hi']:.1f}] |" if at is not None
               else "never (the line does not rise) |"),
            f"| batch completions per place held (median over the fixed-reserve runs) | "
            f"{_fmt(occ['completions_per_place'], 1)} |",
            f"| batch completions at that many places | {_fmt(occ['completions_at_bound'])} |",
            f"| adaptive reserve's p95 − the line at its places (median over runs) | "
            f"{_fmt(occ['adaptive_residual_ms'], 1, ' ms')} |"]


def harvest_section(summary: dict[str, dict]) -> list[str]:
    missing = [n for n in ("batch_alone", "realtime_only") if n not in summary]
    out = ["Harvest = batch output tokens/s under mixed load ÷ (pool output tokens/s with batch alone − realtime "
           "output tokens/s alone), the three from the same repeat of this study, batch tokens counted for requests "
           "that finished inside the window; the median over repeats with its bootstrap interval."]
    if missing:
        return out + ["", f"Not computed: this study did not run {' and '.join(f'`{n}`' for n in missing)}."]
    alone = summary["batch_alone"].get("batch_output_tps")
    rt = summary["realtime_only"].get("realtime_output_tps")
    out += ["", f"Batch alone: {_fmt(alone, 1)} output tok/s; realtime alone: {_fmt(rt, 1)} output tok/s.", "",
            "| scenario | batch output tok/s | harvest [95% interval] |", "|---|---|---|"]
    for name, v in summary.items():
        if "harvest" in v:
            out.append(f"| {name} | {_fmt(v.get('batch_output_tps'), 1)} | {_fmt(v.get('harvest'), 2)} "
                       f"{_interval(*(v.get('harvest_ci') or (None, None)))} |")
    return out


def kv_section(summary: dict[str, dict]) -> list[str]:
    """Where the replica ran out of KV blocks: its preemptions (recompute), per scenario."""
    out = ["The simulator preempts (vLLM's recompute) when running sequences need more KV blocks than it has; "
           "`vllm:num_preemptions_total` summed over replicas, median over repeats.", "",
           "| scenario | preemptions | tokens computed then aborted (evictions) |", "|---|---|---|"]
    for name, v in summary.items():
        out.append(f"| {name} | {_fmt(v.get('preemptions'))} | {_fmt(v.get('recomputed_tokens'))} |")
    return out


def eviction_cost_section(summary: dict[str, dict]) -> list[str]:
    """Newest-first restart against cost-ranked resume, prefix caching off and on (bench/eviction_cost.py's arms
    run inside the study)."""
    from bench.study import SCENARIOS

    names = [n for n in ("holdback_50", *EVICTION_COST) if n in summary]
    if not any(n in summary for n in EVICTION_COST):
        return ["Not run in this study (scenarios " + ", ".join(f"`{n}`" for n in EVICTION_COST) + ")."]
    s = lambda name, k: (summary.get(name) or {}).get(k)  # noqa: E731
    out = ["| scenario | p95 TTFT | batch completions | ÷ holdback alone | evictions | tokens computed then aborted "
           "| preemptions |", "|---|---|---|---|---|---|---|"]
    for name in names:
        out.append(f"| {SCENARIOS[name].title} | {_fmt(s(name, 'p95_ttft_ms'), suffix=' ms')} | "
                   f"{_fmt(s(name, 'batch_completions'))} | {_ratio(s(name, 'batch_completions'), s('holdback_50', 'batch_completions'))} | "
                   f"{_fmt(s(name, 'evictions_sum'))} | {_fmt(s(name, 'recomputed_tokens'))} | {_fmt(s(name, 'preemptions'))} |")
    return out


def make_plots(out_dir: Path, records: list[dict], summary: dict[str, dict],
               run_figs: list[dict] | None = None, occ: dict | None = None) -> list[str]:
    try:
        import matplotlib
    except ImportError as exc:
        raise SystemExit("holdback bench: plotting needs matplotlib; install it with `pip install 'holdback[bench]'` "
                         "(`make test` and `make up` install it already)") from exc

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.study import SCENARIOS

    made = []
    names = [n for n in SCENARIOS if n in summary and SCENARIOS[n].realtime]
    labels = [SHORT.get(n, n) for n in names]

    fig, ax = plt.subplots(figsize=(max(11.0, 1.05 * len(names)), 4.5))
    ours = [summary[n].get("p95_ttft_ms") or 0 for n in names]
    seed = [SEED.get(n, {}).get("p95_ttft_ms") for n in names]
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], ours, width=0.4, label="holdback (ours)", color="#3b6fb6")
    ax.bar([i + 0.2 for i in x], [v or 0 for v in seed], width=0.4, label="seed", color="#b0b0b0")
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel("realtime p95 TTFT (ms)")
    ax.set_title("Realtime p95 time to first token by scenario (median over repeats)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "p95_ttft_by_scenario.png", dpi=110)
    plt.close(fig)
    made.append("p95_ttft_by_scenario.png")

    bnames = [n for n in SCENARIOS if n in summary and SCENARIOS[n].batch]
    if bnames:
        fig, ax = plt.subplots(figsize=(max(10.0, 1.05 * len(bnames)), 4.2))
        ax.bar(range(len(bnames)), [summary[n].get("batch_completions") or 0 for n in bnames], color="#7a4fb0")
        ax.set_xticks(range(len(bnames)), [SHORT.get(n, n) for n in bnames], fontsize=8)
        ax.set_ylabel("batch completions in the window")
        ax.set_title("Batch completions by scenario (median over repeats)")
        fig.tight_layout()
        fig.savefig(out_dir / "batch_completions_by_scenario.png", dpi=110)
        plt.close(fig)
        made.append("batch_completions_by_scenario.png")

    sweep = [(r, summary[n]) for n, r in SWEEP if n in summary]
    if sweep:
        fig, ax1 = plt.subplots(figsize=(7, 4.2))
        ax1.plot([r for r, _ in sweep], [v.get("p95_ttft_ms") or 0 for _, v in sweep], "o-", color="#3b6fb6",
                 label="ours p95 TTFT")
        ax1.plot([r for _, r in SWEEP], [SEED[n]["p95_ttft_ms"] for n, _ in SWEEP], "s--", color="#999999",
                 label="seed p95 TTFT")
        ax1.set_xlabel("reserved capacity for realtime (%)")
        ax1.set_ylabel("realtime p95 TTFT (ms)")
        ax2 = ax1.twinx()
        ax2.bar([r for r, _ in sweep], [v.get("batch_completions") or 0 for _, v in sweep], width=8, alpha=0.25,
                color="#7a4fb0", label="ours batch completions")
        ax2.set_ylabel("batch completions in the window")
        ax1.set_title("Reserve sweep with eviction")
        h1, l1 = ax1.get_legend_handles_labels()
        h2, l2 = ax2.get_legend_handles_labels()
        ax1.legend(h1 + h2, l1 + l2, fontsize=8, loc="upper left")
        fig.tight_layout()
        fig.savefig(out_dir / "reserve_sweep.png", dpi=110)
        plt.close(fig)
        made.append("reserve_sweep.png")

    pair = [next((r for r in records if r["scenario"]["name"] == n), None)
            for n in ("reserve_25_noevict", "reserve_25_evict")]
    pair = [r for r in pair if r is not None]
    if pair:
        fig, axes = plt.subplots(1, len(pair), figsize=(6.5 * len(pair), 4), sharey=True, squeeze=False)
        for ax, rec in zip(axes[0], pair):
            start = (rec.get("window") or {}).get("realtime_start", 0.0)
            pts = [(r["sent_s"], r["ttft_s"] * 1000) for r in rec["realtime"] if r.get("ttft_s") is not None]
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=8, color="#3b6fb6", label="realtime TTFT")
            prev, first = None, True
            for smp in rec.get("samples") or []:
                ev = smp.get("evictions")
                if ev is not None and prev is not None and ev > prev:
                    ax.axvline(smp["t"] - start, color="#d04040", alpha=0.5, lw=1,
                               label="eviction issued" if first else None)
                    first = False
                if ev is not None:
                    prev = ev
            ax.set_xlabel("seconds since realtime traffic started")
            ax.set_title(SCENARIOS[rec["scenario"]["name"]].title, fontsize=10)
            ax.legend(fontsize=8)
        axes[0][0].set_ylabel("TTFT (ms)")
        fig.suptitle("Realtime TTFT over time at 25% reserve, eviction off and on (evictions marked)")
        fig.tight_layout()
        fig.savefig(out_dir / "ttft_over_time.png", dpi=110)
        plt.close(fig)
        made.append("ttft_over_time.png")

    if occ and run_figs:
        fig, ax = plt.subplots(figsize=(7.5, 4.5))
        for names, label, marker, color in (
                (("realtime_only",), "realtime only", "s", "#333333"),
                (FIXED_RESERVE_RUNS, "fixed reserve (fitted)", "o", "#3b6fb6"),
                (("adaptive_evict",), "adaptive reserve (not fitted)", "^", "#d04040")):
            pts = [(f.get("batch_in_flight_mean") or 0.0, f["p95_ttft_ms"]) for f in run_figs
                   if f["scenario"] in names and f.get("p95_ttft_ms") is not None]
            if pts:
                ax.scatter([x for x, _ in pts], [y for _, y in pts], marker=marker, color=color, label=label, s=28)
        top = max(f.get("batch_in_flight_mean") or 0.0 for f in run_figs
                  if f["scenario"] in (*FIXED_RESERVE_RUNS, "adaptive_evict"))
        xs = [0.0, max(top, occ["places_at_bound"] or 0.0) * 1.05]
        ax.plot(xs, [occ["intercept_ms"] + occ["slope_ms"] * x for x in xs], "-", color="#3b6fb6", lw=1,
                label=f"fit: {occ['intercept_ms']:.0f} ms + {occ['slope_ms']:.2f} ms per place")
        ax.axhline(occ["bound"] * occ["realtime_only_ms"], color="#999999", ls="--", lw=1,
                   label=f"{occ['bound']}× realtime-only p95")
        ax.set_xlabel("batch requests in flight at the gateway (mean over the window)")
        ax.set_ylabel("realtime p95 TTFT (ms)")
        ax.set_title("What a batch place costs realtime (one point per run)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / "occupancy_cost.png", dpi=110)
        plt.close(fig)
        made.append("occupancy_cost.png")
    return made


CALIBRATION = """The simulator stands in for one vLLM replica; docs/study/README.md gives the reasoning. KV blocks come
from the model and the GPU: a 32B dense model in bf16 (64 layers, 8 KV heads of 128: 256 KiB of KV per token) on
one 80 GB GPU at 90% memory use keeps about 950 blocks of 16 tokens beside its 65.5 GB of weights. Batch lines
(about 170-335 prompt tokens, 48-160 output tokens) hold 11-21 blocks each and grow as they decode: 48 of them
fill 96% of the pool on average and touch all of it, so 48 in flight is where this replica runs out of KV and
starts to preempt (vLLM's recompute); realtime requests (about 256 prompt tokens, 8 output) hold 17 blocks.
Step timing is fitted to the seed's realtime-only p95 TTFT, not derived from the GPU: a decode step dominates
(about 160 ms with a few sequences), so time to first token is mostly "wait for the step in progress, then one
step". With `{args}` the realtime-only p95 TTFT here is {base} ms over the whole window and {after} ms after
the opening burst (the seed: 342 ms over 300 s, where the burst is 2.6% of the requests). Prefix caching is off
except in the `_cache` scenarios, so a retried request recomputes its prompt."""


def differences(meta: dict, summary: dict[str, dict], run_figs: list[dict], occ: dict | None = None) -> list[str]:
    """Each place our figures part from the seed's, by how much, and the reason the raw records show."""
    s = lambda name, k: (summary.get(name) or {}).get(k)  # noqa: E731
    w = meta.get("workload", {})
    window = w.get("window_s", 300.0)
    rt = next((f for f in run_figs if f["scenario"] == "realtime_only"), None)
    n_rt = rt["realtime_requests"] if rt else None
    burst = w.get("burst", 32)
    share = (burst / n_rt * 100) if n_rt else None
    out: list[str] = []
    base, nc, hb = s("realtime_only", "p95_ttft_ms"), s("no_controls", "p95_ttft_ms"), s("holdback_50", "p95_ttft_ms")
    if base and nc:
        out.append(
            f"- **No controls: {(nc / base - 1) * 100:+.0f}% against the seed's +64%.** With batch holding all "
            f"48 request positions, every realtime arrival waits at the gateway for a batch request to finish. The "
            f"32-request opening burst waits longest; in this {window:.0f} s window it is "
            f"{_fmt(share, 1)}% of the {n_rt} realtime requests, against 2.6% of about 1,232 in the seed's 300 s. "
            f"After the burst has drained the no-controls p95 is {_fmt(s('no_controls', 'p95_ttft_after_burst_ms'))} ms "
            f"against {_fmt(s('realtime_only', 'p95_ttft_after_burst_ms'))} ms for realtime alone: still well above "
            f"baseline, which is the seed's finding.")
    occ = occ if occ is not None else occupancy_cost(run_figs)
    if base and hb:
        verdict = "within 5% of" if abs(hb / base - 1) <= 0.05 else f"{(hb / base - 1) * 100:+.0f}% from"
        text = (f"- **Holdback alone: {verdict} the baseline ({hb / base:.3f}×), against the seed's 341 vs 342 ms.** "
                f"The burst exceeds the 24 reserved positions by 8; without eviction those 8, and the realtime "
                f"requests that arrive while the burst occupies the reserve, wait for batch requests to finish "
                f"naturally (the seed's decision tree says the same). In this {window:.0f} s window the burst is "
                f"{_fmt(share, 1)}% of the realtime requests; after it the holdback p95 is "
                f"{_fmt(s('holdback_50', 'p95_ttft_after_burst_ms'))} ms against "
                f"{_fmt(s('realtime_only', 'p95_ttft_after_burst_ms'))} ms, and with eviction the burst is served at "
                f"once and the p95 is {_fmt(s('holdback_50_evict', 'p95_ttft_ms'))} ms.")
        held = s("holdback_50", "batch_in_flight_mean")
        if occ and held:
            text += (f" The rest of the gap is the batch places themselves: each batch sequence in the replica "
                     f"lengthens every engine step (`--decode-ms-per-seq`, the KV each sequence reads per step) and "
                     f"realtime's time to first token is about two steps, so each batch place held costs realtime "
                     f"{occ['slope_ms']:.2f} ms of p95 [{occ['slope_lo_ms']:.2f}, {occ['slope_hi_ms']:.2f}] (the "
                     f"line in 'What a batch place costs realtime'), {occ['slope_ms'] * held:.0f} ms for the "
                     f"{held:.1f} places holdback alone holds. The line reaches {occ['bound']}× realtime-only at "
                     f"{occ['places_at_bound']:.1f} places [{occ['places_at_bound_lo']:.1f}, "
                     f"{occ['places_at_bound_hi']:.1f}], so the 50% reserve's {held:.1f} places sit at this goal's "
                     f"edge and its verdict turns on a few milliseconds.")
        out.append(text)
    c_hb, c_ev = s("holdback_50", "batch_completions"), s("holdback_50_evict", "batch_completions")
    if c_hb and c_ev is not None and c_ev <= c_hb:
        out.append(
            f"- **Eviction and batch completions: {(c_ev / c_hb - 1) * 100:+.0f}% against the seed's +9%.** An "
            f"evicted request's computed work is lost or resumed at a cost "
            f"({_fmt(s('holdback_50_evict', 'recomputed_tokens'))} tokens computed then aborted here), and at a fixed "
            f"50% ceiling batch holds at most 24 places with or without eviction, so eviction can add completions "
            f"only by sparing the replica preemptions; here it had {_fmt(s('holdback_50', 'preemptions'))} with "
            f"holdback alone and {_fmt(s('holdback_50_evict', 'preemptions'))} with eviction (24 batch requests fill "
            f"about half of its KV blocks). The seed does not say where its extra 150 completions came from."
            + (f" What eviction does make possible is lending the reserve: the adaptive reserve keeps the 50% "
               f"ceiling as its floor, lends the rest while realtime leaves it idle and takes it back by eviction, "
               f"and completed {s('adaptive_evict', 'batch_completions') / c_hb:.2f}× holdback alone's batch "
               f"requests." if s("adaptive_evict", "batch_completions") else ""))
    elif c_hb and c_ev:
        out.append(f"- **Eviction and batch completions: {(c_ev / c_hb - 1) * 100:+.0f}% against the seed's +9%.**")
    sweep = [(r, s(n, "p95_ttft_ms")) for n, r in SWEEP if s(n, "p95_ttft_ms") is not None]
    if sweep:
        best = min(sweep, key=lambda x: x[1])
        out.append(
            f"- **Reserve sweep:** our lowest p95 is at {best[0]}% reserve ({_fmt(best[1])} ms); the seed's at 50%. "
            f"The seed's sweep medians (about 1 s) are three times its main-scenario figures, so its sweep ran under "
            f"heavier pressure than its 300 s comparison; ours uses the same workload throughout. The direction is the same: less reserve means more evictions and more recompute, more "
            f"reserve means fewer batch completions.")
    out += adaptive_differences(summary, w.get("max_concurrency", 48), occ)
    out.append("- **Scale:** our batch completions are counted in a shorter window with a simulated model, so they "
               "are not comparable in absolute terms with the seed's 1,648; only ratios between scenarios are.")
    return out


def adaptive_differences(summary: dict[str, dict], places: int, occ: dict | None = None) -> list[str]:
    """Why the adaptive reserve's batch completions, p95 and harvest land where they do: the places batch held
    against the places realtime left it, and against what each place costs realtime's p95 (`occ`, from
    occupancy_cost); the goals have no seed figure, the reason is in the occupancy."""
    s = lambda name, k: (summary.get(name) or {}).get(k)  # noqa: E731
    best = best_fixed_reserve(summary)
    a_done, b_done = s("adaptive_evict", "batch_completions"), s(best, "batch_completions") if best else None
    a_held, b_held = s("adaptive_evict", "batch_in_flight_mean"), s(best, "batch_in_flight_mean") if best else None
    rt_held = s("adaptive_evict", "realtime_in_flight_mean")
    if not (a_done and b_done and a_held and b_held and rt_held is not None):
        return []
    free = places - rt_held
    bound = free / b_held
    out = [f"- **Adaptive reserve: {a_done / b_done:.2f}× the batch completions of the best fixed reserve "
           f"(`{best}`), goal 1.25×.** Completions follow the places batch holds: the adaptive reserve held "
           f"{a_held:.1f} of the {places} on average, `{best}` {b_held:.1f}. Realtime kept {rt_held:.1f} places busy "
           f"on average (its requests' summed lifetimes ÷ the window), so even a reserve that knew every arrival in "
           f"advance could leave batch at most {free:.1f}, {bound:.2f}× what `{best}` held"
           + (": below 1.25, so no reserve policy can meet this goal at this workload; the fixed reserve it is "
              "measured against already keeps realtime within 5% of its baseline." if bound < 1.25 else
              f"; the adaptive reserve used {(a_held - b_held) / (free - b_held) * 100:.0f}% of the room beyond "
              f"`{best}`." if free > b_held and a_held > b_held else
              f"; the adaptive reserve held no more of it than `{best}`.")]
    base, a_p95 = s("realtime_only", "p95_ttft_ms"), s("adaptive_evict", "p95_ttft_ms")
    if occ and base and a_p95 and occ.get("places_at_bound") and occ.get("completions_per_place"):
        predicted = occ["intercept_ms"] + occ["slope_ms"] * a_held
        need = 1.25 * b_done / occ["completions_per_place"]
        floor = (s("adaptive_evict", "usage_limit") or {}).get("minCeiling")
        # What batch holds at the floor's ceiling: the fixed reserve run at that ceiling (held < ceiling × places,
        # since places turn over).
        from bench.study import SCENARIOS
        at_floor = next((n for n in FIXED_RESERVE_RUNS if n in SCENARIOS and SCENARIOS[n].batch_ceiling == floor
                         and s(n, "batch_in_flight_mean")), None)
        lo, hi = s("adaptive_evict", "batch_ceiling_p10"), s("adaptive_evict", "batch_ceiling_p90")
        text = (f"- **Adaptive reserve p95: {a_p95 / base:.3f}× realtime-only, goal ≤ {occ['bound']}.** At the "
                f"{a_held:.1f} places it held, the fixed reserves' line predicts {predicted:.0f} ms; it measured "
                f"{a_p95:.0f} ms ({occ['adaptive_residual_ms']:+.1f} ms from the line, median over runs): lending "
                f"the reserve and taking it back by eviction costs realtime nothing beyond the places lent. The "
                f"line reaches {occ['bound']}× realtime-only at {occ['places_at_bound']:.1f} places "
                f"[{occ['places_at_bound_lo']:.1f}, {occ['places_at_bound_hi']:.1f}]")
        if at_floor and s(at_floor, "batch_in_flight_mean") > occ["places_at_bound"]:
            text += (f", below the {s(at_floor, 'batch_in_flight_mean'):.1f} places batch holds at the adaptive "
                     f"reserve's own floor (minCeiling {floor}, measured as `{at_floor}`), so as configured it "
                     f"cannot meet the p95 goal")
        text += (f". Both adaptive goals together need between {need:.1f} places (1.25× `{best}`'s completions at "
                 f"{occ['completions_per_place']:.1f} completions per place) and {occ['places_at_bound']:.1f}"
                 + (": no such band, so no policy meets both here." if need >= occ["places_at_bound"] else
                    f"; a fixed reserve holding that many meets them as well as a demand-following one, because "
                    f"the realtime load is steady (a Poisson stream at one rate after the opening burst)"
                    + (f" and the adaptive ceiling only moved between {lo:.2f} and {hi:.2f} of the pool (10th to "
                       f"90th percentile of its samples)" if lo is not None and hi is not None else "")
                    + ". A reserve that follows demand can hold more places than a fixed one for the same p95 only "
                      "where demand rises and falls, which this workload does not do."))
        out.append(text)
    h = s("adaptive_evict", "harvest")
    if h is not None:
        out.append(f"- **Harvest with the adaptive reserve: {h:.2f}, goal 0.8.** Batch held {a_held:.1f} of the "
                   f"{free:.1f} places realtime left on average ({a_held / free * 100:.0f}%); each eviction also "
                   f"discards the victim's unfinished work ({_fmt(s('adaptive_evict', 'recomputed_tokens'))} tokens "
                   f"computed then aborted, median per run), and batch alone, the denominator, runs all {places} "
                   f"places with the replica preempting ({_fmt(s('batch_alone', 'preemptions'))} preemptions).")
    return out
