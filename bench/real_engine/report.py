"""The real-engine study's report (bench/real_engine/study.py): each arm's figures from the records, its tables in
Markdown, and how far the simulator's ratios are from the engine's."""

from __future__ import annotations

import argparse
import random
import statistics
from dataclasses import asdict

from bench.real_engine.traffic import Arm, Record
from bench.stats import BOOTSTRAP_SAMPLES, BOOTSTRAP_SEED, bootstrap_median, central_95, percentile, verdict


def summarise(records: list[Record], arm_list: list[Arm]) -> dict:
    """Per arm: the per-repeat figures, and the medians of the per-repeat ratios with their intervals. A repeat is
    one group: the arm and the two baselines run next to each other in time, so a ratio compares runs that met
    the same machine (its speed drifts by a fifth within a minute where other machines share its cores)."""
    groups: dict[int, dict[str, Record]] = {}
    for r in records:
        groups.setdefault(r.group, {})[r.arm] = r
    out: dict = {}
    for arm in arm_list:
        mine = [(g[arm.name], g) for _, g in sorted(groups.items()) if arm.name in g]
        lat, work, tokens, vs_vllm, per_step = [], [], [], [], []
        for rec, group in mine:
            alone, vllm = group.get("realtime-only"), group.get("vllm-priority")
            if alone is not None:
                lat.append(percentile(rec.ttft, 0.95) / percentile(alone.ttft, 0.95))
            if vllm is not None:
                vs_vllm.append(percentile(rec.ttft, 0.95) / percentile(vllm.ttft, 0.95))
            if vllm is not None and arm.batch and vllm.batch_completed:
                work.append(rec.batch_completed / vllm.batch_completed)
                tokens.append(rec.batch_tokens / vllm.batch_tokens)
                if rec.steps and vllm.steps and vllm.batch_tokens:
                    per_step.append((rec.batch_tokens / rec.steps) / (vllm.batch_tokens / vllm.steps))
        recs = [rec for rec, _ in mine]
        latency, completed, produced = bootstrap_median(lat), bootstrap_median(work), bootstrap_median(tokens)
        stepped = bootstrap_median(per_step)
        out[arm.name] = {
            "title": arm.title, "p95_ms": [round(percentile(r.ttft, 0.95) * 1000, 1) for r in recs],
            "batch_completed": [r.batch_completed for r in recs], "evictions": [r.evictions for r in recs],
            "realtime_failed": [r.realtime_failed for r in recs], "batch_failed": [r.batch_failed for r in recs],
            "batch_tokens": [r.batch_tokens for r in recs], "steps": [r.steps for r in recs],
            "tokens_per_step_ratio": asdict(stepped),
            "p95_ratio": asdict(latency), "batch_ratio": asdict(completed), "tokens_ratio": asdict(produced),
            "p95_vs_vllm": asdict(bootstrap_median(vs_vllm)),
            "cpu": {role: round(statistics.median(r.cpu.get(role, 0.0) for r in recs), 3)
                    for role in sorted({role for r in recs for role in r.cpu})},
            "verdict_p95": verdict(latency, 1.25, at_least=False) if arm.batch else None,
            "verdict_batch": verdict(completed, 1.0, at_least=True) if arm.batch else None,
            "verdict_tokens": verdict(produced, 1.0, at_least=True) if arm.batch else None,
            "verdict_per_step": verdict(stepped, 1.0, at_least=True) if arm.batch and per_step else None,
            # The per-group ratios themselves: the simulator's fidelity resamples them.
            "per_group": {"p95_ratio": lat, "batch_ratio": work, "tokens_ratio": tokens,
                          "tokens_per_step_ratio": per_step},
        }
    return out


FIDELITY_KEYS = ("p95_ratio", "batch_ratio", "tokens_ratio", "tokens_per_step_ratio")
FIDELITY_BOUND = 0.15


def fidelity(engine: dict, sim: dict, samples: int = BOOTSTRAP_SAMPLES, seed: int = BOOTSTRAP_SEED) -> dict:
    """Arm by arm, each of the simulator's ratios ÷ the engine's (goal: within 15%), with a 95% interval: the
    engine's groups and the simulator's are resampled apart (they ran at different times), and the median of each
    draw divided. A verdict is decided only when the whole interval lies within 15% of 1, or outside it: a p95 is
    a tail, and the engine's groups alone often spread wider than the 15% asked of the simulator."""
    out = {}
    for name, e in engine.items():
        s = sim.get(name)
        if s is None:
            continue
        row: dict = {}
        verdicts = []
        for key in FIDELITY_KEYS:
            ev, sv = e.get(key, {}).get("value"), s.get(key, {}).get("value")
            if not ev or sv is None:
                row[key] = None
                continue
            ratio = {"value": round(sv / ev, 3), "lo": None, "hi": None}
            eg, sg = e.get("per_group", {}).get(key, []), s.get("per_group", {}).get(key, [])
            if len(eg) >= 2 and len(sg) >= 2:
                rng = random.Random(seed)
                lo, hi = central_95(
                    statistics.median(rng.choices(sg, k=len(sg))) / statistics.median(rng.choices(eg, k=len(eg)))
                    for _ in range(samples))
                ratio["lo"], ratio["hi"] = round(lo, 3), round(hi, 3)
            row[key] = ratio
            verdicts.append(_within(ratio))
        row["within_15pct"] = ("no" if "no" in verdicts else "undecided" if "undecided" in verdicts else "yes")
        out[name] = row
    return out


