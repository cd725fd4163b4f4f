"""The KV drills' report on the real engine (bench/real_engine/kv_drills.py): from raw/runs.json, per drill and
across its groups, the issue's goals (#47) with each ratio's median over the groups and a bootstrap interval.

Ratios are taken within a group (four arms run next to each other): preemptions with admission on ÷ off (vLLM's
counter; the sums over the groups, since off may be 0 in a group), batch output tokens per engine step on ÷ vLLM
alone, realtime p95 TTFT on ÷ realtime alone (and vLLM alone's, for comparison), and the ledger's reserved blocks
÷ vLLM's used blocks over the 100 ms samples with admission on where vLLM used any (median; and the worst sample
where the ledger held fewer blocks than vLLM used, against one request's blocks).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from bench.stats import bootstrap_median, percentile

ARMS = ("realtime-alone", "vllm-alone", "admission-off", "admission-on")

# The largest request of the drills (900 prompt + 600 output tokens) in 128-token blocks.
ONE_REQUEST_BLOCKS = math.ceil(1500 / 128)


def runs_of(raw: dict, drill: str, arm: str) -> dict[int, dict]:
    """One drill's runs of one arm, by group."""
    return {r["group"]: r for r in raw["runs"] if r["drill"] == drill and r["arm"] == arm}


def _p95(run: dict) -> float | None:
    return percentile(run["ttft"], 0.95) if run["ttft"] else None


def _tokens_per_step(run: dict) -> float | None:
    return run["batch_tokens"] / run["steps"] if run.get("steps") else None


def _ratios(num: dict[int, dict], den: dict[int, dict], figure) -> list[float]:
    out = []
    for group in sorted(set(num) & set(den)):
        a, b = figure(num[group]), figure(den[group])
        if a is not None and b and math.isfinite(a) and math.isfinite(b):
            out.append(a / b)
    return out


def _median(values: list[float]) -> str:
    if not values:
        return "n/a"
    est = bootstrap_median(values)
    interval = f" [{est.lo:.2f}, {est.hi:.2f}]" if est.lo is not None and len(values) > 1 else ""
    return f"{est.value:.2f}{interval} (n={len(values)})"


