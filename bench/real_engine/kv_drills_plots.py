"""The KV drills' plots on the real engine (issue #47), drawn from raw/runs.json and the report's own figures
(bench/real_engine/kv_drills_report.py): per drill, one group's KV blocks over time, vLLM alone against admission
on, with the pool and the watermarks; and every drill's goal ratios, each group a dot, the median a bar."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from bench.real_engine.kv_drills_report import ledger_gap, runs_of
from bench.report.drills import WATERMARKS
from bench.report.pyplot import pyplot
from bench.stats import Estimate, bootstrap_median

ALONE_COLOUR, ON_COLOUR, TUNED_COLOUR = "#d07a2b", "#3b6fb6", "#5a9e4b"
WINDOW_COLOUR = "#eeeeee"
# The group drawn over time: one group's runs are next to each other; averaging groups would smear the steps.
SHOWN_GROUP = 0


@dataclass(frozen=True)
class Goal:
    """One panel of the goal figure: the summary's per-group ratios (by arm) and where the goal lies."""

    name: str
    label: str
    on_key: str  # in the drill's summary, admission on
    tuned_key: str  # in its "tuned" part
    band: tuple[float, float]  # the ratios that meet the goal


GOALS = (
    Goal("batch", "batch tokens per engine step\nadmission ÷ vLLM alone (goal ≥ 0.9)", "batch_per_step_on_over_alone",
         "batch_per_step_over_alone", (0.9, float("inf"))),
    Goal("p95", "realtime p95 TTFT\nadmission ÷ realtime alone (goal ≤ 1.25)", "p95_on_over_alone", "p95_over_alone",
         (0.0, 1.25)),
    Goal("ledger", "ledger's reserved ÷ vLLM's used blocks\n(goal within 10%)", "ledger_gap", "ledger_gap", (0.9, 1.1)),
)


def make_plots(out: Path, raw: dict, summary: dict) -> list[str]:
    """Write the plots into `out`; their file names, for the report."""
    plt = pyplot()
    made = [name for drill in summary if (name := _blocks_over_time(plt, out, raw, drill))]
    return made + [_goal_ratios(plt, out, raw, summary)]


def markdown(names: list[str]) -> list[str]:
    """The report's lines linking the plots."""
    lines = ["", f"Plots: per drill, group {SHOWN_GROUP}'s KV blocks every 100 ms, vLLM alone and with admission on "
             "(vLLM's used, the ledger's reserved), seconds from the drill's window (shaded); and the goal ratios, "
             "each group a dot, the median with its 95% bootstrap interval a bar (the ledger's bar: the table's "
             "median over all the groups' samples in the window, without an interval).", ""]
    for name in names:
        lines += [f"![{Path(name).stem}]({name})", ""]
    return lines[:-1]


def _save(plt, fig, out: Path, name: str, tight: bool = True) -> str:
    if tight:
        fig.tight_layout()
    fig.savefig(out / name, dpi=100)
    plt.close(fig)
    return name


def _series(run: dict, index: int) -> tuple[list[float], list[float]]:
    """One field of a run's samples (1: reserved, 2: used) against seconds from its window's start."""
    start = run["window"][0] if run.get("window") else 0.0
    points = [(s[0] - start, s[index]) for s in run["samples"] if s[index] is not None]
    return [t for t, _ in points], [v for _, v in points]


