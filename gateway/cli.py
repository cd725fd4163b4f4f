"""`holdback gateway`: run the priority-aware gateway in front of model replicas.

Two admin commands beside it: `holdback gateway rollback` (POST /admin/rollback on a running gateway) and
`holdback gateway calibrate` (measure a running replica and write a calibration profile).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys

from aiohttp import web

from gateway.app import Gateway, until_stopped
from gateway.calibration import measure, write_profile
from gateway.log import configure_logging, log_event
from gateway.relays.channel import split_address
from gateway.relays.drain import CUT_SECONDS, DRAIN_GRACE, DRAIN_SECONDS, Drain
from gateway.relays.flow_process import FlowServer
from gateway.relays.local_relays import listening_socket
from gateway.relays.handshake import MIN_SECRET_BYTES, SECRET_ENV, SecretError, channel_secret, run_secret
from gateway.relays.leadership import Leadership
from gateway.relays.relay import run_alone
from gateway.settings import ConfigError, load_config
from gateway.settings.keys import UPSTREAM_KEY_ENV
from holdback.env_flags import flags_from_env

logger = logging.getLogger("gateway")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="holdback gateway", description=(
        "Priority-aware gateway: flow control with priority bands, holdback ceilings, TTLs and in-flight "
        "eviction of sheddable requests and KV admission, in front of vLLM-compatible replicas. SIGHUP reloads "
        "the config. Admin commands: `holdback gateway rollback --help`, `holdback gateway calibrate --help`."))
    p.add_argument("--config", help="YAML config file (default: the shipped gateway/default.yaml)")
    p.add_argument("--host", default=None, help="listen address for clients (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="listen port for clients (default 8200)")
    p.add_argument("--replicas", help="comma-separated replica base URLs; overrides `replicas` in the config")
    p.add_argument("--upstream-api-key", default=None, help=(
        "the key vLLM replicas were started with (`vllm serve --api-key`), sent on every call to them; "
        "overrides `upstream.apiKey` (prefer the variable: a flag is visible in the process list)"))
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.add_argument("--workers", type=int, default=1, help=(
        "relay processes (default 1: one process does everything). With N > 1, one flow-control process "
        "makes every decision (queues, ceilings, KV admission, eviction, replica health) and N relay "
        "processes share the listening port, relay the bytes and ask it over a local channel; a relay that "
        "dies is replaced and its requests released"))
    p.add_argument("--role", choices=ROLES, default="all", help=(
        "`all` (default): the whole gateway here, as one process or with --workers. `flow-control`: only the "
        "decider, serving relays of any host that connect to --relays-listen; it binds no client port (its "
        "/admin/state, /admin/rollback and /metrics are answered through any relay) and takes --config and "
        "--replicas. `relay`: one relay alone, serving clients on --host/--port for the first flow control of "
        "--flow-control that answers; it takes its config from flow control. Both need the channel secret"))
    p.add_argument("--relays-listen", metavar="HOST:PORT", default=None,
                   help="--role flow-control: the TCP address relays connect to")
    p.add_argument("--flow-control", metavar="HOST:PORT[,HOST:PORT]", default=None, help=(
        "--role relay: flow control's channel addresses, tried in order (on start and whenever the channel "
        "closes, with a backoff capped at 5s)"))
    p.add_argument("--channel-secret-file", metavar="PATH", default=None, help=(
        f"--role flow-control/relay: a file holding the channel's shared secret (at least {MIN_SECRET_BYTES} "
        f"bytes, the same on every relay and flow control), or set ${SECRET_ENV} instead. The channel is "
        "authenticated (HMAC-SHA256 on every frame), not encrypted: keep it on a network you trust"))
    p.add_argument("--lease-redis", metavar="URL", default=None, help=(
        "--role flow-control: run as one of several flow controls that elect a leader through this Redis "
        "(redis://host:6379/0); only the leader serves relays and decides, each decision carrying its fencing "
        "token; the others stand by and take over when its lease lapses"))
    p.add_argument("--lease-name", default="gateway", help=(
        "--lease-redis: the gateway's name; flow controls of one gateway share it (default %(default)s)"))
    p.add_argument("--lease-seconds", type=float, default=6.0, help=(
        "--lease-redis: the lease's length; a leader renews it three times as often and stops deciding when a "
        "fifth of it is left unrenewed (default %(default)s)"))
    p.add_argument("--drain-grace", type=float, default=DRAIN_GRACE, metavar="SECONDS", help=(
        "on SIGTERM a process serving clients (the gateway, each relay) reports not ready at once and goes on "
        "accepting for this long, so that load balancers' health checks notice, then stops accepting "
        "(default %(default)s: HAProxy with `inter 2s fall 2` takes 4 s to notice, a Kubernetes endpoint update a few)"))
    p.add_argument("--drain-seconds", type=float, default=DRAIN_SECONDS, metavar="SECONDS", help=(
        "after the grace, how long requests already running may go on; what still runs then is cut (its "
        "connection closes, flow control releases it) and the process exits (default %(default)s; give a pod a "
        "terminationGracePeriodSeconds above grace + this)"))
    p.add_argument("--reuse-port", action="store_true", help=(
        "--role relay: bind the client port with SO_REUSEPORT, so several relays on one host share it (the "
        "kernel spreads new connections over them; a relay that stops or dies resets the connections queued to "
        "it but not yet accepted)"))
    return flags_from_env(p, "gateway")


ROLES = ("all", "flow-control", "relay")


def _check_role(parser: argparse.ArgumentParser, args: argparse.Namespace) -> bytes | None:
    """Refuse flags that do not go together (parser.error exits 2, saying what to change); the channel secret of a
    role that needs one."""
    role = args.role
    for flag, value in (("--drain-grace", args.drain_grace), ("--drain-seconds", args.drain_seconds)):
        if not 0 <= value < float("inf"):
            parser.error(f"{flag} must be 0 or more seconds (got {value:g})")
    if args.reuse_port and role != "relay":
        parser.error("--reuse-port is for --role relay (relays sharing one host's port); --workers N relays share "
                     "one listening socket of their own")
    if role == "all":
        for flag, value, needs in (("--relays-listen", args.relays_listen, "flow-control"),
                                   ("--flow-control", args.flow_control, "relay"),
                                   ("--channel-secret-file", args.channel_secret_file, "relay or flow-control"),
                                   ("--lease-redis", args.lease_redis, "flow-control")):
            if value is not None:
                parser.error(f"{flag} goes with --role {needs}; without --role the whole gateway runs here (and "
                             f"--workers N makes a secret of its own for its relays)")
        return None
    if args.workers != 1:
        parser.error(f"--workers is for the whole gateway on one host; with --role {role} run one process per "
                     f"relay instead")
    if role == "relay":
        if args.flow_control is None:
            parser.error("--role relay needs --flow-control HOST:PORT[,HOST:PORT]: where flow control listens "
                         "for relays (its --relays-listen)")
        for flag, value in (("--relays-listen", args.relays_listen), ("--lease-redis", args.lease_redis)):
            if value is not None:
                parser.error(f"{flag} is flow control's; a relay connects to --flow-control instead (list every "
                             f"flow control there: it finds the leader)")
        for flag, value in (("--config", args.config), ("--replicas", args.replicas),
                            ("--upstream-api-key", args.upstream_api_key)):
            if value is not None:
                parser.error(f"{flag}: a relay takes its config from flow control; give it to the "
                             f"--role flow-control process")
        addresses = [a.strip() for a in args.flow_control.split(",") if a.strip()]
        try:
            for address in addresses:
                split_address(address)
        except ValueError as exc:
            parser.error(f"--flow-control: {exc}")
        if not addresses:
            parser.error("--flow-control names no address: give HOST:PORT[,HOST:PORT]")
        args.flow_control = addresses
    else:
        if args.relays_listen is None:
            parser.error("--role flow-control needs --relays-listen HOST:PORT: where relays connect")
        if args.flow_control is not None:
            parser.error("--flow-control is a relay's; flow control listens on --relays-listen instead")
        if args.host is not None or args.port is not None:
            parser.error("--host/--port: --role flow-control serves no clients; run relays (--role relay) for "
                         "them, and read /admin/state and /metrics through any relay")
        try:
            args.relays_listen = split_address(args.relays_listen)
        except ValueError as exc:
            parser.error(f"--relays-listen: {exc}")
        if args.lease_seconds <= 0.3:
            parser.error(f"--lease-seconds must be over 0.3 (got {args.lease_seconds:g}); a few seconds suits most")
    try:
        return channel_secret(args.channel_secret_file)
    except SecretError as exc:
        parser.error(str(exc))


async def serve_workers(gateway: Gateway, host: str, port: int, workers: int, log_level: str) -> None:
    """One flow-control process (this one) and `workers` relay processes on one listening socket; on SIGTERM the
    relays drain while this process goes on deciding for them."""
    server = FlowServer(gateway, workers, listening_socket(host, port), log_level, run_secret())
    await _serve_relays(server, host=host, port=port, workers=workers)


async def serve_flow_control(gateway: Gateway, relays_listen: tuple[str, int], secret: bytes,
                             log_level: str, args: argparse.Namespace) -> None:
    """Flow control alone (`--role flow-control`), for relays that connect over TCP; one of several contending for
    the lease with `--lease-redis`."""
    leadership = None
    if args.lease_redis is not None:
        from redis import asyncio as aioredis  # only a flow control with a lease talks to Redis

        redis = aioredis.from_url(args.lease_redis, socket_timeout=args.lease_seconds / 3,
                                  socket_connect_timeout=args.lease_seconds / 3)
        leadership = Leadership(redis, args.lease_name, ttl=args.lease_seconds)
    server = FlowServer(gateway, 0, None, log_level, secret, relays_listen, leadership)
    await _serve_relays(server, relays_listen="%s:%d" % relays_listen)


async def _serve_relays(server: FlowServer, **where: object) -> None:
    log_event(logger, "listening", **where, event_loop=type(asyncio.get_running_loop()).__module__.split(".")[0])
    try:
        await server.run(until_stopped())
    finally:
        log_event(logger, "stopping")


async def serve(gateway: Gateway, host: str, port: int) -> None:
    """The gateway as one process; on SIGTERM it drains (gateway/relays/drain.py) and exits."""
    runner = web.AppRunner(gateway.make_app(), handler_cancellation=True, access_log=None,
                           shutdown_timeout=CUT_SECONDS)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=1024, reuse_address=True)
    await site.start()
    # uvloop (a dependency off Windows) runs the transports and callbacks of every relayed chunk in C;
    # asyncio is the fallback where it does not install. The log says which one runs.
    log_event(logger, "listening", host=host, port=port,
              event_loop=type(asyncio.get_running_loop()).__module__.split(".")[0])
    try:
        await until_stopped()
        await gateway.drain.run(runner, role="gateway")
    finally:
        log_event(logger, "stopping")
        await runner.cleanup()


def _rollback(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="holdback gateway rollback", description=(
        "Roll a running gateway back to its previous config digest, keeping the lower admission watermark "
        "(admission stays on). Prints the answer: from_digest, to_digest, admissionWatermark."))
    p.add_argument("--url", default="http://127.0.0.1:8200", help="gateway base URL (default %(default)s)")
    p.add_argument("--key", default=os.environ.get("HOLDBACK_ADMIN_KEY"),
                   help="admin key (default: $HOLDBACK_ADMIN_KEY); needed once the gateway has keys")
    p.add_argument("--admission-watermark", type=float, default=None,
                   help="an admission watermark lower still than both configs' (optional)")
    args = p.parse_args(argv)
    body = {} if args.admission_watermark is None else {"admissionWatermark": args.admission_watermark}
    headers = {"Authorization": f"Bearer {args.key}"} if args.key else {}
    import httpx  # the admin commands' client; the serving gateway does without it

    try:
        resp = httpx.post(args.url.rstrip("/") + "/admin/rollback", json=body, headers=headers, timeout=10)
    except httpx.HTTPError as exc:
        print(f"cannot reach the gateway at {args.url}: {exc}", file=sys.stderr)
        return 1
    if resp.status_code != 200:
        try:
            message = resp.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = resp.text
        print(f"rollback refused ({resp.status_code}): {message}", file=sys.stderr)
        return 1
    print(json.dumps(resp.json(), indent=2))
    return 0


def _calibrate(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="holdback gateway calibrate", description=(
        "Measure a running replica (model, runtime version, KV blocks and block size) and write a calibration "
        "profile for `admission.calibrationProfile`. The gateway refuses a replica whose model or runtime "
        "differs from the profile's."))
    p.add_argument("--replica", required=True, help="replica base URL, e.g. http://127.0.0.1:8100")
    p.add_argument("--gpu", required=True, help="GPU SKU the replica runs on, e.g. H100-80GB (recorded)")
    p.add_argument("--out", required=True, help="profile file to write (JSON)")
    p.add_argument("--api-key", default=os.environ.get(UPSTREAM_KEY_ENV),
                   help=f"the replica's `--api-key`, if it was started with one (default: ${UPSTREAM_KEY_ENV})")
    p.add_argument("--probe-tokens", type=int, default=512,
                   help="prompt tokens of the probe request that measures the safety factor (0: no probe; the "
                        "replica should be idle) (default %(default)s)")
    args = p.parse_args(argv)
    import httpx

    try:
        profile = measure(args.replica, args.gpu, args.probe_tokens, api_key=args.api_key)
    except (httpx.HTTPError, RuntimeError, KeyError, IndexError, ValueError) as exc:
        print(f"cannot calibrate {args.replica}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    write_profile(profile, args.out)
    print(f"wrote {args.out}: model {profile.model}, runtime {profile.runtime_version}, GPU {profile.gpu_sku}, "
          f"{profile.num_gpu_blocks} blocks of {profile.block_size} tokens, measured safety factor "
          f"{profile.safety_factor}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "rollback":
        return _rollback(argv[1:])
    if argv and argv[0] == "calibrate":
        return _calibrate(argv[1:])
    parser = _parser()
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error(f"--workers must be at least 1 (got {args.workers}); 1 runs the gateway as one process")
    secret = _check_role(parser, args)
    configure_logging(args.log_level)
    host = "127.0.0.1" if args.host is None else args.host
    port = 8200 if args.port is None else args.port
    if args.role == "relay":
        assert secret is not None
        return run_alone(args.flow_control, host, port, secret, Drain(args.drain_grace, args.drain_seconds),
                         reuse_port=args.reuse_port)
    if args.upstream_api_key:
        # The config reads the key from this variable, on start and on every SIGHUP reload.
        os.environ[UPSTREAM_KEY_ENV] = args.upstream_api_key
    try:
        loaded = load_config(args.config)
    except ConfigError as exc:
        log_event(logger, "config_rejected", level=logging.ERROR, error=str(exc))
        return 2
    replicas = [u.strip() for u in args.replicas.split(",") if u.strip()] if args.replicas else None
    try:
        gateway = Gateway(loaded, config_path=args.config, replicas_override=replicas)
    except ConfigError as exc:
        log_event(logger, "config_rejected", level=logging.ERROR, error=str(exc))
        return 2
    gateway.drain.grace, gateway.drain.seconds = args.drain_grace, args.drain_seconds
    try:
        import uvloop
    except ImportError:
        uvloop = None
    run = uvloop.run if uvloop is not None else asyncio.run
    if args.role == "flow-control":
        assert secret is not None
        run(serve_flow_control(gateway, args.relays_listen, secret, args.log_level, args))
    elif args.workers > 1:
        run(serve_workers(gateway, host, port, args.workers, args.log_level))
    else:
        run(serve(gateway, host, port))
    return 0
