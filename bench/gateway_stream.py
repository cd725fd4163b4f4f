"""The gateway's cost per streamed token and its added streaming latency, against the simulator in the same run.

One simulated replica (default step timing, no timer spin, so its CPU is the work of generating tokens), one
`holdback gateway` in front of it (KV admission on, so the relay also keeps the ledger's token count) and a bare
aiohttp pass-through relay (the one of bench/gateway_overhead.py: the floor of any relay built on aiohttp) and a
TCP byte relay (uvloop protocols splicing each connection, no HTTP at all: the floor of any relay in Python).
Each round sends `--streams` concurrent streamed chat completions of `--tokens` tokens directly to the replica,
through the gateway and through both relays (the order reverses every other round); a load generator in its
own process records each stream's time to first token and the gaps between its tokens. Reported, per gateway
run, the gateway's CPU per 1,000 streamed tokens divided by the simulator's CPU in the same run (goal at most
0.25) and by the bare relay's CPU per 1,000 tokens (what holdback adds to aiohttp), the byte relay's CPU over
the simulator's (what no Python relay can go below), each relay's system time alone over the simulator's CPU
(the byte relay's is what a relay in any language pays the kernel to see every chunk), and per round the
p95 TTFT and p95 inter-token gap through the gateway divided by direct (goal at most 1.1); medians over rounds,
and for the pooled p95s a distribution-free interval with whether the goal is decided.

With `--workers N` (N > 1) a second gateway runs as `holdback gateway --workers N` (one flow-control process,
N relays; its CPU is all its processes') beside the single-process one, both in every round, and an eviction
phase per gateway (the method of bench/gateway_overhead.py, with KV admission on) reports each eviction's
decision -> capacity released (the ledger's release after the victim's upstream closed), p99 with an interval
against the goal of 10 ms.

    python -m bench.gateway_stream --rounds 3 --streams 256 --tokens 256 [--workers 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import psutil

from bench.gateway_overhead import eviction
from bench.lib.processes import Children, holdback
from bench.lib.readiness import free_port, wait_http
from bench.stats import Estimate, decide, percentile, quantile_interval, ratio_of_runs

PY = sys.executable
_EVENT = b"data: {"


# -- the byte relay (baseline: the floor of any relay in Python) -------------------------------------------------
class _Pipe(asyncio.Protocol):
    """One direction of a TCP splice: what arrives is written to the peer's transport, nothing else."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.peer: _Pipe | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        assert self.peer is not None and self.peer.transport is not None
        self.peer.transport.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.close()


class _Accepted(_Pipe):
    """The caller's side: reading waits until the upstream connection exists."""

    def __init__(self, upstream_port: int) -> None:
        super().__init__()
        self.upstream_port = upstream_port

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        transport.pause_reading()
        asyncio.get_running_loop().create_task(self._connect())

    async def _connect(self) -> None:
        _t, up = await asyncio.get_running_loop().create_connection(_Pipe, "127.0.0.1", self.upstream_port)
        up.peer, self.peer = self, up
        assert self.transport is not None
        self.transport.resume_reading()


def serve_byte_relay(port: int, upstream_port: int) -> None:
    """Each accepted connection spliced to a new upstream connection: no HTTP, no parsing, uvloop."""

    async def serve() -> None:
        server = await asyncio.get_running_loop().create_server(lambda: _Accepted(upstream_port), "127.0.0.1",
                                                                port, backlog=1024)
        async with server:
            await server.serve_forever()

    import uvloop
    uvloop.run(serve())


