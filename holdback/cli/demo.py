"""`holdback demo`: what holdback is for, in one run of about two minutes.

It starts a small platform of its own (`holdback up` in a fresh data dir on free ports, beside anything you
already run) whose one simulated replica saturates: 8 slots, a KV pool that binds, a decode step as long as a 7-8B
model's on a GPU. Then it sends the same seeded realtime traffic three ways, each for the same window:

  1. alone: realtime through the gateway, nothing else running;
  2. beside a batch with no controls: the batch's lines straight to the replica, as a script without holdback
     sends them (as many at once as the workers send), and realtime straight to it too, so vLLM's own
     first-come-first-served scheduler decides;
  3. beside the same batch through holdback: submitted to the Batch API and run by the workers through the
     gateway, with realtime through the gateway.

It ends with one sentence: realtime's p95 time to first token each way, and how many batch requests finished in
the window through holdback against with no controls. Every count is a delta over its window.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from holdback.cli.demo_platform import DemoPlatform, ReplicaShape
from holdback.cli.demo_traffic import DirectBatch, GatewayAdminClient, RealtimeStats, RealtimeTraffic, replica_load
from holdback.cli.up import EXAMPLE_REQUESTS
from holdback.contract import CHAT_ENDPOINT
from holdback.env_flags import flags_from_env
from holdback.progress import Progress
from holdback.settings import Settings

FALLBACK_PROMPT = [{"role": "user", "content": "Summarise document number {i} in detail."}]
REALTIME_MAX_TOKENS = 16


def chat_bodies(model: str, n: int, max_tokens: int, example: Path = EXAMPLE_REQUESTS) -> list[dict]:
    """n chat request bodies whose messages cycle through the chat lines of examples/requests.jsonl."""
    prompts = []
    if example.exists():
        prompts = [json.loads(x)["body"]["messages"] for x in example.read_text().splitlines()
                   if x.strip() and json.loads(x)["url"] == CHAT_ENDPOINT.path]
    return [{"model": model, "max_tokens": max_tokens,
             "messages": prompts[i % len(prompts)] if prompts else [
                 {**m, "content": m["content"].format(i=i)} for m in FALLBACK_PROMPT]} for i in range(n)]


def sample_batch(model: str, n: int, max_tokens: int, example: Path = EXAMPLE_REQUESTS) -> bytes:
    """The same bodies as a batch input file, one request line each."""
    lines = [json.dumps({"custom_id": f"demo-{i}", "method": "POST", "url": CHAT_ENDPOINT.path, "body": body})
             for i, body in enumerate(chat_bodies(model, n, max_tokens, example))]
    return ("\n".join(lines) + "\n").encode()


def _parser(settings: Settings) -> argparse.ArgumentParser:  # noqa: ARG001 - the other commands' shape
    p = argparse.ArgumentParser(prog="holdback demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=15.0,
                   help="each way's window of realtime arrivals (default %(default)s)")
    p.add_argument("--realtime-rate", type=float, default=4.0, help="realtime arrivals per second (default %(default)s)")
    p.add_argument("--concurrency", type=int, default=16,
                   help="batch requests in flight: the workers' concurrency, and the no-controls script's "
                        "(default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=64, help="batch output length (default %(default)s)")
    p.add_argument("--slots", type=int, default=8, help="the replica's sequences at once (default %(default)s)")
    p.add_argument("--kv-blocks", type=int, default=64,
                   help="the replica's KV pool in 16-token blocks (default %(default)s)")
    p.add_argument("--step-ms", type=float, default=25.0, help="the replica's decode step (default %(default)s)")
    p.add_argument("--seed", type=int, default=7, help="seed of the realtime arrivals (default %(default)s)")
    p.add_argument("--keep", action="store_true",
                   help="keep the demo platform's data dir and logs (default: removed at the end)")
    return flags_from_env(p, "demo")


def main(argv: list[str]) -> int:
    p = _parser(Settings())
    args = p.parse_args(argv)
    for flag in ("concurrency", "max_tokens", "slots", "kv_blocks"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    for flag in ("seconds", "realtime_rate", "step_ms"):
        if not getattr(args, flag) > 0:
            p.error(f"--{flag.replace('_', '-')} must be above 0, got {getattr(args, flag)}")
    if importlib.util.find_spec("openai") is None:  # the demo submits its batch with the official client
        p.error("holdback demo uses the official openai client: pip install 'holdback[demo]'")
    platform = DemoPlatform(ReplicaShape(args.slots, args.kv_blocks, args.step_ms), args.concurrency, keep=args.keep)
    print(f"starting a small platform for the demo in {platform.data_dir}: one simulated replica with {args.slots} "
          f"slots, {args.kv_blocks * 16} tokens of KV and a {args.step_ms:g} ms decode step", flush=True)
    try:
        platform.start()
        return asyncio.run(_run(args, platform))
    except RuntimeError as exc:
        print(exc)
        return 1
    finally:
        platform.stop()
        if args.keep:
            print(f"the demo platform's data and logs are kept in {platform.data_dir}")


@dataclass
class Way:
    """One of the three ways realtime went, and what its window measured."""

    title: str
    realtime: RealtimeStats = field(default_factory=RealtimeStats)
    batch_done: int | None = None
    evictions: int | None = None
    preemptions: int = 0
    batch_errors: int = 0


async def _run(args: argparse.Namespace, platform: DemoPlatform) -> int:
    keys = platform.keys
    gateway = GatewayAdminClient(platform.gateway_url, keys["admin"])
    async with httpx.AsyncClient() as http:
        models = (await http.get(f"{platform.gateway_url}/v1/models", timeout=10,
                                 headers={"Authorization": f"Bearer {keys['realtime']}"})).json()
        model = models["data"][0]["id"]
        bodies = chat_bodies(model, 64, args.max_tokens)
        ways = [Way("alone"), Way("beside the batch, no controls"), Way("beside the batch, through holdback")]

        def realtime(targets: list[str], key: str | None) -> RealtimeTraffic:
            return RealtimeTraffic(targets, key, model, burst=0, rate=args.realtime_rate, seconds=args.seconds,
                                   max_tokens=REALTIME_MAX_TOKENS, seed=args.seed)

        print(f"1/3 realtime alone: {args.realtime_rate:g} streams a second for {args.seconds:g} s through the gateway")
        await _window(ways[0], realtime([platform.gateway_url], keys["realtime"]), http, platform, None)

        print(f"2/3 a batch with no controls: {args.concurrency} requests at once straight to the replica, and "
              "realtime straight to it too")
        stop = asyncio.Event()
        direct = DirectBatch([platform.replica_url], bodies, args.concurrency)
        sending = asyncio.create_task(direct.run(stop))
        await _saturated(http, platform, args.slots, lambda: sending.done())

        async def direct_done() -> int:
            return direct.completed

        await _window(ways[1], realtime([platform.replica_url], None), http, platform, direct_done)
        ways[1].batch_errors = direct.errors
        stop.set()
        await sending
        await _idle(http, platform)

        print("3/3 the same batch through holdback: submitted to the Batch API, run by the workers through the "
              "gateway, and realtime through the gateway")
        rows = max(500, 3 * (ways[1].batch_done or 0) + 2 * args.concurrency)
        await _through_holdback(args, platform, ways[2], realtime([platform.gateway_url], keys["realtime"]),
                                model, rows, gateway, http)
    _summary(args, ways)
    return 0 if all(w.realtime.errors == 0 and w.batch_errors == 0 for w in ways) else 1


async def _through_holdback(args: argparse.Namespace, platform: DemoPlatform, way: Way, traffic: RealtimeTraffic,
                            model: str, rows: int, gateway: GatewayAdminClient, http: httpx.AsyncClient) -> None:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{platform.api_url}/v1", api_key=platform.keys["tenant"])
    upload = await client.files.create(file=("demo.jsonl", sample_batch(model, rows, args.max_tokens)),
                                       purpose="batch")
    batch = await client.batches.create(input_file_id=upload.id, endpoint=CHAT_ENDPOINT.path,
                                        completion_window="24h", metadata={"source": "holdback demo"})

    async def done() -> int:
        counts = (await client.batches.retrieve(batch.id)).request_counts
        return (counts.completed + counts.failed) if counts else 0

    async def ended() -> bool:
        return (await client.batches.retrieve(batch.id)).status in ("failed", "expired", "cancelled", "completed")

    await _saturated(http, platform, args.slots, None, ended, gateway)
    before, _ = await gateway.evictions(http)
    await _window(way, traffic, http, platform, done)
    after, why = await gateway.evictions(http)
    way.evictions = after - before if after is not None and before is not None else None
    if way.evictions is None:
        print(f"  the gateway's evictions could not be read: {why}")
    finished = await client.batches.retrieve(batch.id)
    if finished.status in ("completed", "failed"):
        print(f"  the batch ended inside the window ({finished.status}): raise --concurrency or lower --seconds")
    else:
        await client.batches.cancel(batch.id)
    way.batch_errors = finished.request_counts.failed if finished.request_counts else 0


async def _window(way: Way, traffic: RealtimeTraffic, http: httpx.AsyncClient, platform: DemoPlatform,
                  batch_done: Callable[[], Awaitable[int]] | None) -> None:
    """Run the realtime traffic once, showing its progress every second; count the batch requests that finished
    in the same window and the replica's preemptions."""
    load = await replica_load(http, platform.replica_url)
    done_before = await batch_done() if batch_done else 0
    sending = asyncio.create_task(traffic.run())
    progress = Progress(int(traffic.seconds), "s", every=5.0)
    started = time.monotonic()
    while not sending.done():
        await asyncio.wait([sending], timeout=1.0)
        stats, elapsed = traffic.stats, time.monotonic() - started
        p95 = stats.p95_ms()
        status = (f"realtime {stats.finished} done, {stats.in_flight} in flight, p95 TTFT "
                  + (f"{p95:,.0f} ms" if p95 is not None else "—"))
        if batch_done and way.batch_done is None:
            finished = await batch_done() - done_before
            if elapsed >= traffic.seconds:
                way.batch_done = finished  # the window is over; realtime streams still open only end now
            status += f" | batch {finished} finished"
        progress.update(min(int(elapsed), int(traffic.seconds)), status, force=sending.done())
    progress.close()
    way.realtime = sending.result()
    if batch_done and way.batch_done is None:
        way.batch_done = await batch_done() - done_before
    way.preemptions = int((await replica_load(http, platform.replica_url)).preemptions - load.preemptions)


