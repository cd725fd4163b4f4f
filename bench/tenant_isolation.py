"""Tenant isolation under a flood: one tenant's throughput while another submits and cancels large batches.

Each round runs, in alternating order, the quiet tenant's batch of `--quiet-lines` requests alone, and the
same batch while the flood tenant creates `--flood-batches` batches of `--flood-lines` requests each from one
uploaded file and cancels each of them once the processor has expanded it into rows. Throughput is requests ÷ seconds from the
quiet batch's create to `completed`; the figure is flooded ÷ alone, taken within a round, and the median of the
per-round ratios over `--rounds` is reported with every round's value (goal ≥ 0.5). Before a round's second
side starts, every flood batch of the first has reached `cancelled`; the seconds that took (the cancel drain)
are reported too, with how many flood requests ran before their batch was cancelled (the flood tenant's fair
share of the workers while its batches were open) and how many creates the flood tenant's limits refused.

The platform is real and runs through the CLI and HTTP: `holdback sim --zero-latency` behind `holdback
gateway`, `holdback api`, one `holdback processor`, one `holdback worker -n 64`, on a fresh SQLite and a
private redis-server unless --database-url / --redis-url point elsewhere. Under each side a line says how
many cores each component used meanwhile (bench/lib/process_cpu.py): where the flood's cost lands.

    python bench/tenant_isolation.py                                   # 3 rounds, SQLite
    python bench/tenant_isolation.py --database-url postgresql://127.0.0.1/test --rounds 3
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import threading
import time

import httpx

from bench.pipeline_throughput import Bench, add_platform_arguments
from bench.stats import bootstrap_median

TERMINAL = {"completed", "failed", "expired", "cancelled"}


def request_lines(n: int, tag: str) -> bytes:
    return "\n".join(json.dumps({
        "custom_id": f"{tag}-{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "sim-model", "max_tokens": 8,
                 "messages": [{"role": "user", "content": f"{tag} question number {i}, please answer"}]},
    }) for i in range(n)).encode() + b"\n"


class TenantClient:
    def __init__(self, b: Bench, name: str):
        key = httpx.post(f"{b.api_url}/admin/keys", json={"tenant": name},
                         headers={"Authorization": f"Bearer {b.admin_key}"}, timeout=30)
        key.raise_for_status()
        self.api = httpx.Client(base_url=f"{b.api_url}/v1", timeout=120,
                                headers={"Authorization": f"Bearer {key.json()['key']}"})

    def upload(self, payload: bytes) -> str:
        r = self.api.post("/files", files={"file": ("input.jsonl", io.BytesIO(payload), "application/jsonl")},
                          data={"purpose": "batch"})
        r.raise_for_status()
        return r.json()["id"]

    def create(self, file_id: str) -> httpx.Response:
        return self.api.post("/batches", json={"input_file_id": file_id, "endpoint": "/v1/chat/completions",
                                               "completion_window": "24h"})

    def status(self, batch_id: str) -> dict:
        r = self.api.get(f"/batches/{batch_id}")
        r.raise_for_status()
        return r.json()


def check_alive(b: Bench) -> None:
    for proc in b.procs:
        if proc.poll() is not None:
            raise RuntimeError(f"{' '.join(map(str, proc.args[:4]))} exited with {proc.returncode}; logs in {b.data_dir}")


def run_quiet(b: Bench, quiet: TenantClient, file_id: str, lines: int, timeout: float) -> float:
    """Seconds from create to completed for one quiet batch."""
    r = quiet.create(file_id)
    r.raise_for_status()
    batch_id, start = r.json()["id"], time.monotonic()
    while time.monotonic() - start < timeout:
        check_alive(b)
        batch = quiet.status(batch_id)
        if batch["status"] in TERMINAL:
            if batch["status"] != "completed" or batch["request_counts"]["completed"] != lines:
                raise RuntimeError(f"the quiet batch ended {batch['status']} with {batch['request_counts']}")
            return time.monotonic() - start
        time.sleep(0.05)
    raise TimeoutError(f"the quiet batch did not finish in {timeout:.0f}s")


def flood(tenant: TenantClient, file_id: str, batches: int, made: list[str], refused: list[int],
          timeout: float) -> None:
    """Create every batch, then cancel each once the processor has expanded it into rows: both the expansion
    and the cancel of every large batch go through the processor while the quiet tenant's batch runs."""
    for _ in range(batches):
        r = tenant.create(file_id)
        if r.status_code == 429:
            refused.append(1)
            continue
        r.raise_for_status()
        made.append(r.json()["id"])
    pending, start = list(made), time.monotonic()
    while pending and time.monotonic() - start < timeout:
        for batch_id in list(pending):
            if tenant.status(batch_id)["status"] != "validating":
                tenant.api.post(f"/batches/{batch_id}/cancel")
                pending.remove(batch_id)
        time.sleep(0.2)


