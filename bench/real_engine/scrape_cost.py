"""What the gateway's metrics scrape costs a real vLLM replica's API server: its GET /metrics route, which answers
the whole exposition (histograms and all) whatever the query, against its /metrics/ mount asked for the series the
gateway reads (what the gateway scrapes).

One vLLM server (the real-engine tier's CPU build, `--max-num-seqs 8`) pinned to CPU 0, where its API server
shares the core with the engine as it does in the real-engine study; this process on CPU 1. While `--streams`
batch completions stream from it (so its histograms hold what a busy replica's do), each round scrapes it
`--scrapes` times each way, back to back in a shuffled order, and reads the API-server process's CPU seconds
around each phase. The figures are the API server's CPU milliseconds per scrape each way and their ratio
(filtered ÷ whole) per round, the medians over the rounds with 95% bootstrap intervals, the bytes on the wire, and
what a scrape every 0.25 s (the gateway's default) takes of the engine's core each way.

    HOLDBACK_VLLM_PYTHON=... HOLDBACK_VLLM_MODEL=... python -m bench.real_engine.scrape_cost --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
from pathlib import Path

import aiohttp
import psutil

from bench.lib.engines import SLOTS, engine_paths, pin_load, start_vllm
from bench.lib.processes import Children
from bench.real_engine.traffic import stream
from bench.stats import Estimate, bootstrap_median
# The series the gateway reads (gateway/README.md, "The scrape"), asked of vLLM's prometheus_client mount as the
# gateway asks: a benchmark speaks vLLM's and holdback's public interfaces only, so the query is spelled here.
SERIES = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "vllm:num_requests_waiting",
          "vllm:num_requests_running", "vllm:cache_config_info")
FILTERED = "/metrics/?" + "&".join(f"name[]={name}" for name in SERIES)
WAYS = {"whole": ("/metrics", {}), "filtered": (FILTERED, {"Accept-Encoding": "identity"})}


def series(text: str) -> set[str]:
    """The names of SERIES that `text` has samples of."""
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines()} & set(SERIES)


def cpu_seconds(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return times.user + times.system


async def load(session: aiohttp.ClientSession, url: str, stop: asyncio.Event, seed: int) -> None:
    """Batch completions of 200–400 tokens, one after another, until `stop`."""
    rng = random.Random(seed)
    while not stop.is_set():
        body = {"model": "tiny", "prompt": [rng.randrange(1, 800) for _ in range(40)],
                "max_tokens": rng.randint(200, 400), "ignore_eos": True}
        try:
            await stream(session, url, body, {})
        except aiohttp.ClientError:
            await asyncio.sleep(0.05)


async def phase(session: aiohttp.ClientSession, url: str, way: str, scrapes: int,
                api: psutil.Process) -> tuple[float, int, set[str]]:
    """`scrapes` scrapes one way, one after another: the API server's CPU ms per scrape, bytes per scrape, and
    which of SERIES one more answer has."""
    path, headers = WAYS[way]
    size = 0
    before = cpu_seconds(api)
    for _ in range(scrapes):
        async with session.get(url + path, headers=headers, auto_decompress=False) as resp:
            body = await resp.read()
            size = len(body)
        await asyncio.sleep(0.01)  # as a scraper spaces its reads; the API server serves the streams meanwhile
    used = cpu_seconds(api) - before
    async with session.get(url + path, headers=headers) as resp:
        values = series(await resp.text())
    return used * 1000 / scrapes, size, values


async def measure(url: str, api: psutil.Process, args: argparse.Namespace) -> list[dict]:
    rounds = []
    order = random.Random(args.seed)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        stop = asyncio.Event()
        streams = [asyncio.create_task(load(session, url, stop, args.seed * 100 + i)) for i in range(args.streams)]
        await asyncio.sleep(3)  # the streams are running and the histograms filled
        try:
            for rnd in range(args.rounds):
                ways = list(WAYS)
                order.shuffle(ways)
                row: dict = {"round": rnd}
                for way in ways:
                    ms, size, values = await phase(session, url, way, args.scrapes, api)
                    row[way] = {"cpu_ms": ms, "bytes": size, "read": values}
                row["ratio"] = row["filtered"]["cpu_ms"] / row["whole"]["cpu_ms"]
                print(f"round {rnd}: whole {row['whole']['cpu_ms']:.2f} ms ({row['whole']['bytes']} B), "
                      f"filtered {row['filtered']['cpu_ms']:.2f} ms ({row['filtered']['bytes']} B), "
                      f"ratio {row['ratio']:.3f}", file=sys.stderr, flush=True)
                rounds.append(row)
        finally:
            stop.set()
            for task in streams:
                task.cancel()
            await asyncio.gather(*streams, return_exceptions=True)
    return rounds


def span(est: Estimate, digits: int = 2) -> str:
    if est.lo is None or est.hi is None:
        return f"{est.value:.{digits}f} (one round: no interval)"
    return f"{est.value:.{digits}f} [{est.lo:.{digits}f}, {est.hi:.{digits}f}]"


def report(rounds: list[dict], interval: float) -> str:
    lines = ["| figure | median [95% interval] |", "|---|---|"]
    for way in WAYS:
        est = bootstrap_median([r[way]["cpu_ms"] for r in rounds])
        lines.append(f"| API-server CPU per scrape, {way} (ms) | {span(est)} |")
        lines.append(f"| the engine's core taken by a scrape every {interval} s, {way} | "
                     f"{est.value / 1000 / interval:.1%} |")
        lines.append(f"| bytes per scrape, {way} | {statistics.median(r[way]['bytes'] for r in rounds):.0f} |")
    lines.append(f"| **filtered ÷ whole, per round** | **{span(bootstrap_median([r['ratio'] for r in rounds]), 3)}** |")
    same = all(r["filtered"]["read"] == r["whole"]["read"] for r in rounds)
    lines.append(f"| the gateway reads the same series either way | {'yes' if same else 'NO'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--scrapes", type=int, default=100, help="scrapes each way per round")
    p.add_argument("--streams", type=int, default=SLOTS, help="batch completions streaming meanwhile")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    python, model = engine_paths(p)
    pin_load(p)
    tmp = Path(tempfile.mkdtemp(prefix="hb-scrape-cost-"))
    children = Children()
    try:
        url = start_vllm(children, tmp, python, model, SLOTS)
        api = psutil.Process(children.procs[-1].pid)  # vLLM's API server; its engine core is a child process
        rounds = asyncio.run(measure(url, api, args))
    finally:
        children.close()
    print(report(rounds, 0.25))
    print(f"\nvLLM's log: {tmp / 'vllm.log'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
