"""What an eviction costs: newest-first victims that restart (today) against cost-ranked victims that resume,
with prefix caching off and on, at the study's operating point (50% batch reserve), in one run.

Arms (each one run of the study's quick workload on a fresh stack; `--rounds N` repeats the set, every
other round in reverse order, so no arm always runs first or last). Each is a scenario of bench/study.py under
this bench's name (holdback_50, evict_newest_restart[_cache], evict_cost_resume[_cache]), so the study and this
bench configure them in one place:
  holdback_off / holdback_on      holdback alone (eviction off), prefix caching off / on: the baseline
  newest_restart_off / _on        today's eviction: the fixed 50% ceiling, `newest-first` victims, workers
                                  restart evicted requests
  cost_resume_off / _on           eviction that lends the reserve: batch borrows what realtime leaves idle
                                  (`adaptive-reserve`, floor 0.5, so the 50% reserve is the same) and gives it
                                  back by eviction; `cost-ranked` victims, workers resume from partial output
  cost_resume_on_fixed            (only with --arms) cost-ranked resume with cache at the fixed 50% ceiling:
                                  what resume alone does, without borrowing
  newest_restart_lent_on          (only with --arms) today's newest-first restart with the reserve lent as in
                                  cost_resume_on: what the victim order and resume change at the same occupancy
  cost_resume_on_cap60            (only with --arms) cost_resume_on lending at most up to 60% of the pool
                                  (`maxCeiling` 0.6): fewer batch sequences in each engine step for realtime
  holdback_offload, newest_restart_offload, cost_resume_offload
                                  (only with --arms) holdback_on, newest_restart_on and cost_resume_on with a
                                  host-memory tier behind the prefix cache (`--kv-offload-blocks 9500`, vLLM's
                                  CPU offloading): under KV pressure an evicted request's GPU blocks go to the
                                  request it was evicted for, so only a second tier keeps them for its retry
  cost_resume_offload_2r, cost_resume_offload_2r_spread
                                  (only with --arms) cost_resume_offload on two replicas (twice the realtime
                                  traffic), the retry of an evicted request sent back to the replica holding its
                                  blocks (the gateway's default) or scored like a new request
                                  (`picker.evictedAffinity: false`): what the home replica saves
Without eviction the reserve cannot be lent: nothing would give it back when realtime needs it, so the
holdback-alone arms keep batch at the fixed ceiling.
Figures per arm: batch completions in the realtime window, evictions (attempts ended `evicted`), tokens
recomputed per eviction (the workers' per-attempt record: earlier work an attempt computed again), tokens
kept, the simulator's computed-then-aborted tokens, and realtime p95 TTFT with a 95% order-statistic
interval. Ratios are taken within a round and reported as the median over rounds. `--report DIR` recomputes
everything from the raw records a run left in DIR/raw (also after an interrupted run).

The victim policy is chosen with the gateway's `eviction.policy`; records of an eviction arm that named none
(runs on a gateway before that key) ran newest-first, and the report says so (`policy selectable: no`).

    python -m bench.eviction_cost --rounds 1 --window 60
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import httpx

from bench.lib.stack import Stack
from bench.report.figures import figures
from bench.stats import Estimate, decide, percentile, pooled_quantile_ratio, quantile_interval, ratio_of_runs
from bench.study import (CACHE, OFFLOAD, QUICK, SCENARIOS, Scenario, StudyWorkload, read_record, record_paths, run_one,
                         with_overrides)


def _arm(study_name: str, name: str, title: str, **changes) -> Scenario:  # noqa: ANN003
    """One arm: a study scenario (the same gateway, simulator and worker settings) under this bench's name."""
    return replace(SCENARIOS[study_name], name=name, title=title, **changes)


