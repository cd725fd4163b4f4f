"""The load and overhead phases of bench.micro.kv_admission, over HTTP: KV admission off against on under a
load whose KV runs out (completions, failures, preemptions, realtime TTFT, tenant shares, release after
cancel), and the latency admission adds end to end. The docstring of bench.micro.kv_admission says how."""

from __future__ import annotations

import argparse
import asyncio
import random
import socket
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from holdback.contract import DROP_REASON_HEADER, FAIRNESS_HEADER, OBJECTIVE_HEADER
from bench.lib.processes import Children, start_gateway, start_sims
from bench.stats import Estimate, bootstrap_percentile, decide, histogram_bound, percentile, quantile_upper_bound

WORDS = ("ab", "cd", "ef", "gh", "ij", "kl", "mn", "op", "qr", "st", "uv", "wx", "yz")


def gateway_config(admission: bool, max_concurrency: int, tokenizer: str | None = None) -> str:
    # Identical but for admission.enabled (and the tokenizer where a variant names one; None: the default).
    # Anonymous callers may use any objective and name their tenants here (loopback bench).
    return (f"saturation: {{maxConcurrency: {max_concurrency}}}\n"
            "anonymous: {objectives: ['*'], relaysTenants: true}\n"
            "metrics: {scrapeIntervalSeconds: 0.1}\n"
            f"admission: {{enabled: {'true' if admission else 'false'}, queueDeadlineMs: 8000"
            + (f", tokenizer: {tokenizer}" if tokenizer else "") + "}\n")


def wait_in_process_tokenizer(gw: str, timeout: float = 60.0) -> dict:
    """Send one prompt so `tokenizer: auto` checks its candidates, then wait for the check's verdict."""
    import httpx
    httpx.post(gw + "/v1/completions", json={"model": "sim-model", "prompt": "warm up", "max_tokens": 1},
               timeout=30)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = httpx.get(gw + "/admin/state", timeout=10).json()["kv"]["tokenizer"]
        if state.get("replicas"):
            return state
        time.sleep(0.1)
    raise RuntimeError(f"{gw}: the tokenizer check did not finish within {timeout:.0f} s")


def prompt(rng: random.Random, tokens: int) -> str:
    """`tokens` simulator tokens (one per word), random so prefixes are not shared."""
    return " ".join(rng.choice(WORDS) + str(rng.randrange(10)) for _ in range(tokens))


def tail(values: list[float], q: float, min_n: int, seed: int) -> Estimate:
    """The q-quantile of `values` with its bootstrap interval (none under `min_n` values)."""
    return bootstrap_percentile(values, q, seed=seed) if len(values) >= min_n else Estimate(percentile(values, q))


def ci95(est: Estimate, scale: float = 1.0, digits: int = 2) -> list[float]:
    """[lo, hi] scaled and rounded, NaN without an interval."""
    if est.lo is None or est.hi is None:
        return [float("nan")] * 2
    return [round(est.lo * scale, digits), round(est.hi * scale, digits)]


def over_rounds(values: list[float]) -> Estimate:
    """The median of per-round figures, with their range as its interval."""
    return Estimate(statistics.median(values), min(values), max(values), len(values), "range over rounds")


# -- the load phase -------------------------------------------------------------------------------------------
@dataclass
class Tally:
    completed: int = 0
    failed: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    release_ms: list[float] = field(default_factory=list)  # client close -> the gateway's release timestamp
    release_seen_ms: list[float] = field(default_factory=list)  # client close -> a poll shows it gone
    poll_rtt_ms: list[float] = field(default_factory=list)  # each /admin/state poll's round trip
    max_share: float = 0.0
    share_samples: int = 0


async def _answer(resp: aiohttp.ClientResponse, tally: Tally) -> bool:
    """Count one answer; True when it was a success."""
    if resp.status == 200:
        tally.completed += 1
        return True
    reason = resp.headers.get(DROP_REASON_HEADER)
    if reason:
        tally.rejected[reason] = tally.rejected.get(reason, 0) + 1
    else:
        tally.failed += 1
        if len(tally.failures) < 5:
            tally.failures.append(f"{resp.status}: {(await resp.text())[:160]}")
    return False


