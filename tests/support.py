"""Test support shared by every test folder: free ports, readiness waits and child processes.

Child processes are started the way an operator starts them, through the `holdback` CLI, and are
always stopped (SIGTERM, then SIGKILL) when the test ends, so no test leaves an orphan behind.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bench.lib import forkserver
from holdback.cli.listeners import free_port, free_port_block
from holdback.contract import wake_channel

REPO = Path(__file__).resolve().parent.parent

free_ports = free_port_block  # the tests' name for it


@contextlib.asynccontextmanager
async def served(app):  # noqa: ANN001, ANN201 - an aiohttp web.Application; yields its base URL
    """Serve an aiohttp app on a free loopback port for the length of the block: its base URL."""
    from aiohttp import web

    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    finally:
        await runner.cleanup()


def poll(predicate, timeout: float, what: str, detail=lambda: "", interval: float = 0.1):  # noqa: ANN001
    """Wait until `predicate()` is truthy and return its value; on timeout fail naming `what` and `detail()`.

    Tests wait for the state they need instead of sampling a race once or sleeping a fixed time: on a
    loaded two-core machine the state comes late, never early.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}\n{detail()}")
        time.sleep(interval)


class WakeListener:
    """Subscribed to the processors' wake channel (`holdback.contract.wake_channel`) from its creation: the batch
    ids published there since, for a test that waits for the wake-up naming its batch."""

    def __init__(self, connection, namespace: str):  # noqa: ANN001 (a redis.Redis)
        # Kept: a redis.Redis collected closes its pool's connections, the subscription's among them.
        self.connection = connection
        self.pubsub = connection.pubsub(ignore_subscribe_messages=True)
        self.pubsub.subscribe(wake_channel(namespace))
        self.heard: list[str] = []

    def named(self, batch_id: str) -> bool:
        message = self.pubsub.get_message(timeout=0.5)
        if message is not None:
            self.heard.append(message["data"].decode())
        return batch_id in self.heard

    def wait_for(self, batch_id: str, timeout: float, what: str, detail=lambda: "") -> None:  # noqa: ANN001
        poll(lambda: self.named(batch_id), timeout, what, lambda: f"heard {self.heard}\n{detail()}", interval=0)

    def close(self) -> None:
        self.pubsub.close()


def wait_http(url: str, timeout: float = 60.0, proc: subprocess.Popen | None = None) -> None:
    """Wait until GET url answers 2xx; fail early with the child's output if it died."""
    deadline = time.monotonic() + timeout
    last: Exception | str = "no answer"
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} was ready")
        try:
            r = httpx.get(url, timeout=1.0)
            if r.status_code < 300:
                return
            last = f"HTTP {r.status_code}: {r.text[:200]}"
        except httpx.HTTPError as exc:
            last = exc
        time.sleep(0.05)
    raise TimeoutError(f"{url} not ready after {timeout}s: {last}")


def renice_session(pid: int, nice: int) -> bool:
    """Set the CPU priority of `pid`'s session (its autogroup: the kernel shares the CPU between sessions first,
    then between the processes of one) and of the process itself; False where this process may not (a nice below
    0 needs root)."""
    try:
        os.setpriority(os.PRIO_PROCESS, pid, nice)
    except PermissionError:
        return False
    with contextlib.suppress(OSError):  # no autogroups (a kernel without them, or switched off): the nice alone
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))
    return True


