"""Ports and readiness for benchmark scripts that start holdback processes (bench may not import tests/)."""

from __future__ import annotations

import socket
import subprocess
import time
from abc import ABC, abstractmethod

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_block(n: int) -> int:
    """First of n consecutive free ports (the simulator takes --port P for replica 0, P+1 for 1, ...)."""
    for _ in range(200):
        base = free_port()
        if base + n >= 65000:
            continue
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no block of {n} free ports")


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


class Started(ABC):
    """`with Thing(...) as thing:` for a set of processes: `start()` on entry (stopping what did start if it
    fails part-way) and `stop()` on exit."""

    @abstractmethod
    def start(self):  # noqa: ANN201 - returns self, typed by the subclass
        ...

    @abstractmethod
    def stop(self) -> None: ...

    def __enter__(self):  # noqa: ANN204
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()
