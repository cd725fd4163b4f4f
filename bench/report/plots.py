"""The study's PNG plots: p95 TTFT and batch completions by scenario, the reserve sweep, TTFT over time at 25%
reserve, and the occupancy line."""

from __future__ import annotations

from pathlib import Path

from bench.report.pyplot import pyplot
from bench.report.seed import SEED
from bench.report.summary import FIXED_RESERVE_RUNS, SWEEP
from bench.study import SCENARIOS


SHORT = {
    "realtime_only": "realtime\nonly", "no_controls": "no\ncontrols", "holdback_50": "holdback\n50%",
    "holdback_50_evict": "holdback 50%\n+ eviction", "reserve_25_evict": "reserve 25%\n+ eviction",
    "reserve_75_evict": "reserve 75%\n+ eviction", "reserve_25_noevict": "reserve 25%\neviction off",
    "two_replicas": "two replicas\n50% + evict", "standard_check": "standard\nreclaims",
    "adaptive_evict": "adaptive\n+ eviction", "batch_alone": "batch\nalone",
    "evict_newest_restart": "newest\nrestart", "evict_cost_resume": "cost-ranked\nresume",
    "evict_newest_restart_cache": "newest restart\n+ cache", "evict_cost_resume_cache": "cost resume\n+ cache",
}


def make_plots(out_dir: Path, records: list[dict], summary: dict[str, dict],
               run_figs: list[dict] | None = None, occ: dict | None = None) -> list[str]:
    plt = pyplot()
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
