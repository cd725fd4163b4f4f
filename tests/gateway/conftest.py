"""Fixtures for gateway integration tests: real simulator replicas and real gateways as subprocesses.

The flow-control, eviction and admission modules in BOTH_MODES run every test twice: against the gateway as one
process and as `holdback gateway --workers 2` (one flow-control process, two relays); the ids say which.
"""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
import pytest

from tests.support import Processes, free_port, free_ports, wait_http


# Modules whose tests run against both gateway modes (the rest use one process).
BOTH_MODES = ("tests.gateway.test_gateway_sim", "tests.gateway.test_kv_admission_sim",
              "tests.gateway.test_reserve_sim", "tests.gateway.test_pools_sim")
MODES = {"one-process": 1, "workers-2": 2}


def pytest_generate_tests(metafunc):  # noqa: ANN001
    if "stack" in metafunc.fixturenames and metafunc.module.__name__ in BOTH_MODES:
        metafunc.parametrize("gateway_workers", list(MODES.values()), ids=list(MODES), indirect=True)


@pytest.fixture
def gateway_workers(request) -> int:  # noqa: ANN001
    """Relay processes of the gateways a test starts (1: the single-process gateway)."""
    return getattr(request, "param", 1)


class Stack:
    """Starts `holdback sim` and `holdback gateway` children for one test and reads their state."""

    def __init__(self, procs: Processes, tmp: Path, workers: int = 1):
        self.procs = procs
        self.tmp = tmp
        self.workers = workers

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
        workers = ("--workers", str(self.workers)) if self.workers > 1 else ()
        proc = self.procs.start("gateway", "--config", str(path), "--port", str(port),
                                "--replicas", ",".join(replicas), *workers, name="gateway", env=env)
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
        return httpx.get(self.url + "/admin/state").json()

    def band(self, priority: int) -> dict:
        return next(b for b in self.state()["bands"] if b["priority"] == priority)

    def reload(self) -> None:
        self.proc.send_signal(signal.SIGHUP)

    def log(self) -> str:
        """The whole log: a test counting events must not lose the early ones to a tail."""
        return self.procs.log("gateway", tail=None)


def sim_state(url: str) -> dict:
    return httpx.get(url + "/admin/state").json()


def sim_metric(url: str, name: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):  # noqa: ANN001
    report = yield
    if report.when == "call":
        item.stash[_CALL_FAILED] = report.failed
    return report


_CALL_FAILED = pytest.StashKey[bool]()


@pytest.fixture
def stack(request, tmp_path, gateway_workers):
    with Processes(log_dir=tmp_path / "logs") as procs:
        yield Stack(procs, tmp_path, gateway_workers)
        if request.node.stash.get(_CALL_FAILED, False):
            # A failure on a loaded machine is read from what the children logged, not rerun: pytest shows this
            # in the test's teardown output.
            for name in ("gateway", "sim"):
                print(f"--- {name} log (last 20000 characters) ---\n{procs.log(name, tail=20000)}")
