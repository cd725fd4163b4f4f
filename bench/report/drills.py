"""Turn drills raw records into the gate table, summary JSON, Markdown report and plots.

`holdback bench drills --report DIR` regenerates everything from DIR/raw/drills-*.json. With both an
admission-on and an admission-off record, the report shows the gates side by side, so the drills are
seen to fail without the policy.
"""

from __future__ import annotations

import gzip
import json
from collections import Counter
from pathlib import Path

from bench.drills.gates import Gate, evaluate, levels
from bench.report.pyplot import pyplot

WATERMARKS = (("admission", "admissionWatermark", 0.82), ("pause batch", "batchPauseWatermark", 0.88),
              ("hard", "hardWatermark", 0.92))
PHASE_COLORS = {"peak": "#f3d9d9", "bad_config": "#f6e7c8", "storm": "#dde8f3", "burst": "#e4f1dc", "kill": "#ece0f0"}


def load(out_dir: Path) -> list[dict]:
    """The raw records of a results folder: `raw/drills-*.json`, or gzipped (`.json.gz`, as committed)."""
    paths = sorted((out_dir / "raw").glob("drills-*.json")) + sorted((out_dir / "raw").glob("drills-*.json.gz"))
    if not paths:
        raise SystemExit(f"{out_dir}/raw has no drills-*.json: pass a folder written by `holdback bench drills`")

    def read(path: Path) -> dict:
        return json.loads(gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_text())

    # Admission on first.
    return sorted((read(p) for p in paths), key=lambda r: not r["admission"])


def label(record: dict) -> str:
    return f"admission {'on' if record['admission'] else 'off'}"


def gate_table(results: list[tuple[dict, list[Gate]]]) -> list[str]:
    head = "| gate | goal | " + " | ".join(label(r) for r, _ in results) + " |"
    lines = [head, "|" + "---|" * (2 + len(results))]
    for i, gate in enumerate(results[0][1]):
        cells = []
        for _, gates in results:
            g = gates[i]
            mark = {"pass": "PASS", "fail": "**FAIL**", "n/a": "n/a"}[g.status]
            cells.append(f"{mark}: {g.figure}" + (f" ({g.note})" if g.note else ""))
        lines.append(f"| {gate.name} | {gate.goal} | " + " | ".join(cells) + " |")
    return lines


def console_table(record: dict, gates: list[Gate]) -> str:
    width = max(len(g.name) for g in gates)
    out = [f"Gates ({label(record)}, seed {record['seed']}):"]
    for g in gates:
        out.append(f"  {g.status.upper():4}  {g.name:<{width}}  {g.figure}" + (f"  [{g.note}]" if g.note else ""))
    failed = [g.name for g in gates if g.failed]
    out.append("  => " + ("every gate passed" if not failed else f"{len(failed)} failed: {', '.join(failed)}"))
    return "\n".join(out)


def summarize(record: dict, gates: list[Gate]) -> dict:
    reqs = record.get("requests", [])
    by_status = Counter(f"{r['status']} {r.get('drop_reason') or ''}".strip() for r in reqs)
    return {
        "label": label(record), "seed": record["seed"], "admission": record["admission"],
        "drills": record.get("drills"), "plan": record.get("plan"),
        "gates": [g.to_json() for g in gates], "failed": [g.name for g in gates if g.failed],
        "requests": len(reqs), "outcomes": dict(by_status),
        "ramp": record.get("ramp"), "events": record.get("events"),
        "rollback": record.get("rollback"), "unfinished_requests": record.get("unfinished_requests"),
        "evicted_all_done": record.get("evicted_all_done"),
    }


def render(out_dir: Path) -> tuple[Path, list[tuple[dict, list[Gate]]]]:
    records = load(out_dir)
    results = [(r, evaluate(r)) for r in records]
    summary = {label(r): summarize(r, g) for r, g in results}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    plots = make_plots(out_dir, records)
    path = out_dir / "report.md"
    path.write_text("\n".join(markdown(results, plots)) + "\n")
    return path, results


def markdown(results: list[tuple[dict, list[Gate]]], plots: list[str]) -> list[str]:
    first = results[0][0]
    plan = first.get("plan", {})
    lines = ["# KV policy failure drills and deployment gates", ""]
    lines += [f"Seed {first['seed']} (the workload is a function of it); drills: {', '.join(first.get('drills', []))}; "
              f"{plan.get('replicas')} simulated replicas of {_arg(plan, '--num-blocks')} blocks x "
              f"{_arg(plan, '--block-size')} tokens, {_arg(plan, '--max-num-seqs')} sequences, preemption "
              f"{_arg(plan, '--preemption')} (an over-commitment is an out-of-memory, not a recompute).", ""]
    lines += ["## Gates", ""] + gate_table(results) + [""]
    for record, gates in results:
        failed = [g.name for g in gates if g.failed]
        lines.append(f"- {label(record)}: " + ("every gate passed." if not failed else
                                               f"{len(failed)} gate(s) failed: {', '.join(failed)}."))
    lines.append("")
    for record, _ in results:
        lines += [f"## Timeline ({label(record)})", "", "| phase | start s | end s | requests | served | rejected | cancelled or failed |",
                  "|---|---|---|---|---|---|---|"]
        for p in record.get("phases", []):
            inside = [r for r in record.get("requests", [])
                      if p["start"] <= r["sent_t"] < (p["end"] if p["end"] is not None else 1e18)]
            served = sum(1 for r in inside if r["status"] == 200)
            rejected = sum(1 for r in inside if r["status"] == 429 or r.get("drop_reason"))
            lines.append(f"| {p['name']} | {p['start']:.0f} | {(p['end'] or 0):.0f} | {len(inside)} | {served} | "
                         f"{rejected} | {len(inside) - served - rejected} |")
        ramp = record.get("ramp") or {}
        if ramp:
            rates = ", ".join(f"{s['rate']:g}/s" for s in ramp.get("steps", []))
            lines += ["", f"Ramp: {rates}; " + (f"first rejections at {ramp['hold_rate']:g}/s, held there."
                                                  if ramp.get("reached_rejection") else
                                                  f"no rejection up to {ramp['hold_rate']:g}/s; held there.")]
        lines.append("")
    lines += ["## Plots", ""] + [f"![{p}]({p})" for p in plots] + [""]
    lines += ["Regenerate: `holdback bench drills --report <this folder>`.", ""]
    return lines


