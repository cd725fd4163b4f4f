"""A benchmark stopped with SIGTERM stops the processes it started (each runs in its own session, so nothing
else would)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

SCRIPT = textwrap.dedent("""
    import subprocess, sys, time
    from pathlib import Path
    from bench.lib.readiness import ProcessSet

    class Sleeper(ProcessSet):
        def start(self):
            self.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"],
                                         start_new_session=True)
            Path(sys.argv[1]).write_text(str(self.proc.pid))
            return self

        def stop(self):
            self.proc.terminate()
            self.proc.wait(10)

    with Sleeper():
        while True:
            time.sleep(0.05)
""")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0): it has exited once its state is Z.
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] == "Z")


def _wait_for(condition, timeout: float, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_sigterm_stops_the_started_processes(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    parent = subprocess.Popen([sys.executable, "-c", SCRIPT, str(pid_file)], cwd=Path(__file__).parents[2])
    try:
        _wait_for(lambda: pid_file.exists() and pid_file.read_text(), 30, "the child to start")
        child = int(pid_file.read_text())
        parent.send_signal(signal.SIGTERM)
        assert parent.wait(30) == 128 + signal.SIGTERM
        _wait_for(lambda: not _alive(child), 30, f"child {child} to stop")
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(10)
        if pid_file.exists() and pid_file.read_text() and _alive(int(pid_file.read_text())):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
