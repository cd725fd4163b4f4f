"""A gateway fleet for the drills of issue 46: relays on three hosts, two flow controls electing a leader through a
Redis of the fleet's own, two simulated replicas, and HAProxy in front of the relays as a user's load balancer.

Each process runs on its own host (a network namespace, bench/lib/hosts.py; loopback where the machine does not
allow namespaces, and `describe()` says so). HAProxy runs on the machine itself, where the clients are: it checks
every relay's /readyz and, while none is ready (no leader anywhere during a takeover), sends to all of them anyway
(backup servers, unchecked): a relay keeps a request waiting until a leader is back.
Used by tests/gateway/test_fleet_drills.py and bench/fleet.py.
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

import httpx
import redis

from bench.lib.hosts import HostNetwork
from bench.lib.processes import REPO, stop_processes
from bench.lib.readiness import ProcessSet, free_port, wait_http

LEASE_PREFIX = "holdback:gateway:"  # gateway/relays/leadership.py's PREFIX (bench reads Redis as an operator would)


def haproxy_unavailable() -> str:
    """Why HAProxy cannot run here, or '' when it can."""
    if shutil.which("haproxy") is None:
        return "HAProxy is not installed (Debian: apt-get install haproxy)"
    result = subprocess.run(["haproxy", "-v"], capture_output=True, text=True, timeout=30)
    return "" if result.returncode == 0 else f"`haproxy -v` failed: {result.stderr.strip()}"


@dataclass
class FleetSpec:
    relays: int = 3
    flow_controls: int = 2
    replicas: int = 2
    # The slots the gateway is told each replica has; the simulator runs up to four times that, so its running
    # count shows what the gateway sent, not what the engine allowed.
    slots: int = 8
    lease_seconds: float = 1.5
    heartbeat_seconds: float = 2.0
    request_ttl_seconds: float = 120.0
    netns: bool = True
    sim_args: tuple[str, ...] = ("--decode-base-ms", "20", "--step-overhead-ms", "1")
    log_level: str = "INFO"
    # A relay asked to stop (SIGTERM) turns unready and accepts for `drain_grace` seconds, longer than HAProxy's
    # checks take to mark it down (inter 300 ms x fall 2), then lets its streams run `drain_seconds` more.
    drain_grace: float = 1.0
    drain_seconds: float = 5.0
    # The source tree the fleet's processes run from (default: this one), e.g. a snapshot to compare with.
    tree: Path | None = None


def flow_config(spec: FleetSpec) -> str:
    """The flow controls' config: every objective for keyless callers, the replicas' slots told, KV admission off
    (request-count control: the drills count slots)."""
    return (
        "anonymous: {enabled: true, relaysTenants: true, objectives: [realtime, standard, batch]}\n"
        f"saturation: {{maxConcurrency: {spec.slots}}}\n"
        f"engine: {{maxNumSeqs: {spec.slots}, queueAllowance: 0, learnMaxNumSeqs: false}}\n"
        "metrics: {scrapeIntervalSeconds: 0.25}\n"
        f"flowControl: {{heartbeatSeconds: {spec.heartbeat_seconds:g}, "
        f"defaultRequestTTL: {spec.request_ttl_seconds:g}}}\n"
        "admission: {enabled: false}\n")


def haproxy_config(port: int, relays: dict[str, str], stats_port: int) -> str:
    """HAProxy in front of `relays` (name -> host:port): health checks on /readyz, L7 retries elsewhere when a
    relay refuses the connection, and the same relays as unchecked backups for when none is ready."""
    checked = "\n".join(f"  server {name} {address} check inter 300 fall 2 rise 2"
                        for name, address in relays.items())
    backups = "\n".join(f"  server {name}-any {address} backup" for name, address in relays.items())
    return f"""global
  maxconn 4096
defaults
  mode http
  timeout connect 2s
  timeout client 600s
  timeout server 600s
  timeout queue 30s
  retries 3
  option redispatch 1
  retry-on conn-failure empty-response
frontend clients
  bind 127.0.0.1:{port}
  default_backend relays
backend relays
  balance leastconn
  option allbackups
  option httpchk GET /readyz
  http-check expect status 200
  http-response set-header x-fleet-relay %s
{checked}
{backups}
listen stats
  bind 127.0.0.1:{stats_port}
  stats enable
  stats uri /stats
