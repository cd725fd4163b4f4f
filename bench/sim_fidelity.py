"""How closely a simulator replica's client-visible timing follows its own timing model.

For each concurrency C the bench starts C identical streaming completions (prompt P tokens,
max_tokens M, ignore_eos) against one `holdback sim` replica and measures, at the client:

- ITL: the gaps between consecutive tokens while all C streams are decoding and nothing else
  runs. The model predicts every such step takes  overhead + decode_base + decode_per_seq * C.
- TTFT: while the C streams decode, probe requests (prompt P, max_tokens 1) are sent one at a
  time, from a process of their own, at uniformly random moments. A probe waits for the step in
  flight to end (uniform over one decode step), then is prefilled in a step beside the C decodes:
      predicted TTFT (mean and median) = step(0, C) / 2 + step(P, C).
  The table compares the median, which a stray scheduling hiccup on a shared machine cannot move.

The server-side columns are the simulator's own histograms over the same windows.

The replica runs in a child process pinned to CPU 0 (taskset) and this client to CPU 1, so the
simulator's one core is not shared with the load generator; both run at nice -5 when allowed, so
other work on a shared machine delays their wakeups less. Only the CLI and HTTP are used.

    python -m bench.sim_fidelity                       # C = 1, 16, 64, 128, 256
    python -m bench.sim_fidelity --concurrency 1,64 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import multiprocessing
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

from bench.lib.engines import pinned
from bench.lib.processes import stop_processes
from bench.lib.readiness import free_port

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Timing:
    """The simulator's documented step-time formula, with the values this bench passes to it."""

    overhead_ms: float
    prefill_ms_per_token: float
    decode_base_ms: float
    decode_ms_per_seq: float

    def step_ms(self, prefill_tokens: int, decode_seqs: int) -> float:
        ms = self.overhead_ms + prefill_tokens * self.prefill_ms_per_token
        if decode_seqs > 0:
            ms += self.decode_base_ms + self.decode_ms_per_seq * decode_seqs
        return ms


@dataclass
class LevelResult:
    concurrency: int
    itl_gaps: int
    itl_measured_ms: float
    itl_predicted_ms: float
    ttft_probes: int
    ttft_measured_ms: float
    ttft_predicted_ms: float
    # Mean gap between token steps as the simulator itself recorded it over the ITL window.
    server_itl_ms: float
    # Mean probe TTFT as the simulator recorded it (from request parsed to first token).
    server_ttft_ms: float

    @property
    def itl_ratio(self) -> float:
        return self.itl_measured_ms / self.itl_predicted_ms

    @property
    def ttft_ratio(self) -> float:
        return self.ttft_measured_ms / self.ttft_predicted_ms


def start_sim(args, timing: Timing, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "holdback.cli", "sim", "--port", str(port),
           "--max-num-seqs", str(max(args.concurrency) + 8),
           "--step-overhead-ms", str(timing.overhead_ms),
           "--prefill-ms-per-token", str(timing.prefill_ms_per_token),
           "--decode-base-ms", str(timing.decode_base_ms),
           "--decode-ms-per-seq", str(timing.decode_ms_per_seq),
           "--loop", args.sim_loop, "--log-level", "WARNING"]
    cmd = [*pinned(args.sim_cpu, bool(args.pin and shutil.which("taskset"))), *cmd]
    if args.nice and _can_renice(args.nice):
        cmd = ["nice", "-n", str(args.nice), *cmd]
    return subprocess.Popen(cmd, cwd=REPO, start_new_session=True)


def _can_renice(nice: int) -> bool:
    """Lowering niceness needs privileges; without them the bench runs at normal priority."""
    return nice >= 0 or os.geteuid() == 0


async def wait_ready(url: str, proc: subprocess.Popen | None, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise SystemExit(f"simulator exited with {proc.returncode}")
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(url + "/health") as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.1)
    raise SystemExit(f"simulator at {url} not ready after {timeout}s")


class FirstTokens:
    """Fires once every stream of a level has received its first token."""

    def __init__(self, expected: int):
        self.expected = expected
        self.all_started = asyncio.Event()

    def seen(self) -> None:
        self.expected -= 1
        if self.expected == 0:
            self.all_started.set()


async def _stream(session: aiohttp.ClientSession, url: str, body: dict,
                  first: FirstTokens | None = None) -> tuple[float, list[float]]:
    """Send one streaming completion; return its send time and the arrival time of each token."""
    sent = time.perf_counter()
    stamps: list[float] = []
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
        async for line in resp.content:
            if line.startswith(b"data: {"):
                stamps.append(time.perf_counter())
                if first is not None and len(stamps) == 1:
                    first.seen()
    return sent, stamps


