"""The measurements of `python -m bench.fleet` (issue 46's Goals) on a running fleet (bench/lib/fleet.py).

Each function runs one phase and returns plain records (dicts and lists of numbers); bench/fleet.py turns them
into the figures and their verdicts, so the arithmetic is tested without a fleet.
- scale_arm: realtime clients streaming for a while through some of the relays, with the CPU seconds each relay
  and the leader spent meanwhile (a relay's or the leader's process, children included).
- ttft_arm: realtime TTFTs through one URL (a relay on another host, or the one-process gateway).
- full_run: the issue's load (a batch and realtime clients through HAProxy) with no strike, and every eviction's
  decision -> upstream closed as the leader logged it (`eviction_confirmed`).
- takeover: kill -9 the leader under load, what the new leader took and what the load saw.
"""

from __future__ import annotations

import asyncio
import subprocess
import time

import psutil

from bench.lib.fleet import Fleet
from bench.lib.fleet_drills import FleetDrillRun, Load, drill, kill_leader
from bench.lib.fleet_load import RealtimeClients, Stream


def cpu_seconds(proc: subprocess.Popen) -> float:
    """User + system CPU seconds of `proc` and its live children (`ip netns exec` execs, so the pid is the
    gateway's own)."""
    try:
        root = psutil.Process(proc.pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for p in procs:
        try:
            times = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


async def _stream_for(url: str, clients: int, tokens: int, seconds: float) -> list[Stream]:
    """`clients` callers streaming through `url` for `seconds`; each then finishes the stream it is in."""
    realtime = RealtimeClients(url, clients, tokens)
    stop = asyncio.Event()
    task = asyncio.create_task(realtime.run(stop))
    await asyncio.sleep(seconds)
    stop.set()
    await task
    return realtime.streams


def scale_arm(fleet: Fleet, relays: list[str], clients: int, tokens: int, seconds: float) -> dict:
    """Stream through `relays` (one: its own URL; all: HAProxy) and count what they and the leader spent."""
    url = fleet.url if len(relays) == len(fleet.relay_urls) else fleet.relay_urls[relays[0]]
    leader = fleet.leader()
    if leader is None:
        raise RuntimeError("no leader to measure")
    names = [*relays, leader[0]]
    before = {name: cpu_seconds(fleet.procs[name]) for name in names}
    began = time.monotonic()
    streams = asyncio.run(_stream_for(url, clients, tokens, seconds))
    wall = time.monotonic() - began
    spent = {name: cpu_seconds(fleet.procs[name]) - before[name] for name in names}
    done = [s for s in streams if s.done]
    return {"relays": len(relays), "seconds": round(wall, 3), "requests": len(streams), "done": len(done),
            "tokens": sum(s.tokens for s in done), "relay_cpu": round(sum(spent[r] for r in relays), 4),
            "leader_cpu": round(spent[leader[0]], 4)}


def ttft_arm(url: str, clients: int, tokens: int, seconds: float) -> dict:
    """TTFTs (seconds) of the streams that completed through `url`, and how many did not."""
    streams = asyncio.run(_stream_for(url, clients, tokens, seconds))
    ttfts = [s.ttft for s in streams if s.done and s.ttft is not None]
    return {"requests": len(streams), "failed": sum(not s.done for s in streams), "ttft_s": ttfts}


async def _no_strike(fleet: Fleet, run: FleetDrillRun) -> None:  # noqa: ARG001 - a drill's strike
    run.seen["strike"] = "none"


def eviction_latencies(fleet: Fleet, names: list[str], since: float) -> list[float]:
    """Eviction decision -> the victim's upstream closed (seconds), every eviction confirmed since `since`
    (Unix time) as the flow controls `names` logged it: the decision is the leader's, the close the relay's,
    told over the channel (gateway/flow/eviction_control.py)."""
    return [e["latency_ms"] / 1000 for name in names for e in fleet.events(name, "eviction_confirmed")
            if e.get("ts", 0) >= since and "latency_ms" in e]


def _load_summary(run: FleetDrillRun) -> dict:
    failed = [s for s in run.realtime.streams if not s.done]
    return {"realtime_requests": len(run.realtime.streams), "realtime_failed": len(failed),
            "realtime_errors": sorted({(s.error or f"status {s.status}")[:80] for s in failed})[:5],
            "rows": run.batch.rows, "rows_lost": run.batch.lost, "rows_duplicated": run.batch.duplicated,
            "evicted_attempts": sum(a.status == 429 for a in run.batch.attempts),
            "running_peaks": run.sampler.peaks, "running_over_slots": len(run.sampler.over),
            "running_samples": run.sampler.samples}


def full_run(fleet: Fleet, load: Load, flows: list[str]) -> dict:
    """The issue's load through HAProxy with nothing struck: what it saw and the evictions' latencies."""
    since = time.time()
    began = time.monotonic()
    run = asyncio.run(drill(fleet, load, _no_strike))
    out = _load_summary(run)
    out.update(seconds=round(time.monotonic() - began, 2),
               eviction_closed_s=eviction_latencies(fleet, flows, since))
    return out


def takeover(fleet: Fleet, load: Load) -> dict:
    """kill -9 the leader under `load`, start it again (as its supervisor would) and report: when the standby
    led and when it dispatched again (takeover_done), the streams running at the kill that were cut, the TTFTs
    of requests sent before the takeover ended."""
    fleet.settle()
    run = asyncio.run(drill(fleet, load, kill_leader))
    seen = run.seen
    if fleet.procs[seen["old_leader"]].poll() is not None:
        fleet.restart(seen["old_leader"])
    running = run.running_at_strike()
    done_at = run.wall_to_mono(run.struck_wall + seen["takeover_done_after"])
    during = [s for s in run.realtime.streams if run.struck_at <= s.sent <= done_at]
    out = _load_summary(run)
    out.update(old_leader=seen["old_leader"], new_leader=seen["new_leader"], new_token=seen["new_token"],
               led_after=round(seen["led_after"], 4), first_dispatch_after=round(seen["takeover_done_after"], 4),
               running_at_kill=len(running), cut=sum(not s.done for s in running),
               during_ttft_s=[s.ttft for s in during if s.ttft is not None])
    return out

