"""Turn a study's raw records into its figures, summary JSON, Markdown report and PNG plots.

Nothing here is typed in by hand except the seed's own published numbers (SEED), which the report
prints beside ours. Run `holdback bench report DIR` to regenerate everything from DIR/raw/*.json.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from bench.stack import metric_sum

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
SHORT = {
    "realtime_only": "realtime\nonly", "no_controls": "no\ncontrols", "holdback_50": "holdback\n50%",
    "holdback_50_evict": "holdback 50%\n+ eviction", "reserve_25_evict": "reserve 25%\n+ eviction",
    "reserve_75_evict": "reserve 75%\n+ eviction", "reserve_25_noevict": "reserve 25%\neviction off",
    "two_replicas": "two replicas\n50% + evict", "standard_check": "standard\nreclaims",
    "adaptive_evict": "adaptive\n+ eviction", "batch_alone": "batch\nalone",
}
SWEEP = [("reserve_25_evict", 25), ("holdback_50_evict", 50), ("reserve_75_evict", 75)]


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    if k == lo or ordered[hi] == ordered[lo]:
        return ordered[lo]  # also keeps an infinite value (a request that never got its token) infinite
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


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


def histogram_quantile(metrics: dict[str, float], name: str, q: float) -> float | None:
    buckets = []
    for key, value in metrics.items():
        if key.startswith(f"{name}_bucket{{"):
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
        "realtime_requests": len(rt),
        "realtime_ok": len(ok),
        "realtime_errors": len(rt) - len(ok),
        "p95_ttft_ms": percentile(ttfts, 0.95),
        "p50_ttft_ms": percentile(ttfts, 0.50),
        # Diagnostic only (never a headline): p95 over requests sent after the opening burst has drained.
        # A short window makes the burst's aftermath a large share of all requests; this shows how much.
        "p95_ttft_after_burst_ms": percentile([r["ttft_s"] * 1000 for r in ok if r["sent_s"] >= BURST_SETTLE_S], 0.95),
        "realtime_queued_p95_ms": percentile([r["queue_ms"] for r in rt if r.get("queue_ms") is not None], 0.95),
        "realtime_output_tps": sum(r.get("output_tokens") or 0 for r in ok) / win["window_s"] if win.get("window_s") else None,
    }
    if not record["scenario"]["batch"]:
        return f
    start = win.get("realtime_start", 0.0)
    c0, c1 = _completed_at(samples, start), _completed_at(samples, start + win.get("window_s", 0.0))
    f["batch_completions"] = None if c0 is None or c1 is None else round(c1 - c0)
    f["batch_output_tps"] = _batch_output_tps(rows, win)
    ceilings = [x["batch_ceiling"] for x in samples
                if x.get("batch_ceiling") is not None and start <= x["t"] <= start + win.get("window_s", 0.0)]
    f["batch_ceiling_mean"] = statistics.fmean(ceilings) if ceilings else None
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
    f["preemptions"] = int(sum(metric_sum(m, "vllm:num_preemptions_total") for m in sim))
    e2e = [r["finished_at"] - r["first_attempt_at"] for r in rows
           if r["status"] == "succeeded" and r.get("first_attempt_at") and r.get("finished_at")]
    f["batch_p95_e2e_s"] = percentile(e2e, 0.95)
    gm = record.get("gateway_metrics", {})
    f["release_p50_ms"] = _ms(histogram_quantile(gm, "holdback_gateway_eviction_confirmation_seconds", 0.5))
    f["release_p99_ms"] = _ms(histogram_quantile(gm, "holdback_gateway_eviction_confirmation_seconds", 0.99))
    f["evicted_all_done"] = record.get("evicted_all_done")
    return f


def _batch_output_tps(rows: list[dict], win: dict) -> float | None:
    """Output tokens/s of batch requests that finished inside the realtime window (None: no wall-clock anchor,
    which records written before the anchor was added lack)."""
    start, length = win.get("realtime_start_wall"), win.get("window_s")
    if start is None or not length:
        return None
    tokens = sum(r.get("output_tokens") or 0 for r in rows
                 if r["status"] == "succeeded" and r.get("finished_at") and start <= r["finished_at"] <= start + length)
    return tokens / length


def harvest(summary: dict[str, dict], name: str) -> float | None:
    """Batch output tokens/s under mixed load ÷ (pool output tokens/s with batch alone − realtime's alone):
    the share of the capacity realtime leaves spare that batch actually used."""
    mixed = (summary.get(name) or {}).get("batch_output_tps")
    alone = (summary.get("batch_alone") or {}).get("batch_output_tps")
    rt = (summary.get("realtime_only") or {}).get("realtime_output_tps")
    if mixed is None or alone is None or rt is None or alone - rt <= 0:
        return None
    return mixed / (alone - rt)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def _median(values: list) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def summarize(run_figures: list[dict]) -> dict[str, dict]:
    by: dict[str, list[dict]] = {}
    for f in run_figures:
        by.setdefault(f["scenario"], []).append(f)
    out = {}
    for name, runs in by.items():
        keys = sorted({k for r in runs for k in r if k not in ("scenario", "repeat", "evicted_all_done")})
        med = {k: _median([r.get(k) for r in runs]) for k in keys}
        # Counts that must hold in every run are summed, not medianed.
        for k in ("evictions", "evicted_requests", "evicted_completed", "duplicate_final_results",
                  "duplicates_suppressed", "realtime_errors"):
            if any(k in r for r in runs):
                med[f"{k}_sum"] = sum(r.get(k) or 0 for r in runs)
        med["repeats"] = len(runs)
        out[name] = med
    for name, med in out.items():
        if name not in ("batch_alone", "realtime_only"):
            med["harvest"] = harvest(out, name)
    return out


def load(out_dir: Path) -> tuple[dict, list[dict], list[dict]]:
    meta = json.loads((out_dir / "study.json").read_text()) if (out_dir / "study.json").exists() else {}
    records = [json.loads(p.read_text()) for p in sorted((out_dir / "raw").glob("*.json"))]
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


def headline(summary: dict[str, dict]) -> list[tuple[str, bool | None, str]]:
    """The issue's three checks against the seed, each with a verdict and the numbers behind it."""
    g = lambda s, k: (summary.get(s) or {}).get(k)  # noqa: E731
    base, nc, hb = g("realtime_only", "p95_ttft_ms"), g("no_controls", "p95_ttft_ms"), g("holdback_50", "p95_ttft_ms")
    checks: list[tuple[str, bool | None, str]] = []
    if base and nc:
        rise = nc / base - 1
        checks.append(("No controls raises realtime p95 TTFT well above baseline (seed +64%)", rise >= 0.25,
                       f"ours {_fmt(base)} → {_fmt(nc)} ms ({rise * 100:+.0f}%)"))
    if base and hb:
        diff = hb / base - 1
        checks.append(("Holdback brings realtime p95 TTFT back within 5% of baseline (seed 341 vs 342 ms)",
                       abs(diff) <= 0.05 or hb <= base, f"ours {_fmt(hb)} vs {_fmt(base)} ms ({diff * 100:+.1f}%)"))
    c_hb, c_ev = g("holdback_50", "batch_completions"), g("holdback_50_evict", "batch_completions")
    ev = g("holdback_50_evict", "evicted_requests_sum")
    done = g("holdback_50_evict", "evicted_completed_sum")
    dup = sum((v.get("duplicate_final_results_sum") or 0) for v in summary.values())
    if c_hb and c_ev is not None:
        checks.append(("Eviction and retry raise batch completions (seed +9%)", c_ev > c_hb,
                       f"ours {_fmt(c_hb)} → {_fmt(c_ev)} ({_pct(c_ev, c_hb)})"))
    if ev is not None:
        checks.append(("Every evicted request completed after retry, zero duplicates (seed 38 of 38)",
                       ev == done and dup == 0 and ev > 0,
                       f"ours {done} of {ev} evicted requests completed; {dup} duplicate final results in all runs"))
    return checks


def render(out_dir: Path) -> Path:
    meta, records, run_figs = load(out_dir)
    summary = summarize(run_figs)
    (out_dir / "summary.json").write_text(json.dumps({"meta": meta, "scenarios": summary, "runs": run_figs,
                                                      "headline": headline(summary)}, indent=2))
    plots = make_plots(out_dir, records, summary)
    md = report_markdown(meta, summary, run_figs, plots)
    path = out_dir / "report.md"
    path.write_text(md)
    return path


def report_markdown(meta: dict, summary: dict[str, dict], run_figs: list[dict], plots: list[str]) -> str:
    from bench.study import SCENARIOS

    w = meta.get("workload", {})
    s = lambda name, k: (summary.get(name) or {}).get(k)  # noqa: E731
    lines = ["# Holdback and eviction study: ours beside the seed", ""]
    lines += [f"Mode: {'quick' if w.get('window_s', 300) < 300 else 'full'} — window {w.get('window_s')} s per "
              f"scenario, batch lead {w.get('lead_s')} s, {meta.get('repeats')} repeat(s), seed {meta.get('seed')}. "
              f"Figures are medians over repeats; every number below is computed by `bench/report.py` from "
              f"the raw records in `raw/`.", ""]
    lines += ["## Headline", "", "| check | verdict | figures |", "|---|---|---|"]
    for text, ok, detail in headline(summary):
        lines.append(f"| {text} | {'yes' if ok else 'NO'} | {detail} |")
    base = s("realtime_only", "p95_ttft_ms")
    lines += ["", "## Realtime result (seed: table 'Realtime latency was preserved under mixed load')", "",
              "| scenario | seed p95 TTFT | ours p95 TTFT | seed vs baseline | ours vs baseline | realtime errors | "
              "ours p95 after the burst (diagnostic) |",
              "|---|---|---|---|---|---|---|"]
    for name in ("realtime_only", "no_controls", "holdback_50", "holdback_50_evict"):
        seed_v = SEED.get(name, {}).get("p95_ttft_ms")
        ours = s(name, "p95_ttft_ms")
        lines.append(f"| {SCENARIOS[name].title} | {_fmt(seed_v, suffix=' ms')} | {_fmt(ours, suffix=' ms')} | "
                     f"{_pct(seed_v, SEED['realtime_only']['p95_ttft_ms'])} | {_pct(ours, base)} | "
                     f"{_fmt(s(name, 'realtime_errors_sum'))} | {_fmt(s(name, 'p95_ttft_after_burst_ms'), suffix=' ms')} |")
    lines += ["", f"The diagnostic column leaves out requests sent in the first {BURST_SETTLE_S:.0f} s, while the opening "
              "burst drains; the headline always uses every request."]
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
              f"| blocked arrival → capacity released, p50 / p99 | — | — | — | "
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
    lines += ["", "## Harvest", ""] + harvest_section(summary)
    lines += ["", "## Every run", "",
              "| run | p95 TTFT ms | batch done | evictions | evicted → completed | dup | recomputed tok | "
              "batch p95 e2e s | release p99 ms |", "|---|---|---|---|---|---|---|---|---|"]
    for f in run_figs:
        lines.append(f"| {f['scenario']} r{f['repeat']} | {_fmt(f.get('p95_ttft_ms'))} | {_fmt(f.get('batch_completions'))} | "
                     f"{_fmt(f.get('evictions'))} | {_fmt(f.get('evicted_completed'))}/{_fmt(f.get('evicted_requests'))} | "
                     f"{_fmt(f.get('duplicate_final_results'))} | {_fmt(f.get('recomputed_tokens'))} | "
                     f"{_fmt(f.get('batch_p95_e2e_s'), 2)} | {_fmt(f.get('release_p99_ms'), 1)} |")
    lines += ["", "## Where ours differs from the seed, and why", ""] + differences(meta, summary, run_figs)
    lines += ["", "## Calibration", "", CALIBRATION.format(base=_fmt(s("realtime_only", "p95_ttft_ms")),
                                                           args=" ".join(w.get("sim_args", [])))]
    lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in plots]
    lines += ["", "## Workload", "", "```json", json.dumps(w, indent=2), "```", ""]
    return "\n".join(lines)


