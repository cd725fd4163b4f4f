"""`holdback up`: the whole platform on one machine, as supervised child processes.

With no configuration it starts an embedded Redis, migrates SQLite under ./data and runs the API
server with the dashboard, a processor, a worker pool, the gateway and two simulated vLLM replicas.
`--gateway-relays N` runs the gateway as a fleet instead: N relays sharing its port (SO_REUSEPORT) and a flow
control, with `--gateway-standby` two flow controls electing a leader through this `up`'s Redis.
A child that dies (the embedded Redis too) is reported and restarted with backoff; SIGINT (Ctrl-C) or SIGTERM stops
everything, children first, then the embedded Redis. One `holdback up` runs per data dir (a pid-file
lock); its children die with it even when it is killed outright (Linux parent-death signal), and a
port held by anything but its own child fails start-up instead of passing the readiness check.
DATABASE_URL, REDIS_URL and --replicas switch to PostgreSQL, an external Redis and real vLLM.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import secrets
import signal
import sys
import time
from pathlib import Path

import httpx

from holdback.broker import answers, embedded_command, stop_embedded_redis
from holdback.db import make_engine, make_sessionmaker, transaction
from holdback.env_flags import flags_from_env
from holdback.cli.instance_lock import AlreadyRunning, InstanceLock
from holdback.cli.listeners import listener_pids, port_free
from holdback.cli.supervisor import Child, Supervisor, log_line
from holdback.schema import upgrade
from holdback.settings import Settings
from holdback.tenancy import create_key

LOCAL_KEYS = "local-keys.json"
EXAMPLE_REQUESTS = Path(__file__).resolve().parents[2] / "examples" / "requests.jsonl"


class Stop(Exception):
    """SIGINT or SIGTERM arrived: stop everything."""


def local_keys(settings: Settings, session_factory) -> dict[str, str]:  # noqa: ANN001
    """Keys for this machine's platform, made once and kept in the data dir (owner-only file)."""
    path = settings.data_dir / LOCAL_KEYS
    if path.exists():
        keys = json.loads(path.read_text())
        if {"admin", "tenant", "realtime", "batch_gateway", "standard"} <= keys.keys():
            if settings.admin_key and settings.admin_key != keys["admin"]:
                # HOLDBACK_ADMIN_KEY is the operator's choice: it replaces the stored one, and is stored.
                keys["admin"] = settings.admin_key
                _write_keys(path, keys)
                log_line("admin key from HOLDBACK_ADMIN_KEY replaces the stored one", file=path)
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
    _write_keys(path, keys)
    return keys