# The arms are the study's scenarios (bench/study.py), renamed; the two borrowing arms add the adaptive reserve.
ARMS: dict[str, Scenario] = {s.name: s for s in (
    _arm("holdback_50", "holdback_off", "Holdback alone, prefix cache off"),
    _arm("holdback_50", "holdback_on", "Holdback alone, prefix cache on", sim_extra=CACHE),
    _arm("evict_newest_restart", "newest_restart_off", "Newest-first + restart, cache off"),
    _arm("evict_newest_restart_cache", "newest_restart_on", "Newest-first + restart, cache on"),
    _arm("evict_cost_resume", "cost_resume_off", "Cost-ranked + resume, borrowing, cache off", adaptive=True),
    _arm("evict_cost_resume_cache", "cost_resume_on", "Cost-ranked + resume, borrowing, cache on", adaptive=True),
    _arm("evict_cost_resume_cache", "cost_resume_on_fixed", "Cost-ranked + resume, fixed 50%, cache on"),
    _arm("evict_newest_restart_cache", "newest_restart_lent_on", "Newest-first + restart, borrowing, cache on",
         adaptive=True),
    _arm("evict_cost_resume_cache", "cost_resume_on_cap60", "Cost-ranked + resume, borrowing up to 60%, cache on",
         adaptive=True, max_ceiling=0.6),
    _arm("holdback_50", "holdback_offload", "Holdback alone, prefix cache + offload tier", sim_extra=OFFLOAD),
    _arm("evict_newest_restart_cache", "newest_restart_offload", "Newest-first + restart, cache + offload tier",
         sim_extra=OFFLOAD),
    _arm("evict_cost_resume_cache", "cost_resume_offload", "Cost-ranked + resume, borrowing, cache + offload tier",
         adaptive=True, sim_extra=OFFLOAD),
    _arm("evict_cost_resume_cache", "cost_resume_offload_2r", "Cost-ranked + resume, borrowing, offload tier, "
         "2 replicas, retry to its replica", adaptive=True, sim_extra=OFFLOAD, replicas=2),
    _arm("evict_cost_resume_cache", "cost_resume_offload_2r_spread", "Cost-ranked + resume, borrowing, offload "
         "tier, 2 replicas, retry scored anew", adaptive=True, sim_extra=OFFLOAD, replicas=2, evicted_affinity=False),
)}
# The study's calibration before it was sized for KV pressure: the same step timing but a 120 ms decode base, 40,000
# KV blocks (KV never runs short), shorter batch lines. Issue 13's first figures were measured on it; `--calibration
# roomy` runs it again, to compare eviction where the pool has KV to spare with where it has not.
ROOMY = replace(QUICK, batch_prompt_words=(60, 160), batch_max_tokens=(32, 96), sim_args=(
    "--step-overhead-ms", "5", "--prefill-ms-per-token", "0.015", "--decode-base-ms", "120",
    "--decode-ms-per-seq", "0.4", "--max-num-seqs", "256", "--max-num-batched-tokens", "8192",
    "--num-blocks", "40000", "--jitter", "0.05"))
# The KV-pressure calibration as first committed, with a guessed 0.4 ms per decoding sequence where the study now
# derives 0.2 (docs/study/README.md): the records in docs/eviction-cost/kv-pressure-* were measured on it.
def _with_flag(args: tuple[str, ...], flag: str, value: str) -> tuple[str, ...]:
    i = args.index(flag)
    return (*args[:i + 1], value, *args[i + 2:])


KV_PRESSURE_V1 = replace(QUICK, sim_args=_with_flag(QUICK.sim_args, "--decode-ms-per-seq", "0.4"))
CALIBRATIONS = {"kv-pressure": QUICK, "kv-pressure-v1": KV_PRESSURE_V1, "roomy": ROOMY}
DEFAULT_ARMS = [name for name in ARMS
                if name not in ("cost_resume_on_fixed", "newest_restart_lent_on", "cost_resume_on_cap60",
                                "holdback_offload", "newest_restart_offload", "cost_resume_offload",
                                "cost_resume_offload_2r", "cost_resume_offload_2r_spread")]
