"""`holdback bench`: run the priority study (`study`: realtime latency and batch throughput under holdback and
eviction, on simulated replicas) or regenerate its report from raw records (`report`); run the KV policy's failure
drills and deployment gates (`drills`)."""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from bench.drills.plan import DRILLS, PLANS
from bench.drills.run import run_drills
from bench.report import drills as drill_report
from bench.report.study import render
from bench.study import FULL, QUICK, SCENARIOS, StudyMismatch, run_study, with_overrides


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="holdback bench", description=__doc__)
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    st = sub.add_parser("study", help="run the holdback-and-eviction study on simulated replicas and write a report")
    mode = st.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="short windows, one repeat (about 25 minutes for every scenario; default)")
    mode.add_argument("--full", action="store_true", help="300 s per scenario, 3 repeats, 60 s batch lead (about 5 hours for every "
                      "scenario; the estimate is printed at the start; --resume continues a stopped run)")
    st.add_argument("--out", type=Path, default=None, help="results folder (default results/study-<mode>-<time>)")
    st.add_argument("--scenarios", default=",".join(SCENARIOS),
                    help="comma-separated subset of: " + ", ".join(SCENARIOS))
    st.add_argument("--repeats", type=int, default=None, help="repeats per scenario (quick 1, full 3)")
    st.add_argument("--window", type=float, default=None, help="seconds of realtime traffic per scenario")
    st.add_argument("--lead", type=float, default=None, help="seconds batch runs before realtime starts")
    st.add_argument("--seed", type=int, default=7, help="traffic seed (default %(default)s)")
    st.add_argument("--resume", action="store_true",
                    help="keep the runs already recorded in --out (same workload and seed, checked) and run the rest")
    rp = sub.add_parser("report", help="regenerate summary.json, report.md and the plots from DIR/raw/*.json",
                        description="Re-render a study's summary.json, report.md and plots from the raw records a "
                                    "`holdback bench study` run wrote, e.g. after a stopped run or a change to the "
                                    "report. Prints the report.")
    rp.add_argument("dir", type=Path, metavar="DIR",
                    help="a study's results folder, the --out of `holdback bench study` (it holds raw/), "
                         "e.g. docs/study/full")
    dr = sub.add_parser(
        "drills", help="run the KV policy's failure drills on simulated replicas and check the deployment gates",
        description="Starts a stack on simulated replicas, runs the drills (ramp until rejection then hold, "
                    "single-tenant burst, cancellation storm, bad config pushed live and rolled back, kill -9 of a "
                    "worker and a replica) with batch jobs throughout, prints the gate table and writes raw records, "
                    "summary.json, report.md and plots. Exits 1 when a gate fails (with --admission both: when a "
                    "gate fails with admission on).")
    size = dr.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="short phases (a few minutes per run; default)")
    size.add_argument("--full", action="store_true", help="longer phases and larger batch jobs")
    dr.add_argument("--admission", choices=("on", "off", "both"), default="on",
                    help="run with the gateway's KV admission on, off (to see which gates fail without it), or both")
    dr.add_argument("--drills", default=",".join(DRILLS),
                    help="comma-separated subset of: " + ", ".join(DRILLS) + " (off-peak traffic always runs)")
    dr.add_argument("--seed", type=int, default=14, help="workload seed, recorded with the results (default %(default)s)")
    dr.add_argument("--out", type=Path, default=None, help="results folder (default results/drills-<mode>-<time>)")
    dr.add_argument("--report", type=Path, default=None, metavar="DIR",
                    help="only regenerate the gate table, summary and report from DIR/raw/drills-*.json")
    dr.add_argument("--engine", choices=("sim", "vllm"), default="sim",
                    help="vllm: the drills on a real KV-bound vLLM (bench/real_engine/kv_drills.py: long-session, "
                         "surge, realtime-burst; admission on and off, vLLM alone, realtime alone), which needs "
                         "HOLDBACK_VLLM_PYTHON and HOLDBACK_VLLM_MODEL")
    dr.add_argument("--groups", type=int, default=3, help="--engine vllm: groups of every drill's arms")
    dr.add_argument("--window", type=float, default=12.0, help="--engine vllm: seconds of each drill's traffic")
    args = p.parse_args(argv)

    if args.action == "drills":
        return _drills(p, args)
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
    if args.resume and args.out is None:
        p.error("--resume needs --out: the folder of the run to continue")
    out = args.out or Path("results") / f"study-{'full' if args.full else 'quick'}-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        run_study(names, workload, repeats, args.seed, out, resume=args.resume)
    except StudyMismatch as exc:
        p.error(str(exc))
    print(render(out))
    return 0


def _drills(p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.engine == "vllm":
        return _real_engine_drills(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.report is None:
        drills = tuple(n.strip() for n in args.drills.split(",") if n.strip())
        unknown = [n for n in drills if n not in DRILLS]
        if unknown:
            p.error(f"unknown drill(s) {', '.join(unknown)}; choose from {', '.join(DRILLS)}")
        mode = "full" if args.full else "quick"
        out = args.out or Path("results") / f"drills-{mode}-{time.strftime('%Y%m%d-%H%M%S')}"
        for admission in {"on": (True,), "off": (False,), "both": (True, False)}[args.admission]:
            print(f"holdback bench drills: {mode} run, admission {'on' if admission else 'off'}, seed {args.seed} -> {out}",
                  flush=True)
            run_drills(PLANS[mode], admission, args.seed, out, drills)
    else:
        out = args.report
        if not (out / "raw").is_dir():
            p.error(f"{out} has no raw/ folder: pass a folder written by `holdback bench drills`")
    path, results = drill_report.render(out)
    for record, gates in results:
        print(drill_report.console_table(record, gates))
    print(f"report: {path}")
    judged = [gates for record, gates in results if record["admission"]] or [gates for _, gates in results]
    return 1 if any(g.failed for gates in judged for g in gates) else 0


def _real_engine_drills(args: argparse.Namespace) -> int:
    from bench.real_engine import kv_drills, kv_drills_report

    if args.report is not None:
        print(kv_drills_report.write_report(args.report))
        return 0
    out = args.out or Path("results") / f"drills-vllm-{time.strftime('%Y%m%d-%H%M%S')}"
    argv = ["--out", str(out), "--seed", str(args.seed), "--groups", str(args.groups), "--window", str(args.window)]
    if args.drills != ",".join(DRILLS):  # the simulator's drill names are not the real engine's
        argv += ["--drills", args.drills]
    return kv_drills.main(argv)
