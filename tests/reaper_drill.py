"""Run only by tests/test_reaper.py, in a pytest of its own (the name keeps it out of the suite's collection): a
test that starts children the way the suite does and then waits to be killed."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.support import Processes, free_port, wait_http


def test_starts_children_and_waits_to_be_killed(tmp_path) -> None:  # noqa: ANN001
    report = os.environ.get("HBTEST_REAPER_DRILL")
    if not report:
        pytest.skip("run by tests/test_reaper.py, which kills this test's process mid-test")
    port = free_port()
    with Processes(log_dir=tmp_path / "logs") as procs:
        sim = procs.start("sim", "--port", str(port), name="sim")
        wait_http(f"http://127.0.0.1:{port}/health", proc=sim)
        loner = subprocess.Popen(["sleep", "600"], start_new_session=True)  # its own session, as a daemon's
        Path(report + ".tmp").write_text(f"{os.getpid()} {sim.pid} {loner.pid}\n")
        os.rename(report + ".tmp", report)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:  # the outer test kills this process long before the deadline
            time.sleep(0.5)
