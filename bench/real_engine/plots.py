"""The real-engine study's PNG plots, drawn from its summary and raw records: each arm's two goal ratios per group
with their median and 95% interval, the realtime TTFT distribution of every arm, and (with the simulator run)
how far the simulator's ratios are from the engine's."""

from __future__ import annotations

import math
from pathlib import Path

from bench.real_engine.traffic import Record
from bench.report.pyplot import pyplot

ENGINE_COLOUR, SIM_COLOUR = "#3b6fb6", "#d07a2b"


def make_plots(out_dir: Path, result: dict, records: list[Record]) -> list[str]:
    """Write the plots into `out_dir`; their file names, for the report."""
    plt = pyplot()
    made = [_goal_ratios(plt, out_dir, result)]
    made.append(_ttft_distribution(plt, out_dir, result["engine"], [r for r in records if r.engine == "vllm"]))
    if result.get("fidelity"):
        made.append(_fidelity(plt, out_dir, result))
    return made


def _save(plt, fig, out_dir: Path, name: str) -> str:
    fig.tight_layout()
    fig.savefig(out_dir / name, dpi=110)
    plt.close(fig)
    return name


def _short(title: str) -> str:
    """An arm's title wrapped for an axis label."""
    words, lines, line = title.split(), [], ""
    for w in words:
        if line and len(line) + len(w) > 22:
            lines.append(line)
            line = w
        else:
            line = f"{line} {w}".strip()
    return "\n".join(lines + [line])


def _goal_ratios(plt, out_dir: Path, result: dict) -> str:
    """Realtime p95 ÷ realtime alone, batch done and batch tokens per engine step ÷ vLLM priority: each group a
    dot, the median a bar with its interval, the goal a dashed line."""
    panels = [("p95_ratio", "realtime p95 ÷ realtime alone", 1.25, True),
              ("batch_ratio", "batch done ÷ vLLM priority alone", 1.0, False),
              ("tokens_per_step_ratio", "batch tokens per engine step ÷ vLLM priority's", 1.0, False)]
    runs = [("engine", ENGINE_COLOUR, -0.15)] + ([("sim", SIM_COLOUR, 0.15)] if "sim" in result else [])
    names = [n for n, a in result["engine"].items() if a["verdict_p95"] is not None]  # not realtime alone
    # The engine's steps are scraped from vLLM: runs recorded before that have no per-step panel.
    panels = [p for p in panels if any(result["engine"][n]["per_group"].get(p[0]) for n in names)]
    fig, axes = plt.subplots(1, len(panels), figsize=(max(5.0 * len(panels), 3.3 * len(names)), 4.8))
    for ax, (key, label, goal, log) in zip(axes, panels):
        for run, colour, shift in runs:
            for i, name in enumerate(names):
                arm = result[run].get(name)
                if arm is None:
                    continue
                points = [v for v in arm["per_group"].get(key, []) if math.isfinite(v)]
                ax.scatter([i + shift] * len(points), points, s=14, color=colour, alpha=0.6, zorder=3)
                est = arm[key]
                if est.get("value") is not None and est.get("lo") is not None:
                    ax.errorbar(i + shift, est["value"], yerr=[[est["value"] - est["lo"]], [est["hi"] - est["value"]]],
                                fmt="_", markersize=16, color=colour, capsize=4, zorder=4,
                                label=run if i == 0 else None)
        ax.axhline(goal, ls="--", color="#444444", lw=1, label=f"goal {'≤' if log else '≥'} {goal}")
        if log:
            ax.set_yscale("log")
        ax.set_xticks(range(len(names)), [_short(result["engine"][n]["title"]) for n in names], fontsize=7)
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    fig.suptitle("Each group (dots) and the median with its 95% interval (bars)")
    return _save(plt, fig, out_dir, "goal_ratios.png")


def _ttft_distribution(plt, out_dir: Path, engine: dict, records: list[Record]) -> str:
    """Each arm's realtime TTFT over all its runs, as the share of requests answered by a time (log scale)."""
    fig, ax = plt.subplots(figsize=(8.5, 4.8))
    for name, arm in engine.items():
        ttft = sorted(t * 1000 for r in records if r.arm == name for t in r.ttft if math.isfinite(t))
        if not ttft:
            continue
        ax.step(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], where="post", label=arm["title"], lw=1.4)
    ax.axhline(0.95, ls=":", color="#444444", lw=1)
    ax.set_xscale("log")
    ax.set_xlabel("realtime time to first token (ms)")
    ax.set_ylabel("share of realtime requests")
    ax.set_title("Realtime TTFT on the engine, every run of each arm")
    ax.legend(fontsize=7, loc="lower right")
    return _save(plt, fig, out_dir, "ttft_cdf.png")


def _fidelity(plt, out_dir: Path, result: dict) -> str:
    """The simulator's ratio ÷ the engine's, per arm and figure, with its interval; the 15% band shaded."""
    keys = [("p95_ratio", "p95 ratio"), ("batch_ratio", "batch done"), ("tokens_per_step_ratio", "tokens per step")]
    names = list(result["fidelity"])
    fig, ax = plt.subplots(figsize=(max(8.0, 1.8 * len(names)), 4.5))
    ax.axhspan(0.85, 1.15, color="#d8ead2", label="within 15%")
    width = 0.8 / len(keys)
    for k, (key, label) in enumerate(keys):
        for i, name in enumerate(names):
            r = result["fidelity"][name].get(key)
            if r is None:
                continue
            x = i - 0.4 + width * (k + 0.5)
            lo, hi = (r["value"], r["value"]) if r["lo"] is None else (r["lo"], r["hi"])
            ax.errorbar(x, r["value"], yerr=[[r["value"] - lo], [hi - r["value"]]], fmt="o", capsize=3,
                        color=f"C{k}", label=label)
            label = None  # one legend entry per figure
    ax.axhline(1.0, color="#444444", lw=1)
    ax.set_xticks(range(len(names)), [_short(result["engine"][n]["title"]) for n in names], fontsize=7)
    ax.set_ylabel("simulator ÷ engine")
    ax.set_title("Simulator fidelity: each ratio's simulator ÷ engine, with its 95% interval")
    ax.legend(fontsize=8)
    return _save(plt, fig, out_dir, "fidelity.png")