"""


@dataclass
class Fleet(ProcessSet):
    spec: FleetSpec
    log_dir: Path
    network: HostNetwork | None = None
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.name = f"fleet-{uuid.uuid4().hex[:8]}"
        self.work = Path(tempfile.mkdtemp(prefix="hbf-"))
        self.secret = self.work / "channel-secret"
        self.addresses: dict[str, str] = {}  # process name -> the host:port others reach it at
        self.relay_urls: dict[str, str] = {}
        self.replica_urls: list[str] = []
        self.url = ""  # HAProxy: where clients send
        self.stats_url = ""
        self._lease_port = 0
        self.argv: dict[str, list[str]] = {}  # what started each process, to start it again

    # -- topology -------------------------------------------------------------------------------------
    @property
    def hosts(self) -> list[str]:
        s = self.spec
        return (["replicas", "lease"] + [f"flow-{i}" for i in range(1, s.flow_controls + 1)]
                + [f"relay-{i}" for i in range(1, s.relays + 1)])

    def describe(self) -> str:
        assert self.network is not None
        return self.network.describe()

    def start(self) -> "Fleet":
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.network = net = HostNetwork.create(self.hosts, want_netns=self.spec.netns)
        self.secret.write_text(secrets.token_hex(32))
        self.secret.chmod(0o600)
        config = self.work / "flow.yaml"
        config.write_text(flow_config(self.spec))
        self._lease_port = free_port()
        self.start_lease_store()
        sim_port = free_port()
        self.replica_urls = [f"http://{net.addresses['replicas']}:{sim_port + i}" for i in range(self.spec.replicas)]
        self._run("replicas", [sys.executable, "-m", "holdback.cli", "sim", "--host", net.bind_address("replicas"),
                               "--port", str(sim_port), "--replicas", str(self.spec.replicas), "--max-num-seqs",
                               str(self.spec.slots * 4), "--log-level", "WARNING", *self.spec.sim_args])
        for url in self.replica_urls:
            wait_http(url + "/health", self.procs["replicas"], 60, what="the simulated replicas")
        lease_url = f"redis://{net.addresses['lease']}:{self._lease_port}/0"
        for i in range(1, self.spec.flow_controls + 1):
            host = f"flow-{i}"
            port = free_port()
            self.addresses[host] = f"{net.addresses[host]}:{port}"
            self._holdback(host, "gateway", "--role", "flow-control", "--relays-listen",
                           f"{net.bind_address(host)}:{port}", "--config", str(config), "--replicas",
                           ",".join(self.replica_urls), "--lease-redis", lease_url, "--lease-name", self.name,
                           "--lease-seconds", f"{self.spec.lease_seconds:g}")
            if i == 1:  # the first leads: the drills know whom they kill
                self.wait(lambda: self.leader() is not None, 60, "flow-1 to take the lease")
        flow_addresses = ",".join(self.addresses[f"flow-{i}"] for i in range(1, self.spec.flow_controls + 1))
        for i in range(1, self.spec.relays + 1):
            host = f"relay-{i}"
            port = free_port()
            self.addresses[host] = f"{net.addresses[host]}:{port}"
            self.relay_urls[host] = f"http://{self.addresses[host]}"
            self._holdback(host, "gateway", "--role", "relay", "--flow-control", flow_addresses, "--host",
                           net.bind_address(host), "--port", str(port), "--drain-grace",
                           f"{self.spec.drain_grace:g}", "--drain-seconds", f"{self.spec.drain_seconds:g}")
        for host, url in self.relay_urls.items():
            wait_http(url + "/readyz", self.procs[host], 120, what=f"{host} (log {self.log_dir / host}.log)")
        self._start_haproxy()
        return self

    def _start_haproxy(self) -> None:
        port, stats = free_port(), free_port()
        cfg = self.work / "haproxy.cfg"
        relays = {host: self.addresses[host] for host in self.relay_urls}
        cfg.write_text(haproxy_config(port, relays, stats))
        check = subprocess.run(["haproxy", "-c", "-f", str(cfg)], capture_output=True, text=True, timeout=30)
        if check.returncode != 0:
            raise RuntimeError(f"HAProxy refused its config {cfg}: {check.stdout}{check.stderr}")
        self.procs["haproxy"] = self._popen("haproxy", ["haproxy", "-db", "-f", str(cfg)])
        self.url = f"http://127.0.0.1:{port}"
        self.stats_url = f"http://127.0.0.1:{stats}/stats"
        self.wait(lambda: self.up_relays() == len(relays), 60, "HAProxy to see every relay up")

    def start_gateway(self, host: str) -> str:
        """The whole gateway as one process (flow control and proxy, the fleet's config and replicas) on `host`,
        beside what runs there: the baseline a relay's channel is measured against. Its URL once ready."""
        assert self.network is not None
        port = free_port()
        self._run(host, [sys.executable, "-P", "-m", "holdback.cli", "gateway", "--config", str(self.work / "flow.yaml"),
                         "--replicas", ",".join(self.replica_urls), "--host", self.network.bind_address(host),
                         "--port", str(port), "--drain-grace", "0", "--log-level", self.spec.log_level],
                  name="gateway")
        url = f"http://{self.network.addresses[host]}:{port}"
        wait_http(url + "/readyz", self.procs["gateway"], 120, what=f"the one-process gateway (log {self.log_dir})")
        return url

    def _popen(self, name: str, argv: list[str]) -> subprocess.Popen:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if self.spec.tree is not None:
            env["PYTHONPATH"] = str(self.spec.tree)
        self.argv[name] = argv
        with open(self.log_dir / f"{name}.log", "ab") as log:
            return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env,
                                    cwd=self.spec.tree or REPO)

    def _run(self, host: str, argv: list[str], name: str | None = None) -> subprocess.Popen:
        assert self.network is not None
        proc = self.procs[name or host] = self._popen(name or host, self.network.command(host, argv))
        return proc

    def _holdback(self, host: str, *args: str) -> None:
        self._run(host, [sys.executable, "-P", "-m", "holdback.cli", *args, "--channel-secret-file", str(self.secret),
                         "--log-level", self.spec.log_level])

    def restart(self, name: str) -> None:
        """Start process `name` again as it was first started (after a drill killed it)."""
        if self.procs[name].poll() is None:
            raise RuntimeError(f"{name} is still running (pid {self.procs[name].pid})")
        self.procs[name] = self._popen(name, self.argv[name])

    def settle(self, timeout: float = 120) -> None:
        """Wait until the fleet is whole again: every process running, a leader, every relay up at HAProxy."""
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}; restart it first (logs in {self.log_dir})")
        self.wait(lambda: self.leader() is not None, timeout, "a leader")
        self.wait(lambda: self.up_relays() == len(self.relay_urls), timeout, "HAProxy to see every relay up")

    # -- the lease store ------------------------------------------------------------------------------
    def start_lease_store(self) -> None:
        """The fleet's own Redis (not the machine's), without persistence, as a cache-only Redis runs."""
        assert self.network is not None
        proc = self._run("lease", ["redis-server", "--bind", self.network.bind_address("lease"), "--port",
                                   str(self._lease_port), "--protected-mode", "no", "--save", "", "--appendonly", "no",
                                   "--dir", str(self.work)])
        self.wait(lambda: self._redis_answers(), 30, "the lease store to answer", proc)

    def stop_lease_store(self) -> None:
        """Stop the lease store as an operator or a crash would: its data is gone with it."""
        proc = self.procs["lease"]
        proc.terminate()
        proc.wait(30)

    def _redis_answers(self) -> bool:
        try:
            return bool(self.lease_client().ping())
        except (redis.RedisError, OSError):
            return False

    def lease_client(self) -> redis.Redis:
        assert self.network is not None
        return redis.Redis(host=self.network.addresses["lease"], port=self._lease_port, socket_timeout=2,
                           socket_connect_timeout=2)

    def leader(self) -> tuple[str, int] | None:
        """(process name, fencing token) of the flow control holding the lease, as Redis says; None without one."""
        try:
            value = self.lease_client().get(f"{LEASE_PREFIX}{self.name}:leader")
        except (redis.RedisError, OSError):
            return None
        if value is None:
            return None
        holder, token = value.decode().rsplit("#", 1)
        pid = int(holder.split(":")[-2])
        names = [name for name, proc in self.procs.items() if proc.pid == pid]
        return (names[0] if names else f"pid {pid}"), int(token)

    # -- reading the fleet ----------------------------------------------------------------------------
    def up_relays(self) -> int:
        """Relays HAProxy's health checks count as up."""
        try:
            rows = httpx.get(self.stats_url + ";csv", timeout=5).text.splitlines()
        except httpx.HTTPError:
            return 0
        return sum(1 for row in rows if row.startswith("relays,relay-") and ",UP" in row and "-any," not in row)

    def relays_on(self, token: int) -> int:
        """How many relays the leader of fencing token `token` holds a channel with, as its /admin/state says
        (through any relay connected to it); 0 while none answers for that leader."""
        for url in self.relay_urls.values():
            try:
                lead = httpx.get(url + "/admin/state", timeout=10).json().get("leadership") or {}
            except (httpx.HTTPError, ValueError):
                continue
            if lead.get("leading") and lead.get("token") == token:
                return int(lead.get("relays", 0))
        return 0

    def decisions(self) -> dict[str, float]:
        """holdback_gateway_relay_decisions_total by token and outcome, summed over the relays (as the leader
        collects them); {} while no relay reaches a leader."""
        for url in self.relay_urls.values():
            try:
                answer = httpx.get(url + "/metrics", timeout=10)
            except httpx.HTTPError:
                continue
            if answer.status_code == 200:
                return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in answer.text.splitlines()
                        if line.startswith("holdback_gateway_relay_decisions_total{")}
        return {}

    def events(self, name: str, event: str) -> list[dict]:
        """The structured log lines `event` of process `name`."""
        path = self.log_dir / f"{name}.log"
        if not path.exists():
            return []
        out = []
        for line in path.read_text(errors="replace").splitlines():
            if f'"event":"{event}"' in line or f'"event": "{event}"' in line:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue
        return out

    def log(self, name: str, tail: int = 3000) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace")[-tail:] if path.exists() else ""

    def signal(self, name: str, sig: signal.Signals) -> None:
        """Send `sig` to process `name` (its whole group: `ip netns exec` runs it as the group's leader)."""
        os.killpg(self.procs[name].pid, sig)
        if sig == signal.SIGKILL:
            self.procs[name].wait(30)

    def wait(self, predicate, timeout: float, what: str, proc: subprocess.Popen | None = None):  # noqa: ANN001
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"{what}: the process exited with {proc.returncode}; logs in {self.log_dir}")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}; logs in {self.log_dir}")
            time.sleep(0.1)

    def stop(self) -> None:
        stop_processes(list(self.procs.values()), 20)
        if self.network is not None:
            self.network.close()
        shutil.rmtree(self.work, ignore_errors=True)