GOAL_RECOMPUTE_RATIO = 5.0  # newest-first restart ÷ cost-ranked resume with caching, per eviction
GOAL_COMPLETIONS_RATIO = 1.09  # eviction arm ÷ holdback alone, batch completions in the window
# "No worse" realtime p95 TTFT, judged over every round at once: the upper end of the ratio's 95% interval at
# most this. The margin is the one the study allows holdback against realtime alone (p95 within 1.05×): a
# batch sequence more in the engine step lengthens it, so "never slower at all" would forbid any batch gain.
TTFT_MARGIN = 1.05
# The TTFT comparisons judged across rounds: (candidate, baseline).
TTFT_PAIRS = (("cost_resume_on", "newest_restart_on"), ("cost_resume_on", "newest_restart_off"),
              ("cost_resume_on", "newest_restart_lent_on"), ("cost_resume_on_cap60", "newest_restart_on"),
              ("cost_resume_offload", "newest_restart_offload"), ("cost_resume_offload", "newest_restart_off"))


def attempt_tokens(stack: Stack, rows: list[dict]) -> dict:
    """Sum the per-attempt resume figures over every request that was evicted at least once."""
    headers = {"Authorization": f"Bearer {stack.admin_key}"}
    out = {"evicted_attempts": 0, "tokens_recomputed": 0, "tokens_kept": 0, "resumed_attempts": 0}
    with httpx.Client(timeout=30) as client:
        for row in rows:
            if not row.get("evictions"):
                continue
            for a in client.get(f"{stack.api_url}/admin/requests/{row['id']}/attempts", headers=headers).json()["data"]:
                out["evicted_attempts"] += a["outcome"] == "evicted"
                out["tokens_recomputed"] += a.get("tokens_recomputed", 0)
                out["tokens_kept"] += a.get("tokens_kept", 0)
                out["resumed_attempts"] += a.get("tokens_kept", 0) > 0
    return out


@dataclass(frozen=True)
class ArmFigures:
    arm: str
    policy_applied: bool
    batch_completions: int | None
    evictions: int
    tokens_recomputed: int
    tokens_kept: int
    recomputed_per_eviction: float | None
    aborted_computed_tokens: int
    p95_ttft_ms: float | None
    p95_ttft_lo_ms: float | None
    p95_ttft_hi_ms: float | None
    # Mean batch requests in flight at the gateway over the realtime window (from the run's samples): how much
    # of the pool batch used.
    batch_in_flight_mean: float | None = None
    # Diagnostic: p95 over the realtime requests sent after the opening burst drained (the study report's, bench.report.figures).
    p95_ttft_after_burst_ms: float | None = None


def arm_figures(record: dict, policy_applied: bool) -> ArmFigures:
    f = figures(record)
    got = record.get("collected") or {}
    ttfts = [r["ttft_s"] * 1000 for r in record.get("realtime", []) if r["status"] == 200 and r["ttft_s"] is not None]
    lo, hi = quantile_interval(ttfts, 0.95)
    evictions = got.get("evicted_attempts", 0)
    recomputed = got.get("tokens_recomputed", 0)
    return ArmFigures(
        arm=record["scenario"]["name"], policy_applied=policy_applied, batch_completions=f.get("batch_completions"),
        evictions=evictions, tokens_recomputed=recomputed, tokens_kept=got.get("tokens_kept", 0),
        recomputed_per_eviction=recomputed / evictions if evictions else None,
        aborted_computed_tokens=f.get("recomputed_tokens", 0), p95_ttft_ms=percentile(ttfts, 0.95),
        p95_ttft_lo_ms=lo, p95_ttft_hi_ms=hi, batch_in_flight_mean=f.get("batch_in_flight_mean"),
        p95_ttft_after_burst_ms=f.get("p95_ttft_after_burst_ms"))


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


