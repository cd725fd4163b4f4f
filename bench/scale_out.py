"""Scale-out benchmark: batch throughput of the multi-host topology against one host with the same workers.

Each round runs one batch of --lines requests twice, in alternating order: on "multi-host" (two API
servers, two processors, N worker processes, each in its own network namespace when the machine allows,
see bench/lib/hosts.py) and on "one host" (one API server, one processor and the same N worker processes
with the same concurrency, all on loopback). Both use the machine's PostgreSQL and Redis and an S3
server. Throughput is requests per second from the batch's creation to the moment it reads completed;
the figure is the median of the per-round ratios multi-host / one host.

    python -m bench.scale_out --lines 5000 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.lib.cluster import POSTGRES_URL, REDIS_URL, Cluster, ClusterSpec


def run_once(spec: ClusterSpec, lines: int, log_dir: Path) -> dict:
    log_dir.mkdir(parents=True, exist_ok=True)
    with Cluster(spec, log_dir) as cluster:
        started = time.monotonic()
        batch_id = cluster.submit(lines)
        done = cluster.wait_batch(batch_id, lambda b: b["status"] in ("completed", "failed", "expired", "cancelled"),
                                  1800, "the batch to finish")
        seconds = time.monotonic() - started
        assert done["status"] == "completed", done
        return {"hosts": cluster.network.describe(), "seconds": round(seconds, 2),
                "requests_per_s": round(lines / seconds, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scale_out", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=5000, help="requests per batch (default 5000)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each running both topologies (default 3)")
    parser.add_argument("--workers", type=int, default=3, help="worker processes in both topologies (default 3)")
    parser.add_argument("--worker-concurrency", type=int, default=16, help="-n of each worker (default 16)")
    parser.add_argument("--postgres-url", default=POSTGRES_URL, help=f"server to create databases on ({POSTGRES_URL})")
    parser.add_argument("--redis-url", default=REDIS_URL, help=f"Redis server ({REDIS_URL})")
    args = parser.parse_args(argv)
    common = dict(workers=args.workers, worker_concurrency=args.worker_concurrency, postgres_url=args.postgres_url,
                  redis_url=args.redis_url)
    topologies = {
        "multi_host": ClusterSpec(apis=2, processors=2, netns=True, **common),
        "one_host": ClusterSpec(apis=1, processors=1, netns=False, **common),
    }
    logs = Path(tempfile.mkdtemp(prefix="hb-scale-out-"))
    rounds = []
    for r in range(args.rounds):
        order = list(topologies) if r % 2 == 0 else list(reversed(topologies))
        result = {name: run_once(topologies[name], args.lines, logs / f"round{r}-{name}") for name in order}
        result["ratio"] = round(result["multi_host"]["requests_per_s"] / result["one_host"]["requests_per_s"], 3)
        rounds.append(result)
        print(json.dumps({"round": r, **result}), flush=True)
    ratios = [r["ratio"] for r in rounds]
    print(json.dumps({
        "lines": args.lines, "workers": args.workers, "worker_concurrency": args.worker_concurrency,
        "multi_host_hosts": rounds[0]["multi_host"]["hosts"],
        "median_ratio_multi_over_one": statistics.median(ratios), "ratios": ratios,
        "multi_host_requests_per_s": [r["multi_host"]["requests_per_s"] for r in rounds],
        "one_host_requests_per_s": [r["one_host"]["requests_per_s"] for r in rounds],
        "logs": str(logs),
    }, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
