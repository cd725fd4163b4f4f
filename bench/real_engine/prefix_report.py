"""The report of issue 50's real-engine study (bench/real_engine/prefix.py): per-group ratios between its arms,
their medians with bootstrap intervals and the goals' verdicts, the prefix cache's hit rate per arm, and the plots."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from bench.makespan import fig
from bench.report.pyplot import pyplot
from bench.stats import bootstrap_median, verdict


@dataclass(frozen=True)
class Ratio:
    """One figure of one arm ÷ the same figure of another, per group of one workload; `goal` (None: reported
    beside the goals) is met at least (`at_least`) or at most."""

    workload: str
    figure: str  # a PrefixRun field: tokens_per_step, ttft_p95, makespan
    num: str
    den: str
    goal: float | None = None
    at_least: bool = True

    @property
    def name(self) -> str:
        return f"{self.workload}: {self.figure} {self.num} ÷ {self.den}"


RATIOS = (
    Ratio("shared", "tokens_per_step", "plan", "vllm-priority", 1.3),
    Ratio("shared", "ttft_p95", "plan", "vllm-priority", 0.2, at_least=False),
    Ratio("shared", "tokens_per_step", "plan-off", "vllm-priority"),
    Ratio("shared", "tokens_per_step", "plan", "plan-off"),
    Ratio("shared", "ttft_p95", "plan-off", "vllm-priority", 0.2, at_least=False),
    Ratio("shared", "makespan", "plan", "vllm-priority", at_least=False),
    Ratio("shared", "makespan", "plan-off", "vllm-priority", at_least=False),
    Ratio("shared", "makespan", "plan", "plan-off", at_least=False),
    Ratio("shared", "tokens_per_step", "plan-off", "line-order"),
    Ratio("shared", "ttft_p95", "plan-off", "line-order", at_least=False),
    Ratio("shared", "makespan", "plan-off", "line-order", at_least=False),
    Ratio("shared", "tokens_per_step", "line-order", "vllm-priority"),
    Ratio("no-shared", "tokens_per_step", "plan", "line-order", 0.99),
    Ratio("no-shared", "ttft_p95", "plan", "line-order", at_least=False),
    Ratio("no-shared", "makespan", "plan", "line-order", at_least=False),
    Ratio("system-prompt", "tokens_per_step", "plan", "vllm-priority"),
    Ratio("system-prompt", "ttft_p95", "plan", "vllm-priority", at_least=False),
    Ratio("system-prompt", "tokens_per_step", "plan", "line-order"),
    Ratio("system-prompt", "makespan", "plan", "vllm-priority", at_least=False),
    Ratio("branched", "tokens_per_step", "plan", "vllm-priority"),
    Ratio("branched", "ttft_p95", "plan", "vllm-priority", at_least=False),
    Ratio("branched", "tokens_per_step", "plan-off", "line-order"),
    Ratio("branched", "tokens_per_step", "plan", "plan-off"),
    Ratio("branched", "makespan", "plan", "vllm-priority", at_least=False),
    # Two replicas (`--replicas 2`): the gateway's picker by prefix ÷ by load.
    Ratio("shared", "tokens_per_second", "prefix-affinity", "least-loaded", 1.3),
    Ratio("shared", "ttft_p95", "prefix-affinity", "least-loaded", at_least=False),
    Ratio("shared", "tokens_per_step", "prefix-affinity", "least-loaded"),
    Ratio("shared", "makespan", "prefix-affinity", "least-loaded", at_least=False),
    Ratio("no-shared", "tokens_per_second", "prefix-affinity", "least-loaded", 0.99),
    Ratio("no-shared", "ttft_p95", "prefix-affinity", "least-loaded", at_least=False),
)
LABELS = {"tokens_per_step": "batch tokens per engine step", "tokens_per_second": "batch tokens per second",
          "ttft_p95": "realtime p95 TTFT", "makespan": "makespan (wall clock)"}


def per_group(runs: list[dict], ratio: Ratio) -> list[float]:
    """The ratio in each group that ran both arms with a figure for each."""
    by = {(r["workload"], r["arm"], r["group"]): r for r in runs}
    out = []
    for g in sorted({r["group"] for r in runs}):
        num, den = by.get((ratio.workload, ratio.num, g)), by.get((ratio.workload, ratio.den, g))
        if num and den and num[ratio.figure] is not None and den[ratio.figure]:
            out.append(num[ratio.figure] / den[ratio.figure])
    return out


def summarise(runs: list[dict]) -> dict:
    ratios = {}
    for ratio in RATIOS:
        values = per_group(runs, ratio)
        if not values:
            continue
        est = bootstrap_median(values)
        ratios[ratio.name] = {**est.as_dict(), "per_group": values, "goal": ratio.goal, "at_least": ratio.at_least,
                              "verdict": verdict(est, ratio.goal, ratio.at_least) if ratio.goal else None}
    hit_rate, evictions, ahead = {}, {}, {}
    for workload, arm in sorted({(r["workload"], r["arm"]) for r in runs}):
        mine = [r for r in runs if (r["workload"], r["arm"]) == (workload, arm)]
        hit_rate[f"{workload}: {arm}"] = {**bootstrap_median([r["hit_rate"] for r in mine]).as_dict(),
                                          "per_group": [r["hit_rate"] for r in mine]}
        if arm != "vllm-priority":
            evictions[f"{workload}: {arm}"] = [r["evictions"] for r in mine]
            ahead[f"{workload}: {arm}"] = [r.get("cached_first", 0) for r in mine]
    return {"groups": len({r["group"] for r in runs}), "ratios": ratios, "hit_rate": hit_rate,
            "lines_failed": sum(r["lines_failed"] for r in runs),
            "realtime_failed": sum(r["realtime_failed"] for r in runs), "evictions_per_group": evictions,
            "cached_first_per_group": ahead}


def markdown(summary: dict, args: argparse.Namespace) -> str:
    head = (f"Batches planned for the prefix cache ({args.engine}; {args.documents} documents of {args.doc_words} "
            f"words × {args.questions} questions, {args.max_tokens} output tokens each; KV pool {args.kv_blocks} "
            f"blocks, step budget {args.step_tokens} tokens, {args.slots} slots, {getattr(args, 'replicas', 1)} "
            f"replica(s); realtime {args.rate}/s; {summary['groups']} groups)")
    rows = ["| figure | median [95% interval] | per group | goal | verdict |", "|---|---|---|---|---|"]
    for name, e in summary["ratios"].items():
        goal = "—" if e["goal"] is None else f"{'≥' if e['at_least'] else '≤'} {e['goal']}"
        rows.append(f"| {name} | {fig(e)} | {', '.join(f'{x:.3f}' for x in e['per_group'])} | {goal} | "
                    f"{e['verdict'] or '—'} |")
    hits = ["| workload: arm | prefix-cache hit rate (median) | per group |", "|---|---|---|"]
    hits += [f"| {name} | {fig(e)} | {', '.join(f'{x:.3f}' for x in e['per_group'])} |"
             for name, e in summary["hit_rate"].items()]
    tail = (f"lines not completed {summary['lines_failed']}; realtime without a first token "
            f"{summary['realtime_failed']}; evictions per group {summary['evictions_per_group']}; requests sent "
            f"ahead by cached-first dispatch per group {summary['cached_first_per_group']}")
    return "\n".join([head, "", *rows, "", *hits, "", tail])


def make_plots(out_dir: Path, summary: dict, runs: list[dict]) -> list[str]:
    """The ratios (each group a dot, the median a bar with its interval, the goal dashed) and the hit rates;
    the file names written into `out_dir`."""
    plt = pyplot()
    panels = [(figure, figure == "ttft_p95") for figure in LABELS
              if any(f": {figure} " in name for name in summary["ratios"])]
    fig_, grid = plt.subplots(1, len(panels) + 1, figsize=(5 * (len(panels) + 1), 5.2), squeeze=False)
    axes = grid[0]
    for ax, (figure, log) in zip(axes, panels):
        _ratio_panel(ax, summary, figure, log)
    _hit_panel(axes[-1], summary)
    fig_.tight_layout()
    fig_.savefig(out_dir / "prefix_ratios.png", dpi=110)
    plt.close(fig_)
    return ["prefix_ratios.png"]


def _ratio_panel(ax, summary: dict, figure: str, log: bool) -> None:
    chosen = [(n, e) for n, e in summary["ratios"].items() if f": {figure} " in n]
    for i, (name, e) in enumerate(chosen):
        ax.bar(i, e["value"], color="#3b6fb6", alpha=0.35)
        if e.get("lo") is not None:
            ax.errorbar(i, e["value"], yerr=[[e["value"] - e["lo"]], [e["hi"] - e["value"]]], color="black",
                        capsize=4)
        ax.scatter([i] * len(e["per_group"]), e["per_group"], color="#3b6fb6", zorder=3, s=14)
        if e["goal"] is not None:
            ax.hlines(e["goal"], i - 0.4, i + 0.4, colors="#c0392b", linestyles="dashed")
    ax.axhline(1.0, color="grey", linewidth=0.6)
    ax.set_xticks(range(len(chosen)))
    ax.set_xticklabels([n.replace(f" {figure} ", "\n").replace(" ÷ ", "\n÷ ") for n, _ in chosen], fontsize=7)
    ax.set_title(f"{LABELS[figure]}, ratio", fontsize=10)
    if log:
        ax.set_yscale("log")


def _hit_panel(ax, summary: dict) -> None:
    names = list(summary["hit_rate"])
    for i, name in enumerate(names):
        e = summary["hit_rate"][name]
        ax.bar(i, e["value"], color="#d07a2b", alpha=0.5)
        ax.scatter([i] * len(e["per_group"]), e["per_group"], color="#d07a2b", zorder=3, s=14)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels([n.replace(": ", "\n") for n in names], fontsize=7)
    ax.set_ylim(0, 1)
    ax.set_title("prefix-cache hit rate (vLLM's hits ÷ queries)", fontsize=10)