async def _saturated(http: httpx.AsyncClient, platform: DemoPlatform, slots: int,
                     failed: Callable[[], bool] | None, ended: Callable[[], Awaitable[bool]] | None = None,
                     gateway: GatewayAdminClient | None = None, timeout: float = 90.0) -> None:
    """Wait until the batch fills the replica: every slot running or waiting, or most of its KV in use, or (through
    the gateway) batch requests waiting in the gateway's queue because the pool is full."""
    deadline = time.monotonic() + timeout
    while True:
        load = await replica_load(http, platform.replica_url)
        if load.running + load.waiting >= slots or load.kv_usage >= 0.75:
            return
        if gateway is not None and load.running > 0 and await gateway.queued(http) > 0:
            return
        if (failed and failed()) or (ended and await ended()):
            raise RuntimeError("the batch ended before it filled the replica; see the logs: " + platform.tail(5))
        if time.monotonic() > deadline:
            raise RuntimeError(f"the batch did not fill the replica within {timeout:.0f} s (running {load.running:.0f}"
                               f", waiting {load.waiting:.0f}, KV {load.kv_usage:.0%})")
        await asyncio.sleep(0.2)


async def _idle(http: httpx.AsyncClient, platform: DemoPlatform, timeout: float = 60.0) -> None:
    """Wait until the replica has let go of everything the last way sent it."""
    deadline = time.monotonic() + timeout
    while (load := await replica_load(http, platform.replica_url)).running + load.waiting > 0:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the replica still held {load.running + load.waiting:.0f} requests {timeout:.0f} s "
                               "after the batch with no controls stopped")
        await asyncio.sleep(0.2)