def _arg(plan: dict, flag: str) -> str:
    args = list(plan.get("sim_args") or [])
    return args[args.index(flag) + 1] if flag in args else "?"


def make_plots(out_dir: Path, records: list[dict]) -> list[str]:
    plt = pyplot()

    made = []

    def shade(ax, record: dict) -> None:  # noqa: ANN001
        for p in record.get("phases", []):
            if p["name"] in PHASE_COLORS and p["end"] is not None:
                ax.axvspan(p["start"], p["end"], color=PHASE_COLORS[p["name"]], alpha=0.6, lw=0)
                ax.text(p["start"], 1.0, p["name"], transform=ax.get_xaxis_transform(), fontsize=7, va="top")

    for record in records:
        tag = "on" if record["admission"] else "off"
        samples = record.get("samples", [])
        adm = (record.get("gateway_settings") or {}).get("admission") or {}

        fig, ax = plt.subplots(figsize=(11, 4.5))
        shade(ax, record)
        for i in sorted({k for s in samples for k in (s.get("replicas") or {})}):
            pts = [(s["t"], s["replicas"][i]["usage"]) for s in samples if "usage" in (s.get("replicas") or {}).get(i, {})]
            ax.plot([t for t, _ in pts], [u for _, u in pts], label=f"replica {i} used", lw=1)
        urls = sorted({u for s in samples for u in (((s.get("kv") or {}).get("replicas")) or {})})
        for url in urls:
            pts = [(s["t"], v["reserved_blocks"] / v["total_blocks"]) for s in samples
                   for v in [(((s.get("kv") or {}).get("replicas")) or {}).get(url)] if v and v.get("total_blocks")]
            ax.plot([t for t, _ in pts], [u for _, u in pts], ls="--", lw=1, label=f"reserved {url.rsplit(':', 1)[-1]}")
        for name, key, default in WATERMARKS:
            ax.axhline(float(adm.get(key, default)), color="grey", ls=":", lw=1)
            ax.text(0, float(adm.get(key, default)), f" {name}", fontsize=7, va="bottom", color="grey")
        ax.set_ylim(0, 1.05)
        made.append(_save(fig, ax, out_dir, f"kv_usage_{tag}.png", "seconds", "share of KV blocks",
                          f"KV usage and reservations over time, with watermarks (admission {tag})"))

        fig, ax = plt.subplots(figsize=(11, 4.5))
        shade(ax, record)
        for klass, color in (("critical", "#c0392b"), ("interactive", "#2c7fb8")):
            pts = [(r["sent_t"], r["ttft_s"] * 1000) for r in record.get("requests", [])
                   if r["klass"] == klass and r["status"] == 200 and r["ttft_s"] is not None]
            ax.scatter([t for t, _ in pts], [v for _, v in pts], s=4, color=color, label=klass, alpha=0.6)
        ax.axhline(record.get("ttft_gate_s", 0.9) * 1000, color="black", ls="--", lw=1, label="critical gate")
        ax.set_yscale("log")
        made.append(_save(fig, ax, out_dir, f"ttft_{tag}.png", "seconds (send time)", "TTFT (ms)",
                          f"Time to first token by class (admission {tag})"))

        fig, ax = plt.subplots(figsize=(9, 4))
        reasons = Counter()
        for r in record.get("requests", []):
            if r["status"] != 200:
                reasons[r.get("drop_reason") or f"HTTP {r['status']}" + (" (cancelled)" if r["status"] == 499 else "")] += 1
        names = sorted(reasons)
        ax.barh(names, [reasons[n] for n in names], color="#7f7f7f")
        made.append(_save(fig, ax, out_dir, f"rejections_{tag}.png", "requests", "",
                          f"Requests not served, by rejection reason or status (admission {tag})", legend=False))

        fig, ax = plt.subplots(figsize=(11, 4))
        shade(ax, record)
        pts = [(s["t"], sum(int(b.get("completed") or 0) for b in s["batches"].values())) for s in samples
               if s.get("batches") and all("completed" in b for b in s["batches"].values())]
        ax.plot([t for t, _ in pts], [c for _, c in pts], color="#2ca02c", label="batch rows completed")
        paused = [s["t"] for s in samples if levels(s) and all(l in ("pause-batch", "evict") for l in levels(s))]
        if paused:
            ax.scatter(paused, [0] * len(paused), marker="|", color="#d62728", label="every replica >= pause-batch")
        made.append(_save(fig, ax, out_dir, f"batch_{tag}.png", "seconds", "rows",
                          f"Batch progress through the peak (admission {tag})"))
    return made


def _save(fig, ax, out_dir: Path, name: str, xlabel: str, ylabel: str, title: str,  # noqa: ANN001
          legend: bool = True) -> str:
    import matplotlib.pyplot as plt

    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if legend:
        ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(out_dir / name, dpi=110)
    plt.close(fig)
    return name
