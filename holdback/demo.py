"""`holdback demo`: show holdback and eviction happen on a running `holdback up`.

It submits a sample batch through the Batch API with the official `openai` client, then sends bursts
of realtime streaming requests through the gateway, and draws one progress line: batch progress,
realtime p95 time to first token, and the gateway's evictions so far.
"""

from __future__ import annotations

import argparse
import io
import json
import random
import sys
import threading
import time
from pathlib import Path

import httpx

from holdback.settings import Settings
from holdback.supervisor import LOCAL_KEYS


def _p95(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]


class RealtimeTraffic(threading.Thread):
    """Opening burst, then seeded arrivals around `rate` per second; TTFT measured at the client."""

    def __init__(self, gateway: str, key: str, model: str, burst: int, rate: float, seconds: float, seed: int = 7):
        super().__init__(daemon=True)
        self.gateway, self.key, self.model = gateway, key, model
        self.burst, self.rate, self.seconds = burst, rate, seconds
        self.rng = random.Random(seed)
        self.ttfts: list[float] = []
        self.errors = 0
        self._lock = threading.Lock()

    def _one(self, client: httpx.Client) -> None:
        body = {"model": self.model, "stream": True, "max_tokens": 16,
                "messages": [{"role": "user", "content": "Say hello to the realtime path."}]}
        headers = {"Authorization": f"Bearer {self.key}", "x-llm-d-inference-objective": "realtime"}
        start = time.monotonic()
        try:
            with client.stream("POST", f"{self.gateway}/v1/chat/completions", json=body, headers=headers) as r:
                if r.status_code != 200:
                    r.read()
                    raise httpx.HTTPStatusError(r.text[:200], request=r.request, response=r)
                first = True
                for line in r.iter_lines():
                    if first and line.startswith("data:"):
                        first = False
                        with self._lock:
                            self.ttfts.append(time.monotonic() - start)
        except httpx.HTTPError:
            with self._lock:
                self.errors += 1

    def run(self) -> None:
        threads: list[threading.Thread] = []
        with httpx.Client(timeout=120, limits=httpx.Limits(max_connections=256)) as client:
            def spawn() -> None:
                t = threading.Thread(target=self._one, args=(client,), daemon=True)
                t.start()
                threads.append(t)

            for _ in range(self.burst):
                spawn()
            end = time.monotonic() + self.seconds
            while time.monotonic() < end:
                time.sleep(self.rng.expovariate(self.rate))
                spawn()
            for t in threads:
                t.join(120)


def _sample_batch(model: str, n: int, max_tokens: int) -> bytes:
    lines = []
    for i in range(n):
        lines.append(json.dumps({
            "custom_id": f"demo-{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "max_tokens": max_tokens,
                     "messages": [{"role": "user", "content": f"Summarise document number {i} in detail."}]},
        }))
    return ("\n".join(lines) + "\n").encode()


def _bar(done: int, failed: int, total: int, width: int = 30) -> str:
    filled = int(width * (done + failed) / total) if total else 0
    return "[" + "#" * filled + "." * (width - filled) + "]"


def main(argv: list[str]) -> int:
    settings = Settings()
    p = argparse.ArgumentParser(prog="holdback demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--api-url", default="http://127.0.0.1:8000", help="Batch API base URL (default %(default)s)")
    p.add_argument("--gateway-url", default="http://127.0.0.1:8200", help="gateway base URL (default %(default)s)")
    p.add_argument("--keys", type=Path, default=settings.data_dir / LOCAL_KEYS,
                   help="keys file written by `holdback up` (default %(default)s)")
    p.add_argument("--requests", type=int, default=400, help="batch size (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=256, help="batch output length (default %(default)s)")
    p.add_argument("--realtime-seconds", type=float, default=30.0, help="how long realtime traffic runs")
    p.add_argument("--realtime-rate", type=float, default=4.0, help="realtime arrivals per second")
    p.add_argument("--burst", type=int, default=64,
                   help="realtime opening burst; above the pool's realtime reserve it forces evictions (default %(default)s)")
    p.add_argument("--timeout", type=float, default=600.0, help="give up waiting for the batch after this many seconds")
    args = p.parse_args(argv)
    if args.requests < 1:
        p.error("--requests must be at least 1")
    if not args.keys.exists():
        p.error(f"no keys file at {args.keys}: start the platform with `holdback up` (or `make up`) first, "
                "from the same directory or with the same HOLDBACK_DATA_DIR")
    keys = json.loads(args.keys.read_text())

    from openai import OpenAI  # the demo shows the official client; it is a dev dependency

    client = OpenAI(base_url=f"{args.api_url}/v1", api_key=keys["tenant"])
    models = httpx.get(f"{args.gateway_url}/v1/models", headers={"Authorization": f"Bearer {keys['realtime']}"},
                       timeout=10).json()
    model = models["data"][0]["id"]
    upload = client.files.create(file=("demo.jsonl", io.BytesIO(_sample_batch(model, args.requests, args.max_tokens))),
                                 purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h",
                                  metadata={"source": "holdback demo"})
    print(f"submitted {batch.id}: {args.requests} requests, max_tokens={args.max_tokens}, model={model}")
    print("waiting 5 s so batch fills its share of the pool, then realtime traffic starts")
    time.sleep(5)
    rt = RealtimeTraffic(args.gateway_url, keys["realtime"], model, args.burst, args.realtime_rate,
                         args.realtime_seconds)
    rt.start()

    deadline = time.monotonic() + args.timeout
    while True:
        batch = client.batches.retrieve(batch.id)
        counts = batch.request_counts
        total = counts.total if counts and counts.total else args.requests
        done, failed = (counts.completed, counts.failed) if counts else (0, 0)
        evictions = _evictions(args.gateway_url, keys)
        p95 = _p95(rt.ttfts)
        rt_text = f"realtime p95 TTFT {p95 * 1000:.0f} ms over {len(rt.ttfts)}" if p95 is not None else "realtime: waiting"
        sys.stdout.write(f"\r{_bar(done, failed, total)} {done}/{total} done, {failed} failed | {rt_text} | "
                         f"evictions {evictions}   ")
        sys.stdout.flush()
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            break
        if time.monotonic() > deadline:
            print(f"\nbatch still {batch.status} after {args.timeout:.0f}s; it keeps running, check the dashboard")
            return 1
        time.sleep(0.5)
    rt.join(10)
    print(f"\nbatch {batch.id} {batch.status}: output file {batch.output_file_id}, error file {batch.error_file_id}")
    if batch.usage:
        print(f"usage: {batch.usage.input_tokens} input + {batch.usage.output_tokens} output tokens")
    print(f"realtime: {len(rt.ttfts)} streams, {rt.errors} errors, p95 TTFT "
          f"{(_p95(rt.ttfts) or 0) * 1000:.0f} ms; gateway evictions {_evictions(args.gateway_url, keys)}")
    print(f"see {args.api_url}/dashboard (admin key in {args.keys})")
    return 0 if batch.status == "completed" else 1


def _evictions(gateway: str, keys: dict[str, str]) -> str:
    """Evictions the gateway has issued (`totals.evictions.issued` in its /admin/state), or "?" if unreachable."""
    try:
        state = httpx.get(f"{gateway}/admin/state", headers={"Authorization": f"Bearer {keys['admin']}"}, timeout=2).json()
    except (httpx.HTTPError, ValueError):
        return "?"
    return str(((state.get("totals") or {}).get("evictions") or {}).get("issued", "?"))
