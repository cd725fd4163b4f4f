"""The report's tables beside the seed's: goals, adaptive reserve, occupancy, harvest, KV pressure, eviction
cost."""

from __future__ import annotations

import json

from bench.report.cells import fmt, interval, ratio
from bench.report.summary import EVICTION_COST, FIXED_RESERVE_RUNS, SWEEP, best_fixed_reserve
from bench.study import SCENARIOS


def goals_table(judged: list[dict]) -> list[str]:
    out = ["| goal | ours [95% interval] | bound | verdict | how the interval was made |", "|---|---|---|---|---|"]
    for g in judged:
        if g["bound"] is None:
            out.append(f"| {g['text']} | {g['note']} | — | {g['verdict']} | {g['method']} |")
            continue
        value = "—" if g["value"] is None else f"{g['value']:.2f} {interval(g['lo'], g['hi'])}"
        note = f" ({g['note']})" if g["note"] else ""
        n = f", n={g['n']}" if g["n"] else ""
        out.append(f"| {g['text']}{note} | {value} | {'≥' if g['at_least'] else '≤'} {g['bound']} | {g['verdict']} "
                   f"| {g['method']}{n} |")
    return out


def adaptive_section(summary: dict[str, dict]) -> list[str]:
    """The adaptive reserve against the fixed reserves measured in the same study, as ratios."""
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
        out.append(f"| {SCENARIOS[name].title} | {fmt(s(name, 'p95_ttft_ms'), suffix=' ms')} | "
                   f"{fmt(s(name, 'p95_ttft_after_burst_ms'), suffix=' ms')} | {fmt(s(name, 'batch_completions'))} | {fmt(s(name, 'evictions'))} | "
                   f"{fmt(s(name, 'batch_ceiling_mean'), 3)} |")
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
            f"{fmt(occ['completions_per_place'], 1)} |",
            f"| batch completions at that many places | {fmt(occ['completions_at_bound'])} |",
            f"| adaptive reserve's p95 − the line at its places (median over runs) | "
            f"{fmt(occ['adaptive_residual_ms'], 1, ' ms')} |"]


def harvest_section(summary: dict[str, dict]) -> list[str]:
    missing = [n for n in ("batch_alone", "realtime_only") if n not in summary]
    out = ["Harvest = batch output tokens/s under mixed load ÷ (pool output tokens/s with batch alone − realtime "
           "output tokens/s alone), the three from the same repeat of this study, batch tokens counted for requests "
           "that finished inside the window; the median over repeats with its bootstrap interval."]
    if missing:
        return out + ["", f"Not computed: this study did not run {' and '.join(f'`{n}`' for n in missing)}."]
    alone = summary["batch_alone"].get("batch_output_tps")
    rt = summary["realtime_only"].get("realtime_output_tps")
    out += ["", f"Batch alone: {fmt(alone, 1)} output tok/s; realtime alone: {fmt(rt, 1)} output tok/s.", "",
            "| scenario | batch output tok/s | harvest [95% interval] |", "|---|---|---|"]
    for name, v in summary.items():
        if "harvest" in v:
            out.append(f"| {name} | {fmt(v.get('batch_output_tps'), 1)} | {fmt(v.get('harvest'), 2)} "
                       f"{interval(*(v.get('harvest_ci') or (None, None)))} |")
    return out


def kv_section(summary: dict[str, dict]) -> list[str]:
    """Where the replica ran out of KV blocks: its preemptions (recompute), per scenario."""
    out = ["The simulator preempts (vLLM's recompute) when running sequences need more KV blocks than it has; "
           "`vllm:num_preemptions_total` summed over replicas, median over repeats.", "",
           "| scenario | preemptions | tokens computed then aborted (evictions) |", "|---|---|---|"]
    for name, v in summary.items():
        out.append(f"| {name} | {fmt(v.get('preemptions'))} | {fmt(v.get('recomputed_tokens'))} |")
    return out


def eviction_cost_section(summary: dict[str, dict]) -> list[str]:
    """Newest-first restart against cost-ranked resume, prefix caching off and on (bench/eviction_cost.py's arms
    run inside the study)."""
    names = [n for n in ("holdback_50", *EVICTION_COST) if n in summary]
    if not any(n in summary for n in EVICTION_COST):
        return ["Not run in this study (scenarios " + ", ".join(f"`{n}`" for n in EVICTION_COST) + ")."]
    s = lambda name, k: (summary.get(name) or {}).get(k)  # noqa: E731
    out = ["| scenario | p95 TTFT | batch completions | ÷ holdback alone | evictions | tokens computed then aborted "
           "| preemptions |", "|---|---|---|---|---|---|---|"]
    for name in names:
        out.append(f"| {SCENARIOS[name].title} | {fmt(s(name, 'p95_ttft_ms'), suffix=' ms')} | "
                   f"{fmt(s(name, 'batch_completions'))} | {ratio(s(name, 'batch_completions'), s('holdback_50', 'batch_completions'))} | "
                   f"{fmt(s(name, 'evictions_sum'))} | {fmt(s(name, 'recomputed_tokens'))} | {fmt(s(name, 'preemptions'))} |")
    return out
