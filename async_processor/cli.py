"""`holdback worker`: send queued batch requests through the gateway, N in flight per process."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import time

from async_processor.log import configure as configure_logging, logger
from async_processor.config import WorkerConfig, WorkerSettings
from async_processor.metrics import WorkerMetrics
from async_processor.registration import WorkerNameTaken
from holdback.broker import resolve_redis_url
from holdback.contract import requests_queue_name, worker_name
from holdback.attempts import Jitter, RetryPolicy
from holdback.env_flags import flags_from_env
from holdback.logs import log_event
from holdback.settings import Settings


def _parser(env: WorkerSettings) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="holdback worker",
        description="Async workers: take request jobs from the RQ queue, send each through the gateway with the "
                    "batch objective, retry evictions and transient failures with backoff (parked in RQ's "
                    "ScheduledJobRegistry, not holding a slot), wait out gateway and replica outages without "
                    "spending the retry budget (a circuit shared in Redis stops claiming meanwhile), and record "
                    "exactly one final result per request. "
                    "Defaults come from HOLDBACK_WORKER_* variables, e.g. HOLDBACK_WORKER_BACKOFF_BASE.")
    p.add_argument("-n", "--concurrency", type=int, default=env.concurrency,
                   help="requests in flight per process (default %(default)s)")
    p.add_argument("--processes", type=int, default=1, help="worker processes to run (default %(default)s)")
    p.add_argument("--name", help="worker name in Redis (default <namespace>.<host>.<pid>; .1, .2, ... per process)")
    p.add_argument("--gateway-url", help="where requests go (default HOLDBACK_GATEWAY_URL or http://127.0.0.1:8200)")
    p.add_argument("--metrics-port", type=int,
                   help="serve /metrics, /healthz and /readyz on this port (process i of --processes uses PORT+i)")
    p.add_argument("--metrics-host", default="127.0.0.1", help="metrics listen address (default %(default)s)")
    p.add_argument("--burst", action="store_true", help="exit once the queue is empty and nothing is in flight")
    p.add_argument("--backoff-base", type=float, default=env.backoff_base,
                   help="first retry step in seconds, doubling per attempt (default %(default)s)")
    p.add_argument("--backoff-cap", type=float, default=env.backoff_cap,
                   help="largest retry step in seconds (default %(default)s)")
    p.add_argument("--jitter", choices=[j.value for j in Jitter], default=env.jitter.value,
                   help="full: wait in [0, step); equal: in [step/2, step) (default %(default)s)")
    p.add_argument("--transient-budget", type=int, default=env.transient_budget,
                   help="a request fails on this many 5xx/transport failures it may have caused; a refused "
                        "connection, 502/503 or no healthy replica never counts (default %(default)s)")
    p.add_argument("--closing-recheck", type=float, default=env.closing_recheck,
                   help="seconds a request of a batch past its deadline waits for the processor to close it "
                        "(default %(default)s)")
    p.add_argument("--request-timeout", type=float, default=env.request_timeout,
                   help="seconds one gateway request may take (default %(default)s)")
    p.add_argument("--heartbeat-ttl", type=int, default=env.heartbeat_ttl,
                   help="seconds a running job survives without a heartbeat before it is requeued "
                        "(default %(default)s)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds to let in-flight requests finish before requeueing them "
                        "(default %(default)s)")
    p.add_argument("--scheduler-interval", type=float, default=env.scheduler_interval,
                   help="seconds between moves of due retries to the queue (default %(default)s)")
    p.add_argument("--probe-interval", type=float, default=env.probe_interval,
                   help="while the shared gateway circuit is open (gateway or every replica down), seconds between "
                        "probes that close it; no new jobs are claimed meanwhile (default %(default)s)")
    p.add_argument("--db-lanes", type=int, default=env.db_lanes,
                   help="database threads per process; each runs the calls waiting for it in one transaction "
                        "(group commit). SQLite always uses 1 (default %(default)s)")
    p.add_argument("--no-resume", dest="resume", action="store_false", default=env.resume,
                   help="restart evicted requests from scratch instead of continuing their partial output "
                        "(HOLDBACK_WORKER_RESUME=0; for comparisons)")
    p.add_argument("--stream-interval", type=int, default=env.stream_interval,
                   help="ask vLLM to send a resumable (streamed) request's tokens this many per event: fewer events "
                        "cost the replica's API server, the gateway and the worker less per token; an eviction "
                        "loses at most this many unsent tokens, decoded again. A vLLM that does not know the "
                        "per-request stream_interval (older than 0.32) ignores it; 1 sends every token and not the "
                        "field (HOLDBACK_WORKER_STREAM_INTERVAL; default %(default)s)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="DEBUG also logs every successful request (default %(default)s)")
    return flags_from_env(p, "worker")


def main(argv: list[str] | None = None) -> int:
    env = WorkerSettings()
    parser = _parser(env)
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    for flag, value, minimum in (("--concurrency/-n", args.concurrency, 1), ("--processes", args.processes, 1),
                                 ("--heartbeat-ttl", args.heartbeat_ttl, 3), ("--transient-budget",
                                 args.transient_budget, 1), ("--db-lanes", args.db_lanes, 1),
                                 ("--stream-interval", args.stream_interval, 1)):
        if value < minimum:
            parser.error(f"{flag} must be at least {minimum}, got {value}")
    for flag, value in (("--request-timeout", args.request_timeout), ("--backoff-base", args.backoff_base),
                        ("--scheduler-interval", args.scheduler_interval), ("--closing-recheck", args.closing_recheck),
                        ("--probe-interval", args.probe_interval)):
        if value <= 0:
            parser.error(f"{flag} must be positive, got {value}")
    if args.backoff_cap < args.backoff_base:
        parser.error(f"--backoff-cap ({args.backoff_cap}) must not be below --backoff-base ({args.backoff_base})")
    settings = Settings()
    name = args.name or worker_name(settings.redis_namespace, socket.gethostname(), os.getpid())
    if args.processes > 1:
        return _supervise(argv if argv is not None else sys.argv[1:], args, name)
    try:
        policy = RetryPolicy(base=args.backoff_base, cap=args.backoff_cap, jitter=Jitter(args.jitter),
                             transient_budget=args.transient_budget, closing_recheck=args.closing_recheck)
        config = WorkerConfig(
            name=name,
            queue_name=requests_queue_name(settings.redis_namespace),
            namespace=settings.redis_namespace,
            redis_url=resolve_redis_url(settings),
            database_url=settings.sqlalchemy_url,
            gateway_url=args.gateway_url or settings.gateway_url,
            gateway_key=settings.gateway_key,
            concurrency=args.concurrency,
            policy=policy,
            request_timeout=args.request_timeout,
            heartbeat_ttl=args.heartbeat_ttl,
            scheduler_interval=args.scheduler_interval,
            probe_interval=args.probe_interval,
            db_lanes=args.db_lanes,
            resume=args.resume,
            stream_interval=args.stream_interval,
            burst=args.burst,
            metrics_port=args.metrics_port,
            drain_timeout=args.drain_timeout,
        )
    except ValueError as exc:
        parser.error(str(exc))
    from async_processor.health import probes
    from async_processor.worker import AsyncWorker
    from holdback.probes import serve

    worker = AsyncWorker(config, WorkerMetrics(config.name))
    if config.metrics_port:
        serve(probes(worker), config.metrics_port, args.metrics_host)
    try:
        import uvloop
    except ImportError:
        uvloop = None
    try:
        return uvloop.run(worker.run()) if uvloop is not None else asyncio.run(worker.run())
    except WorkerNameTaken as exc:
        log_event(logger, "worker_name_taken", level=logging.ERROR, error=str(exc))
        return 2


def _supervise(argv: list[str], args: argparse.Namespace, name: str) -> int:
    """Run --processes single-process workers; restart one that dies; pass SIGTERM/SIGINT on.

    Children get SIGTERM if this supervisor dies (Linux parent-death signal), so none is ever orphaned.
    Each child runs in its own session: Linux's scheduler (autogroup, on by default) shares the CPU between
    sessions, so N processes in the supervisor's session got one session's share — on a busy host, no more CPU
    than one process. Stopping the supervisor (SIGTERM/SIGINT, or its death) still stops every child.
    """
    base = _without(argv, {"--processes", "--name", "--metrics-port"})
    stopping = False

    def child_argv(i: int) -> list[str]:
        extra = ["--processes", "1", "--name", f"{name}.{i}"]
        if args.metrics_port:
            extra += ["--metrics-port", str(args.metrics_port + i)]
        return [sys.executable, "-P", "-m", "holdback.cli", "worker", *base, *extra]  # -P: as holdback up's children

    def spawn(i: int) -> subprocess.Popen:
        return subprocess.Popen(child_argv(i), start_new_session=True, preexec_fn=_die_with_parent)

    def forward(signum, _frame):  # noqa: ANN001
        nonlocal stopping
        stopping = True
        for proc in children.values():
            if proc.poll() is None:
                proc.send_signal(signum)

    children: dict[int, subprocess.Popen] = {}
    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    try:
        for i in range(args.processes):
            children[i] = spawn(i)
        log_event(logger, "worker_pool_started", processes=args.processes, worker=name)
        while True:
            alive = False
            for i, proc in list(children.items()):
                code = proc.poll()
                if code is None:
                    alive = True
                elif not stopping and not args.burst and code != 0:
                    log_event(logger, "worker_process_died", level=logging.WARNING, index=i, exit_code=code)
                    time.sleep(1.0)
                    children[i] = spawn(i)
                    alive = True
            if not alive:
                break
            time.sleep(0.5)
    finally:
        for proc in children.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in children.values():
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    return max((p.returncode or 0) for p in children.values())


def _die_with_parent() -> None:
    """In a child before exec: ask Linux to SIGTERM it when the supervisor dies (no-op elsewhere)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


def _without(argv: list[str], flags: set[str]) -> list[str]:
    """argv minus the given flags and their values (both `--flag v` and `--flag=v`)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in flags:
            skip = True
            continue
        if arg.split("=", 1)[0] in flags:
            continue
        out.append(arg)
    return out
