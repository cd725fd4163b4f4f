"""bench/makespan.py on the simulator, small: both arms run on one engine, every line of the batch completes
through the Batch API and the workers, realtime is answered throughout, and the record has what the report needs
(evictions per row, each eviction's wait for its next attempt, the engine's counters)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support import REPO

pytestmark = pytest.mark.e2e


def test_a_small_makespan_run_on_the_simulator(tmp_path):
    out = tmp_path / "makespan"
    done = subprocess.run([sys.executable, "-m", "bench.makespan", "--lines", "40", "--groups", "1", "--tokens",
                           "16,48", "--rate", "2", "--timeout", "300", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads((out / "raw.json").read_text())
    runs = {r["arm"]: r for r in record["runs"]}
    assert set(runs) == {"vllm-priority", "holdback"}
    for run in runs.values():
        assert run["lines_failed"] == 0 and run["realtime_failed"] == 0 and run["makespan"] > 0
        assert run["ttft"] and run["engine"]["generated"] > 0
    # Where the engine's CPU went in each arm: the simulator served both, holdback's processes only one.
    assert runs["vllm-priority"]["cpu"]["simulator"] > 0 and "holdback" not in runs["vllm-priority"]["cpu"]
    assert runs["holdback"]["cpu"]["simulator"] > 0 and runs["holdback"]["cpu"]["holdback"] > 0
    ours = runs["holdback"]
    assert len(ours["evictions"]) == 40 and len(ours["eviction_waits"]) == sum(ours["evictions"])
    summary = record["summary"]
    assert summary["groups"] == 1 and summary["makespan_ratio"]["per_group"]
    assert (out / "summary.md").read_text().startswith("Makespan (sim")