def _within(ratio: dict) -> str:
    """yes / no when the interval (the point, with none) lies within 15% of 1 or wholly outside; else undecided."""
    lo = ratio["value"] if ratio["lo"] is None else ratio["lo"]
    hi = ratio["value"] if ratio["hi"] is None else ratio["hi"]
    if 1 - FIDELITY_BOUND <= lo and hi <= 1 + FIDELITY_BOUND:
        return "yes"
    if hi < 1 - FIDELITY_BOUND or lo > 1 + FIDELITY_BOUND:
        return "no"
    return "undecided"


def _ratio(r: dict | None) -> str:
    if r is None:
        return "—"
    return str(r["value"]) if r["lo"] is None else f"{r['value']} [{r['lo']}, {r['hi']}]"


def _fig(est: dict) -> str:
    if est.get("value") is None:
        return "—"
    if est.get("lo") is None:
        return f"{est['value']:.2f}"
    return f"{est['value']:.2f} [{est['lo']:.2f}, {est['hi']:.2f}]"


def table(summary: dict) -> list[str]:
    lines = ["| arm | realtime p95 per repeat (ms) | p95 ÷ alone | p95 ÷ vLLM priority | batch done per repeat | "
             "batch done ÷ vLLM priority | batch tokens ÷ vLLM priority | batch tokens per engine step ÷ vLLM "
             "priority's | evictions | verdicts (p95 ≤ 1.25; done, tokens, tokens per step ≥ 1.0) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for a in summary.values():
        verdicts = (f"{a['verdict_p95']}; {a['verdict_batch']}; {a.get('verdict_tokens')}; "
                    f"{a.get('verdict_per_step') or '—'}" if a["verdict_p95"] else "—")
        lines.append(f"| {a['title']} | {', '.join(str(p) for p in a['p95_ms'])} | {_fig(a['p95_ratio'])} | "
                     f"{_fig(a['p95_vs_vllm'])} | "
                     f"{', '.join(str(b) for b in a['batch_completed'])} | {_fig(a['batch_ratio'])} | "
                     f"{_fig(a.get('tokens_ratio', {}))} | {_fig(a.get('tokens_per_step_ratio', {}))} | "
                     f"{', '.join(str(e) for e in a['evictions'])} | {verdicts} |")
    return lines


def cpu_table(summary: dict) -> list[str]:
    """Cores each of the study's processes used over an arm's runs (lead included), medians over the runs."""
    roles = sorted({role for a in summary.values() for role in a.get("cpu", {})})
    if not roles:
        return []
    lines = ["", "Cores used over a run (medians over its runs; the machine has 2):", "",
             "| arm | " + " | ".join(roles) + " | all |", "|---" * (len(roles) + 2) + "|"]
    for a in summary.values():
        cpu = a.get("cpu", {})
        lines.append(f"| {a['title']} | " + " | ".join(f"{cpu.get(r, 0.0):.2f}" for r in roles)
                     + f" | {sum(cpu.values()):.2f} |")
    return lines


def markdown(result: dict, args: argparse.Namespace, engine_cpu: int, relay_cpu: int, plots: list[str]) -> str:
    blocks = f" --block-size {args.block_size}" if getattr(args, "block_size", None) else ""
    replicas = getattr(args, "replicas", 1)
    if getattr(args, "unpinned", False):
        placed = "unpinned: the engine, the gateway and the load share both cores. "
    elif replicas > 1:
        placed = (f"each pinned to a core of its own (CPUs {engine_cpu}–{engine_cpu + replicas - 1}); the gateway and "
                  "the load run beside them, unpinned; with no gateway, each request goes to the next replica in "
                  "turn. ")
    else:
        placed = f"pinned to CPU {engine_cpu}; gateway and load on CPU {relay_cpu}. "
    lines = [("One vLLM replica" if replicas == 1 else f"{replicas} vLLM replicas")
             + f" (CPU build, tiny model, `--max-num-seqs {args.slots} --scheduling-policy priority{blocks}`) "
             + placed
             + f"Realtime: burst {args.burst} + "
             f"Poisson {args.rate}/s for {args.window:.0f} s, 8 tokens streamed. Batch: {args.batch_inflight} in "
             f"flight, {args.batch_tokens[0]}–{args.batch_tokens[1]} tokens, resumed when evicted. {args.rounds} "
             f"rounds on the engine" + ("" if getattr(args, "no_sim", False) else f" ({args.sim_rounds} on the "
                                        "simulator)") + ", each arm run in a group with the two "
             "baselines next to it in time; medians of the per-group ratios with 95% bootstrap intervals. The "
             "study's processes "
             + ("ran at nice −15, their sessions too (ahead of other work on the machine)."
                if result.get("favoured") else "could not be favoured over other work (not root)."),
             "", "### The engine", "",
             *table(result["engine"]), *cpu_table(result["engine"])]
    if "sim" in result:
        t = result["timing"]
        lines += ["", f"### The simulator, fitted to the engine (prefill {t.get('prefill_base_ms', 0.0):.2f} ms + "
                  f"{t.get('prefill_ms_per_seq', 0.0):.2f} ms/request + {t['prefill_ms_per_token']:.4f} ms/token, "
                  f"decode {t['decode_base_ms']:.2f} ms + {t['decode_ms_per_seq']:.3f} ms/sequence)", "",
                  *table(result["sim"]), "",
                  "| arm | sim ÷ engine: p95 ratio | batch done ratio | batch tokens ratio | tokens per step ratio | "
                  "within 15% (yes: every interval lies within; no: one lies outside; else undecided) |",
                  "|---|---|---|---|---|---|"]
        for name, row in result["fidelity"].items():
            lines.append(f"| {result['engine'][name]['title']} | "
                         + " | ".join(_ratio(row[key]) for key in FIDELITY_KEYS) + f" | {row['within_15pct']} |")
    if plots:
        lines += ["", "### Plots", "", *(f"![{p}]({p})" for p in plots)]
    return "\n".join(lines) + "\n"
