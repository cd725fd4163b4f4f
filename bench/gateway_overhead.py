"""Gateway overhead and eviction release latency, measured against baselines from the same run.

Throughput and latency: short non-streaming completions against a zero-latency simulator replica, three
ways — direct to the replica, through a bare aiohttp pass-through proxy (defined in this file), and through
`holdback gateway`. The load generator runs in its own process for each run; every round runs the targets in
a shuffled order and then in reverse (A B C C B A), so drift on a small shared machine hits all three alike.
Reported: gateway ÷ bare-proxy throughput (goal ≥ 0.8) and the added p50 latency at concurrency 1
(goal ≤ 1 ms), each computed within a round and then taken as the median over rounds.

Eviction release: a simulator with real step timing is kept full of long batch requests through the
gateway (eviction on, no holdback); realtime requests then arrive one at a time, each blocked, and the
gateway's own timestamps give arrival → dispatch (`x-holdback-queue-ms`: the eviction decision, the victim's
upstream close and the dispatch) and decision → upstream closed (eviction confirmation histogram).
Goal p99 < 50 ms.

    python bench/gateway_overhead.py --rounds 5 --duration 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from aiohttp import web

from holdback.contract import DROP_REASON_HEADER, OBJECTIVE_HEADER, QUEUE_MS_HEADER, is_eviction
from bench.lib.processes import Children, holdback
from bench.lib.readiness import free_port, wait_http
from bench.stats import histogram_bound, percentile

PY = sys.executable


# -- the bare pass-through proxy (baseline) ------------------------------------------------------------------
_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "upgrade", "te", "trailer"}


def serve_bare_proxy(port: int, upstream: str) -> None:
    """An aiohttp server forwarding to `upstream` with one shared aiohttp client session: nothing else."""

    async def startup(app: web.Application) -> None:
        app["session"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1024, limit_per_host=0),
                                               auto_decompress=False, skip_auto_headers=("User-Agent",))

    async def cleanup(app: web.Application) -> None:
        await app["session"].close()

    async def forward(request: web.Request) -> web.StreamResponse:
        session: aiohttp.ClientSession = request.app["session"]
        data = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        async with session.request(request.method, upstream + request.path_qs, data=data, headers=headers) as r:
            out = {k: v for k, v in r.headers.items() if k.lower() not in _HOP}
            if "Content-Length" in r.headers and not r.headers.get("Content-Type", "").startswith("text/event"):
                return web.Response(status=r.status, body=await r.read(), headers=out)
            stream = web.StreamResponse(status=r.status, headers=out)
            await stream.prepare(request)
            async for chunk in r.content.iter_any():
                await stream.write(chunk)
            await stream.write_eof()
            return stream

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_route("*", "/v1/{tail:.*}", forward)
    app.on_startup.append(startup)
    app.on_cleanup.append(cleanup)

    async def serve() -> None:
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port, backlog=1024, reuse_address=True).start()
        await asyncio.Event().wait()  # until SIGTERM ends the process

    _run(serve())


def _run(coro) -> None:
    try:
        import uvloop
        uvloop.run(coro)
    except ImportError:
        asyncio.run(coro)


# -- the load generator (its own process) ----------------------------------------------------------------------
PAYLOAD = json.dumps({"model": "sim-model", "prompt": "hello", "max_tokens": 1}).encode()


async def _load(url: str, concurrency: int, duration: float, warmup: float) -> dict:
    latencies: list[float] = []
    errors = 0
    connector = aiohttp.TCPConnector(limit=concurrency, limit_per_host=0)
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession(connector=connector) as session:
        start = time.perf_counter()
        measure_from = start + warmup
        stop_at = measure_from + duration

        async def worker() -> None:
            nonlocal errors
            while True:
                t0 = time.perf_counter()
                if t0 >= stop_at:
                    return
                try:
                    async with session.post(url, data=PAYLOAD, headers=headers) as r:
                        await r.read()
                        ok = r.status == 200
                except aiohttp.ClientError:
                    ok = False
                t1 = time.perf_counter()
                if t0 >= measure_from and t1 <= stop_at:
                    if ok:
                        latencies.append(t1 - t0)
                    else:
                        errors += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    n = len(latencies)
    return {"requests": n, "errors": errors, "rps": n / duration,
            "p50_ms": percentile(latencies, 0.5) * 1000 if n else None,
            "p99_ms": percentile(latencies, 0.99) * 1000 if n else None}


def run_load(url: str, concurrency: int, duration: float, warmup: float) -> dict:
    out = subprocess.run([PY, __file__, "--load", url, "--concurrency", str(concurrency), "--duration",
                          str(duration), "--warmup", str(warmup)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


# -- phase 1: overhead -----------------------------------------------------------------------------------------
def overhead(args: argparse.Namespace, children: Children, tmp: Path) -> dict:
    sim_port, bare_port, gw_port = free_port(), free_port(), free_port()
    sim = f"http://127.0.0.1:{sim_port}"
    p = children.start(holdback("sim", "--port", str(sim_port), "--replicas", "1", "--zero-latency",
                                "--max-num-seqs", "1024", "--log-level", "WARNING"), tmp / "sim.log")
    wait_http(sim + "/health", p)
    p = children.start([PY, __file__, "--serve-bare-proxy", str(bare_port), "--upstream", sim], tmp / "bare.log")
    wait_http(f"http://127.0.0.1:{bare_port}/health", p)
    config = tmp / "gateway.yaml"
    # Capacity far above the load: this phase measures the proxy path, not queueing.
    config.write_text("saturation: {maxConcurrency: 1024}\nanonymous: {objectives: ['*']}\n")
    p = children.start(holdback("gateway", "--config", str(config), "--port", str(gw_port), "--replicas", sim,
                                "--log-level", "WARNING"), tmp / "gateway.log")
    wait_http(f"http://127.0.0.1:{gw_port}/health", p)
    targets = {"direct": sim, "bare_proxy": f"http://127.0.0.1:{bare_port}",
               "gateway": f"http://127.0.0.1:{gw_port}"}
    results: dict[str, dict[str, list[dict]]] = {t: {"high": [], "low": []} for t in targets}
    rng = random.Random(args.seed)
    ratios: list[float] = []
    added: list[float] = []
    for rnd in range(args.rounds):
        order = list(targets)
        rng.shuffle(order)
        # A B C C B A: each target runs once early and once late in the round, so drift cancels in the ratio.
        runs: dict[str, list[tuple[dict, dict]]] = {n: [] for n in targets}
        for name in order + order[::-1]:
            url = targets[name] + "/v1/completions"
            high = run_load(url, args.concurrency, args.duration, args.warmup)
            low = run_load(url, 1, args.duration / 2, args.warmup)
            runs[name].append((high, low))
            results[name]["high"].append(high)
            results[name]["low"].append(low)
        rps = {n: sum(h["rps"] for h, _ in r) / len(r) for n, r in runs.items()}
        p50 = {n: sum(lo["p50_ms"] for _, lo in r) / len(r) for n, r in runs.items()}
        ratios.append(rps["gateway"] / rps["bare_proxy"])
        added.append(p50["gateway"] - p50["bare_proxy"])
        print(f"round {rnd + 1}/{args.rounds}: " + ", ".join(
            f"{n} {rps[n]:.0f} rps / p50@1 {p50[n]:.3f} ms" for n in targets), file=sys.stderr, flush=True)
    summary = {
        name: {"rps_median": statistics.median(r["rps"] for r in res["high"]),
               "p50_ms_at_c1_median": statistics.median(r["p50_ms"] for r in res["low"]),
               "p99_ms_at_c1_median": statistics.median(r["p99_ms"] for r in res["low"]),
               "errors": sum(r["errors"] for r in res["high"] + res["low"])}
        for name, res in results.items()
    }
    summary["throughput_ratio_gateway_over_bare"] = {"median": statistics.median(ratios),
                                                     "per_round": [round(x, 3) for x in ratios]}
    summary["added_p50_ms_gateway_minus_bare"] = {"median": statistics.median(added),
                                                  "per_round": [round(x, 3) for x in added]}
    return summary


# -- phase 2: eviction release latency -------------------------------------------------------------------------
async def _eviction_trials(gw: str, batch_slots: int, trials: int) -> dict:
    """Blocked realtime arrivals, each evicting batch. With KV admission on, also every eviction's decision ->
    upstream closed and decision -> capacity released in the ledger (/admin/state `kv.recent_releases`, exact
    per eviction; in one process both are the same moment)."""
    import httpx
    releases: dict[tuple[str, float], tuple[float, float]] = {}
    queue_ms: list[float] = []
    client_ms: list[float] = []
    stop = asyncio.Event()
    evicted = 0
    batch_body = {"model": "sim-model", "prompt": "batch work " * 50, "max_tokens": 4000, "ignore_eos": True}
    rt_body = {"model": "sim-model", "prompt": "hi", "max_tokens": 1}
    limits = httpx.Limits(max_connections=batch_slots + 8, max_keepalive_connections=batch_slots + 8)
    async with httpx.AsyncClient(base_url=gw, timeout=120, limits=limits) as client:

        async def batch_worker() -> None:
            nonlocal evicted
            while not stop.is_set():
                try:
                    r = await client.post("/v1/completions", json=batch_body,
                                          headers={OBJECTIVE_HEADER: "batch"})
                    if is_eviction(r.headers.get(DROP_REASON_HEADER)):
                        evicted += 1
                except httpx.HTTPError:
                    await asyncio.sleep(0.05)

        async def batch_in_flight() -> int:
            s = (await client.get("/admin/state")).json()
            for release in s["kv"]["recent_releases"]:
                if release["cause"] == "evict":
                    releases[(release["request_id"], release["at"])] = (
                        release["upstream_closed_after_cause"], release["seconds_after_cause"])
            return next(b for b in s["bands"] if b["priority"] == -10)["in_flight"]

        workers = [asyncio.create_task(batch_worker()) for _ in range(batch_slots)]
        for _ in range(trials):
            deadline = time.monotonic() + 30
            while await batch_in_flight() < batch_slots:
                if time.monotonic() > deadline:
                    raise RuntimeError("batch never refilled the pool")
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)
            t0 = time.perf_counter()
            r = await client.post("/v1/completions", json=rt_body,
                                  headers={OBJECTIVE_HEADER: "realtime"})
            client_ms.append((time.perf_counter() - t0) * 1000)
            if r.status_code != 200:
                raise RuntimeError(f"realtime request failed: {r.status_code} {r.text[:200]}")
            if QUEUE_MS_HEADER in r.headers:  # absent: it was not blocked, so it measures nothing here
                queue_ms.append(float(r.headers[QUEUE_MS_HEADER]))
        await batch_in_flight()  # the last trial's release
        stop.set()
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        metrics = (await client.get("/metrics")).text
    p99_conf, confirmations = histogram_bound(metrics, "holdback_gateway_eviction_confirmation_seconds", 0.99)
    return {"trials": trials, "blocked_trials": len(queue_ms), "evicted_batch_responses": evicted,
            "arrival_to_dispatch_ms": {"p50": percentile(queue_ms, 0.5), "p99": percentile(queue_ms, 0.99),
                                       "max": max(queue_ms)},
            "realtime_client_latency_ms": {"p50": percentile(client_ms, 0.5), "p99": percentile(client_ms, 0.99)},
            "confirmation_p99_bucket_ms": p99_conf * 1000 if p99_conf is not None else None,
            "confirmations": confirmations,
            "upstream_closed_after_eviction_s": [closed for closed, _released in releases.values()],
            "release_after_eviction_s": [released for _closed, released in releases.values()]}


def eviction(args: argparse.Namespace, children: Children, tmp: Path, gateway_args: tuple[str, ...] = (),
             admission: bool = False) -> dict:
    """The eviction phase against its own simulator and gateway (`gateway_args`: e.g. --workers 2; `admission`:
    KV admission on, so each eviction's release is recorded exactly)."""
    sim_port, gw_port = free_port(), free_port()
    sim = f"http://127.0.0.1:{sim_port}"
    p = children.start(holdback("sim", "--port", str(sim_port), "--replicas", "1", "--log-level", "WARNING"),
                       tmp / f"sim-evict{sim_port}.log")
    wait_http(sim + "/health", p)
    config = tmp / "gateway-evict.yaml"
    config.write_text(f"saturation: {{maxConcurrency: {args.eviction_slots}}}\nusageLimit: {{policy: static}}\n"
                      "anonymous: {objectives: ['*']}\n"
                      + ("admission: {enabled: true, tokenizer: estimate, kvPoolGiB: 4096}\n" if admission else ""))
    gw = f"http://127.0.0.1:{gw_port}"
    p = children.start(holdback("gateway", "--config", str(config), "--port", str(gw_port), "--replicas", sim,
                                "--log-level", "WARNING", *gateway_args), tmp / f"gateway-evict{sim_port}.log")
    wait_http(gw + "/health", p)
    return asyncio.run(_eviction_trials(gw, args.eviction_slots, args.eviction_trials))


def _table(o: dict, e: dict | None) -> str:
    lines = ["| target | throughput (req/s, c={c}) | p50 @ c=1 (ms) | p99 @ c=1 (ms) |".format(c=o["concurrency"]),
             "|---|---|---|---|"]
    for name in ("direct", "bare_proxy", "gateway"):
        s = o[name]
        lines.append(f"| {name} | {s['rps_median']:.0f} | {s['p50_ms_at_c1_median']:.3f} | "
                     f"{s['p99_ms_at_c1_median']:.3f} |")
    r = o["throughput_ratio_gateway_over_bare"]
    a = o["added_p50_ms_gateway_minus_bare"]
    lines += ["", f"gateway / bare proxy throughput: median {r['median']:.3f} (rounds {r['per_round']}) — goal >= 0.8",
              f"gateway - bare proxy p50 at c=1: median {a['median']:.3f} ms (rounds {a['per_round']}) — goal <= 1 ms"]
    if e is not None:
        lines += ["", f"eviction release over {e['blocked_trials']} blocked realtime arrivals: arrival -> dispatch "
                  f"p50 {e['arrival_to_dispatch_ms']['p50']:.2f} ms, p99 {e['arrival_to_dispatch_ms']['p99']:.2f} ms, "
                  f"max {e['arrival_to_dispatch_ms']['max']:.2f} ms — goal p99 < 50 ms",
                  f"decision -> upstream closed: p99 <= {e['confirmation_p99_bucket_ms']} ms (histogram bucket, "
                  f"{e['confirmations']} confirmations); realtime client latency p50 "
                  f"{e['realtime_client_latency_ms']['p50']:.2f} ms, p99 {e['realtime_client_latency_ms']['p99']:.2f} ms"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="Children are started with the "
                                 "`holdback` CLI and stopped at the end; results go to stdout (table or --json).")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds per target (default 5)")
    ap.add_argument("--duration", type=float, default=3.0, help="measured seconds per throughput run; latency runs take half (default 3)")
    ap.add_argument("--warmup", type=float, default=0.5, help="unmeasured seconds before each run (default 0.5)")
    ap.add_argument("--concurrency", type=int, default=32, help="closed-loop clients for throughput (default 32)")
    ap.add_argument("--eviction-slots", type=int, default=8, help="pool slots kept full of batch (default 8)")
    ap.add_argument("--eviction-trials", type=int, default=100, help="blocked realtime arrivals (default 100)")
    ap.add_argument("--skip-overhead", action="store_true", help="only the eviction phase")
    ap.add_argument("--skip-eviction", action="store_true", help="only the overhead phase")
    ap.add_argument("--seed", type=int, default=1, help="seed of the interleaving order")
    ap.add_argument("--json", action="store_true", help="print the raw results as JSON")
    # Internal roles of this file in its child processes.
    ap.add_argument("--serve-bare-proxy", type=int, metavar="PORT", help=argparse.SUPPRESS)
    ap.add_argument("--upstream", help=argparse.SUPPRESS)
    ap.add_argument("--load", metavar="URL", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.serve_bare_proxy:
        serve_bare_proxy(args.serve_bare_proxy, args.upstream)
        return 0
    if args.load:
        result: dict = {}

        async def go() -> None:
            result.update(await _load(args.load, args.concurrency, args.duration, args.warmup))

        _run(go())
        print(json.dumps(result))
        return 0

    children = Children()
    out: dict = {}
    try:
        with tempfile.TemporaryDirectory(prefix="gw-bench-") as tmp:
            if not args.skip_overhead:
                out["overhead"] = overhead(args, children, Path(tmp))
                out["overhead"]["concurrency"] = args.concurrency
                children.close()
                children.procs.clear()
            if not args.skip_eviction:
                out["eviction"] = eviction(args, children, Path(tmp))
    finally:
        children.close()
    if args.json:
        print(json.dumps(out, indent=2))
    elif "overhead" in out:
        print(_table(out["overhead"], out.get("eviction")))
    else:
        print(json.dumps(out["eviction"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