def _ms(value: float | None) -> str:
    return f"{value:,.0f} ms" if value is not None else "—"


def _summary(args: argparse.Namespace, ways: list[Way]) -> None:
    print(f"\n{'':<36} {'realtime p95 TTFT':>18} {'streams':>8} {'errors':>7} {'batch finished':>15} "
          f"{'evictions':>10} {'preemptions':>12}")
    for w in ways:
        r = w.realtime
        print(f"{w.title:<36} {_ms(r.p95_ms()):>18} {r.finished:>8} {r.errors:>7} "
              f"{'—' if w.batch_done is None else w.batch_done:>15} {'—' if w.evictions is None else w.evictions:>10} "
              f"{w.preemptions:>12}")
        if r.first_error:
            print(f"{'':<36} first realtime error: {r.first_error}")
    alone, none, holdback = ways
    share = (f" ({holdback.batch_done / none.batch_done:.0%} of the {none.batch_done} it finished with no controls)"
             if none.batch_done and holdback.batch_done is not None else "")
    print(f"\nrealtime p95 {_ms(alone.realtime.p95_ms())} alone, {_ms(none.realtime.p95_ms())} beside a batch with no "
          f"controls, {_ms(holdback.realtime.p95_ms())} with holdback, while the batch finished "
          f"{holdback.batch_done} requests in {args.seconds:g} s{share}.")
