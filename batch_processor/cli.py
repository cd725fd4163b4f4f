"""`holdback processor`: claim, validate, expand, enqueue, finalize, cancel and expire batches.

Several may run against one database and Redis; leases keep them off each other's batches.
SIGTERM or SIGINT finishes the current round, hands back what it holds, and exits 0.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from holdback.logs import configure_json_logging, log_event
from holdback.env_flags import flags_from_env
from batch_processor.processor import Processor, log
from batch_processor.processor_config import ProcessorConfig, default_name

_DEFAULTS = ProcessorConfig()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="holdback processor",
        description="Claim batches, validate and expand their input, enqueue rows fairly, and finalize, cancel "
                    "and expire them. Settings (database, Redis, namespace, gateway) come from HOLDBACK_* and "
                    "DATABASE_URL / REDIS_URL.",
    )
    p.add_argument("--id", default=None, help="this processor's name in leases and logs (default: host and pid)")
    p.add_argument("--poll-interval", type=float, default=_DEFAULTS.poll_interval,
                   help="seconds between rounds (default %(default)s)")
    p.add_argument("--window", type=int, default=_DEFAULTS.window,
                   help="most rows of one tenant in flight over all its batches: queued + running + waiting to "
                        "retry (default %(default)s)")
    p.add_argument("--queue-rounds", type=float, default=_DEFAULTS.queue_rounds,
                   help="shrink each tenant's window so all tenants together keep about this many times the "
                        "workers' total concurrency in flight, so a new tenant waits behind little; 0 keeps "
                        "--window as is (default %(default)s)")
    p.add_argument("--dispatch", choices=("async", "sync"), default=_DEFAULTS.dispatch,
                   help="async: RQ jobs for `holdback worker`; sync: this process calls the gateway (default %(default)s)")
    p.add_argument("--sync-concurrency", type=int, default=_DEFAULTS.sync_concurrency,
                   help="upper bound of the adaptive (AIMD) concurrency in sync mode (default %(default)s)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve /metrics, /healthz (liveness) and /readyz (database, Redis and gateway answer) on this port "
                        "(0: a free port the system picks, logged in the `metrics_listening` event)")
    p.add_argument("--metrics-host", default="127.0.0.1", help="metrics listen address (default %(default)s)")
    p.add_argument("--once", action="store_true", help="run a single round and exit")
    p.add_argument("--lease-seconds", type=float, default=_DEFAULTS.lease_seconds,
                   help="how long a claimed batch stays ours without renewal (default %(default)s)")
    p.add_argument("--reconcile-interval", type=float, default=_DEFAULTS.reconcile_interval,
                   help="seconds between reconciliations with Redis (default %(default)s)")
    p.add_argument("--reconcile-grace", type=float, default=_DEFAULTS.reconcile_grace,
                   help="seconds a queued or due row may lack its job before it is re-enqueued (default %(default)s)")
    p.add_argument("--running-grace", type=float, default=_DEFAULTS.running_grace,
                   help="seconds a running row may lack a live job before it counts as abandoned (default %(default)s)")
    p.add_argument("--backoff-base", type=float, default=_DEFAULTS.backoff_base,
                   help="sync mode: first retry step in seconds (default %(default)s)")
    p.add_argument("--backoff-cap", type=float, default=_DEFAULTS.backoff_cap,
                   help="sync mode: largest retry step in seconds (default %(default)s)")
    p.add_argument("--round-work-seconds", type=float, default=_DEFAULTS.round_work_seconds,
                   help="seconds of whole-batch steps (expand, cancel, expire, finalize) per round before the rest "
                        "wait for the next round; running batches are refilled between them (default %(default)s)")
    p.add_argument("--prefix-plan", choices=("on", "off"), default="on" if _DEFAULTS.prefix_plan else "off",
                   help="on: within a batch, rows sharing a prompt prefix are queued together, the longest shared "
                        "prefix first; off: in line order (default %(default)s)")
    p.add_argument("--log-level", default="info", help="logging level (default %(default)s)")
    return flags_from_env(p, "processor")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    configure_json_logging("batch_processor", args.log_level)
    from holdback.settings import Settings

    try:
        config = ProcessorConfig(
            name=args.id or default_name(), poll_interval=args.poll_interval, window=args.window,
            queue_rounds=args.queue_rounds,
            dispatch=args.dispatch, sync_concurrency=args.sync_concurrency, lease_seconds=args.lease_seconds,
            reconcile_interval=args.reconcile_interval, reconcile_grace=args.reconcile_grace,
            running_grace=args.running_grace, backoff_base=args.backoff_base, backoff_cap=args.backoff_cap,
            round_work_seconds=args.round_work_seconds, prefix_plan=args.prefix_plan == "on",
        )
    except ValueError as exc:
        print(f"holdback processor: {exc}", file=sys.stderr)
        return 2
    processor = Processor(Settings(), config)
    if args.metrics_port is not None:
        from batch_processor.health import probes
        from holdback.probes import serve

        server = serve(probes(processor), args.metrics_port, args.metrics_host)
        log_event(log, "metrics_listening", port=server.server_port, host=args.metrics_host,
                  paths="/metrics /healthz /readyz")

    stop = threading.Event()

    def _stop(signum, _frame) -> None:  # noqa: ANN001
        log_event(log, "processor_stopping", signal=signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        processor.run(stop, once=args.once)
    finally:
        processor.close()
    return 0