def ledger_gap(runs: dict[int, dict]) -> dict:
    """Reserved ÷ used over the samples within the drill's window where vLLM used blocks and the gateway
    answered, and the worst shortfall; also the worst over the whole run. After the window the bench closes its
    batch streams at once: the gateway releases their blocks then, vLLM at its next step and its gauge after,
    so a sample there can show the ledger a whole batch under vLLM's usage while that KV is being freed."""
    ratios, worst_under, worst_any = [], 0.0, 0.0
    for run in runs.values():
        lo, hi = run.get("window") or (-math.inf, math.inf)
        for t, reserved, used in run["samples"]:
            if reserved is None or not used:
                continue
            worst_any = max(worst_any, used - reserved)
            if lo <= t <= hi:
                ratios.append(reserved / used)
                worst_under = max(worst_under, used - reserved)
    ratios.sort()
    return {"samples": len(ratios), "median": ratios[len(ratios) // 2] if ratios else None,
            "worst_under_blocks": round(worst_under, 2), "worst_under_blocks_whole_run": round(worst_any, 2)}


def summarise(raw: dict) -> dict:
    drills = sorted({r["drill"] for r in raw["runs"]}, key=lambda d: [r["drill"] for r in raw["runs"]].index(d))
    out = {}
    for drill in drills:
        arm = {a: runs_of(raw, drill, a) for a in ("realtime-alone", "vllm-alone", "admission-off", "admission-on")}
        pre = {a: sum(r["preemptions"] or 0 for r in arm[a].values()) for a in ("vllm-alone", "admission-off",
                                                                                "admission-on")}
        out[drill] = {
            "groups": len(arm["admission-on"]),
            "preemptions": pre,
            "preemptions_on_over_off": (pre["admission-on"] / pre["admission-off"]) if pre["admission-off"] else None,
            "batch_per_step_on_over_alone": _ratios(arm["admission-on"], arm["vllm-alone"], _tokens_per_step),
            "batch_per_step_off_over_alone": _ratios(arm["admission-off"], arm["vllm-alone"], _tokens_per_step),
            "p95_on_over_alone": _ratios(arm["admission-on"], arm["realtime-alone"], _p95),
            "p95_vllm_over_alone": _ratios(arm["vllm-alone"], arm["realtime-alone"], _p95),
            "p95_off_over_alone": _ratios(arm["admission-off"], arm["realtime-alone"], _p95),
            "p95_ms": {a: [round(_p95(r) * 1000, 1) if _p95(r) is not None and math.isfinite(_p95(r)) else None
                           for _, r in sorted(arm[a].items())] for a in arm},
            "realtime_refused": {a: [r["realtime_refused"] for _, r in sorted(arm[a].items())] for a in arm},
            "other": {a: [r["other"] for _, r in sorted(arm[a].items())] for a in arm},
            "batch_refused_evicted": {a: [(r["batch_refused"], r["batch_evicted"]) for _, r in sorted(arm[a].items())]
                                      for a in arm},
            "ledger_gap": ledger_gap(arm["admission-on"]),
        }
        tuned = runs_of(raw, drill, "admission-tuned")
        if tuned:
            out[drill]["tuned"] = {
                "preemptions": sum(r["preemptions"] or 0 for r in tuned.values()),
                "batch_per_step_over_alone": _ratios(tuned, arm["vllm-alone"], _tokens_per_step),
                "batch_per_step_over_on": _ratios(tuned, arm["admission-on"], _tokens_per_step),
                "p95_over_alone": _ratios(tuned, arm["realtime-alone"], _p95),
                "ledger_gap": ledger_gap(tuned)}
    return out


def _verdict(values: list[float], goal: float, at_least: bool) -> str:
    if not values:
        return "n/a"
    values = sorted(values)
    mid = values[len(values) // 2]
    return "met" if (mid >= goal if at_least else mid <= goal) else "missed"


def markdown(raw: dict, summary: dict) -> str:
    args = raw["args"]
    lines = ["# The KV drills on a real vLLM (issue #47)", "",
             f"`python -m bench.real_engine.kv_drills --groups {args['groups']} --window {args['window']}"
             + (f" --arms {args['arms']}" if args.get("arms", ",".join(ARMS)) != ",".join(ARMS) else "")
             + (f" --tuned '{args['tuned']}'" if args.get("tuned") else "") + "` "
             f"(seed {args['seed']}): one vLLM 0.32 CPU engine, tiny model, {raw['engine']['kv_blocks']} KV blocks "
             f"of {raw['engine']['block_size']} tokens, {raw['engine']['slots']} slots, priority scheduling, pinned "
             f"to CPU {raw['engine']['cpu']}; gateways and load on the other CPU (favoured with nice: "
             f"{raw['favoured']}). The machine was shared with other work while it ran: ratios are taken within "
             "a group of runs of every arm next to each other. Raw records: `raw/runs.json`; the method: "
             "bench/real_engine/kv_drills.py.", "",
             "| drill | preemptions alone / off / on (sum) | on ÷ off (goal ≤ 0.1) | batch tokens/step on ÷ alone "
             "(≥ 0.9) | off ÷ alone | realtime p95 on ÷ alone (≤ 1.25) | vLLM alone ÷ alone | off ÷ alone | "
             "ledger ÷ vLLM used, median (within 10%) | worst under in the window, whole run (blocks; one "
             f"request = {ONE_REQUEST_BLOCKS}) |", "|" + "---|" * 10]
    for drill, s in summary.items():
        pre = s["preemptions"]
        ratio = s["preemptions_on_over_off"]
        gap = s["ledger_gap"]
        gap_median = "n/a" if gap["median"] is None else f"{gap['median']:.2f}"
        lines.append(
            f"| {drill} | {pre['vllm-alone']:.0f} / {pre['admission-off']:.0f} / {pre['admission-on']:.0f} | "
            f"{'n/a (off: 0 or not run)' if ratio is None else f'{ratio:.2f}'} | "
            f"{_median(s['batch_per_step_on_over_alone'])} {_verdict(s['batch_per_step_on_over_alone'], 0.9, True)} | "
            f"{_median(s['batch_per_step_off_over_alone'])} | "
            f"{_median(s['p95_on_over_alone'])} {_verdict(s['p95_on_over_alone'], 1.25, False)} | "
            f"{_median(s['p95_vllm_over_alone'])} | {_median(s['p95_off_over_alone'])} | "
            f"{gap_median} ({gap['samples']} samples) | "
            f"{gap['worst_under_blocks']}, {gap['worst_under_blocks_whole_run']} |")
    tuned = {drill: s["tuned"] for drill, s in summary.items() if "tuned" in s}
    if tuned:
        lines += ["", f"Admission on with `{args.get('tuned')}` (arm admission-tuned), in the same groups:", "",
                  "| drill | preemptions (sum) | batch tokens/step ÷ vLLM alone | ÷ admission on | realtime p95 ÷ "
                  "alone | ledger ÷ vLLM used, median | worst under in the window, whole run (blocks) |", "|" + "---|" * 7]
        for drill, t in tuned.items():
            gap = t["ledger_gap"]
            gap_median = "n/a" if gap["median"] is None else f"{gap['median']:.2f}"
            lines.append(f"| {drill} | {t['preemptions']:.0f} | {_median(t['batch_per_step_over_alone'])} | "
                         f"{_median(t['batch_per_step_over_on'])} | {_median(t['p95_over_alone'])} | "
                         f"{gap_median} ({gap['samples']} samples) | {gap['worst_under_blocks']}, "
                         f"{gap['worst_under_blocks_whole_run']} |")
    lines += ["", "Per run (group order): realtime p95 TTFT in ms, realtime refusals by status, the drill's own "
              "requests by status, batch (refused, evicted):", ""]
    for drill, s in summary.items():
        lines.append(f"- **{drill}**: p95 ms {json.dumps(s['p95_ms'])}; realtime refused "
                     f"{json.dumps(s['realtime_refused'])}; drill requests {json.dumps(s['other'])}; batch "
                     f"{json.dumps(s['batch_refused_evicted'])}")
    return "\n".join(lines) + "\n"


def write_report(out: Path) -> str:
    raw = json.loads((out / "raw" / "runs.json").read_text())
    summary = summarise(raw)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    # Imported here: the plots take this module's figures, and summarising needs no matplotlib.
    from bench.real_engine import kv_drills_plots

    plots = kv_drills_plots.make_plots(out, raw, summary)
    text = markdown(raw, summary) + "\n".join(kv_drills_plots.markdown(plots)) + "\n"
    (out / "report.md").write_text(text)
    return text