def drain(tenant: TenantClient, batch_ids: list[str], timeout: float) -> tuple[float, int]:
    """Seconds until every flood batch is terminal, and how many of their requests completed before."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        batches = [tenant.status(b) for b in batch_ids]
        if all(b["status"] in TERMINAL for b in batches):
            return time.monotonic() - start, sum(b["request_counts"]["completed"] for b in batches)
        time.sleep(0.2)
    raise TimeoutError(f"the flood's batches were not all cancelled after {timeout:.0f}s")


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--quiet-lines", type=int, default=3000, help="the quiet tenant's batch (default %(default)s)")
    p.add_argument("--flood-batches", type=int, default=20, help="batches the flood creates (default %(default)s)")
    p.add_argument("--flood-lines", type=int, default=10_000, help="lines of each (default %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="rounds; the median of per-round ratios is reported")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds any one wait may take")
    add_platform_arguments(p)
    args = p.parse_args(argv)
    args.path = "gateway"

    b = Bench(args)
    rounds: list[dict] = []
    try:
        b.start_platform(window=256)
        b.holdback("worker", "-n", "64", "--log-level", "WARNING", log="worker")
        quiet, noisy = TenantClient(b, "quiet"), TenantClient(b, "flood")
        quiet_file = quiet.upload(request_lines(args.quiet_lines, "quiet"))
        flood_file = noisy.upload(request_lines(args.flood_lines, "flood"))
        run_quiet(b, quiet, quiet_file, args.quiet_lines, args.timeout)  # warm-up: every process has served once
        for n in range(args.rounds):
            result: dict = {"round": n + 1}
            for side in (("alone", "flooded") if n % 2 == 0 else ("flooded", "alone")):
                if side == "alone":
                    with b.sampler() as sampled:
                        result["alone_s"] = run_quiet(b, quiet, quiet_file, args.quiet_lines, args.timeout)
                    result["alone_cpu"] = sampled.shares.line()
                    continue
                made: list[str] = []
                refused: list[int] = []
                flooding = threading.Thread(target=flood, args=(noisy, flood_file, args.flood_batches, made, refused,
                                                                  args.timeout))
                flooding.start()
                with b.sampler() as sampled:
                    result["flooded_s"] = run_quiet(b, quiet, quiet_file, args.quiet_lines, args.timeout)
                result["flooded_cpu"] = sampled.shares.line()
                flooding.join()
                result["drain_s"], result["flood_completed"] = drain(noisy, made, args.timeout)
                result["flood_refused"] = len(refused)
            result["ratio"] = result["alone_s"] / result["flooded_s"]
            rounds.append(result)
            print(f"round {n + 1}: alone {args.quiet_lines / result['alone_s']:.0f} req/s, flooded "
                  f"{args.quiet_lines / result['flooded_s']:.0f} req/s, ratio {result['ratio']:.2f}; flood cancelled "
                  f"in {result['drain_s']:.1f} s after the quiet batch ({result['flood_completed']} of its requests "
                  f"had completed), {result['flood_refused']} creates refused\n  cores used, alone: "
                  f"{result['alone_cpu']}\n  cores used, flooded: {result['flooded_cpu']}", flush=True)
    finally:
        b.close()
    estimate = bootstrap_median([r["ratio"] for r in rounds])
    verdict = "met" if estimate.lo is not None and estimate.lo >= 0.5 else (
        "missed" if estimate.hi is not None and estimate.hi < 0.5 else "undecided")
    print(f"\nquiet tenant's throughput flooded ÷ alone ({b.database}, {args.flood_batches} × {args.flood_lines:,}-line "
          f"batches created and cancelled): median {statistics.median(r['ratio'] for r in rounds):.2f} "
          f"[{_fmt(estimate.lo)}, {_fmt(estimate.hi)}] over {len(rounds)} rounds, goal ≥ 0.5: {verdict}")
    if args.json:
        args.json.write_text(json.dumps({"database": b.database, "rounds": rounds,
                                         "median": estimate.as_dict()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