async def batch_loop(session, gw, tenant, rng, stop, tally):
    while not stop.is_set():
        body = {"model": "sim-model", "prompt": prompt(rng, rng.randint(800, 2000)),
                "max_tokens": rng.randint(300, 800), "ignore_eos": True}
        headers = {OBJECTIVE_HEADER: "batch", FAIRNESS_HEADER: tenant}
        try:
            async with session.post(gw + "/v1/completions", json=body, headers=headers) as resp:
                ok = await _answer(resp, tally)
                await resp.read()
        except aiohttp.ClientError as exc:
            tally.failed += 1
            tally.failures.append(f"{type(exc).__name__}")
            ok = False
        if not ok:
            await asyncio.sleep(0.25)  # like a worker: back off, retry later


async def realtime_loop(session, gw, rng, stop, tally, interval):
    while not stop.is_set():
        body = {"model": "sim-model", "prompt": prompt(rng, rng.randint(100, 300)), "max_tokens": 30,
                "ignore_eos": True, "stream": True}
        headers = {OBJECTIVE_HEADER: "realtime", FAIRNESS_HEADER: "rt"}
        t0 = time.monotonic()
        try:
            async with session.post(gw + "/v1/completions", json=body, headers=headers) as resp:
                if resp.status == 200:
                    await resp.content.readany()
                    tally.ttft.append(time.monotonic() - t0)
                    await resp.read()
                await _answer(resp, tally)
        except aiohttp.ClientError as exc:
            tally.failed += 1
            tally.failures.append(f"{type(exc).__name__}")
        await asyncio.sleep(max(0.0, interval - (time.monotonic() - t0)))


async def cancel_loop(session, gw, rng, stop, tally, poll_interval, loop_id):
    """Open a stream, close it after the first chunk, time until its reservation is gone.

    The clock starts when the client's socket is shut down (the FIN leaves then, not at the client loop's next
    turn). Cancels take turns between two ways of seeing the release, so that neither disturbs the other:
    three in four wait 100 ms, then read the release time the gateway recorded (`kv.recent_releases[].at`,
    wall clock, same host); every fourth polls /admin/state every `poll_interval` s until the tenant is gone —
    an upper bound that adds the poll's interval and its round trip (a full /admin/state document each time)."""
    k = 0
    while not stop.is_set():
        k += 1
        tenant = f"cancel-{loop_id}-{k}"
        body = {"model": "sim-model", "prompt": prompt(rng, 400), "max_tokens": 600, "ignore_eos": True,
                "stream": True}
        headers = {OBJECTIVE_HEADER: "standard", FAIRNESS_HEADER: tenant}
        resp = await session.post(gw + "/v1/completions", json=body, headers=headers)
        if resp.status != 200:
            await _answer(resp, tally)
            resp.release()
            await asyncio.sleep(0.25)
            continue
        await resp.content.readany()
        sock = resp.connection.transport.get_extra_info("socket") if resp.connection else None
        closed = time.time()
        if sock is not None:
            sock.shutdown(socket.SHUT_RDWR)  # the caller leaves now
        resp.close()
        lazy = k % 4 != 1
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            await asyncio.sleep(0.1 if lazy else poll_interval)
            sent = time.monotonic()
            async with session.get(gw + "/admin/state") as st:
                kv = (await st.json())["kv"]
            if not lazy:
                tally.poll_rtt_ms.append((time.monotonic() - sent) * 1000)
            if tenant not in kv["tenants"]:
                if not lazy:
                    tally.release_seen_ms.append((time.time() - closed) * 1000)
                    break
                at = next((r["at"] for r in kv["recent_releases"] if r["fairness_id"] == tenant), None)
                if at is not None:
                    tally.release_ms.append((at - closed) * 1000)
                break
        await asyncio.sleep(0.15)


async def share_sampler(session, gw, stop, tally):
    while not stop.is_set():
        t0 = time.monotonic()
        async with session.get(gw + "/admin/state") as st:
            kv = (await st.json())["kv"]
        shares = [t["share"] for t in kv["tenants"].values()]
        tally.max_share = max([tally.max_share, *shares])
        tally.share_samples += 1
        await asyncio.sleep(max(0.0, 0.1 - (time.monotonic() - t0)))


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def preemptions(urls: list[str]) -> float:
    import httpx
    total = 0.0
    for url in urls:
        for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
            if line.startswith("vllm:num_preemptions_total"):
                total += float(line.rsplit(" ", 1)[1])
    return total