# The per-round ratios: name -> (the ArmFigures field, numerator arm, denominator arm), in report order.
RATIOS: dict[str, tuple[str, str, str]] = {
    "recompute_restart_off_vs_resume_on": ("recomputed_per_eviction", "newest_restart_off", "cost_resume_on"),
    "recompute_restart_on_vs_resume_on": ("recomputed_per_eviction", "newest_restart_on", "cost_resume_on"),
    "recompute_restart_off_vs_resume_off": ("recomputed_per_eviction", "newest_restart_off", "cost_resume_off"),
    "recompute_restart_off_vs_resume_offload": ("recomputed_per_eviction", "newest_restart_off",
                                                "cost_resume_offload"),
    "recompute_restart_offload_vs_resume_offload": ("recomputed_per_eviction", "newest_restart_offload",
                                                    "cost_resume_offload"),
    "completions_resume_offload_vs_holdback_offload": ("batch_completions", "cost_resume_offload",
                                                       "holdback_offload"),
    "p95_ttft_resume_offload_vs_restart_offload": ("p95_ttft_ms", "cost_resume_offload", "newest_restart_offload"),
    "recompute_2r_spread_vs_2r_home": ("recomputed_per_eviction", "cost_resume_offload_2r_spread",
                                       "cost_resume_offload_2r"),
    "completions_resume_on_vs_holdback_on": ("batch_completions", "cost_resume_on", "holdback_on"),
    "completions_resume_on_cap60_vs_holdback_on": ("batch_completions", "cost_resume_on_cap60", "holdback_on"),
    "completions_resume_off_vs_holdback_off": ("batch_completions", "cost_resume_off", "holdback_off"),
    "completions_restart_off_vs_holdback_off": ("batch_completions", "newest_restart_off", "holdback_off"),
    "completions_resume_on_fixed_vs_holdback_on": ("batch_completions", "cost_resume_on_fixed", "holdback_on"),
    "p95_ttft_resume_on_vs_restart_off": ("p95_ttft_ms", "cost_resume_on", "newest_restart_off"),
    "p95_ttft_resume_on_vs_restart_on": ("p95_ttft_ms", "cost_resume_on", "newest_restart_on"),
    "p95_ttft_resume_on_fixed_vs_restart_off": ("p95_ttft_ms", "cost_resume_on_fixed", "newest_restart_off"),
    "p95_after_burst_resume_on_vs_restart_off": ("p95_ttft_after_burst_ms", "cost_resume_on", "newest_restart_off"),
}


def round_ratios(arms: dict[str, ArmFigures]) -> dict[str, float | None]:
    def value(field: str, name: str) -> float | None:
        return getattr(arms[name], field) if name in arms else None

    return {key: _ratio(value(field, a), value(field, b)) for key, (field, a, b) in RATIOS.items()}


def ttft_verdict(arms: dict[str, ArmFigures], candidate: str, baseline: str) -> str:
    """p95 TTFT of `candidate` no worse than `baseline`: decided only when the intervals do not overlap (the
    widest ratio they allow is on one side of 1)."""
    a, b = arms.get(candidate), arms.get(baseline)
    if a is None or b is None:
        return f"not run ({candidate if a is None else baseline} is not in this round)"
    if None in (a.p95_ttft_lo_ms, a.p95_ttft_hi_ms, b.p95_ttft_lo_ms, b.p95_ttft_hi_ms):
        return "undecided (too few requests)"
    ratio = ratio_of_runs(Estimate(a.p95_ttft_ms, a.p95_ttft_lo_ms, a.p95_ttft_hi_ms),
                          Estimate(b.p95_ttft_ms, b.p95_ttft_lo_ms, b.p95_ttft_hi_ms))
    return {"met": "met (better, intervals apart)", "missed": "not met (worse, intervals apart)"}.get(
        decide(ratio, 1.0, at_least=False), "undecided (intervals overlap)")


def _ttfts(record: dict) -> list[float]:
    return [r["ttft_s"] * 1000 for r in record.get("realtime", []) if r["status"] == 200 and r["ttft_s"] is not None]


def non_inferiority(estimate: tuple[float, float, float] | None, margin: float = TTFT_MARGIN) -> str:
    if estimate is None:
        return "undecided (fewer than two rounds with both arms)"
    est = Estimate(*estimate)
    decided = decide(est, margin, at_least=False)
    if decided == "met" and est.hi < 1.0:
        return "met (better: the whole interval is below 1)"
    return {"met": f"met (no worse: the interval's upper end is at most {margin})",
            "missed": f"not met (worse: the whole interval is above {margin})"}.get(
        decided, f"undecided (the interval straddles {margin})")


