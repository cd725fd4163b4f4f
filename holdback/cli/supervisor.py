"""The children of `holdback up` and their supervisor: each child in its own session and dying with its parent
(Linux parent-death signal), ready once it answers from its own process, restarted with backoff when it dies,
stopped in order (the embedded Redis last), and the `[holdback up]` lines that report it all.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from holdback.cli.listeners import descendants, listener_pids

PR_SET_PDEATHSIG = 1  # linux/prctl.h


@dataclass
class Child:
    name: str
    args: list[str]
    ready_url: str | None = None
    # A program other than `python -m holdback.cli` (the embedded Redis): its whole argv, and how to tell it
    # is ready when it has no HTTP endpoint.
    command: list[str] | None = None
    ready: Callable[[], bool] | None = None
    stop_last: bool = False
    # Variables for this child only (the gateway fleet's channel secret).
    env: dict[str, str] = field(default_factory=dict)
    # Its port is shared with siblings (relays with SO_REUSEPORT): ready only once it listens there itself.
    shares_port: bool = False
    proc: subprocess.Popen | None = None
    restarts: int = 0
    next_start: float = 0.0
    log_path: Path | None = None
    started_at: float = field(default=0.0)


def log_line(event: str, **fields: object) -> None:
    parts = " ".join(f"{k}={v}" for k, v in fields.items())
    print(f"[holdback up] {event} {parts}".rstrip(), flush=True)


class Supervisor:
    def __init__(self, children: list[Child], env: dict[str, str], log_dir: Path):
        self.children = children
        self.env = env
        self.log_dir = log_dir
        self.stopping = False

    def start(self, child: Child) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        child.log_path = self.log_dir / f"{child.name}.log"
        out = open(child.log_path, "ab")
        # -P: the working directory is not put first on the child's path, so a folder that holds a `holdback`
        # directory (a checkout's parent) does not shadow the installed package.
        child.proc = spawn(child.command or [sys.executable, "-P", "-m", "holdback.cli", *child.args],
                            env={**self.env, **child.env}, stdout=out, stderr=subprocess.STDOUT)
        out.close()
        child.started_at = time.monotonic()
        log_line("started", child=child.name, pid=child.proc.pid, log=child.log_path)

    def wait_ready(self, child: Child, timeout: float = 60.0) -> None:
        """Wait until the child answers its readiness check (`ready`, else `ready_url` answering 2xx from this
        child's own process); a child with neither is ready once started."""
        if child.ready is None and child.ready_url is None:
            return
        probe = child.ready or (lambda: self._answers_http(child))
        where = f" at {child.ready_url}" if child.ready is None else ""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self.stopping:
            if child.proc is not None and child.proc.poll() is not None:
                raise RuntimeError(f"{child.name} exited with {child.proc.returncode} during start-up; "
                                   f"see {child.log_path}")
            if probe():
                return
            time.sleep(0.1)
        if not self.stopping:
            raise RuntimeError(f"{child.name} not ready{where} after {timeout:.0f}s; see {child.log_path}")

    def _answers_http(self, child: Child) -> bool:
        try:
            if httpx.get(child.ready_url, timeout=1.0).status_code >= 300:
                return False
        except httpx.HTTPError:
            return False
        try:
            self.confirm_own(child)
        except _NotYet:
            return False
        return True

    def confirm_own(self, child: Child) -> None:
        """The process answering child.ready_url must be that child (or below it), not a leftover."""
        port = urlsplit(child.ready_url).port
        owners = listener_pids(port) if port else None
        if not owners or child.proc is None:
            return  # no /proc here, or the socket is not visible: the free-port check before start stands
        if child.shares_port and not owners & descendants(child.proc.pid):
            raise _NotYet  # a sibling answered: this child does not listen yet
        if not owners & descendants(child.proc.pid):
            raise RuntimeError(f"{child.name}: port {port} is answered by pid {', '.join(map(str, sorted(owners)))}, "
                               f"not by the {child.name} this holdback up started (pid {child.proc.pid}); "
                               "stop that process and start again")

    def supervise_once(self) -> None:
        now = time.monotonic()
        for child in self.children:
            proc = child.proc
            if proc is None:
                if now >= child.next_start:
                    self.start(child)
                continue
            code = proc.poll()
            if code is None:
                if child.restarts and now - child.started_at > 60:
                    child.restarts = 0  # it has stayed up: forget earlier crashes
                continue
            child.restarts += 1
            delay = min(30.0, 0.5 * 2 ** (child.restarts - 1))
            log_line("child exited, restarting", child=child.name, code=code, restart=child.restarts,
                    delay_s=f"{delay:.1f}", log=child.log_path)
            child.proc = None
            child.next_start = now + delay

    def stop_all(self, timeout: float = 15.0) -> None:
        """SIGTERM every child and wait; children marked `stop_last` (the embedded Redis) only once the
        others have gone, so a draining worker still has its queue."""
        self.stopping = True
        first = [c for c in self.children if not c.stop_last]
        self._stop([c for c in reversed(first)], timeout)
        self._stop([c for c in reversed(self.children) if c.stop_last], timeout)

    def _stop(self, children: list[Child], timeout: float) -> None:
        for child in children:
            if child.proc is not None and child.proc.poll() is None:
                try:
                    os.killpg(child.proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    continue
        deadline = time.monotonic() + timeout
        for child in children:
            if child.proc is None:
                continue
            try:
                child.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log_line("child did not stop, killing", child=child.name)
                os.killpg(child.proc.pid, signal.SIGKILL)
                child.proc.wait(5)
            code = child.proc.returncode
            # uvicorn re-raises the SIGTERM it handled, so a clean stop can also end "by signal".
            log_line("stopped", child=child.name,
                    **({"signal": signal.Signals(-code).name} if code < 0 else {"code": code}))


class _NotYet(Exception):
    """A child sharing its port is not listening there yet."""


def spawn(command: list[str], **popen: object) -> subprocess.Popen:
    """A child in its own session (a terminal's Ctrl-C reaches only `holdback up`) that dies with us."""
    return subprocess.Popen(command, start_new_session=True, preexec_fn=_die_with_parent(os.getpid()), **popen)


def _die_with_parent(parent: int):  # noqa: ANN202
    """preexec_fn for a child: on Linux the kernel sends it SIGTERM when `holdback up` dies, even by SIGKILL."""
    def arm() -> None:
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        except (OSError, AttributeError):
            return  # not Linux: `holdback up` stops its children on every exit it can see
        if os.getppid() != parent:  # the parent died before the signal was armed
            os._exit(1)
    return arm
