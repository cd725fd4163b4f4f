"""Child processes of a benchmark: `holdback` commands (a simulator, a gateway) started from the repository in
their own sessions, and the one way bench stops a process: SIGTERM, a deadline, then SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

from bench.lib import forkserver
from bench.lib.readiness import free_port, free_port_block, wait_http

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable


class Children:
    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, args: list[str], log: Path) -> subprocess.Popen:
        proc = forkserver.popen(args, cwd=REPO, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                                start_new_session=True)
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        stop_processes(reversed(self.procs), 10)


def stop_processes(procs: Iterable[subprocess.Popen], timeout: float) -> None:
    """Stop `procs` together: SIGTERM to each still running, a wait for all of them within one `timeout` (s), then
    SIGKILL to what is left. A process that leads its own process group (started in a session of its own) is
    signalled with its whole group, so what it started goes too."""
    running = [p for p in procs if p.poll() is None]
    for p in running:
        _signal(p, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in running:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal(p, signal.SIGKILL)
            p.wait()


def _signal(proc: subprocess.Popen, sig: int) -> None:
    try:
        if os.getpgid(proc.pid) == proc.pid:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
    except ProcessLookupError:
        pass  # it ended meanwhile


def holdback(*args: str) -> list[str]:
    """The command line of `holdback ARGS` in this interpreter."""
    return [PY, "-m", "holdback.cli", *args]


def start_gateway(children: Children, tmp: Path, name: str, replicas: list[str], config: str) -> str:
    """`holdback gateway` with `config` (YAML text) in front of `replicas`; its URL once it answers /health."""
    port = free_port()
    path = tmp / f"{name}.yaml"
    path.write_text(config)
    p = children.start(holdback("gateway", "--config", str(path), "--port", str(port), "--replicas",
                                ",".join(replicas), "--log-level", "WARNING"), tmp / f"{name}.log")
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", p, what=name)
    return url


def start_sims(children: Children, tmp: Path, name: str, n: int, *args: str) -> list[str]:
    """`holdback sim` serving `n` replicas on consecutive ports; their URLs once each answers /health."""
    port = free_port_block(n)
    p = children.start(holdback("sim", "--port", str(port), "--replicas", str(n), "--log-level", "WARNING",
                                *args), tmp / f"{name}.log")
    urls = [f"http://127.0.0.1:{port + i}" for i in range(n)]
    for url in urls:
        wait_http(url + "/health", p, what=name)
    return urls
