"""Two scenarios of one study run, compared repeat by repeat: each figure's per-repeat ratio and their median with a
bootstrap interval (a repeat's scenarios share its traffic seed, so the ratio is taken within the repeat).

    holdback bench report DIR       # writes DIR/summary.json from DIR/raw
    python -m bench.scenario_ratios DIR no_reserve_evict holdback_50_evict
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.stats import bootstrap_median

FIGURES = ("p95_ttft_ms", "p95_ttft_after_burst_ms", "batch_completions", "batch_output_tps", "preemptions",
           "evictions", "batch_in_flight_mean")


def ratios(summary: dict, num: str, den: str) -> dict[str, dict]:
    """Per figure: both scenarios' values by repeat, the per-repeat ratios and their median [interval]."""
    runs = {(r["scenario"], r["repeat"]): r for r in summary["runs"]}
    repeats = sorted({rep for name, rep in runs if name == num} & {rep for name, rep in runs if name == den})
    out: dict[str, dict] = {}
    for figure in FIGURES:
        a = [runs[(num, rep)].get(figure) for rep in repeats]
        b = [runs[(den, rep)].get(figure) for rep in repeats]
        per = [x / y for x, y in zip(a, b) if x is not None and y]
        est = bootstrap_median(per) if per else None
        out[figure] = {num: a, den: b, "ratios": [round(r, 3) for r in per],
                       "median": None if est is None else [round(v, 3) if v is not None else None
                                                           for v in (est.value, est.lo, est.hi)]}
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", type=Path, help="a study folder with summary.json (holdback bench report)")
    p.add_argument("scenario", help="the numerator")
    p.add_argument("baseline", help="the denominator")
    args = p.parse_args(argv)
    summary_path = args.folder / "summary.json"
    if not summary_path.exists():
        p.error(f"{summary_path} does not exist: run `holdback bench report {args.folder}` first")
    table = ratios(json.loads(summary_path.read_text()), args.scenario, args.baseline)
    if not any(row["ratios"] for row in table.values()):
        p.error(f"no repeat has both {args.scenario!r} and {args.baseline!r} in {summary_path}")
    print(f"| figure | {args.scenario} | {args.baseline} | per-repeat ratios | median [95% interval] |")
    print("|---|---|---|---|---|")
    for figure, row in table.items():
        fmt = ", ".join("—" if v is None else f"{v:.1f}" for v in row[args.scenario])
        base = ", ".join("—" if v is None else f"{v:.1f}" for v in row[args.baseline])
        med = "—"
        if row["median"] is not None:
            value, lo, hi = row["median"]
            med = f"{value} (one repeat: no interval)" if lo is None else f"{value} [{lo}, {hi}]"
        print(f"| {figure} | {fmt} | {base} | {', '.join(map(str, row['ratios']))} | {med} |")


if __name__ == "__main__":
    main()