async def load(gw: str, args: argparse.Namespace, admission: bool, seed: int) -> Tally:
    tally = Tally()
    stop = asyncio.Event()
    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        tasks = [asyncio.create_task(batch_loop(session, gw, f"batch-{t}", random.Random(rng.random()), stop,
                                                tally))
                 for t in range(args.batch_tenants) for _ in range(args.loops_per_tenant)]
        tasks.append(asyncio.create_task(realtime_loop(session, gw, random.Random(rng.random()), stop, tally,
                                                       1.0 / args.realtime_rate)))
        if admission:  # the ledger and /admin/state kv views exist only with admission on
            tasks += [asyncio.create_task(cancel_loop(session, gw, random.Random(rng.random()), stop, tally,
                                                      args.release_poll_ms / 1000.0, i))
                      for i in range(args.cancel_loops)]
            tasks.append(asyncio.create_task(share_sampler(session, gw, stop, tally)))
        await asyncio.sleep(args.duration)
        stop.set()
        # Requests still running are abandoned after a short grace: the figures are for the window.
        await asyncio.wait(tasks, timeout=10)
        for t in tasks:
            t.cancel()
    return tally


def load_phase(args: argparse.Namespace, children: Children, tmp: Path) -> dict:
    import httpx
    out = {}
    for mode in ("off", "on"):
        on = mode == "on"
        sims = start_sims(children, tmp, f"sim-{mode}", args.replicas, "--num-blocks", str(args.num_blocks),
                          "--max-num-seqs", "128", "--max-model-len", "8192", "--seed", str(args.seed))
        gw = start_gateway(children, tmp, f"gateway-{mode}", sims, gateway_config(on, args.max_concurrency))
        before = preemptions(sims)
        print(f"load phase, admission {mode}: {args.duration:.0f} s", file=sys.stderr, flush=True)
        tally = asyncio.run(load(gw, args, on, args.seed))
        pre = preemptions(sims) - before
        metrics = httpx.get(gw + "/metrics", timeout=5).text
        ttft = tail(tally.ttft, 0.95, 20, args.seed)
        res = {"completed": tally.completed, "failed": tally.failed, "failures": tally.failures,
               "rejected": tally.rejected, "preemptions": pre,
               "realtime_ttft_ms": {"n": len(tally.ttft),
                                    "p50": round(percentile(tally.ttft, 0.5) * 1000, 1) if tally.ttft else None,
                                    "p95": round(percentile(tally.ttft, 0.95) * 1000, 1) if tally.ttft else None,
                                    "p95_ci95": ci95(ttft, 1000, 1),
                                    "goal_900ms": decide(ttft, 0.9, at_least=False)}}
        if on:
            rel, seen = tally.release_ms, tally.release_seen_ms
            rel_p99, seen_p99 = tail(rel, 0.99, 10, args.seed), tail(seen, 0.99, 10, args.seed)
            p99_gw, n_gw = histogram_bound(metrics, "holdback_gateway_kv_release_seconds", 0.99, 'cause="cancel"')
            res["max_tenant_share"] = {"value": round(tally.max_share, 4), "samples": tally.share_samples,
                                       "goal_0.15": "met" if tally.max_share <= 0.15 + 1e-9 else "missed"}
            res["release_after_cancel_ms"] = {
                "n": len(rel), "p50": round(percentile(rel, 0.5), 2) if rel else None,
                "p99": round(percentile(rel, 0.99), 2) if rel else None,
                "p99_ci95": ci95(rel_p99), "goal_50ms": decide(rel_p99, 50.0, at_least=False),
                "max": round(max(rel), 2) if rel else None, "over_50ms": sum(1 for r in rel if r > 50.0),
                "p99_upper_bound_95": _rounded(quantile_upper_bound(rel, 0.99)),
                "polled_upper_bound": {
                    "poll_interval_ms": args.release_poll_ms, "n": len(seen),
                    "poll_round_trip_ms_p50": round(percentile(tally.poll_rtt_ms, 0.5), 2) if seen else None,
                    "poll_round_trip_ms_p99": round(percentile(tally.poll_rtt_ms, 0.99), 2) if seen else None,
                    "p50": round(percentile(seen, 0.5), 2) if seen else None,
                    "p99": round(percentile(seen, 0.99), 2) if seen else None,
                    "p99_ci95": ci95(seen_p99), "goal_50ms": decide(seen_p99, 50.0, at_least=False)},
                "gateway_histogram_p99_le_s": p99_gw, "gateway_histogram_n": n_gw}
            res["tokenizer"] = httpx.get(gw + "/admin/state", timeout=5).json()["kv"]["tokenizer"]
        out[mode] = res
        children.close()
    off, on = out["off"]["preemptions"], out["on"]["preemptions"]
    out["preemption_ratio_off_over_on"] = (off / on) if on else (float("inf") if off else None)
    return out


