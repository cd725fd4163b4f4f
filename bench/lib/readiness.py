"""Ports and readiness for benchmark scripts that start holdback processes (bench may not import tests/)."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from abc import ABC, abstractmethod

import httpx

from holdback.cli.listeners import free_port, free_port_block  # noqa: F401  (bench's readiness API)


def wait_http(url: str, proc: subprocess.Popen | None = None, timeout: float = 30.0, what: str = "",
              headers: dict[str, str] | None = None) -> None:
    """Wait until GET url answers 2xx; fail at once if `proc` exits first. `what` names it in errors."""
    name = what or url
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode} before {url} was ready")
        try:
            if httpx.get(url, timeout=1.0, headers=headers).status_code < 300:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{name} not ready at {url} after {timeout:.0f}s")


class ProcessSet(ABC):
    """`with Thing(...) as thing:` for a set of processes: `start()` on entry (stopping what did start if it
    fails part-way) and `stop()` on exit."""

    @abstractmethod
    def start(self):  # noqa: ANN201 - returns self, typed by the subclass
        """Start every process and wait until each is ready."""

    @abstractmethod
    def stop(self) -> None:
        """Stop every process that was started."""

    def __enter__(self):  # noqa: ANN204
        _stop_on_sigterm()
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


def _raise_exit(signum: int, frame) -> None:  # noqa: ANN001, ARG001
    raise SystemExit(128 + signum)


def _stop_on_sigterm() -> None:
    """Make SIGTERM unwind the main thread (so every `with ProcessSet` stops its processes) instead of ending the
    interpreter at once, which would leave the children, each in its own session, running. Only where nothing
    else handles SIGTERM, and only in the main thread (where Python delivers signals)."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _raise_exit)