def _ratio(a, b, digits: int = 2) -> str:  # noqa: ANN001
    return "—" if a is None or b in (None, 0) else f"{a / b:.{digits}f}"


def adaptive_section(summary: dict[str, dict]) -> list[str]:
    """The adaptive reserve against the fixed reserves measured in the same study, as ratios."""
    from bench.study import ADAPTIVE_RESERVE, SCENARIOS

    s = lambda name, k: (summary.get(name) or {}).get(k)  # noqa: E731
    if "adaptive_evict" not in summary:
        return ["Not run in this study (scenario `adaptive_evict`)."]
    fixed = [n for n, _ in SWEEP if s(n, "batch_completions") is not None]
    best = max(fixed, key=lambda n: s(n, "batch_completions")) if fixed else None
    base = s("realtime_only", "p95_ttft_ms")
    a_done, a_p95 = s("adaptive_evict", "batch_completions"), s("adaptive_evict", "p95_ttft_ms")
    # Fewer than three repeats leave the spread unmeasured: a verdict says which side this run fell on only.
    decided = (s("adaptive_evict", "repeats") or 1) >= 3
    verdict = lambda value, goal, above: _verdict(value, goal, above, decided)  # noqa: E731
    out = [f"Gateway `usageLimit: {{policy: adaptive-reserve, minCeiling: 0.5, adaptive: {json.dumps(ADAPTIVE_RESERVE)}}}`"
           ": the batch ceiling is 1 − forecast − margin, never below the 50% reserve's ceiling.", "",
           "| scenario | p95 TTFT | p95 after the burst (diagnostic) | batch completions | evictions | "
           "mean batch ceiling in window |", "|---|---|---|---|---|---|"]
    for name in [n for n in ("realtime_only", *[n for n, _ in SWEEP], "adaptive_evict") if n in summary]:
        out.append(f"| {SCENARIOS[name].title} | {_fmt(s(name, 'p95_ttft_ms'), suffix=' ms')} | "
                   f"{_fmt(s(name, 'p95_ttft_after_burst_ms'), suffix=' ms')} | {_fmt(s(name, 'batch_completions'))} | {_fmt(s(name, 'evictions'))} | "
                   f"{_fmt(s(name, 'batch_ceiling_mean'), 3)} |")
    out += ["", "| ratio | value | goal | verdict |", "|---|---|---|---|"]
    if best is not None:
        r = a_done / s(best, "batch_completions") if a_done is not None and s(best, "batch_completions") else None
        out.append(f"| batch completions ÷ best fixed reserve measured ({SCENARIOS[best].title}) | {_ratio(a_done, s(best, 'batch_completions'))} "
                   f"| ≥ 1.25 | {verdict(r, 1.25, True)} |")
    out.append(f"| realtime p95 TTFT ÷ realtime-only | {_ratio(a_p95, base)} | ≤ 1.05 | "
               f"{verdict(a_p95 / base if a_p95 is not None and base else None, 1.05, False)} |")
    if best is not None:
        out.append(f"| realtime p95 TTFT ÷ {SCENARIOS[best].title} | {_ratio(a_p95, s(best, 'p95_ttft_ms'))} | — | — |")
    if not decided:
        out += ["", "Undecided: with fewer than three repeats the run-to-run spread is not measured, and a quick-mode "
                "p95 over about 280 requests moves by an engine step between reruns."]
    return out


