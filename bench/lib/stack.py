"""A whole holdback stack for one benchmark run, started through the CLI like an operator would.

Each run gets a fresh data dir (SQLite and an embedded Redis), fresh ports, its own gateway config
and simulated replicas; everything is stopped and the Redis shut down when the run ends.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from bench.lib import forkserver
from bench.lib.processes import stop_processes
from bench.lib.prometheus import parse_prometheus
from bench.lib.readiness import ProcessSet, free_port_block, wait_http

# The study's base gateway config (request-count control only), beside the study.
STUDY_GATEWAY_CONFIG = Path(__file__).resolve().parents[1] / "gateway-study.yaml"


@dataclass
class StackSpec:
    replicas: int = 1
    sim_args: list[str] = field(default_factory=list)
    gateway: dict = field(default_factory=dict)  # merged over the base gateway config
    # One simulator process per replica, so a drill can kill -9 a single replica.
    sim_per_replica: bool = False
    worker_concurrency: int = 64
    backoff_base: float = 2.0
    backoff_cap: float = 60.0
    worker_args: list[str] = field(default_factory=list)  # extra `holdback worker` flags, e.g. --no-resume


class Stack(ProcessSet):
    """Start with `with Stack(spec, log_dir) as stack:`; `stack.start_workers()` when batch should begin."""

    def __init__(self, spec: StackSpec, log_dir: Path):
        self.spec = spec
        self.log_dir = log_dir
        self.data_dir = Path(tempfile.mkdtemp(prefix="hbb-"))
        base = free_port_block(4 + spec.replicas)
        self.api_port, self.gateway_port, self.sim_port = base, base + 1, base + 2
        self.admin_key = "hb-admin-" + secrets.token_urlsafe(12)
        self.realtime_key = "hb-rt-" + secrets.token_urlsafe(12)
        self.batch_key = "hb-bw-" + secrets.token_urlsafe(12)
        self.tenant_key: str | None = None
        self.procs: dict[str, subprocess.Popen] = {}
        self.env = {
            **os.environ,
            "HOLDBACK_DATA_DIR": str(self.data_dir),
            "HOLDBACK_ADMIN_KEY": self.admin_key,
            "HOLDBACK_GATEWAY_URL": self.gateway_url,
            "HOLDBACK_GATEWAY_KEY": self.batch_key,
            "HOLDBACK_GATEWAY_BATCH_KEY": self.batch_key,
            "HOLDBACK_GATEWAY_REALTIME_KEY": self.realtime_key,
            "PYTHONUNBUFFERED": "1",
        }
        for var in ("DATABASE_URL", "REDIS_URL"):
            self.env.pop(var, None)

    # -- addresses ---------------------------------------------------------
    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    @property
    def gateway_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    @property
    def replica_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{self.sim_port + i}" for i in range(self.spec.replicas)]

    # -- lifecycle ---------------------------------------------------------
    def _start(self, name: str, *args: str) -> subprocess.Popen:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_dir / f"{name}.log", "ab") as out:
            proc = forkserver.popen([sys.executable, "-m", "holdback.cli", *args], env=self.env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        self.procs[name] = proc
        return proc

    def _wait(self, name: str, url: str, timeout: float = 60.0) -> None:
        wait_http(url, self.procs[name], timeout, what=f"{name} (log {self.log_dir / (name + '.log')})")

    def gateway_config(self) -> dict:
        # The study's own base config: request-count control only (KV admission off), see the file.
        config = yaml.safe_load(STUDY_GATEWAY_CONFIG.read_text())
        config["replicas"] = self.replica_urls
        return _merge(config, self.spec.gateway)

    def start(self) -> "Stack":
        db = self.data_dir / "holdback.db"
        subprocess.run([sys.executable, "-m", "holdback.cli", "db", "upgrade"], env=self.env, check=True,
                       stdout=subprocess.DEVNULL)
        assert db.exists(), "db upgrade did not create the SQLite file"
        cfg = self.gateway_config_path
        cfg.write_text(yaml.safe_dump(self.gateway_config(), sort_keys=False))
        if self.spec.sim_per_replica:
            for i in range(self.spec.replicas):
                self._start(f"sim-{i}", "sim", "--port", str(self.sim_port + i), "--replicas", "1",
                            *self.spec.sim_args)
        else:
            self._start("sim", "sim", "--port", str(self.sim_port), "--replicas", str(self.spec.replicas),
                        *self.spec.sim_args)
        self._start("gateway", "gateway", "--config", str(cfg), "--port", str(self.gateway_port))
        self._start("api", "api", "--port", str(self.api_port))
        self._start("processor", "processor", "--poll-interval", "0.1")
        for i in range(self.spec.replicas):
            self._wait(self.sim_process(i), f"{self.replica_urls[i]}/health")
        self._wait("gateway", f"{self.gateway_url}/health")
        # The gateway answers /health before its first replica health check; runs start once it serves.
        wait_http(f"{self.gateway_url}/v1/models", self.procs["gateway"], 60.0, what="gateway replicas",
                  headers={"Authorization": f"Bearer {self.realtime_key}"})
        self._wait("api", f"{self.api_url}/readyz")
        r = httpx.post(f"{self.api_url}/admin/keys", json={"tenant": "study"},
                       headers={"Authorization": f"Bearer {self.admin_key}"}, timeout=10)
        r.raise_for_status()
        self.tenant_key = r.json()["key"]
        return self

    @property
    def gateway_config_path(self) -> Path:
        return self.data_dir / "gateway.yaml"

    def sim_process(self, replica: int) -> str:
        """Name of the process serving replica `replica` (for kill)."""
        return f"sim-{replica}" if self.spec.sim_per_replica else "sim"

    def kill(self, name: str) -> None:
        """kill -9 one started process (its whole process group), as a crash would."""
        proc = self.procs[name]
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)

    def push_gateway_config(self, overrides: dict) -> None:
        """Write the base config merged with `overrides` to the gateway's file and SIGHUP it (a live push)."""
        self.gateway_config_path.write_text(yaml.safe_dump(_merge(self.gateway_config(), overrides), sort_keys=False))
        self.procs["gateway"].send_signal(signal.SIGHUP)

    def start_workers(self) -> None:
        self._start("worker", "worker", "-n", str(self.spec.worker_concurrency),
                    "--backoff-base", str(self.spec.backoff_base), "--backoff-cap", str(self.spec.backoff_cap),
                    *self.spec.worker_args)

    def stop(self) -> None:
        stop_processes(reversed(list(self.procs.values())), 20)
        subprocess.run([sys.executable, "-c",
                        "import sys; from pathlib import Path; from holdback.broker import stop_embedded_redis; "
                        "stop_embedded_redis(Path(sys.argv[1]))", str(self.data_dir)],
                       env=self.env, check=False)
        shutil.rmtree(self.data_dir, ignore_errors=True)

    # -- public read-outs --------------------------------------------------
    def gateway_state(self) -> dict:
        return httpx.get(f"{self.gateway_url}/admin/state", headers=self.admin_headers, timeout=5).json()

    @property
    def admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_key}"}

    def sim_metrics(self) -> list[dict[str, float]]:
        return [parse_prometheus(httpx.get(f"{u}/metrics", timeout=5).text) for u in self.replica_urls]

    def gateway_metrics(self) -> dict[str, float]:
        return parse_prometheus(httpx.get(f"{self.gateway_url}/metrics", timeout=5).text)

    def sim_states(self, replicas: list[int] | None = None, history_since: float | None = None) -> list[dict]:
        params = {"history_since": history_since} if history_since is not None else None
        return [httpx.get(f"{self.replica_urls[i]}/admin/state", params=params, timeout=5).json()
                for i in (range(self.spec.replicas) if replicas is None else replicas)]

    def batch_rows(self, batch_id: str) -> list[dict]:
        """Every request row of a batch, as the Batch API's admin route pages them."""
        rows: list[dict] = []
        after = None
        while True:
            params = {"limit": 1000, **({"after": after} if after else {})}
            page = httpx.get(f"{self.api_url}/admin/batches/{batch_id}/requests", params=params,
                             headers=self.admin_headers, timeout=30).json()
            rows.extend(page["data"])
            if not page.get("has_more") or not page["data"]:
                return rows
            after = page["data"][-1]["id"]

    def wait_evicted_done(self, batch_id: str, timeout: float) -> bool:
        """Wait until every request of the batch that was evicted has a final result (its retry completed)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            page = httpx.get(f"{self.api_url}/admin/batches/{batch_id}/requests",
                             params={"evicted": "true", "unfinished": "true", "limit": 1}, headers=self.admin_headers,
                             timeout=30).json()
            if not page["data"]:
                return True
            time.sleep(0.5)
        return False


def _merge(base: dict, over: dict) -> dict:
    out = json.loads(json.dumps(base))
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out