# -- the load generator (its own process) ----------------------------------------------------------------------
async def _streams(url: str, streams: int, tokens: int) -> dict:
    body = json.dumps({"model": "sim-model", "messages": [{"role": "user", "content": "tell me a story"}],
                       "max_tokens": tokens, "ignore_eos": True, "stream": True}).encode()
    headers = {"Content-Type": "application/json"}
    ttft: list[float] = []
    gaps: list[float] = []
    counted = errors = 0
    connector = aiohttp.TCPConnector(limit=streams, limit_per_host=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:

        async def one() -> None:
            nonlocal counted, errors
            t0 = time.perf_counter()
            last = None
            seen = 0
            try:
                async with session.post(url, data=body, headers=headers) as r:
                    if r.status != 200:
                        errors += 1
                        await r.read()
                        return
                    async for chunk in r.content.iter_any():
                        now = time.perf_counter()
                        n = chunk.count(_EVENT)
                        if not n:
                            continue
                        if last is None:
                            ttft.append(now - t0)
                        else:
                            gaps.append(now - last)
                        # Tokens that arrived in one read arrived together: their gaps are zero.
                        gaps.extend([0.0] * (n - 1))
                        last = now
                        seen += n
            except aiohttp.ClientError:
                errors += 1
                return
            counted += seen

        await asyncio.gather(*(one() for _ in range(streams)))
    return {"tokens": counted, "errors": errors, "ttft": ttft, "gaps": gaps}


def run_streams(url: str, streams: int, tokens: int) -> dict:
    out = subprocess.run([PY, "-m", "bench.gateway_stream", "--load", url, "--streams", str(streams),
                          "--tokens", str(tokens)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def _p95(values: list[float]) -> float:
    return percentile(values, 0.95)


def _cpu(proc: psutil.Process, fields: slice = slice(0, 2)) -> float:
    """CPU seconds of a process and its children (`holdback` may run the service in a child): user + system by
    default, `_KERNEL` for system time alone."""
    total = sum(proc.cpu_times()[fields])
    for child in proc.children(recursive=True):
        try:
            total += sum(child.cpu_times()[fields])
        except psutil.NoSuchProcess:
            pass
    return total


# System time alone: the kernel's work for the process (socket syscalls, and on loopback the TCP delivery to the
# peer that each send() runs): what a relay in any language pays to forward a chunk it must see.
_KERNEL = slice(1, 2)


def _split_cpu(proc: psutil.Process) -> dict[str, float]:
    """CPU seconds of a `--workers` gateway by process: "flow_control" (the parent) and each relay (by pid)."""
    out = {"flow_control": sum(proc.cpu_times()[:2])}
    for child in proc.children(recursive=True):
        try:
            out[f"relay_{child.pid}"] = sum(child.cpu_times()[:2])
        except psutil.NoSuchProcess:
            pass
    return out


def _verdict(gw: list[float], direct: list[float], goal: float) -> dict:
    g_lo, g_hi = quantile_interval(gw, 0.95)
    d_lo, d_hi = quantile_interval(direct, 0.95)
    out = {"gateway_p95_ms": _p95(gw) * 1000, "direct_p95_ms": _p95(direct) * 1000,
           "gateway_interval_ms": [g_lo * 1000, g_hi * 1000] if g_lo is not None else None,
           "direct_interval_ms": [d_lo * 1000, d_hi * 1000] if d_lo is not None else None}
    # The widest ratio the two intervals allow, against the goal.
    ratio = ratio_of_runs(Estimate(_p95(gw), g_lo, g_hi), Estimate(_p95(direct), d_lo, d_hi))
    if ratio.lo is None:
        out["goal"] = "undecided (too few samples)"
    else:
        out["goal"] = {"met": f"met (even the interval ends are within {goal}x)",
                       "missed": f"not met (the interval ends are apart by more than {goal}x)"}.get(
            decide(ratio, goal, at_least=False), "undecided (the intervals straddle the goal)")
    return out


def _release_verdict(seconds: list[float], goal_ms: float) -> dict:
    """p99 of decision -> capacity released, a distribution-free interval, and whether the goal is decided."""
    if not seconds:
        return {"evictions": 0, "goal": "undecided (no eviction recorded)"}
    ms = sorted(x * 1000 for x in seconds)
    lo, hi = quantile_interval(ms, 0.99)
    p99 = percentile(ms, 0.99)
    out = {"evictions": len(ms), "p50_ms": percentile(ms, 0.5), "p99_ms": p99,
           "max_ms": ms[-1], "p99_interval_ms": [lo, hi] if lo is not None else None, "goal_ms": goal_ms}
    if lo is None:
        out["goal"] = "undecided (too few evictions)"
    else:
        out["goal"] = {"met": "met (the interval ends within the goal)",
                       "missed": "not met (the interval starts above the goal)"}.get(
            decide(Estimate(p99, lo, hi), goal_ms, at_least=False), "undecided (the interval straddles the goal)")
    return out


def eviction_phase(args: argparse.Namespace, children: Children, tmp: Path) -> dict:
    """Eviction release through the single-process gateway and, with --workers N, through N relays."""
    modes = {"single_process": ()}
    if args.workers > 1:
        modes[f"workers_{args.workers}"] = ("--workers", str(args.workers))
    out = {}
    for name, gateway_args in modes.items():
        trials = eviction(args, children, tmp, gateway_args, admission=True)
        releases = trials.pop("release_after_eviction_s")
        closed = trials.pop("upstream_closed_after_eviction_s")
        out[name] = {**trials, "release_after_eviction": _release_verdict(releases, 10.0),
                     "upstream_closed_after_eviction": _release_verdict(closed, 10.0)}
        for figure in ("upstream_closed_after_eviction", "release_after_eviction"):
            print(f"eviction {name}: {figure} p99 {out[name][figure].get('p99_ms')} ms over {len(releases)} "
                  f"evictions; {out[name][figure]['goal']}", file=sys.stderr, flush=True)
    return out


def measure(args: argparse.Namespace, children: Children, tmp: Path) -> dict:
    sim_port, gw_port = free_port(), free_port()
    sim = f"http://127.0.0.1:{sim_port}"
    sim_proc = children.start(holdback("sim", "--port", str(sim_port), "--max-num-seqs", str(2 * args.streams),
                                       "--num-blocks", "200000", "--timer-spin-ms", "0", "--log-level", "WARNING"),
                              tmp / "sim.log")
    wait_http(sim + "/health", sim_proc)
    config = tmp / "gateway.yaml"
    # Capacity above the load and a KV pool far larger than it: this measures the relay, not queueing.
    config.write_text("saturation: {maxConcurrency: 1024}\nanonymous: {objectives: ['*']}\n"
                      "admission: {enabled: true, tokenizer: estimate, kvPoolGiB: 4096}\n")
    gw_proc = children.start(holdback("gateway", "--config", str(config), "--port", str(gw_port), "--replicas",
                                      sim, "--log-level", "WARNING"), tmp / "gateway.log")
    gw = f"http://127.0.0.1:{gw_port}"
    wait_http(gw + "/health", gw_proc)
    workers_gw = workers_proc = None
    if args.workers > 1:  # the same gateway as N relays and one flow-control process
        workers_port = free_port()
        workers_proc = children.start(holdback("gateway", "--config", str(config), "--port", str(workers_port),
                                               "--replicas", sim, "--log-level", "WARNING", "--workers",
                                               str(args.workers)), tmp / "gateway-workers.log")
        workers_gw = f"http://127.0.0.1:{workers_port}"
        wait_http(workers_gw + "/health", workers_proc)
    # The floor of an aiohttp relay: the bare pass-through proxy of bench/gateway_overhead.py, same library.
    bare_port = free_port()
    bare_proc = children.start([PY, "-m", "bench.gateway_overhead", "--serve-bare-proxy", str(bare_port),
                                "--upstream", sim], tmp / "bare.log")
    bare = f"http://127.0.0.1:{bare_port}"
    wait_http(bare + "/health", bare_proc)
    byte_port = free_port()
    byte_proc = children.start([PY, "-m", "bench.gateway_stream", "--serve-byte-relay", str(byte_port),
                                "--upstream-port", str(sim_port)], tmp / "byte.log")
    byte = f"http://127.0.0.1:{byte_port}"
    wait_http(byte + "/health", byte_proc)
    sim_ps = psutil.Process(sim_proc.pid)
    relays = {"gateway": psutil.Process(gw_proc.pid), "bare_relay": psutil.Process(bare_proc.pid),
              "byte_relay": psutil.Process(byte_proc.pid)}
    targets = {"direct": sim, "gateway": gw, "bare_relay": bare, "byte_relay": byte}
    if workers_gw is not None and workers_proc is not None:
        relays["gateway_workers"] = psutil.Process(workers_proc.pid)
        targets["gateway_workers"] = workers_gw
    for url in list(targets.values())[1:]:  # warm the relays' connections and imports
        run_streams(url + "/v1/chat/completions", 16, 16)
    workers_ratios: list[float] = []
    workers_over_single: list[float] = []
    workers_ttft: list[float] = []
    workers_itl: list[float] = []
    flow_shares: list[float] = []  # the flow-control process's part of the --workers gateway's CPU
    relay_balance: list[float] = []  # the least busy relay's CPU over the busiest's
    cpu_ratios: list[float] = []
    bare_ratios: list[float] = []
    byte_ratios: list[float] = []
    kernel_ratios: dict[str, list[float]] = {"gateway": [], "byte_relay": []}
    relay_itl: dict[str, list[float]] = {"bare_relay": [], "byte_relay": []}
    gw_ms_per_k: list[float] = []
    sim_ms_per_k: list[float] = []
    ttft_ratios: list[float] = []
    itl_ratios: list[float] = []
    pooled: dict[str, dict[str, list[float]]] = {t: {"ttft": [], "gaps": []} for t in targets}
    errors = dict.fromkeys(targets, 0)
    for rnd in range(args.rounds):
        order = list(targets) if rnd % 2 == 0 else list(targets)[::-1]
        runs: dict[str, dict] = {}
        for name in order:
            sim0 = _cpu(sim_ps)
            relay = relays.get(name)
            relay0 = _cpu(relay) if relay is not None else 0.0
            kernel0 = _cpu(relay, _KERNEL) if relay is not None else 0.0
            split0 = _split_cpu(relay) if name == "gateway_workers" and relay is not None else {}
            res = run_streams(targets[name] + "/v1/chat/completions", args.streams, args.tokens)
            res["sim_cpu"] = _cpu(sim_ps) - sim0
            res["relay_cpu"] = _cpu(relay) - relay0 if relay is not None else 0.0
            res["relay_kernel_cpu"] = _cpu(relay, _KERNEL) - kernel0 if relay is not None else 0.0
            if split0 and relay is not None:  # flow control's own CPU, and each relay's
                res["split_cpu"] = {k: v - split0.get(k, 0.0) for k, v in _split_cpu(relay).items()}
            runs[name] = res
            errors[name] += res["errors"]
            pooled[name]["ttft"] += res["ttft"]
            pooled[name]["gaps"] += res["gaps"]
        g, d = runs["gateway"], runs["direct"]
        per_k_gw = g["relay_cpu"] / g["tokens"] * 1e6
        per_k = {n: runs[n]["relay_cpu"] / runs[n]["tokens"] * 1e6 for n in ("bare_relay", "byte_relay")}
        bare_ratios.append(per_k_gw / per_k["bare_relay"])
        for name, ratios in relay_itl.items():
            ratios.append(_p95(runs[name]["gaps"]) / _p95(d["gaps"]))
        byte_ratios.append(per_k["byte_relay"] / (g["sim_cpu"] / g["tokens"] * 1e6))
        for name in ("gateway", "byte_relay"):  # each relay's kernel time ÷ the simulator's CPU in its own run
            kernel_ratios[name].append(runs[name]["relay_kernel_cpu"] / runs[name]["tokens"]
                                       / (runs[name]["sim_cpu"] / runs[name]["tokens"]))
        per_k_sim = g["sim_cpu"] / g["tokens"] * 1e6
        gw_ms_per_k.append(per_k_gw)
        sim_ms_per_k.append(per_k_sim)
        cpu_ratios.append(per_k_gw / per_k_sim)
        ttft_ratios.append(_p95(g["ttft"]) / _p95(d["ttft"]))
        itl_ratios.append(_p95(g["gaps"]) / _p95(d["gaps"]))
        if "gateway_workers" in runs:
            w = runs["gateway_workers"]
            per_k_w = w["relay_cpu"] / w["tokens"] * 1e6
            workers_ratios.append(per_k_w / (w["sim_cpu"] / w["tokens"] * 1e6))
            workers_over_single.append(per_k_w / per_k_gw)
            workers_ttft.append(_p95(w["ttft"]) / _p95(d["ttft"]))
            workers_itl.append(_p95(w["gaps"]) / _p95(d["gaps"]))
            split = w.get("split_cpu", {})
            if w["relay_cpu"] > 0 and split:
                flow_shares.append(split["flow_control"] / w["relay_cpu"])
                relay_cpu = sorted((v for k, v in split.items() if k.startswith("relay_")), reverse=True)
                relay_balance.append(relay_cpu[-1] / relay_cpu[0] if relay_cpu and relay_cpu[0] > 0 else 0.0)
            print(f"round {rnd + 1}/{args.rounds}: --workers {args.workers}: {per_k_w:.1f} ms CPU / 1k tokens "
                  f"(all its processes), ÷ simulator {workers_ratios[-1]:.3f}, ÷ single process "
                  f"{workers_over_single[-1]:.3f}; p95 TTFT ÷ direct {workers_ttft[-1]:.3f}, p95 inter-token "
                  f"÷ direct {workers_itl[-1]:.3f}; flow control {flow_shares[-1] if flow_shares else 0:.3f} of its CPU, "
                  f"relay balance {relay_balance[-1] if relay_balance else 0:.2f}; tokens {w['tokens']}",
                  file=sys.stderr, flush=True)
        print(f"round {rnd + 1}/{args.rounds}: gateway {per_k_gw:.1f} ms CPU / 1k tokens, simulator "
              f"{per_k_sim:.1f} (ratio {cpu_ratios[-1]:.3f}), gateway / bare aiohttp relay {bare_ratios[-1]:.3f}, "
              f"byte relay / simulator {byte_ratios[-1]:.3f} (kernel time alone {kernel_ratios['byte_relay'][-1]:.3f}; "
              f"the gateway's {kernel_ratios['gateway'][-1]:.3f}); "
              f"p95 TTFT gw/direct {ttft_ratios[-1]:.3f}, "
              f"p95 inter-token gw/direct {itl_ratios[-1]:.3f}; tokens {g['tokens']}/{d['tokens']}",
              file=sys.stderr, flush=True)
    summary = {
        "streams": args.streams, "tokens_per_stream": args.tokens, "rounds": args.rounds, "errors": errors,
        "gateway_cpu_ms_per_1k_tokens": {"median": statistics.median(gw_ms_per_k),
                                         "per_round": [round(x, 2) for x in gw_ms_per_k]},
        "simulator_cpu_ms_per_1k_tokens": {"median": statistics.median(sim_ms_per_k),
                                           "per_round": [round(x, 2) for x in sim_ms_per_k]},
        "cpu_ratio_gateway_over_simulator": {"median": statistics.median(cpu_ratios), "goal": 0.25,
                                             "per_round": [round(x, 3) for x in cpu_ratios]},
        "cpu_ratio_gateway_over_bare_relay": {"median": statistics.median(bare_ratios),
                                              "per_round": [round(x, 3) for x in bare_ratios]},
        "cpu_ratio_byte_relay_over_simulator": {"median": statistics.median(byte_ratios),
                                                "per_round": [round(x, 3) for x in byte_ratios]},
        # Relays' system time alone ÷ the simulator's CPU for the same tokens: the byte relay's is the floor of a
        # relay in any language that reads and writes each chunk through the kernel's sockets.
        "kernel_cpu_ratio_over_simulator": {
            name: {"median": statistics.median(r), "per_round": [round(x, 3) for x in r]}
            for name, r in kernel_ratios.items()},
        # The baselines' own added inter-token latency: what any relay on this machine adds.
        "p95_inter_token_ratio_relays_over_direct": {name: {"median": statistics.median(r),
                                                            "per_round": [round(x, 3) for x in r]}
                                                     for name, r in relay_itl.items()},
        "p95_ttft_ratio_gateway_over_direct": {"median": statistics.median(ttft_ratios), "goal": 1.1,
                                               "per_round": [round(x, 3) for x in ttft_ratios],
                                               "pooled": _verdict(pooled["gateway"]["ttft"],
                                                                  pooled["direct"]["ttft"], 1.1)},
        "p95_inter_token_ratio_gateway_over_direct": {"median": statistics.median(itl_ratios), "goal": 1.1,
                                                      "per_round": [round(x, 3) for x in itl_ratios],
                                                      "pooled": _verdict(pooled["gateway"]["gaps"],
                                                                         pooled["direct"]["gaps"], 1.1)},
    }
    if workers_ratios:
        def figure(values: list[float]) -> dict:
            return {"median": statistics.median(values), "per_round": [round(x, 3) for x in values]}

        summary[f"workers_{args.workers}"] = {
            "cpu_ratio_gateway_over_simulator": figure(workers_ratios),
            "cpu_ratio_over_single_process": figure(workers_over_single),
            "flow_control_share_of_cpu": figure(flow_shares) if flow_shares else None,
            "relay_cpu_balance_min_over_max": figure(relay_balance) if relay_balance else None,
            "p95_ttft_ratio_over_direct": {**figure(workers_ttft), "pooled": _verdict(
                pooled["gateway_workers"]["ttft"], pooled["direct"]["ttft"], 1.1)},
            "p95_inter_token_ratio_over_direct": {**figure(workers_itl), "pooled": _verdict(
                pooled["gateway_workers"]["gaps"], pooled["direct"]["gaps"], 1.1)},
        }
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="rounds of direct + gateway runs (default 3)")
    p.add_argument("--streams", type=int, default=256, help="concurrent streams per run (default 256)")
    p.add_argument("--tokens", type=int, default=256, help="tokens per stream (default 256)")
    p.add_argument("--workers", type=int, default=1, help="also run the gateway as `holdback gateway --workers N` "
                   "(N > 1) beside the single-process one, and the eviction phase for both (default 1: single only)")
    p.add_argument("--eviction-trials", type=int, default=None,
                   help="blocked realtime arrivals per eviction phase (default 100 with --workers N > 1, else 0: "
                        "no eviction phase)")
    p.add_argument("--eviction-slots", type=int, default=8, help="pool slots kept full of batch (default 8)")
    p.add_argument("--out", help="write the JSON summary here as well")
    p.add_argument("--load", help=argparse.SUPPRESS)  # internal: run the load generator against this URL
    p.add_argument("--serve-byte-relay", type=int, help=argparse.SUPPRESS)  # internal: the byte relay's port
    p.add_argument("--upstream-port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.workers < 1:
        p.error(f"--workers must be at least 1 (got {args.workers})")
    if args.eviction_trials is None:
        args.eviction_trials = 100 if args.workers > 1 else 0
    if args.serve_byte_relay:
        serve_byte_relay(args.serve_byte_relay, args.upstream_port)
        return 0
    if args.load:
        print(json.dumps(asyncio.run(_streams(args.load, args.streams, args.tokens))))
        return 0
    children = Children()
    try:
        with tempfile.TemporaryDirectory(prefix="gateway-stream-") as tmp:
            summary = measure(args, children, Path(tmp)) if args.rounds > 0 else {}
            if args.eviction_trials > 0:
                children.close()
                children.procs.clear()
                summary["eviction_release"] = eviction_phase(args, children, Path(tmp))
    finally:
        children.close()
    text = json.dumps(summary, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