class Prober:
    """TTFT probes from a process of their own, so they never queue behind the load client's streams."""

    def __init__(self, port: int, cpu: int | None):
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_probe_worker, args=(port, cpu, child), daemon=True)
        self._proc.start()

    def measure(self, body: dict, delays: list[float]) -> list[float]:
        self._conn.send((body, delays))
        return self._conn.recv()

    def close(self) -> None:
        self._conn.send(None)
        self._proc.join(10)


def _probe_worker(port: int, cpu: int | None, conn) -> None:
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    http_conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    while (job := conn.recv()) is not None:
        body, delays = job
        payload = json.dumps(body)
        ttfts = []
        for delay in delays:
            time.sleep(delay)
            sent = time.perf_counter()
            http_conn.request("POST", "/v1/completions", payload, {"Content-Type": "application/json"})
            resp = http_conn.getresponse()
            first = None
            while line := resp.readline():
                if first is None and line.startswith(b"data: {"):
                    first = time.perf_counter()
            ttfts.append((first - sent) * 1000)
        conn.send(ttfts)
    http_conn.close()


async def run_level(url: str, args, timing: Timing, concurrency: int, rng: random.Random,
                    prober: Prober) -> LevelResult:
    prompt = " ".join(["w"] * args.prompt_tokens)  # one simulator token per word
    decode_step = timing.step_ms(0, concurrency)
    probe_window_steps = args.probes * 6 + 10
    max_tokens = args.itl_steps + probe_window_steps + 20
    body = {"model": "sim-model", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        first = FirstTokens(concurrency)
        tasks = [asyncio.create_task(_stream(session, url + "/v1/completions", body, first))
                 for _ in range(concurrency)]
        # Once every stream has its first token, all C decode in lockstep: measure ITL, then probe TTFT.
        await asyncio.wait_for(first.all_started.wait(), timeout=120)
        await asyncio.sleep(3 * decode_step / 1000)
        itl_start = time.perf_counter()
        itl_before = await _server_histogram(session, url, "vllm:inter_token_latency_seconds")
        await asyncio.sleep(args.itl_steps * decode_step / 1000)
        itl_after = await _server_histogram(session, url, "vllm:inter_token_latency_seconds")
        itl_end = time.perf_counter()
        ttft_before = await _server_histogram(session, url, "vllm:time_to_first_token_seconds")

        probe_body = {"model": "sim-model", "prompt": prompt, "max_tokens": 1, "stream": True}
        delays = [rng.uniform(0, 2 * decode_step) / 1000 for _ in range(args.probes)]
        ttfts = await asyncio.get_running_loop().run_in_executor(None, prober.measure, probe_body, delays)
        probes_end = time.perf_counter()
        ttft_after = await _server_histogram(session, url, "vllm:time_to_first_token_seconds")
        results = await asyncio.gather(*tasks)

    first_tokens = [stamps[0] for _, stamps in results]
    last_tokens = [stamps[-1] for _, stamps in results]
    if max(first_tokens) > itl_start or min(last_tokens) < probes_end:
        raise RuntimeError(f"C={concurrency}: the measuring windows were not inside the all-decoding phase "
                           f"(last first token {max(first_tokens) - itl_start:+.3f}s after the ITL window began, "
                           f"first stream ended {min(last_tokens) - probes_end:+.3f}s after the probes); "
                           "raise --itl-steps or lower the load on this machine")
    gaps = [(b - a) * 1000 for _, stamps in results for a, b in zip(stamps, stamps[1:])
            if a >= itl_start and b <= itl_end]
    return LevelResult(
        concurrency=concurrency,
        itl_gaps=len(gaps),
        itl_measured_ms=statistics.fmean(gaps),
        itl_predicted_ms=decode_step,
        ttft_probes=len(ttfts),
        ttft_measured_ms=statistics.median(ttfts),
        ttft_predicted_ms=decode_step / 2 + timing.step_ms(args.prompt_tokens, concurrency),
        server_itl_ms=(itl_after[0] - itl_before[0]) / max(itl_after[1] - itl_before[1], 1) * 1000,
        server_ttft_ms=(ttft_after[0] - ttft_before[0]) / max(ttft_after[1] - ttft_before[1], 1) * 1000,
    )


async def _server_histogram(session: aiohttp.ClientSession, url: str, name: str) -> tuple[float, float]:
    """(sum, count) of one of the simulator's histograms."""
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    values = {}
    for line in text.splitlines():
        for suffix in ("_sum", "_count"):
            if line.startswith(f"{name}{suffix}{{"):
                values[suffix] = float(line.rsplit(" ", 1)[1])
    return values["_sum"], values["_count"]


def table(results: list[LevelResult]) -> str:
    head = ("| concurrency | ITL measured ms | ITL predicted ms | ITL ratio | TTFT p50 measured ms | TTFT predicted ms "
            "| TTFT ratio | server ITL ms | server TTFT ms | gaps | probes |")
    rows = [head, "|" + "---|" * 11]
    for r in results:
        rows.append(f"| {r.concurrency} | {r.itl_measured_ms:.2f} | {r.itl_predicted_ms:.2f} | {r.itl_ratio:.3f} "
                    f"| {r.ttft_measured_ms:.2f} | {r.ttft_predicted_ms:.2f} | {r.ttft_ratio:.3f} "
                    f"| {r.server_itl_ms:.2f} | {r.server_ttft_ms:.2f} | {r.itl_gaps} | {r.ttft_probes} |")
    return "\n".join(rows)


async def amain(args) -> int:
    timing = Timing(args.step_overhead_ms, args.prefill_ms_per_token, args.decode_base_ms, args.decode_ms_per_seq)
    port = args.port or free_port()
    url = f"http://127.0.0.1:{port}"
    proc = None if args.external else start_sim(args, timing, port)
    rng = random.Random(args.seed)
    prober = Prober(port, args.client_cpu if args.pin else None)
    try:
        await wait_ready(url, proc)
        results = []
        for c in args.concurrency:
            result = await run_level(url, args, timing, c, rng, prober)
            print(f"C={c}: ITL {result.itl_measured_ms:.2f}/{result.itl_predicted_ms:.2f} ms "
                  f"TTFT {result.ttft_measured_ms:.2f}/{result.ttft_predicted_ms:.2f} ms", file=sys.stderr)
            results.append(result)
    finally:
        prober.close()
        if proc is not None:
            stop_processes([proc], 15)
    print(table(results))
    worst = max(max(abs(r.itl_ratio - 1), abs(r.ttft_ratio - 1)) for r in results)
    print(f"\nworst deviation from the model: {worst * 100:.1f}% (goal: within {args.tolerance * 100:.0f}%)")
    if args.json:
        Path(args.json).write_text(json.dumps(
            [asdict(r) | {"itl_ratio": r.itl_ratio, "ttft_ratio": r.ttft_ratio} for r in results], indent=2))
    return 0 if worst <= args.tolerance else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.sim_fidelity",
        description="Measure simulator TTFT and inter-token latency at the client and compare them with the "
                    "simulator's timing model.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64, 128, 256],
                   help="comma-separated numbers of concurrent streams")
    p.add_argument("--prompt-tokens", type=int, default=128, help="prompt length of every request")
    p.add_argument("--itl-steps", type=int, default=60, help="decode steps in the ITL window")
    p.add_argument("--probes", type=int, default=60, help="TTFT probes per concurrency level")
    p.add_argument("--step-overhead-ms", type=float, default=2.0)
    p.add_argument("--prefill-ms-per-token", type=float, default=0.1)
    p.add_argument("--decode-base-ms", type=float, default=8.0)
    p.add_argument("--decode-ms-per-seq", type=float, default=0.08)
    p.add_argument("--sim-loop", choices=("asyncio", "uvloop"), default="asyncio",
                   help="event loop of the simulator process")
    p.add_argument("--no-pin", dest="pin", action="store_false", help="do not pin the simulator and client to CPUs")
    p.add_argument("--sim-cpu", type=int, default=0, help="CPU for the simulator")
    p.add_argument("--nice", type=int, default=-5,
                   help="niceness of the simulator and the client (negative needs root; 0 = unchanged), so that "
                        "other work on a shared machine delays their wakeups less")
    p.add_argument("--client-cpu", type=int, default=1, help="CPU for this client")
    p.add_argument("--port", type=int, default=0, help="simulator port (default: a free one)")
    p.add_argument("--external", action="store_true",
                   help="measure a simulator already listening on --port (started with the timing flags given "
                        "here and --max-num-seqs above the largest concurrency) instead of starting one")
    p.add_argument("--seed", type=int, default=1, help="seed of the probe timing")
    p.add_argument("--tolerance", type=float, default=0.10, help="exit 1 if any ratio is further than this from 1")
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args(argv)
    if args.pin and hasattr(os, "sched_setaffinity") and args.client_cpu in os.sched_getaffinity(0):
        os.sched_setaffinity(0, {args.client_cpu})
    if args.nice and _can_renice(args.nice):
        os.setpriority(os.PRIO_PROCESS, 0, args.nice)
    try:
        import uvloop
    except ImportError:
        return asyncio.run(amain(args))
    return uvloop.run(amain(args))


if __name__ == "__main__":
    sys.exit(main())
