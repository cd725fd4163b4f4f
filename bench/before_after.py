"""Before/after ratios of `bench/pipeline_throughput.py` runs: one tree's code against another's, same machine.

Run pipeline_throughput.py once per tree per pair, alternating which tree goes first, each with `--json`; name
the files `before<N>.json` and `after<N>.json` in one directory. This reads them and prints, for each figure,
the median over pairs of after ÷ before (for times and CPU: before ÷ after, so above 1 is always better), with
every pair's value. The `ours÷SimpleWorker` figures are already ratios to RQ's no-op rate within one run, so
they cancel the load the machine was under during that run; the raw rates do not.

    python bench/before_after.py DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

# name -> (how to read it from one run's JSON, True if higher is better)
FIGURES = {
    "ingest total (s)": (lambda r: r["ingest"]["total_s"], False),
    "ours jobs/s, 1 process": (lambda r: _run(r, 1)["rate"], True),
    "ours jobs/s, 2 processes": (lambda r: _run(r, 2)["rate"], True),
    "ours÷SimpleWorker rate, 1 process": (lambda r: r["throughput"]["median_ratios"]["ours÷SimpleWorker rate, ×1"], True),
    "ours÷SimpleWorker rate, 2 processes": (lambda r: r["throughput"]["median_ratios"]["ours÷SimpleWorker rate, ×2"],
                                            True),
    "ours worker CPU ms/job, 1 process": (lambda r: _run(r, 1)["cpu_ms_per_job"], False),
    "ours worker CPU ms/job, 2 processes": (lambda r: _run(r, 2)["cpu_ms_per_job"], False),
}


def _run(result: dict, processes: int) -> dict:
    (run,) = [r for r in result["throughput"]["runs"] if r["side"] == "ours" and r["processes"] == processes]
    return run


def pairs(directory: Path) -> list[tuple[dict, dict]]:
    found = []
    n = 1
    while (directory / f"before{n}.json").exists() and (directory / f"after{n}.json").exists():
        found.append((json.loads((directory / f"before{n}.json").read_text()),
                      json.loads((directory / f"after{n}.json").read_text())))
        n += 1
    return found


def report(directory: Path) -> int:
    found = pairs(directory)
    if not found:
        print(f"no before1.json/after1.json pair in {directory}", file=sys.stderr)
        return 2
    print(f"{len(found)} pair(s); after vs before, above 1 is better (times and CPU inverted); median (per pair)")
    for name, (read, higher) in FIGURES.items():
        ratios = []
        for before, after in found:
            try:
                b, a = read(before), read(after)
            except (KeyError, ValueError):
                continue  # a run without that part (--skip-ingest, other --processes)
            ratios.append(a / b if higher else b / a)
        if ratios:
            print(f"  {name:40s} {statistics.median(ratios):5.2f}   ({', '.join(f'{r:.2f}' for r in ratios)})")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("directory", type=Path, help="holds before<N>.json and after<N>.json")
    return report(p.parse_args(argv).directory)


if __name__ == "__main__":
    sys.exit(main())