def _verdict(value: float | None, goal: float, above: bool, decided: bool = True) -> str:
    if value is None:
        return "not measured"
    met = value >= goal if above else value <= goal
    if not decided:
        return f"undecided (this run {'meets' if met else 'misses'} it)"
    return "yes" if met else "NO"


def harvest_section(summary: dict[str, dict]) -> list[str]:
    missing = [n for n in ("batch_alone", "realtime_only") if n not in summary]
    out = ["Harvest = batch output tokens/s under mixed load ÷ (pool output tokens/s with batch alone − realtime "
           "output tokens/s alone), batch tokens counted for requests that finished inside the window."]
    if missing:
        return out + ["", f"Not computed: this study did not run {' and '.join(f'`{n}`' for n in missing)}."]
    out += ["", "| scenario | batch output tok/s | harvest |", "|---|---|---|"]
    for name, v in summary.items():
        if "harvest" in v:
            out.append(f"| {name} | {_fmt(v.get('batch_output_tps'), 1)} | {_fmt(v.get('harvest'), 2)} |")
    return out


def make_plots(out_dir: Path, records: list[dict], summary: dict[str, dict]) -> list[str]:
    try:
        import matplotlib
    except ImportError as exc:
        raise SystemExit("holdback bench: plotting needs matplotlib; install it with `pip install 'holdback[bench]'` "
                         "(`make test` and `make up` install it already)") from exc

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.study import SCENARIOS

    made = []
    names = [n for n in SCENARIOS if n in summary]
    labels = [SHORT.get(n, n) for n in names]

    fig, ax = plt.subplots(figsize=(11, 4.5))
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

    bnames = [n for n in names if SCENARIOS[n].batch]
    fig, ax = plt.subplots(figsize=(10, 4.2))
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
    return made