def run(arm_names: list[str], w: StudyWorkload, rounds: int, seed: int, out_dir: Path, first_round: int = 0) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    for r in range(first_round, first_round + rounds):
        for name in (arm_names if r % 2 == 0 else arm_names[::-1]):
            print(f"round {r + 1}/{first_round + rounds}: {name}", file=sys.stderr, flush=True)
            run_one(ARMS[name], w, r, seed + r, out_dir, collect=attempt_tokens)
    return summarize(out_dir, {"workload": asdict(w), "seed": seed})


def summarize(out_dir: Path, meta: dict | None = None) -> dict:
    """Figures of every raw record under `out_dir/raw` (a run's arms, or what an interrupted run left)."""
    by_round: dict[int, dict[str, ArmFigures]] = {}
    ttfts: dict[int, dict[str, list[float]]] = {}
    for path in record_paths(out_dir):
        record = read_record(path)
        scenario = record["scenario"]
        if scenario["name"] not in ARMS:
            continue
        applied = scenario.get("eviction_policy") is not None or not scenario["eviction"]
        by_round.setdefault(record["repeat"], {})[scenario["name"]] = arm_figures(record, applied)
        ttfts.setdefault(record["repeat"], {})[scenario["name"]] = _ttfts(record)
    results = [{"arms": {k: asdict(v) for k, v in arms.items()}, "ratios": round_ratios(arms),
                "ttft_cost_resume_on_vs_newest_restart_off": ttft_verdict(arms, "cost_resume_on",
                                                                          "newest_restart_off")}
               for _, arms in sorted(by_round.items())]
    medians = {}
    for key in (results[0]["ratios"] if results else {}):
        values = [x["ratios"][key] for x in results if x["ratios"][key] is not None]
        medians[key] = statistics.median(values) if values else None
    # Only eviction arms say whether the policy took: holdback-alone arms never name one.
    flags = [a["policy_applied"] for x in results for name, a in x["arms"].items() if ARMS[name].eviction]
    applied = all(flags) if flags else None
    pooled = {}
    for candidate, baseline in TTFT_PAIRS:
        pairs = [(arms[candidate], arms[baseline]) for arms in ttfts.values() if candidate in arms and baseline in arms]
        if pairs:
            estimate = pooled_quantile_ratio(pairs, 0.95)
            pooled[f"{candidate}_vs_{baseline}"] = {
                "rounds": len(pairs), "ratio": None if estimate is None else list(estimate),
                "verdict": non_inferiority(estimate)}
    summary = {**(meta or {}), "rounds": len(results), "policy_selectable": applied, "median_ratios": medians,
               "pooled_p95_ttft": pooled, "results": results, "goals": {"recompute_per_eviction_ratio": GOAL_RECOMPUTE_RATIO,
                                             "completions_ratio": GOAL_COMPLETIONS_RATIO,
                                             "p95_ttft_margin": TTFT_MARGIN}}
    (out_dir / "eviction_cost.json").write_text(json.dumps(summary, indent=2))
    return summary


