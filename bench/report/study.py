"""A study's report from its raw records: `holdback bench report DIR` regenerates DIR's summary.json, report.md
and plots from DIR/raw/*.json."""

from __future__ import annotations

import json
from pathlib import Path

from bench.report.figures import figures
from bench.report.markdown import report_markdown
from bench.report.plots import make_plots
from bench.report.summary import goals, occupancy_cost, summarize
from bench.study import read_record, record_paths


def load(out_dir: Path) -> tuple[dict, list[dict], list[dict]]:
    meta = json.loads((out_dir / "study.json").read_text()) if (out_dir / "study.json").exists() else {}
    records = [read_record(p) for p in record_paths(out_dir)]
    return meta, records, [figures(r) for r in records]


def render(out_dir: Path) -> Path:
    meta, records, run_figs = load(out_dir)
    summary = summarize(run_figs)
    judged = goals(summary, run_figs)
    (out_dir / "summary.json").write_text(json.dumps({"meta": meta, "scenarios": summary, "runs": run_figs,
                                                      "goals": judged}, indent=2))
    occ = occupancy_cost(run_figs)
    plots = make_plots(out_dir, records, summary, run_figs, occ)
    md = report_markdown(meta, summary, run_figs, plots, judged, occ)
    path = out_dir / "report.md"
    path.write_text(md)
    return path
