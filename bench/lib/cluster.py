"""The Compose topology without containers: PostgreSQL, Redis and an S3 server shared by API servers,
processors and worker processes, each on its own host (see bench/lib/hosts.py), plus a gateway and
simulated replicas. Used by the multi-host drill test and by bench/scale_out.py.

Nothing is shared on disk: each process has its own data dir, so files must travel through S3.
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
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import httpx
import redis
from rq.job import Job
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from bench.lib.hosts import HostNetwork
from bench.lib.processes import stop_processes
from bench.lib.readiness import ProcessSet, free_port, wait_http
from bench.lib.s3_server import S3Server

POSTGRES_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
REDIS_URL = "redis://127.0.0.1:6379/0"


@dataclass
class ClusterSpec:
    apis: int = 2
    processors: int = 2
    workers: int = 3  # worker processes, one per host
    worker_concurrency: int = 16
    netns: bool = True  # ask for one network namespace per process (falls back to loopback)
    postgres_url: str = POSTGRES_URL
    redis_url: str = REDIS_URL
    # Short lease and graces so a killed processor's or worker's work moves within seconds, not minutes.
    processor_args: tuple[str, ...] = ("--poll-interval", "0.1", "--lease-seconds", "10", "--reconcile-interval", "1",
                                       "--reconcile-grace", "5", "--running-grace", "5")
    worker_args: tuple[str, ...] = ("--heartbeat-ttl", "6", "--backoff-base", "0.2", "--backoff-cap", "2")
    # Zero-latency replicas: the runs measure and stress holdback itself, not the model.
    sim_args: tuple[str, ...] = ("--replicas", "2", "--zero-latency")


@dataclass
class Cluster(ProcessSet):
    spec: ClusterSpec
    log_dir: Path
    network: HostNetwork | None = None
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    urls: dict[str, str] = field(default_factory=dict)
    tenant_key: str = ""

    def __post_init__(self) -> None:
        self.tag = uuid.uuid4().hex[:8]
        self.work = Path(tempfile.mkdtemp(prefix="hbc-"))
        self.admin_key = "hb-admin-" + secrets.token_hex(8)
        self.namespace = f"hbc-{self.tag}"
        self.database = f"hbc_{self.tag}"
        self.s3: S3Server | None = None

    # -- topology -------------------------------------------------------------------------------------

    @property
    def hosts(self) -> list[str]:
        s = self.spec
        return (["gateway", "replicas"] + [f"api-{i}" for i in range(1, s.apis + 1)]
                + [f"processor-{i}" for i in range(1, s.processors + 1)]
                + [f"worker-{i}" for i in range(1, s.workers + 1)])

    def start(self) -> "Cluster":
        self.network = HostNetwork.create(self.hosts, want_netns=self.spec.netns)
        net = self.network
        admin = create_engine(self.spec.postgres_url, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{self.database}"'))
        admin.dispose()
        pg = make_url(self.spec.postgres_url)
        pg_host, pg_port = net.forward(pg.host or "127.0.0.1", pg.port or 5432)
        rd = redis.Redis.from_url(self.spec.redis_url).connection_pool.connection_kwargs
        rd_host, rd_port = net.forward(rd.get("host", "127.0.0.1"), rd.get("port", 6379))
        self.s3 = S3Server.start(host=net.infra_address)
        bucket = self.s3.bucket()
        self.database_url = pg.set(host=pg_host, port=pg_port, database=self.database).render_as_string(
            hide_password=False)
        redis_url = f"redis://{rd_host}:{rd_port}/{rd.get('db', 0)}"
        gateway_port, sim_port = free_port(), free_port()
        self.urls["gateway"] = f"http://{net.addresses['gateway']}:{gateway_port}"
        replicas = ",".join(f"http://{net.addresses['replicas']}:{sim_port + i}" for i in range(2))
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("HOLDBACK_")},
            "DATABASE_URL": self.database_url, "REDIS_URL": redis_url, "HOLDBACK_REDIS_NAMESPACE": self.namespace,
            "HOLDBACK_ADMIN_KEY": self.admin_key, "HOLDBACK_GATEWAY_URL": self.urls["gateway"],
            "PYTHONUNBUFFERED": "1", **self.s3.env(bucket, prefix=self.tag),
        }
        self._run("replicas", "sim", "--host", net.bind_address("replicas"), "--port", str(sim_port),
                  *self.spec.sim_args)
        self._run("gateway", "gateway", "--host", net.bind_address("gateway"), "--port", str(gateway_port),
                  "--replicas", replicas)
        for host in self.hosts:
            if host.startswith("api-"):
                port = free_port()
                self.urls[host] = f"http://{net.addresses[host]}:{port}"
                # Every API migrates on start, all at once, on the empty database: the advisory lock's job.
                self._run(host, "api", "--host", net.bind_address(host), "--port", str(port), "--log-level", "warning")
        for host in self.hosts:
            if host.startswith("api-"):
                wait_http(f"{self.urls[host]}/readyz", self.procs[host], 120, what=host)
        for host in self.hosts:
            if host.startswith("processor-"):
                self._run(host, "processor", "--id", host, *self.spec.processor_args)
            elif host.startswith("worker-"):
                self._run(host, "worker", "-n", str(self.spec.worker_concurrency), "--name",
                          f"{self.namespace}.{host}", *self.spec.worker_args)
        wait_http(f"{self.urls['gateway']}/health", self.procs["gateway"], 60, what="gateway")
        r = httpx.post(f"{self.urls['api-1']}/admin/keys", json={"tenant": "drill"},
                       headers={"authorization": f"Bearer {self.admin_key}"}, timeout=30)
        r.raise_for_status()
        self.tenant_key = r.json()["key"]
        return self

    def _run(self, host: str, *args: str) -> None:
        assert self.network is not None
        data_dir = self.work / host
        data_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_dir / f"{host}.log", "ab")
        argv = self.network.command(host, [sys.executable, "-m", "holdback.cli", *args])
        self.procs[host] = subprocess.Popen(argv, env={**self.env, "HOLDBACK_DATA_DIR": str(data_dir)},
                                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()

    def kill(self, host: str) -> None:
        """SIGKILL the host's process: no shutdown hooks, no requeue; like pulling the plug."""
        proc = self.procs[host]
        proc.killed_on_purpose = True  # type: ignore[attr-defined]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)

    @property
    def admin_database_url(self) -> str:
        """This run's database as the machine (not a host) reaches it."""
        return make_url(self.spec.postgres_url).set(database=self.database).render_as_string(hide_password=False)

    # -- the Batch API, spread over the API servers ---------------------------------------------------

    def http(self, api: str) -> httpx.Client:
        return httpx.Client(base_url=self.urls[api], headers={"authorization": f"Bearer {self.tenant_key}"},
                            timeout=120)

    def submit(self, lines: int, *, upload_via: str = "api-1", create_via: str | None = None) -> str:
        body = "".join(json.dumps({
            "custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "sim-model", "messages": [{"role": "user", "content": f"hello {i}"}], "max_tokens": 8},
        }) + "\n" for i in range(lines)).encode()
        with self.http(upload_via) as http:
            file = http.post("/v1/files", data={"purpose": "batch"},
                             files={"file": ("drill.jsonl", body, "application/jsonl")}).raise_for_status().json()
        with self.http(create_via or upload_via) as http:
            batch = http.post("/v1/batches", json={"input_file_id": file["id"], "endpoint": "/v1/chat/completions",
                                                   "completion_window": "24h"}).raise_for_status().json()
        return batch["id"]

    def batch(self, batch_id: str, api: str = "api-1") -> dict:
        with self.http(api) as http:
            return http.get(f"/v1/batches/{batch_id}").raise_for_status().json()

    def wait_batch(self, batch_id: str, until: Callable[[dict], bool], timeout: float, what: str) -> dict:
        deadline = time.monotonic() + timeout
        apis = [h for h in self.hosts if h.startswith("api-")]
        i = 0
        while time.monotonic() < deadline:
            batch = self.batch(batch_id, apis[i % len(apis)])  # alternate: every API answers for the batch
            i += 1
            if until(batch):
                return batch
            for host, proc in self.procs.items():
                if proc.poll() is not None and not getattr(proc, "killed_on_purpose", False):
                    raise RuntimeError(f"{host} exited with {proc.returncode}; see {self.log_dir / (host + '.log')}")
            time.sleep(0.5)
        raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}; last {batch['request_counts']}, "
                           f"status {batch['status']}; logs in {self.log_dir}")

    # -- shutdown -------------------------------------------------------------------------------------

    def stop(self) -> None:
        stop_processes(self.procs.values(), 30)
        if self.s3 is not None:
            self.s3.stop()
        self._drop_redis_keys()
        admin = create_engine(self.spec.postgres_url, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{self.database}" WITH (FORCE)'))
        admin.dispose()
        if self.network is not None:
            self.network.close()
        shutil.rmtree(self.work, ignore_errors=True)

    def _drop_redis_keys(self) -> None:
        r = redis.Redis.from_url(self.spec.redis_url)
        for key in r.scan_iter(match=f"*{self.namespace}*", count=1000):
            r.delete(key)
        # RQ keeps job hashes under rq:job:<row id>, outside our namespace: remove this run's.
        engine = create_engine(self.admin_database_url)
        try:
            with engine.connect() as conn:
                ids = conn.execute(text("SELECT id FROM request_rows")).scalars().all()
        except Exception:  # noqa: BLE001 - the database may never have been migrated
            ids = []
        finally:
            engine.dispose()
        for start in range(0, len(ids), 1000):
            r.delete(*(Job.key_for(i) for i in ids[start:start + 1000]))