def render(summary: dict) -> str:
    selectable = {True: "yes", False: "no (newest-first in every arm)", None: "n/a (no eviction arm)"}
    lines = [f"policy selectable by config: {selectable[summary['policy_selectable']]}",
             "", "| arm | round | completions | batch in flight | evictions | recomputed/eviction | kept | "
             "aborted-computed | p95 TTFT ms [95% interval] | p95 after the burst |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for i, res in enumerate(summary["results"]):
        for a in res["arms"].values():
            per = "—" if a["recomputed_per_eviction"] is None else f"{a['recomputed_per_eviction']:.1f}"
            ttft = "—" if a["p95_ttft_ms"] is None else f"{a['p95_ttft_ms']:.0f}"
            interval = "" if a["p95_ttft_lo_ms"] is None else f" [{a['p95_ttft_lo_ms']:.0f}, {a['p95_ttft_hi_ms']:.0f}]"
            held = "—" if a.get("batch_in_flight_mean") is None else f"{a['batch_in_flight_mean']:.1f}"
            after = "—" if a.get("p95_ttft_after_burst_ms") is None else f"{a['p95_ttft_after_burst_ms']:.0f}"
            lines.append(f"| {a['arm']} | {i + 1} | {a['batch_completions']} | {held} | {a['evictions']} | {per} | "
                         f"{a['tokens_kept']} | {a['aborted_computed_tokens']} | {ttft}{interval} | {after} |")
    lines.append("")
    for key, value in summary["median_ratios"].items():
        lines.append(f"- {key}: {'—' if value is None else f'{value:.2f}×'}")
    for i, res in enumerate(summary["results"]):
        lines.append(f"- round {i + 1} realtime p95 TTFT, cost-ranked resume (cache on) vs newest-first restart: "
                     f"{res['ttft_cost_resume_on_vs_newest_restart_off']}")
    for key, value in summary.get("pooled_p95_ttft", {}).items():
        est = value["ratio"]
        shown = "—" if est is None else f"{est[0]:.3f}× [{est[1]:.3f}, {est[2]:.3f}]"
        lines.append(f"- realtime p95 TTFT over {value['rounds']} rounds, {key}: {shown}: {value['verdict']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.eviction_cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arms", default=",".join(DEFAULT_ARMS),
                   help="comma-separated subset of: " + ", ".join(ARMS) + " (default: all but those marked "
                        "'only with --arms' above)")
    p.add_argument("--rounds", type=int, default=1, help="repeats of the whole set (default %(default)s)")
    p.add_argument("--window", type=float, default=None, help="seconds of realtime traffic per arm (quick: 60)")
    p.add_argument("--lead", type=float, default=None, help="seconds batch runs before realtime starts (quick: 8)")
    p.add_argument("--seed", type=int, default=7, help="traffic seed (default %(default)s)")
    p.add_argument("--calibration", choices=sorted(CALIBRATIONS), default="kv-pressure",
                   help="the simulator and batch lines: the study's (kv-pressure, the default) or the earlier one "
                        "whose KV never runs short (roomy)")
    p.add_argument("--first-round", type=int, default=0, metavar="N",
                   help="number the rounds from N (0-based): add rounds to a folder an earlier run wrote, with "
                        "--out, without overwriting its records (default %(default)s)")
    p.add_argument("--out", type=Path, default=None, help="results folder (default results/eviction-cost-<time>)")
    p.add_argument("--report", type=Path, metavar="DIR", help="only recompute the figures from DIR/raw/*.json")
    args = p.parse_args(argv)
    if args.report is not None:
        if not (args.report / "raw").is_dir():
            p.error(f"{args.report} has no raw/ folder: pass a folder written by this bench")
        print(render(summarize(args.report)))
        return 0
    names = [n.strip() for n in args.arms.split(",") if n.strip()]
    unknown = [n for n in names if n not in ARMS]
    if unknown:
        p.error(f"unknown arm(s) {', '.join(unknown)}; choose from {', '.join(ARMS)}")
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if args.first_round < 0:
        p.error("--first-round must be 0 or more")
    w = with_overrides(CALIBRATIONS[args.calibration], window_s=args.window, lead_s=args.lead)
    out = args.out or Path("results") / f"eviction-cost-{time.strftime('%Y%m%d-%H%M%S')}"
    taken = [f"{n}-r{r}.json" for n in names for r in range(args.first_round, args.first_round + args.rounds)
             if (out / "raw" / f"{n}-r{r}.json").exists()]
    if taken:
        p.error(f"{out}/raw already has {', '.join(taken[:3])}{' ...' if len(taken) > 3 else ''}: pass a "
                "--first-round past the rounds it holds, or another --out")
    print(render(run(names, w, args.rounds, args.seed, out, args.first_round)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
