"""`holdback bench`: run the seed study (`study`) or regenerate its report from raw records (`report`)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from bench.report import render
from bench.study import FULL, QUICK, SCENARIOS, run_study, with_overrides


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="holdback bench", description=__doc__)
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    st = sub.add_parser("study", help="run the holdback-and-eviction study on simulated replicas and write a report")
    mode = st.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="short windows, one repeat (about 10 minutes; default)")
    mode.add_argument("--full", action="store_true", help="300 s per scenario, 3 repeats, 60 s batch lead")
    st.add_argument("--out", type=Path, default=None, help="results folder (default results/study-<mode>-<time>)")
    st.add_argument("--scenarios", default=",".join(SCENARIOS),
                    help="comma-separated subset of: " + ", ".join(SCENARIOS))
    st.add_argument("--repeats", type=int, default=None, help="repeats per scenario (quick 1, full 3)")
    st.add_argument("--window", type=float, default=None, help="seconds of realtime traffic per scenario")
    st.add_argument("--lead", type=float, default=None, help="seconds batch runs before realtime starts")
    st.add_argument("--seed", type=int, default=7, help="traffic seed (default %(default)s)")
    rp = sub.add_parser("report", help="regenerate summary.json, report.md and the plots from DIR/raw/*.json")
    rp.add_argument("dir", type=Path)
    args = p.parse_args(argv)

    if args.action == "report":
        if not (args.dir / "raw").is_dir():
            p.error(f"{args.dir} has no raw/ folder: pass a folder written by `holdback bench study`")
        print(render(args.dir))
        return 0

    names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        p.error(f"unknown scenario(s) {', '.join(unknown)}; choose from {', '.join(SCENARIOS)}")
    base = FULL if args.full else QUICK
    workload = with_overrides(base, window_s=args.window, lead_s=args.lead)
    repeats = args.repeats or (3 if args.full else 1)
    if repeats < 1:
        p.error("--repeats must be at least 1")
    out = args.out or Path("results") / f"study-{'full' if args.full else 'quick'}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_study(names, workload, repeats, args.seed, out)
    print(render(out))
    return 0
