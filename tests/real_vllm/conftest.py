"""The real-engine tier: real vLLM servers (the CPU build, the tiny model) as fixtures.

`make test-vllm` builds the environment (tests/real_vllm/engine_env.py) and points HOLDBACK_VLLM_PYTHON and
HOLDBACK_VLLM_MODEL at it; without them every test here is skipped with the command that runs them. The servers
start as vLLM's own entrypoint does (`python -m vllm.entrypoints.openai.api_server`), each in its own process
group, and stop with SIGTERM to the group, so the `EngineCore` child that a SIGKILL of the API server would
orphan is reaped too.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import httpx
import psutil
import pytest

from tests.support import free_port

PYTHON = os.environ.get("HOLDBACK_VLLM_PYTHON", "")
MODEL = os.environ.get("HOLDBACK_VLLM_MODEL", "")
SERVED = "tiny"
CONTEXT = 512
# float32, not bfloat16: with bfloat16 on a CPU that reports AMX, vLLM 0.32 runs its AMX attention kernel
# (`cpu_attention_with_kv_cache`), which died with SIGILL on our machines after working for a while on the same
# one; float32 takes the AVX-512 kernel. The model is tiny, so the cost is nothing.
DTYPE = os.environ.get("HOLDBACK_VLLM_DTYPE", "float32")
START_TIMEOUT = float(os.environ.get("HOLDBACK_VLLM_START_TIMEOUT", "300"))



def require_engine() -> None:
    if not (PYTHON and MODEL):
        pytest.skip("the real-engine tier runs under `make test-vllm`, which builds vLLM's CPU environment and "
                    "sets HOLDBACK_VLLM_PYTHON and HOLDBACK_VLLM_MODEL")


@pytest.fixture(autouse=True, scope="session")
def _needs_the_engine() -> None:
    require_engine()

# vLLM's environment for this machine: 1 GiB of KV cache, no model hub, no usage reports leaving the machine.
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
              "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


# The engines' CPU share behind everything else. Two busy vLLM engines kept 21 threads runnable on the two cores
# and the rest of the machine (the gateway, the worker, Redis, the test itself) got no CPU for 9-12 s at a time:
# health probes timed out, a worker's heartbeats lapsed and its own requests were requeued, and a test's wait
# missed the state it waited for. Under a GPU the engine does not compete with the stack for the CPU at all.
ENGINE_NICE = 19


def _behind_the_stack(pid: int) -> None:
    """Lower the server's priority and its session's (the kernel's autogroups share the CPU between sessions, and
    the server leads its own); the engine processes it starts later inherit both."""
    os.setpriority(os.PRIO_PROCESS, pid, ENGINE_NICE)
    with contextlib.suppress(OSError):  # no autogroups (kernel without them, or switched off): nice alone
        Path(f"/proc/{pid}/autogroup").write_text(str(ENGINE_NICE))


@dataclass
class VllmServer:
    """One vLLM API server and its engine processes."""

    log_path: Path
    served: str = SERVED
    args: tuple[str, ...] = ()
    api_key: str | None = None
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None
    # Pin the API server and its engine processes to this CPU (None: wherever the kernel puts them).
    cpu: int | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "VllmServer":
        cmd = [PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", MODEL, "--served-model-name",
               self.served, "--host", "127.0.0.1", "--port", str(self.port), "--enforce-eager", "--dtype",
               DTYPE, "--max-model-len", str(CONTEXT), *self.args]
        if self.api_key:
            cmd += ["--api-key", self.api_key]
        env = {**os.environ, **ENGINE_ENV}
        if self.cpu is not None:
            cmd = ["taskset", "-c", str(self.cpu), *cmd]
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(self.cpu)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log_path.open("wb"),
                                     stderr=subprocess.STDOUT, start_new_session=True)
        _behind_the_stack(self.proc.pid)
        return self

    def wait_ready(self, timeout: float = START_TIMEOUT) -> "VllmServer":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode} while starting:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"vLLM not healthy after {timeout:.0f}s:\n{self.log_tail()}")

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def metrics(self, **labels: str) -> dict[str, float]:
        """Every `vllm:` sample with these label values, summed over its other labels (engines...), by name."""
        out: dict[str, float] = {}
        for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            if not line.startswith("vllm:"):
                continue
            name, _, rest = line.partition("{") if "{" in line.split(" ", 1)[0] else (line.split(" ", 1)[0], "", "")
            if any(f'{k}="{v}"' not in rest for k, v in labels.items()):
                continue
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        return out

    def engine_pids(self) -> list[int]:
        try:
            return [p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc is None:
            return
        group = self.proc.pid
        leftovers = self.engine_pids()
        try:
            os.killpg(group, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        # A killed API server leaves its engine behind in the group: whatever is left goes now.
        for pid in leftovers:
            try:
                psutil.Process(pid).kill()
            except psutil.NoSuchProcess:
                pass
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if self.proc.poll() is None:
            self.proc.wait(10)

    def aborted(self) -> str:
        """vLLM's own record of the requests it aborted (their ids start with the caller's X-Request-Id)."""
        return "\n".join(line for line in self.log_path.read_text(errors="replace").splitlines()
                         if "Aborted request" in line)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""


@pytest.fixture(scope="session")
def engine_logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vllm-logs")


@pytest.fixture(scope="session")
def vllm(engine_logs) -> Iterator[VllmServer]:
    """The tier's shared server: vLLM's defaults (prefix caching on, no prompt-token details), and a log line for
    each request it aborts (`--enable-log-requests`), which is how a test sees an eviction reach the engine."""
    server = VllmServer(engine_logs / "shared.log", args=("--enable-log-requests",)).start()
    try:
        yield server.wait_ready()
    finally:
        server.stop()


@pytest.fixture
def one_at_a_time_vllm(engine_logs, request) -> Iterator[VllmServer]:
    """A server a test may kill, started for that test alone, running one sequence at a time
    (`--max-num-seqs 1`): the tiny model streams 480 tokens in under 0.25 s, so only a queue inside vLLM keeps
    requests in flight there long enough for a test to kill it under them."""
    server = VllmServer(engine_logs / f"{request.node.name}.log", args=("--max-num-seqs", "1")).start()
    try:
        yield server.wait_ready()
    finally:
        server.stop()
