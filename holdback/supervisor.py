"""`holdback up`: the whole platform on one machine, as supervised child processes.

With no configuration it starts an embedded Redis, migrates SQLite under ./data and runs the API
server with the dashboard, a processor, a worker pool, the gateway and two simulated vLLM replicas.
A child that dies is reported and restarted with backoff; Ctrl-C (or SIGTERM) stops everything,
children first, then the embedded Redis. DATABASE_URL, REDIS_URL and --replicas switch to
PostgreSQL, an external Redis and real vLLM.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from holdback.broker import ensure_embedded_redis, stop_embedded_redis
from holdback.db import make_engine, make_sessionmaker, transaction
from holdback.schema import upgrade
from holdback.settings import Settings
from holdback.tenancy import create_key

LOCAL_KEYS = "local-keys.json"


@dataclass
class Child:
    name: str
    args: list[str]
    ready_url: str | None = None
    proc: subprocess.Popen | None = None
    restarts: int = 0
    next_start: float = 0.0
    log_path: Path | None = None
    started_at: float = field(default=0.0)


def _log(event: str, **fields: object) -> None:
    parts = " ".join(f"{k}={v}" for k, v in fields.items())
    print(f"[holdback up] {event} {parts}".rstrip(), flush=True)


def local_keys(settings: Settings, session_factory) -> dict[str, str]:  # noqa: ANN001
    """Keys for this machine's platform, made once and kept in the data dir (owner-only file)."""
    path = settings.data_dir / LOCAL_KEYS
    if path.exists():
        keys = json.loads(path.read_text())
        if {"admin", "tenant", "realtime", "batch_gateway", "standard"} <= keys.keys():
            return keys
    with transaction(session_factory) as session:
        tenant_key = create_key(session, "default")
    keys = {
        "admin": settings.admin_key or "hb-admin-" + secrets.token_urlsafe(18),
        "tenant": tenant_key,
        "realtime": "hb-rt-" + secrets.token_urlsafe(18),
        "standard": "hb-std-" + secrets.token_urlsafe(18),
        "batch_gateway": "hb-bw-" + secrets.token_urlsafe(18),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(keys, indent=2))
    path.chmod(0o600)
    return keys


def build_children(args: argparse.Namespace, settings: Settings) -> list[Child]:
    host = args.host
    children: list[Child] = []
    replicas = args.replicas
    if not replicas:
        children.append(Child("sim", ["sim", "--host", host, "--port", str(args.sim_port), "--replicas",
                                      str(args.sim_replicas), *args.sim_args],
                              ready_url=f"http://{host}:{args.sim_port}/health"))
        replicas = ",".join(f"http://{host}:{args.sim_port + i}" for i in range(args.sim_replicas))
    gateway = ["gateway", "--host", host, "--port", str(args.gateway_port), "--replicas", replicas]
    if args.gateway_config:
        gateway += ["--config", str(args.gateway_config)]
    children.append(Child("gateway", gateway, ready_url=f"http://{host}:{args.gateway_port}/health"))
    children.append(Child("api", ["api", "--host", host, "--port", str(args.api_port)],
                          ready_url=f"http://{host}:{args.api_port}/healthz"))
    children.append(Child("processor", ["processor"]))
    children.append(Child("worker", ["worker", "-n", str(args.worker_concurrency)]))
    return children


