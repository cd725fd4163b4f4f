"""Heartbeat cost: what the shorter default heartbeat TTL (9 s) costs in Redis commands and CPU against 90 s.

Runs the worker's own heartbeat and scheduler loops (`AsyncWorker._heartbeat_loop`, `_scheduler_loop`) with
`--in-flight` claimed jobs, on a private Redis, for `--seconds` per setting; each round measures the baseline
(TTL 90) and the new default back to back, in alternating order. Redis commands come from `INFO stats`
(total_commands_processed, less our own INFO calls), Redis CPU from `INFO cpu`, worker CPU from this
process's CPU time. Reported: per-setting medians and the median of per-round ratios (new / baseline).

    .venv/bin/python bench/micro/heartbeat_cost.py --rounds 3 --seconds 30 --in-flight 64
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import redis.asyncio as aioredis

from async_processor.config import WorkerConfig
from async_processor.metrics import WorkerMetrics
from async_processor.queue import ClaimQueue
from async_processor.registration import Registration
from async_processor.worker import AsyncWorker
from holdback.broker import ensure_embedded_redis, stop_embedded_redis

BASELINE_TTL = 90


async def _redis_counters(r: aioredis.Redis) -> tuple[int, float]:
    stats, cpu = await r.info("stats"), await r.info("cpu")
    return int(stats["total_commands_processed"]), float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


async def measure(url: str, ttl: int, in_flight: int, seconds: float) -> dict[str, float]:
    """Commands/s, Redis CPU ms/s and worker CPU ms/s of one worker's heartbeat + scheduler loops."""
    r = aioredis.Redis.from_url(url)
    name = f"bench-{uuid.uuid4().hex[:8]}"
    config = WorkerConfig(name=name, queue_name=f"{name}-q", namespace=name, redis_url=url, database_url="unused",
                          gateway_url="http://127.0.0.1:9", gateway_key=None, heartbeat_ttl=ttl)
    worker = AsyncWorker(config, WorkerMetrics(config.name))
    worker.redis = r
    worker.queue = ClaimQueue(r, config.queue_name, name, ttl, config.failure_ttl)
    worker.registration = Registration(r, worker.queue, config.concurrency, ttl)
    await worker.registration.register_birth()
    ids = [f"{name}-{i}" for i in range(in_flight)]
    async with r.pipeline(transaction=False) as pipe:
        for job_id in ids:
            pipe.hset(f"rq:job:{job_id}", mapping={"status": "queued"})
            pipe.rpush(worker.queue.key, job_id)
        await pipe.execute()
    claims, _ = await worker.queue.claim(in_flight)
    worker.claims = {c.job_id: c for c in claims}
    worker.inflight = dict.fromkeys(worker.claims)  # only its size is read

    commands0, redis_cpu0 = await _redis_counters(r)
    cpu0, wall0 = time.process_time(), time.monotonic()
    loops = [asyncio.create_task(worker._heartbeat_loop()), asyncio.create_task(worker._scheduler_loop())]
    await asyncio.sleep(seconds)
    worker.closing.set()
    await asyncio.wait(loops, timeout=10)
    wall, cpu = time.monotonic() - wall0, time.process_time() - cpu0
    commands1, redis_cpu1 = await _redis_counters(r)
    await worker.registration.register_death()
    await r.delete(*(f"rq:job:{i}" for i in ids))
    await r.aclose()
    return {"commands_per_s": (commands1 - commands0 - 2) / wall,  # less the two INFO calls of the first read
            "redis_cpu_ms_per_s": 1000 * (redis_cpu1 - redis_cpu0) / wall,
            "worker_cpu_ms_per_s": 1000 * cpu / wall}


async def main_async(args: argparse.Namespace) -> None:
    data_dir = Path(tempfile.mkdtemp(prefix="hb-hbcost-"))
    new_ttl = WorkerConfig(name="x", queue_name="q", namespace="n", redis_url="", database_url="", gateway_url="",
                           gateway_key=None).heartbeat_ttl
    try:
        url = ensure_embedded_redis(data_dir)
        runs: dict[int, list[dict[str, float]]] = {BASELINE_TTL: [], new_ttl: []}
        for rnd in range(args.rounds):
            order = (BASELINE_TTL, new_ttl) if rnd % 2 == 0 else (new_ttl, BASELINE_TTL)
            for ttl in order:
                runs[ttl].append(await measure(url, ttl, args.in_flight, args.seconds))
                print(f"round {rnd + 1} ttl {ttl:>2}: " + ", ".join(f"{k} {v:.2f}" for k, v in runs[ttl][-1].items()))
        print(f"\nmedians over {args.rounds} rounds, {args.in_flight} jobs in flight, {args.seconds:g} s each")
        for key in runs[BASELINE_TTL][0]:
            base = statistics.median(x[key] for x in runs[BASELINE_TTL])
            new = statistics.median(x[key] for x in runs[new_ttl])
            ratios = [n[key] / b[key] for n, b in zip(runs[new_ttl], runs[BASELINE_TTL]) if b[key] > 0]
            ratio = f"{statistics.median(ratios):.2f}" if ratios else "n/a"
            print(f"  {key:<22} ttl {BASELINE_TTL}: {base:8.2f}   ttl {new_ttl}: {new:8.2f}   ratio (median of "
                  f"rounds) {ratio}")
    finally:
        stop_embedded_redis(data_dir)
        shutil.rmtree(data_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=30.0, help="measured time per setting and round")
    p.add_argument("--in-flight", type=int, default=64, help="claimed jobs the heartbeat keeps alive")
    asyncio.run(main_async(p.parse_args(argv)))


if __name__ == "__main__":
    main()
