"""The small platform `holdback demo` runs on: a `holdback up` of its own, in a fresh data dir on free ports, with
one simulated replica sized to saturate (few slots, a KV pool that binds) and the embedded Redis and SQLite. Its
gateway runs the shipped config with two changes a deployment makes: the replica's slots (`engine.maxNumSeqs`,
its --max-num-seqs, as docs/real-vllm.md says; untold, the gateway learns them about 2 s into the replica's first
saturation, which can fall inside the demo's short window) and, for a single tenant, its KV shares at 1.0
(docs/choosing-settings.md; the shipped 0.15 would let the demo's one tenant hold 15% of the KV).

It is started from this environment minus every `HOLDBACK_*`, `DATABASE_URL` and `REDIS_URL` variable, so a
platform the user already runs (`make up`, a PostgreSQL, real replicas) is neither used nor disturbed. It dies
with the demo however the demo ends: stopped by SIGTERM on the way out, and by the kernel's parent-death signal
if the demo is killed outright.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from holdback.cli.listeners import free_port, free_port_block
from holdback.cli.supervisor import spawn
from gateway.settings.loading import DEFAULT_CONFIG_PATH
from holdback.cli.up import LOCAL_KEYS

READY_LINE = "holdback is up."


@dataclass(frozen=True)
class ReplicaShape:
    """The simulated replica's size and speed: `slots` sequences at once (vLLM's --max-num-seqs), a KV pool of
    `kv_blocks` blocks of 16 tokens, and a decode step of about `step_ms` (a 7-8B model's on a GPU)."""

    slots: int
    kv_blocks: int
    step_ms: float

    def sim_args(self) -> list[str]:
        return [f"--sim-arg=--max-num-seqs={self.slots}", f"--sim-arg=--num-blocks={self.kv_blocks}",
                f"--sim-arg=--decode-base-ms={self.step_ms}"]


class DemoPlatform:
    def __init__(self, shape: ReplicaShape, worker_concurrency: int, keep: bool = False):
        self.shape, self.worker_concurrency, self.keep = shape, worker_concurrency, keep
        self.data_dir = Path(tempfile.mkdtemp(prefix="holdback-demo-"))
        self.api_port, self.gateway_port, self.sim_port = free_port(), free_port(), free_port_block(1)
        self.api_url, self.gateway_url, self.replica_url = (f"http://127.0.0.1:{port}" for port in (
            self.api_port, self.gateway_port, self.sim_port))
        self.proc: subprocess.Popen | None = None
        self.keys: dict[str, str] = {}

    @property
    def log_path(self) -> Path:
        return self.data_dir / "up.log"

    def start(self, timeout: float = 180.0) -> None:
        """Start it and wait until every component is ready; RuntimeError with the log's tail if it is not."""
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("HOLDBACK_") and k not in ("DATABASE_URL", "REDIS_URL")}
        env.update(HOLDBACK_DATA_DIR=str(self.data_dir), PYTHONUNBUFFERED="1")
        config = yaml.safe_load(DEFAULT_CONFIG_PATH.read_text())
        config["admission"].update(tenantMaxShare=1.0, tenantSoftShare=1.0)
        config.setdefault("engine", {})["maxNumSeqs"] = self.shape.slots
        (self.data_dir / "gateway.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        command = [sys.executable, "-P", "-m", "holdback.cli", "up", "--api-port", str(self.api_port),
                   "--gateway-port", str(self.gateway_port), "--sim-port", str(self.sim_port), "--sim-replicas", "1",
                   "--processor-metrics-port", str(free_port()), "--worker-metrics-port", str(free_port()),
                   "--worker-concurrency", str(self.worker_concurrency), "--gateway-config", "gateway.yaml",
                   *self.shape.sim_args()]
        with open(self.log_path, "ab") as log:
            self.proc = spawn(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=self.data_dir)
        deadline = time.monotonic() + timeout
        while READY_LINE not in self.log_path.read_text(errors="replace"):
            if self.proc.poll() is not None:
                raise RuntimeError(f"the demo's platform exited with {self.proc.returncode} while starting:\n"
                                   + self.tail())
            if time.monotonic() > deadline:
                raise RuntimeError(f"the demo's platform was not up after {timeout:.0f} s:\n" + self.tail())
            time.sleep(0.2)
        self.keys = json.loads((self.data_dir / LOCAL_KEYS).read_text())

    def tail(self, lines: int = 20) -> str:
        text = self.log_path.read_text(errors="replace").splitlines() if self.log_path.exists() else []
        return "\n".join(text[-lines:]) + f"\n(the whole log: {self.log_path})"

    def stop(self) -> None:
        """SIGTERM, as an operator stops `holdback up`; it stops its children in turn. Killed after 60 s."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        if not self.keep:
            shutil.rmtree(self.data_dir, ignore_errors=True)
