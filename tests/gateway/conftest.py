"""Fixtures for gateway integration tests: real simulator replicas and real gateways as subprocesses."""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
import pytest

from tests.support import Processes, free_port, free_ports, wait_http


class Stack:
    """Starts `holdback sim` and `holdback gateway` children for one test and reads their state."""

    def __init__(self, procs: Processes, tmp: Path):
        self.procs = procs
        self.tmp = tmp

    def sim(self, replicas: int = 1, *args: str) -> list[str]:
        port = free_ports(replicas)
        proc = self.procs.start("sim", "--port", str(port), "--replicas", str(replicas), "--log-level", "WARNING",
                                *args, name="sim")
        urls = [f"http://127.0.0.1:{port + i}" for i in range(replicas)]
        for url in urls:
            wait_http(url + "/health", proc=proc)
        return urls

    def gateway(self, replicas: list[str], config: str = "", env: dict[str, str] | None = None) -> "Gateway":
        path = self.tmp / f"gateway-{free_port()}.yaml"
        path.write_text(config)
        port = free_port()
        proc = self.procs.start("gateway", "--config", str(path), "--port", str(port),
                                "--replicas", ",".join(replicas), name="gateway", env=env)
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health", proc=proc)
        return Gateway(url, proc, path, self.procs)


class Gateway:
    def __init__(self, url: str, proc, config_path: Path, procs: Processes):
        self.url = url
        self.proc = proc
        self.config_path = config_path
        self.procs = procs

    def state(self) -> dict:
        return httpx.get(self.url + "/admin/state", timeout=5).json()

    def band(self, priority: int) -> dict:
        return next(b for b in self.state()["bands"] if b["priority"] == priority)

    def reload(self) -> None:
        self.proc.send_signal(signal.SIGHUP)

    def log(self) -> str:
        return self.procs.log("gateway")


def sim_state(url: str) -> dict:
    return httpx.get(url + "/admin/state", timeout=5).json()


def sim_metric(url: str, name: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture
def stack(tmp_path):
    with Processes(log_dir=tmp_path / "logs") as procs:
        yield Stack(procs, tmp_path)