CALIBRATION = """The simulator stands in for one vLLM replica of a large model whose decode step dominates: every engine
step costs `step_overhead + prefill_tokens × prefill_per_token + decode_base + decode_per_seq × running`
(`model_sim/timing.py`). With `{args}` a decode step with a handful of sequences takes about 125 ms and a
256-token realtime prompt adds about 4 ms of prefill, so a lone realtime request sees roughly one and a half
steps before its first token, and the 32-request opening burst (8,192 prompt tokens) is prefilled in one step.
That puts the realtime-only baseline at a p95 TTFT of {base} ms, the seed's regime (342 ms). Batch lines use
70–180 prompt tokens and 32–96 output tokens (seeded), about 10 s of service each; realtime uses 8 output
tokens. Prefix caching is off, as in the seed, so a retried request recomputes its prompt."""


def differences(meta: dict, summary: dict[str, dict], run_figs: list[dict]) -> list[str]:
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
    if base and hb:
        verdict = "within 5% of" if abs(hb / base - 1) <= 0.05 else f"{(hb / base - 1) * 100:+.0f}% from"
        out.append(
            f"- **Holdback alone: {verdict} the baseline, against the seed's 341 vs 342 ms.** The burst exceeds the "
            f"24 reserved positions by 8; without eviction those 8, and the realtime requests that arrive while the "
            f"burst occupies the reserve, wait for batch requests to finish naturally (the seed's decision tree "
            f"says the same). Over {window:.0f} s they are enough requests to reach the p95; over 300 s they are "
            f"not. After the burst the holdback p95 is {_fmt(s('holdback_50', 'p95_ttft_after_burst_ms'))} ms against "
            f"{_fmt(s('realtime_only', 'p95_ttft_after_burst_ms'))} ms. With eviction the burst is served at once and "
            f"the p95 is {_fmt(s('holdback_50_evict', 'p95_ttft_ms'))} ms.")
    c_hb, c_ev = s("holdback_50", "batch_completions"), s("holdback_50_evict", "batch_completions")
    if c_hb and c_ev is not None and c_ev <= c_hb:
        out.append(
            f"- **Eviction and batch completions: {(c_ev / c_hb - 1) * 100:+.0f}% against the seed's +9%.** In our "
            f"simulator an evicted request's computed tokens are thrown away "
            f"({_fmt(s('holdback_50_evict', 'recomputed_tokens'))} here) and at a fixed 50% ceiling nothing else "
            f"changes for batch, so eviction cannot add batch completions (with one repeat per scenario the "
            f"run-to-run spread is not measured here; the full mode's three repeats give medians). The seed does not say where its extra 150 completions came "
            f"from; real vLLM under KV pressure preempts and recomputes running work when a burst lands, which "
            f"eviction avoids and which our simulator, sized with ample KV blocks, never does.")
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
    out.append("- **Scale:** our batch completions are counted in a shorter window with a simulated model, so they "
               "are not comparable in absolute terms with the seed's 1,648; only ratios between scenarios are.")
    return out