def _write_keys(path: Path, keys: dict[str, str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # Created owner-only, never readable by others even for an instant.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(keys, indent=2))
    path.chmod(0o600)


def build_children(args: argparse.Namespace, settings: Settings, redis_url: str | None = None) -> list[Child]:
    host = args.host
    children: list[Child] = []
    replicas = args.replicas
    if not replicas:
        # --enable-prompt-tokens-details: the platform reports cached prompt tokens (vLLM's default is off).
        children.append(Child("sim", ["sim", "--host", host, "--port", str(args.sim_port), "--replicas",
                                      str(args.sim_replicas), "--enable-prompt-tokens-details", *args.sim_args],
                              ready_url=f"http://{host}:{args.sim_port}/health"))
        replicas = ",".join(f"http://{host}:{args.sim_port + i}" for i in range(args.sim_replicas))
    config = ["--config", str(args.gateway_config)] if args.gateway_config else []
    # No load balancer checks readiness on one machine: a gateway asked to stop stops accepting at once.
    drain = ["--drain-grace", "0", "--drain-seconds", "10"]
    # With our simulators the gateway must see a healthy replica before it counts as up; real vLLM may
    # still be loading its weights, so then only liveness is awaited and the banner says where to look.
    gateway_probe = "/healthz" if args.replicas else "/readyz"
    ready_url = f"http://{host}:{args.gateway_port}{gateway_probe}"
    if args.gateway_relays:
        assert redis_url is not None, "the fleet's lease lives in this up's Redis"
        children += gateway_fleet(args, replicas, config, drain, redis_url, lease_name(settings), ready_url)
    else:
        children.append(Child("gateway", ["gateway", "--host", host, "--port", str(args.gateway_port), "--replicas",
                                          replicas, *config, *drain], ready_url=ready_url))
    children.append(Child("api", ["api", "--host", host, "--port", str(args.api_port)],
                          ready_url=f"http://{host}:{args.api_port}/readyz"))
    children.append(Child("processor", ["processor", "--metrics-host", host,
                                        "--metrics-port", str(args.processor_metrics_port)],
                          ready_url=f"http://{host}:{args.processor_metrics_port}/readyz"))
    children.append(Child("worker", ["worker", "-n", str(args.worker_concurrency), "--metrics-host", host,
                                     "--metrics-port", str(args.worker_metrics_port)],
                          ready_url=f"http://{host}:{args.worker_metrics_port}/readyz"))
    return children


def lease_name(settings: Settings) -> str:
    """The fleet's lease name: one per data dir, which one `holdback up` runs at a time."""
    return "up-" + hashlib.sha256(str(settings.data_dir.resolve()).encode()).hexdigest()[:12]


def gateway_fleet(args: argparse.Namespace, replicas: str, config: list[str], drain: list[str], redis_url: str,
                  lease: str, ready_url: str) -> list[Child]:
    """The gateway as a fleet on this machine: a flow control (two electing a leader with --gateway-standby) and
    `--gateway-relays` relays sharing the gateway's port, the channel's secret new each run, in their environment."""
    from gateway.relays.handshake import SECRET_ENV

    host, secret = args.host, {SECRET_ENV: secrets.token_hex(32)}
    flows = [args.gateway_flow_port + i for i in range(2 if args.gateway_standby else 1)]
    lease_flags = ["--lease-redis", redis_url, "--lease-name", lease] if args.gateway_standby else []
    children = [Child(f"gateway-flow-{'ab'[i]}", ["gateway", "--role", "flow-control", "--relays-listen",
                                                 f"{host}:{port}", "--replicas", replicas, *config, *lease_flags],
                      ready=lambda port=port: not port_free(host, port), env=secret)
                for i, port in enumerate(flows)]
    addresses = ",".join(f"{host}:{port}" for port in flows)
    children += [Child(f"gateway-relay-{i}", ["gateway", "--role", "relay", "--flow-control", addresses, "--host",
                                              host, "--port", str(args.gateway_port), "--reuse-port", *drain],
                       ready_url=ready_url, env=secret, shares_port=True)
                 for i in range(args.gateway_relays)]
    return children


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
    p.add_argument("--processor-metrics-port", type=int, default=9101,
                   help="processor's /metrics, /healthz, /readyz port (default %(default)s)")
    p.add_argument("--worker-metrics-port", type=int, default=9102,
                   help="worker's /metrics, /healthz, /readyz port (default %(default)s)")
    p.add_argument("--sim-replicas", type=int, default=2, help="simulated replicas (default %(default)s)")
    p.add_argument("--sim-arg", dest="sim_args", action="append", default=[],
                   help="extra flag passed to `holdback sim`, e.g. --sim-arg=--zero-latency (repeatable)")
    p.add_argument("--replicas", default=os.environ.get("HOLDBACK_REPLICAS", ""),
                   help="comma-separated vLLM base URLs; when set no simulator is started (env HOLDBACK_REPLICAS)")
    p.add_argument("--gateway-config", type=Path, default=None, help="gateway YAML (default: the built-in config)")
    p.add_argument("--gateway-relays", type=int, default=0, help=(
        "run the gateway as a fleet: this many relay processes sharing --gateway-port (SO_REUSEPORT) and a "
        "separate flow-control process (default 0: the gateway as one process)"))
    p.add_argument("--gateway-standby", action="store_true", help=(
        "with --gateway-relays: a second flow control stands by, the two electing a leader through this up's "
        "Redis; kill the leader and the standby takes over while the relays keep their streams"))
    p.add_argument("--gateway-flow-port", type=int, default=8210, help=(
        "with --gateway-relays: where the flow control listens for relays (the standby on the next port) "
        "(default %(default)s)"))
    p.add_argument("--worker-concurrency", type=int, default=64, help="requests in flight per worker (default %(default)s)")
    return flags_from_env(p, "up")


def _ports_taken(args: argparse.Namespace) -> list[str]:
    """Ports `holdback up` is about to listen on that something else holds, each with its holders' pids."""
    ports = {"api": args.api_port, "gateway": args.gateway_port, "processor metrics": args.processor_metrics_port,
             "worker metrics": args.worker_metrics_port}
    if args.gateway_relays:
        ports.update({f"gateway flow control {i + 1}": args.gateway_flow_port + i
                      for i in range(2 if args.gateway_standby else 1)})
    if not args.replicas:
        ports.update({f"sim replica {i}": args.sim_port + i for i in range(args.sim_replicas)})
    taken = []
    for name, port in ports.items():
        if not port_free(args.host, port):
            pids = listener_pids(port)
            holder = f" (pid {', '.join(map(str, sorted(pids)))})" if pids else ""
            taken.append(f"{name} port {port} is in use{holder}")
    return taken


def _on_signal(signum, _frame):  # noqa: ANN001
    # Further signals are ignored while stopping: the stop itself is bounded and ends with SIGKILL.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Stop(signal.Signals(signum).name)


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.sim_replicas < 1:
        _parser().error("--sim-replicas must be at least 1")
    if args.gateway_relays < 0:
        _parser().error(f"--gateway-relays must be 0 (the gateway as one process) or more (got {args.gateway_relays})")
    if args.gateway_standby and not args.gateway_relays:
        _parser().error("--gateway-standby needs --gateway-relays N: the standby is a second flow control for relays")
    settings = Settings()
    # Handled alike, and installed even when SIGINT arrives ignored (a background job of a script).
    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    try:
        lock = InstanceLock.acquire(settings.data_dir)
    except AlreadyRunning as exc:
        log_line("refused", error=str(exc))
        return 1
    try:
        if taken := _ports_taken(args):
            log_line("refused", error="; ".join(taken) + "; stop what holds them or choose other ports with "
                                     "--api-port/--gateway-port/--sim-port/--processor-metrics-port/--worker-metrics-port")
            return 1
        return _run(args, settings)
    except Stop:
        return 0
    finally:
        lock.release()


def _run(args: argparse.Namespace, settings: Settings) -> int:
    redis_url, redis_child = settings.redis_url, None
    if redis_url is None:
        # The embedded Redis is a supervised child like the rest: restarted on the same socket with its data
        # when it dies (the workers and the processor reconnect), and stopped last. One that another process
        # of this data dir started (`holdback api` run alone before) is used as it is.
        command, redis_url = embedded_command(settings.data_dir)
        if answers(redis_url):
            log_line("using the running embedded Redis", url=redis_url)
        else:
            redis_child = Child("redis", [], command=command, ready=lambda: answers(redis_url), stop_last=True)
    try:
        return _supervise(args, settings, redis_url, redis_child)
    finally:
        if settings.redis_url is None:
            stop_embedded_redis(settings.data_dir)  # one this `up` did not start (its own is stopped already)
            log_line("stopped", child="embedded-redis")


def _supervise(args: argparse.Namespace, settings: Settings, redis_url: str, redis_child: Child | None) -> int:
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
    children = build_children(args, settings, redis_url)
    sup = Supervisor([redis_child, *children] if redis_child else children, env, settings.data_dir / "logs")
    return_code = 0
    try:
        for child in sup.children:
            if child.name == "gateway-flow-a" and args.gateway_standby:
                _clear_lease(redis_url, lease_name(settings))
            sup.start(child)
            sup.wait_ready(child)
        _banner(args, keys, settings)
        while True:
            sup.supervise_once()
            time.sleep(0.5)
    except (Stop, KeyboardInterrupt) as exc:
        log_line("stopping", signal=str(exc) or "SIGINT")
    except RuntimeError as exc:
        log_line("start-up failed", error=str(exc))
        return_code = 1
    finally:
        sup.stop_all()
    return return_code


def _clear_lease(redis_url: str, name: str) -> None:
    """A new run's first leader starts the fencing tokens again: no leader of this data dir runs now, so none holds
    back new requests for a takeover that is not one."""
    import redis

    from gateway.relays.leadership import PREFIX

    with redis.Redis.from_url(redis_url, socket_timeout=5) as client:
        client.delete(f"{PREFIX}{name}:leader", f"{PREFIX}{name}:fencing-token")


def _banner(args: argparse.Namespace, keys: dict[str, str], settings: Settings) -> None:
    api = f"http://{args.host}:{args.api_port}"
    gw = f"http://{args.host}:{args.gateway_port}"
    processor = f"http://{args.host}:{args.processor_metrics_port}"
    worker = f"http://{args.host}:{args.worker_metrics_port}"
    model = _served_model(gw, keys["realtime"])
    print(f"""
holdback is up.
  Batch API      {api}/v1          (tenant key: {keys['tenant']})
  Dashboard      {api}/dashboard   (admin key:  {keys['admin']})
  Gateway        {gw}/v1           (realtime key: {keys['realtime']}){_fleet_line(args)}
  Logs           {settings.data_dir / "logs"}

Metrics (Prometheus) and probes (/healthz liveness, /readyz readiness) of every component:
  API            {api}/metrics
  Gateway        {gw}/metrics
  Processor      {processor}/metrics
  Worker         {worker}/metrics

A request line (examples/requests.jsonl has chat, completions and embeddings lines):
  {_first_line(model)}

{try_commands(args, settings, model, keys['tenant'])}
Ctrl-C or SIGTERM stops everything.
""", flush=True)


def _fleet_line(args: argparse.Namespace) -> str:
    if not args.gateway_relays:
        return ""
    flows = f"{args.host}:{args.gateway_flow_port}"
    if args.gateway_standby:
        flows += f" and {args.host}:{args.gateway_flow_port + 1} (leader and standby)"
    return f"\n                 {args.gateway_relays} relays on its port, flow control at {flows}"


def try_commands(args: argparse.Namespace, settings: Settings, model: str | None, tenant_key: str) -> str:
    """What to run next, from another terminal in this directory, spelled so that each works as printed:
    this interpreter's own `holdback`, and the flags that differ from the commands' defaults."""
    api = f"http://{args.host}:{args.api_port}"
    holdback = _here(Path(sys.executable).with_name("holdback"))
    if not Path(sys.executable).with_name("holdback").exists():
        holdback = f"{_here(Path(sys.executable))} -m holdback.cli"
    keys_file = settings.data_dir.resolve() / LOCAL_KEYS
    keys_flag = [] if keys_file == (Path.cwd() / "data" / LOCAL_KEYS).resolve() else ["--keys", _here(keys_file)]
    api_flag = [] if api == "http://127.0.0.1:8000" else ["--api-url", api]
    lines = []
    if EXAMPLE_REQUESTS.exists():
        model_flag = [] if model in (None, _example_model()) else ["--model", model]
        submit = [holdback, "submit", _here(EXAMPLE_REQUESTS), *api_flag, *keys_flag, *model_flag]
        lines += ["Run the example requests and download the results (one batch per endpoint):", "  " + " ".join(submit),
                  ""]
    else:
        lines += ["Run a JSONL file of requests like the line above and download the results:",
                  "  " + " ".join([holdback, "submit", "FILE", *api_flag, *keys_flag]), ""]
    lines += ["See what holdback is for: realtime alone, beside a batch with no controls, and through holdback (on a "
              "small platform of its own, about a minute):", f"  {holdback} demo"]
    if importlib.util.find_spec("openai") is None:
        lines[-1] += "   (needs the openai client: pip install 'holdback[demo]')"
    elif (EXAMPLE_REQUESTS.parent / "submit.py").exists() and model in (None, _example_model()):
        lines += ["", "The example requests with the official openai client, in Python:",
                  f"  {_here(Path(sys.executable))} {_here(EXAMPLE_REQUESTS.parent / 'submit.py')} {api}/v1 {tenant_key}"]
    return "\n".join(lines) + "\n"


def _here(path: Path) -> str:
    """`path` relative to the working directory when it is below it, else absolute."""
    try:
        return str(path.absolute().relative_to(Path.cwd()))
    except ValueError:
        return str(path.absolute())


def _example_model() -> str | None:
    try:
        return json.loads(EXAMPLE_REQUESTS.read_text().splitlines()[0])["body"]["model"]
    except (OSError, IndexError, ValueError, KeyError, TypeError):
        return None


def _served_model(gateway: str, key: str) -> str | None:
    """The first model the replicas serve (the gateway's `/v1/models`), or None when none answers yet."""
    try:
        r = httpx.get(f"{gateway}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=5)
        return r.json()["data"][0]["id"] if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return None


def _first_line(model: str | None) -> str:
    """The example file's first line, naming a model the replicas serve (the file says `sim-model`)."""
    try:
        line = json.loads(EXAMPLE_REQUESTS.read_text().splitlines()[0])
    except (OSError, IndexError, ValueError):
        return "(examples/requests.jsonl is in the source checkout)"
    if model is None:
        return f"{json.dumps(line)}\n  (no replica has answered /v1/models yet: put your served model's name in `model`)"
    line["body"]["model"] = model
    return json.dumps(line)