class Processes:
    """Start `holdback ...` children and stop them all on exit. Each child leads its own session (so that a
    stop reaches everything it started), at `nice` when given (see renice_session)."""

    def __init__(self, env: dict[str, str] | None = None, log_dir: Path | None = None, nice: int | None = None):
        # No load balancer watches a test's gateways: one asked to stop stops accepting at once instead of after the
        # production grace (gateway/relays/drain.py); a test of the grace passes --drain-grace itself.
        self.env = {"HOLDBACK_GATEWAY_DRAIN_GRACE": "0", **os.environ, **(env or {})}
        self.log_dir = log_dir
        self.nice = nice
        self.children: list[tuple[subprocess.Popen, str]] = []

    def start(self, *args: str, name: str | None = None, env: dict[str, str] | None = None) -> subprocess.Popen:
        name = name or args[0]
        out = subprocess.DEVNULL
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            out = open(self.log_dir / f"{name}-{len(self.children)}.log", "wb")
        proc = forkserver.popen(
            [sys.executable, "-m", "holdback.cli", *args],
            cwd=REPO,
            env={**self.env, **(env or {})},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        if self.nice is not None:
            renice_session(proc.pid, self.nice)
        self.children.append((proc, name))
        return proc

    def stop(self, proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)

    def log(self, name: str, tail: int | None = 4000) -> str:
        """The logs of the children called `name`: the last `tail` characters of each (None: all of it)."""
        if self.log_dir is None:
            return ""
        return "\n".join(p.read_text(errors="replace")[-tail if tail else 0:]
                         for p in sorted(self.log_dir.glob(f"{name}-*.log")))

    def close(self, timeout: float = 10.0) -> None:
        """SIGTERM every child at once, then wait for all with one deadline (stopping them one by one
        costs each one's drain time in turn), then SIGKILL what is left."""
        running = [proc for proc, _ in reversed(self.children) if proc.poll() is None]
        for proc in running:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + timeout
        for proc in running:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(5)
        self.children.clear()

    def __enter__(self) -> "Processes":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# -- batches through the official client --------------------------------------------------------------------

TERMINAL_BATCH = ("completed", "failed", "expired", "cancelled")


def chat_lines(n: int, *, max_tokens: int, content: str = "question number {i}", model: str = "sim-model",
               extra_body: dict | None = None) -> list[str]:
    """n chat-completion input lines with custom ids req-0 .. req-(n-1)."""
    return [json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
                        "body": {"model": model, "max_tokens": max_tokens, **(extra_body or {}),
                                 "messages": [{"role": "user", "content": content.format(i=i)}]}})
            for i in range(n)]


def submit_batch(client, lines: list[str], window: str = "24h") -> str:  # noqa: ANN001
    """Upload the lines as a JSONL file and create a chat-completions batch from it; returns its id."""
    f = client.files.create(file=("input.jsonl", io.BytesIO("\n".join(lines).encode())), purpose="batch")
    return client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window=window).id


def wait_batch(client, batch_id: str, until, timeout: float, context=lambda: ""):  # noqa: ANN001
    """Poll until `until(batch)`; on timeout fail with the batch's state and `context()` (e.g. child logs)."""
    deadline = time.monotonic() + timeout
    batch = client.batches.retrieve(batch_id)
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if until(batch):
            return batch
        time.sleep(0.2)
    raise AssertionError(f"batch {batch_id} stuck at {batch.status} {batch.request_counts}\n{context()}")


class small_disk:
    """A tmpfs of `size` mounted at `path` for the test: a disk that really fills (ENOSPC). Skips the test
    where it cannot be mounted (not root, or a container without the capability); CI runs as root."""

    def __init__(self, path: Path, size: str = "4m"):
        self.path, self.size = path, size

    def __enter__(self) -> Path:
        import pytest

        if os.geteuid() != 0:
            pytest.skip("mounting a small tmpfs as a full disk needs root (CI runs as root)")
        self.path.mkdir(parents=True, exist_ok=True)
        made = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.size}", "tmpfs", str(self.path)],
                              capture_output=True, text=True)
        if made.returncode != 0:
            pytest.skip(f"this machine does not let root mount a tmpfs: {made.stderr.strip()}")
        return self.path

    def __exit__(self, *_exc: object) -> None:
        subprocess.run(["umount", "-l", str(self.path)], check=False)


@contextlib.asynccontextmanager
async def in_process_gateway(replicas: list[str], config: str = "", env: dict[str, str] | None = None):
    """A Gateway serving on a port of this process, in front of `replicas` with `config` (YAML) added; yields it
    and its URL."""
    from aiohttp import web

    from gateway.app import Gateway
    from gateway.settings import parse_config

    loaded = parse_config(f"replicas: {json.dumps(replicas)}\n{config}", "test.yaml", env or {})
    gw = Gateway(loaded)
    runner = web.AppRunner(gw.make_app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield gw, "http://127.0.0.1:%d" % site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    finally:
        await runner.cleanup()

