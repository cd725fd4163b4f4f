"""Nothing a test starts outlives it: a pytest worker SIGKILLed mid-test takes its children with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from tests import reaper
from tests.support import REPO, poll


def test_children_of_a_killed_pytest_worker_die_with_it(tmp_path: Path) -> None:
    report = tmp_path / "pids"
    inner = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-n", "1", "-p", "no:cacheprovider", "-q", "tests/reaper_drill.py"],
        cwd=REPO, env={**{k: v for k, v in os.environ.items() if k != "HOLDBACK_TEST_FAILURE_DIR"},
             "HBTEST_REAPER_DRILL": str(report), "PYTEST_ADDOPTS": ""},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        poll(report.exists, 120, "the drill's worker to start its children",
             lambda: inner.stdout.read().decode(errors="replace") if inner.poll() is not None else "")
        worker, *children = (int(pid) for pid in report.read_text().split())
        assert worker != inner.pid, "the drill ran in an xdist worker, not in the controller"
        assert all(reaper.alive(pid) for pid in children)
        os.kill(worker, signal.SIGKILL)
        poll(lambda: not any(reaper.alive(pid) for pid in children), 60,
             "the killed worker's children to die with it",
             lambda: "\n".join(f"{pid}: {reaper.describe(pid)}" for pid in children if reaper.alive(pid)))
    finally:
        if inner.poll() is None:
            os.killpg(inner.pid, signal.SIGKILL)
        inner.wait(30)
