"""The real-engine tier: real vLLM servers (the CPU build, the tiny model) as fixtures.

`make test-vllm` builds the environment (tests/real_vllm/engine_env.py) and points HOLDBACK_VLLM_PYTHON and
HOLDBACK_VLLM_MODEL at it; without them every test here is skipped with the command that runs them. The servers
start as vLLM's own entrypoint does (`python -m vllm.entrypoints.openai.api_server`), each in its own process
group, and stop with SIGTERM to the group, so the `EngineCore` child that a SIGKILL of the API server would
orphan is reaped too.
"""

from __future__ import annotations

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

from tests.support import free_port, renice_session

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


# vLLM's environment for this machine: 1 GiB of KV cache, no model hub, no usage reports leaving the machine.
# The model runs inside the engine-core process (the "uni" executor, which the CPU build allows only with
# VLLM_ENABLE_V1_MULTIPROCESSING=0: that variable moves the executor in-process, the engine core stays a process of
# its own). With the default "mp" executor each server imported torch and vLLM three times, one process after the
# other (API server, engine core, worker): two imports start in 20 s where three took 36 s on a quiet core, and
# the engine core no longer hands every step to a worker process on the same CPU (a decode step 2.7 ms against
# 3.6 ms, a request's round trip 6 ms against 8-10 ms). What the tier asks of vLLM (its API, scheduler, aborts,
# metrics) is the same code either way.
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
              "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
              "VLLM_ENABLE_RESPONSES_API_STORE": "1"}
ENGINE_ARGS = ("--distributed-executor-backend", "uni")


# Who gets the CPU first. Two busy vLLM engines kept 21 threads runnable on the two cores and the rest of the
# machine (the gateway, the worker, Redis, the test itself) got no CPU for 9-12 s at a time: health probes timed out,
# a worker's heartbeats lapsed and its own requests were requeued, and a test's wait missed the state it waited for.
# Under a GPU the engine does not compete with the stack for the CPU at all. So the stack under test (this process
# and the holdback processes the tier starts) runs ahead of the engines, and the engines level with whatever else
# the machine runs: put behind everything (nice 19), an engine got nothing beside a CPU burner at nice 0 and took
# 150 s to start. Where this process may not raise the stack (not root), the engines go behind everything instead.
STACK_NICE, ENGINE_NICE, ENGINE_BEHIND_NICE = -10, 0, 19
# Each engine runs on one CPU of its own (the API server and its engine processes, and vLLM's OpenMP threads):
# unpinned, vLLM's engine-core process polled its worker on the other CPU too, and a second engine took both.
FIRST_CPU, SECOND_CPU = 1, 0


@dataclass
class _Priorities:
    stack_raised: bool = False

    @property
    def engine_nice(self) -> int:
        return ENGINE_NICE if self.stack_raised else ENGINE_BEHIND_NICE

    @property
    def stack_nice(self) -> int | None:
        return STACK_NICE if self.stack_raised else None


PRIORITIES = _Priorities()


@pytest.fixture(autouse=True, scope="session")
def _needs_the_engine() -> Iterator[None]:
    require_engine()
    before = _session_nice(os.getpid())
    PRIORITIES.stack_raised = renice_session(os.getpid(), STACK_NICE)
    yield
    if PRIORITIES.stack_raised:  # the session is the shell's that ran make: leave it as it was
        renice_session(os.getpid(), before)


def _session_nice(pid: int) -> int:
    try:  # "/autogroup-85 nice 0"
        return int(Path(f"/proc/{pid}/autogroup").read_text().split()[-1])
    except (OSError, ValueError, IndexError):
        return os.getpriority(os.PRIO_PROCESS, pid)


def _behind_the_stack(pid: int) -> None:
    """The server's priority and its session's (the engine processes it starts later inherit both)."""
    renice_session(pid, PRIORITIES.engine_nice)


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
    context: int = CONTEXT  # --max-model-len

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "VllmServer":
        cmd = [PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", MODEL, "--served-model-name",
               self.served, "--host", "127.0.0.1", "--port", str(self.port), "--enforce-eager", "--dtype",
               DTYPE, "--max-model-len", str(self.context), *ENGINE_ARGS, *self.args]
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


@dataclass
class _SharedEngine:
    """The tier's shared server, started by the first test that asks for it and stopped after the last one: the
    tier runs those tests first (see pytest_collection_modifyitems), so the modules with engines of their own
    run after it is gone."""

    server: VllmServer | None = None

    def get(self, logs: Path) -> VllmServer:
        if self.server is None:
            server = VllmServer(logs / "shared.log", cpu=FIRST_CPU,
                                args=("--enable-log-requests", "--trust-request-chat-template")).start()
            try:
                server.wait_ready()
            except BaseException:
                server.stop()
                raise
            self.server = server
        return self.server

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


SHARED = _SharedEngine()


@pytest.fixture
def vllm(engine_logs) -> VllmServer:
    """The tier's shared server: vLLM's defaults (prefix caching on, no prompt-token details), a log line for
    each request it aborts (`--enable-log-requests`), which is how a test sees an eviction reach the engine, and
    a request's own `chat_template` accepted (`--trust-request-chat-template`), so a test renders its chats with
    another template than the tiny model's without a server of its own."""
    return SHARED.get(engine_logs)


def pytest_collection_modifyitems(config, items):  # noqa: ANN001
    """The tier's tests that use the shared server first, each group in its file order: one engine at a time
    but where a test needs two. (This hook sees the whole suite's items: only the tier's are moved.)"""
    here = Path(__file__).parent
    places = [i for i, item in enumerate(items) if here in item.path.parents]
    ordered = sorted((items[i] for i in places), key=lambda item: "vllm" not in item.fixturenames)
    for i, item in zip(places, ordered):
        items[i] = item


def pytest_runtest_teardown(item, nextitem):  # noqa: ANN001
    if nextitem is None or "vllm" not in nextitem.fixturenames:
        SHARED.stop()


@pytest.fixture
def one_at_a_time_vllm(engine_logs, request) -> Iterator[VllmServer]:
    """A server a test may kill, started for that test alone on the other CPU, running one sequence at a time
    (`--max-num-seqs 1`): the tiny model streams 480 tokens in under 0.25 s, so only a queue inside vLLM keeps
    requests in flight there long enough for a test to kill it under them."""
    server = VllmServer(engine_logs / f"{request.node.name}.log", cpu=SECOND_CPU, args=("--max-num-seqs", "1"))
    try:
        yield server.start().wait_ready()
    finally:
        server.stop()