# -- the overhead phase ---------------------------------------------------------------------------------------
async def _sequential(session, url: str, bodies: list[dict]) -> list[float]:
    out = []
    for body in bodies:
        t0 = time.perf_counter()
        async with session.post(url + "/v1/completions", json=body) as resp:
            await resp.read()
            if resp.status != 200:
                raise RuntimeError(f"{url}: {resp.status} {(await resp.text())[:200]}")
        out.append((time.perf_counter() - t0) * 1000)
    return out


def overhead_phase(args: argparse.Namespace, children: Children, tmp: Path) -> dict:
    sims = start_sims(children, tmp, "sim-overhead", 1, "--zero-latency", "--max-num-seqs", "1024")
    # kind -> (the "on" gateway's config, distinct prompts). Every kind has its own admission-off gateway, and
    # the kinds take turns request by request, so every gateway process is used at the same cadence. The
    # control puts a second admission-off gateway in the place of "on": what "added" reads when nothing is.
    variants = {"default_tokenizer_distinct": (gateway_config(True, 1024), True),
                "replica_tokenizer_distinct": (gateway_config(True, 1024, "replica"), True),
                "replica_tokenizer_cached": (gateway_config(True, 1024, "replica"), False),
                "control_off_vs_off": (gateway_config(False, 1024), True)}
    pairs = {kind: {"off": start_gateway(children, tmp, f"gateway-{i}-off", sims, gateway_config(False, 1024)),
                    "on": start_gateway(children, tmp, f"gateway-{i}-on", sims, config)}
             for i, (kind, (config, _)) in enumerate(variants.items())}
    # The default (tokenizer: auto) counts in process once its check has agreed with the replica.
    state = wait_in_process_tokenizer(pairs["default_tokenizer_distinct"]["on"])
    if not any(r["in_process"] for r in state["replicas"].values()):
        raise RuntimeError(f"tokenizer: auto found no in-process tokenizer for the simulator: {state}")
    rng = random.Random(args.seed)
    fixed = prompt(rng, 200)

    async def run() -> dict:
        added: dict[str, list[float]] = {kind: [] for kind in variants}
        # Per turn (off, on, on, off): mean(on) - mean(off), over every round.
        paired: dict[str, list[float]] = {kind: [] for kind in variants}
        async with aiohttp.ClientSession() as session:
            for rnd in range(args.rounds):
                samples = {kind: {"off": [], "on": []} for kind in variants}
                for _ in range(args.requests):
                    for kind, (_, distinct) in variants.items():
                        turn = []
                        for name in ("off", "on", "on", "off"):  # drift hits both alike
                            body = {"model": "sim-model", "max_tokens": 1,
                                    "prompt": prompt(rng, 200) if distinct else fixed}
                            turn += await _sequential(session, pairs[kind][name], [body])
                        samples[kind]["off"] += [turn[0], turn[3]]
                        samples[kind]["on"] += [turn[1], turn[2]]
                        paired[kind].append((turn[1] + turn[2] - turn[0] - turn[3]) / 2)
                for kind, got in samples.items():
                    added[kind].append(statistics.median(got["on"]) - statistics.median(got["off"]))
                print(f"overhead round {rnd + 1}/{args.rounds}: added p50 " + ", ".join(
                    f"{k} {v[-1]:.3f} ms" for k, v in added.items()), file=sys.stderr, flush=True)
        out = {}
        for kind, v in added.items():
            turns = bootstrap_percentile(paired[kind], 0.5, seed=args.seed)
            out[kind] = {"median_ms": round(statistics.median(v), 3), "min_ms": round(min(v), 3),
                         "max_ms": round(max(v), 3), "per_round": [round(x, 3) for x in v],
                         "goal_1ms": decide(over_rounds(v), 1.0, at_least=False),
                         "paired_turns": {"n": len(paired[kind]),
                                          "median_ms": round(statistics.median(paired[kind]), 3),
                                          "ci95": ci95(turns, digits=3),
                                          "goal_1ms": decide(turns, 1.0, at_least=False)}}
            if kind.startswith("control"):  # nothing is added there: no goal, only the noise it shows
                del out[kind]["goal_1ms"], out[kind]["paired_turns"]["goal_1ms"]
        return out

    try:
        return asyncio.run(run())
    finally:
        children.close()