def _blocks_over_time(plt, out: Path, raw: dict, drill: str) -> str | None:
    """vLLM alone fills the pool and preempts; admission keeps vLLM under the watermarks, the ledger above it."""
    alone = runs_of(raw, drill, "vllm-alone").get(SHOWN_GROUP)
    on = runs_of(raw, drill, "admission-on").get(SHOWN_GROUP)
    if alone is None or on is None:
        return None
    pool = raw["engine"]["kv_blocks"]
    fig, ax = plt.subplots(figsize=(9.5, 4.2))
    ax.axvspan(0, on["window_s"], color=WINDOW_COLOUR, label="measured window")
    ax.plot(*_series(alone, 2), color=ALONE_COLOUR, lw=1.4,
            label=f"vLLM alone: used ({alone['preemptions'] or 0:.0f} preemptions)")
    ax.plot(*_series(on, 2), color=ON_COLOUR, lw=1.4,
            label=f"admission on: vLLM used ({on['preemptions'] or 0:.0f} preemptions)")
    ax.plot(*_series(on, 1), color=ON_COLOUR, lw=1.2, ls="--", label="admission on: ledger reserved")
    ax.axhline(pool, color="black", lw=1)
    ax.text(1.005, pool, f"pool {pool}", fontsize=7, va="center", transform=ax.get_yaxis_transform())
    for name, _, share in WATERMARKS:  # the shipped settings', which admission on runs with
        ax.axhline(share * pool, color="grey", ls=":", lw=1)
        ax.text(1.005, share * pool, f"{name} {share}", fontsize=7, va="center", color="grey",
                transform=ax.get_yaxis_transform())
    ax.set_ylim(0, pool * 1.08)
    ax.set_xlabel("seconds from the drill's window's start")
    ax.set_ylabel(f"KV blocks ({raw['engine']['block_size']} tokens)")
    ax.set_title(f"{drill}, group {SHOWN_GROUP}: KV blocks every 100 ms")
    ax.legend(fontsize=7, loc="lower center")
    return _save(plt, fig, out, f"kv_blocks_{drill}.png")


def _ledger_points(raw: dict, drill: str, arm: str) -> list[float]:
    """Each group's median ledger ÷ used, by the report's own function applied to that group alone."""
    medians = [ledger_gap({group: run})["median"] for group, run in sorted(runs_of(raw, drill, arm).items())]
    return [m for m in medians if m is not None]


def _goal_values(raw: dict, summary: dict, drill: str, goal: Goal, tuned: bool) -> tuple[list[float], Estimate]:
    """A drill's per-group ratios and their median as the report states it."""
    if tuned and "tuned" not in summary[drill]:
        return [], Estimate(None)
    figures = summary[drill]["tuned"] if tuned else summary[drill]
    if goal.name == "ledger":
        return _ledger_points(raw, drill, "admission-tuned" if tuned else "admission-on"), \
            Estimate(figures["ledger_gap"]["median"])
    values = figures[goal.tuned_key if tuned else goal.on_key]
    return values, bootstrap_median(values)


def _draw_goal(ax, raw: dict, summary: dict, goal: Goal, arms: list[tuple[str, str, bool, float]]) -> None:
    drills = list(summary)
    for edge in goal.band:
        if 0 < edge < float("inf"):
            ax.axhline(edge, ls="--", color="#444444", lw=1)
    for label, colour, tuned, shift in arms:
        for i, drill in enumerate(drills):
            points, est = _goal_values(raw, summary, drill, goal, tuned)
            ax.scatter([i + shift] * len(points), points, s=14, color=colour, alpha=0.6, zorder=3)
            if est.value is None:
                continue
            low, high = (est.lo, est.hi) if est.lo is not None else (est.value, est.value)
            ax.errorbar(i + shift, est.value, yerr=[[est.value - low], [high - est.value]], fmt="_", markersize=16,
                        color=colour, capsize=4, zorder=4, label=label if i == 0 else None)
    ax.set_xticks(range(len(drills)), drills, fontsize=8)
    ax.set_xlim(-0.5, len(drills) - 0.5)
    ax.set_ylabel(goal.label, fontsize=8)


def _goal_ratios(plt, out: Path, raw: dict, summary: dict) -> str:
    """The three ratio goals of #47 per drill, admission on (and the tuned arm where it ran)."""
    arms = [("admission on", ON_COLOUR, False, -0.12)]
    if any("tuned" in s for s in summary.values()):
        arms.append((f"admission-tuned ({raw['args'].get('tuned')})", TUNED_COLOUR, True, 0.12))
    fig, axes = plt.subplots(1, len(GOALS), figsize=(13, 4.4))
    for ax, goal in zip(axes, GOALS):
        _draw_goal(ax, raw, summary, goal, arms)
    axes[0].plot([], [], ls="--", color="#444444", lw=1, label="goal")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.suptitle("The KV drills' goal ratios: each group (dots), the median with its 95% interval (bars)", fontsize=10)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return _save(plt, fig, out, "goal_ratios.png", tight=False)