class Supervisor:
    def __init__(self, children: list[Child], env: dict[str, str], log_dir: Path):
        self.children = children
        self.env = env
        self.log_dir = log_dir
        self.stopping = False

    def start(self, child: Child) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        child.log_path = self.log_dir / f"{child.name}.log"
        out = open(child.log_path, "ab")
        child.proc = subprocess.Popen(
            [sys.executable, "-m", "holdback.cli", *child.args],
            env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )
        out.close()
        child.started_at = time.monotonic()
        _log("started", child=child.name, pid=child.proc.pid, log=child.log_path)

    def wait_ready(self, child: Child, timeout: float = 60.0) -> None:
        if child.ready_url is None:
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self.stopping:
            if child.proc is not None and child.proc.poll() is not None:
                raise RuntimeError(f"{child.name} exited with {child.proc.returncode} during start-up; "
                                   f"see {child.log_path}")
            try:
                if httpx.get(child.ready_url, timeout=1.0).status_code < 300:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        if not self.stopping:
            raise RuntimeError(f"{child.name} not ready at {child.ready_url} after {timeout:.0f}s; see {child.log_path}")

    def supervise_once(self) -> None:
        now = time.monotonic()
        for child in self.children:
            proc = child.proc
            if proc is None:
                if now >= child.next_start:
                    self.start(child)
                continue
            code = proc.poll()
            if code is None:
                if child.restarts and now - child.started_at > 60:
                    child.restarts = 0  # it has stayed up: forget earlier crashes
                continue
            child.restarts += 1
            delay = min(30.0, 0.5 * 2 ** (child.restarts - 1))
            _log("child exited, restarting", child=child.name, code=code, restart=child.restarts,
                 delay_s=f"{delay:.1f}", log=child.log_path)
            child.proc = None
            child.next_start = now + delay

    def stop_all(self, timeout: float = 15.0) -> None:
        self.stopping = True
        for child in reversed(self.children):
            if child.proc is not None and child.proc.poll() is None:
                try:
                    os.killpg(child.proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    continue
        deadline = time.monotonic() + timeout
        for child in self.children:
            if child.proc is None:
                continue
            try:
                child.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _log("child did not stop, killing", child=child.name)
                os.killpg(child.proc.pid, signal.SIGKILL)
                child.proc.wait(5)
            code = child.proc.returncode
            # uvicorn re-raises the SIGTERM it handled, so a clean stop can also end "by signal".
            _log("stopped", child=child.name,
                 **({"signal": signal.Signals(-code).name} if code < 0 else {"code": code}))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="holdback up",
        description="Run the whole platform on this machine: API + dashboard, processor, workers, gateway "
                    "and simulated vLLM replicas. Configure with DATABASE_URL, REDIS_URL, HOLDBACK_DATA_DIR.",
    )
    p.add_argument("--host", default="127.0.0.1", help="interface every component listens on (default %(default)s)")
    p.add_argument("--api-port", type=int, default=8000, help="Batch API and dashboard port (default %(default)s)")
    p.add_argument("--gateway-port", type=int, default=8200, help="gateway port (default %(default)s)")
    p.add_argument("--sim-port", type=int, default=8301, help="first simulated replica's port (default %(default)s)")
    p.add_argument("--sim-replicas", type=int, default=2, help="simulated replicas (default %(default)s)")
    p.add_argument("--sim-arg", dest="sim_args", action="append", default=[],
                   help="extra flag passed to `holdback sim`, e.g. --sim-arg=--zero-latency (repeatable)")
    p.add_argument("--replicas", default=os.environ.get("HOLDBACK_REPLICAS", ""),
                   help="comma-separated vLLM base URLs; when set no simulator is started (env HOLDBACK_REPLICAS)")
    p.add_argument("--gateway-config", type=Path, default=None, help="gateway YAML (default: the built-in config)")
    p.add_argument("--worker-concurrency", type=int, default=64, help="requests in flight per worker (default %(default)s)")
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.sim_replicas < 1:
        _parser().error("--sim-replicas must be at least 1")
    settings = Settings()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    started_redis = False
    redis_url = settings.redis_url
    if redis_url is None:
        redis_url = ensure_embedded_redis(settings.data_dir)
        started_redis = True
    engine = make_engine(settings.sqlalchemy_url)
    upgrade(engine)
    keys = local_keys(settings, make_sessionmaker(engine))
    engine.dispose()

    env = {
        **os.environ,
        "HOLDBACK_DATA_DIR": str(settings.data_dir.resolve()),
        "DATABASE_URL": settings.sqlalchemy_url,
        "REDIS_URL": redis_url,
        "HOLDBACK_ADMIN_KEY": keys["admin"],
        "HOLDBACK_GATEWAY_URL": f"http://{args.host}:{args.gateway_port}",
        "HOLDBACK_GATEWAY_KEY": keys["batch_gateway"],
        "HOLDBACK_GATEWAY_BATCH_KEY": keys["batch_gateway"],
        "HOLDBACK_GATEWAY_REALTIME_KEY": keys["realtime"],
        "HOLDBACK_GATEWAY_STANDARD_KEY": keys["standard"],
        "HOLDBACK_MIGRATE_ON_START": "false",
        "PYTHONUNBUFFERED": "1",
    }
    sup = Supervisor(build_children(args, settings), env, settings.data_dir / "logs")

    def _stop(signum, _frame):  # noqa: ANN001
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _stop)
    return_code = 0
    try:
        for child in sup.children:
            sup.start(child)
            sup.wait_ready(child)
        _banner(args, keys, settings.data_dir / "logs")
        while True:
            sup.supervise_once()
            time.sleep(0.5)
    except KeyboardInterrupt:
        _log("stopping")
    except RuntimeError as exc:
        _log("start-up failed", error=str(exc))
        return_code = 1
    finally:
        sup.stop_all()
        if started_redis:
            stop_embedded_redis(settings.data_dir)
            _log("stopped", child="embedded-redis")
    return return_code


def _banner(args: argparse.Namespace, keys: dict[str, str], log_dir: Path) -> None:
    api = f"http://{args.host}:{args.api_port}"
    gw = f"http://{args.host}:{args.gateway_port}"
    print(f"""
holdback is up.
  Batch API      {api}/v1          (tenant key: {keys['tenant']})
  Dashboard      {api}/dashboard   (admin key:  {keys['admin']})
  Gateway        {gw}/v1           (realtime key: {keys['realtime']})
  Logs           {log_dir}

Try it with the official openai client:
  from openai import OpenAI
  client = OpenAI(base_url="{api}/v1", api_key="{keys['tenant']}")
  batch = client.batches.create(input_file_id=client.files.create(file=open("requests.jsonl", "rb"), purpose="batch").id, endpoint="/v1/chat/completions", completion_window="24h")

Or run `holdback demo` in another terminal. Ctrl-C stops everything.
""", flush=True)
