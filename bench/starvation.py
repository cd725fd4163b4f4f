"""Starvation: a batch with a short window beside realtime that alone fills every engine slot, through
`holdback up --replicas ENGINE` as users run it; does the batch finish inside its window, and what does that
cost realtime?

One engine (the simulator, or with `--engine vllm` the real-engine tier's vLLM pinned to CPU 0 with this process
and the stack on CPU 1) serves every arm; each arm starts a fresh `holdback up` (warmed with a short batch so
the gateway knows the engine's slots, as a stack in service does), then runs `--clients` closed-loop realtime
clients (each sends its next streamed completion of `--realtime-tokens` tokens as soon as the last ends: more
clients than slots keep every slot busy and realtime queued) for `--seconds`, with, from their start:
- `floor`: a batch whose `completion_window` is `--window` and that needs about a tenth of the engine's
  capacity for it (`--lines`, by default sized from the lines' measured time alone on the engine), with the
  built-in gateway config (`flowControl.atRiskFloor` 0.1);
- `no-floor`: the same batch with `atRiskFloor: 0` — strict priority, as before the floor;
- `not-at-risk`: the same lines with a 24 h window (never at risk): the floor must cost realtime nothing;
- `realtime-alone`: no batch: realtime's own p95 here is the baseline.
Figures: whether each batch completed inside its window (its status and the seconds it took), and realtime's p95
time to first token over the arm ÷ `realtime-alone`'s, with the order-statistic intervals of each.

    python -m bench.starvation                                            # the simulator, a 60 s window
    HOLDBACK_VLLM_PYTHON=... HOLDBACK_VLLM_MODEL=... python -m bench.starvation --engine vllm --window 300 \\
        --seconds 600 --out docs/study/starvation
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import time
from dataclasses import asdict, dataclass, field

import aiohttp
import httpx

from bench.lib.engines import one_engine, wait_idle
from bench.lib.holdback_up import HoldbackUp, create_batch, finished, upload, warm_up
from bench.makespan import batch_lines, common_arguments, write_out
from bench.real_engine.traffic import BROKEN, Streamed, prompt, stream
from bench.stats import percentile, quantile_interval

ARMS = ("realtime-alone", "floor", "no-floor", "not-at-risk")
NO_FLOOR = {"flowControl": {"atRiskFloor": 0}}


@dataclass
class StarvationRun:
    arm: str
    ttft: list[float] = field(default_factory=list)  # seconds; inf: no first token
    realtime_done: int = 0
    realtime_failed: int = 0
    batch_status: str | None = None
    batch_seconds: float | None = None  # creation → terminal
    batch_completed: int = 0
    batch_total: int = 0
    at_risk_floor: dict = field(default_factory=dict)  # the gateway's /admin/state `at_risk_floor`, at the end
    floor_dispatches: float = 0.0  # requests the gateway dispatched into the floor over the arm


async def realtime_clients(url: str, headers: dict, model: str, args: argparse.Namespace, run: StarvationRun) -> None:
    """`--clients` closed loops for `--seconds`, each a streamed completion after another."""
    end = time.monotonic() + args.seconds

    async def client(i: int, session: aiohttp.ClientSession) -> None:
        rng = random.Random(args.seed * 1000 + i)
        while time.monotonic() < end:
            try:
                got = await stream(session, url, {"model": model, "prompt": prompt(rng, 24),
                                                  "max_tokens": args.realtime_tokens, "ignore_eos": True}, headers)
            except aiohttp.ClientConnectionError:
                got = Streamed(BROKEN)
            if got.status != 200 or got.first is None:
                run.realtime_failed += 1
                run.ttft.append(float("inf"))
                await asyncio.sleep(0.1)
            else:
                run.realtime_done += 1
                run.ttft.append(got.first)

    timeout = aiohttp.ClientTimeout(total=args.seconds + 120)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(client(i, session) for i in range(args.clients)))


async def one_arm(arm: str, up: HoldbackUp, warm: list[dict], lines: list[dict],
                  args: argparse.Namespace) -> StarvationRun:
    run = StarvationRun(arm)
    await warm_up(up, warm, args)
    rt = asyncio.create_task(realtime_clients(up.gateway, up.realtime, lines[0]["model"], args, run))
    if arm != "realtime-alone":
        window = "24h" if arm == "not-at-risk" else f"{int(args.window)}s"
        async with httpx.AsyncClient(base_url=up.api, headers=up.tenant, timeout=60) as api:
            file_id = await upload(api, lines)
            start = time.monotonic()
            batch = await create_batch(api, file_id, window)
            if arm == "not-at-risk":
                await rt  # its window never closes in this arm: read where it got when realtime ended
                batch = (await api.get(f"/v1/batches/{batch['id']}")).raise_for_status().json()
            else:
                batch = await finished(api, batch, start, args, up.log)
                run.batch_seconds = time.monotonic() - start
        run.batch_status = batch["status"]
        run.batch_completed, run.batch_total = batch["request_counts"]["completed"], batch["request_counts"]["total"]
    await rt
    state = httpx.get(up.gateway + "/admin/state", headers=up.admin, timeout=30).json()
    run.at_risk_floor = state.get("at_risk_floor", {})
    metrics = httpx.get(up.gateway + "/metrics", headers=up.admin, timeout=30).text
    run.floor_dispatches = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                               if line.startswith("holdback_gateway_dispatches_total{") and 'path="floor"' in line)
    return run


async def line_seconds(engine: str, lines: list[dict], slots: int) -> float:
    """Seconds one line takes on the idle engine, measured over a full set of slots run together."""
    async with aiohttp.ClientSession() as session:
        start = time.monotonic()
        await asyncio.gather(*(stream(session, engine, body, {}) for body in lines[:slots]))
        return time.monotonic() - start


def report(runs: list[StarvationRun], args: argparse.Namespace) -> str:
    alone = next((r for r in runs if r.arm == "realtime-alone"), None)
    base = percentile(alone.ttft, 0.95) if alone else None
    out = [f"Starvation ({args.engine}, {args.clients} realtime clients for {args.seconds:g} s, batch of {args.lines} "
           f"lines in a {args.window:g} s window)"]
    for r in runs:
        p95 = percentile(r.ttft, 0.95)
        lo, hi = quantile_interval(r.ttft, 0.95)
        ratio = f"{p95 / base:.3f}× realtime alone's" if p95 is not None and base else "—"
        interval = f" [{lo:.3f}, {hi:.3f}]" if lo is not None else ""
        batch = (f"; batch {r.batch_status}, {r.batch_completed}/{r.batch_total} in "
                 f"{r.batch_seconds:.0f} s" if r.batch_seconds is not None else
                 f"; batch {r.batch_status}, {r.batch_completed}/{r.batch_total} done" if r.batch_status else "")
        out.append(f"- {r.arm}: realtime p95 TTFT {p95 or 0:.3f} s{interval} ({len(r.ttft)} requests, "
                   f"{r.realtime_failed} failed), {ratio}{batch}; {r.floor_dispatches:g} dispatched into the floor")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=("sim", "vllm"), default="sim")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    p.add_argument("--window", type=float, default=60.0, help="the batch's completion window, s (default 60)")
    p.add_argument("--seconds", type=float, default=None, help="realtime's run, s (default: the window)")
    p.add_argument("--clients", type=int, default=None, help="closed-loop realtime clients (default: 2 × slots)")
    p.add_argument("--realtime-tokens", type=int, default=64, help="each realtime completion's tokens (default 64)")
    p.add_argument("--lines", type=int, default=None, help="the batch's lines (default: a tenth of the capacity)")
    p.add_argument("--tokens", type=lambda s: tuple(int(x) for x in s.split(",")), default=(100, 200),
                   help="each line's output tokens, min,max (default 100,200)")
    p.add_argument("--slots", type=int, default=8, help="the engine's --max-num-seqs (default %(default)s)")
    common_arguments(p, timeout=3600.0)
    args = p.parse_args(argv)
    args.seconds = args.seconds or args.window
    args.clients = args.clients or 2 * args.slots
    arms = [a for a in args.arms.split(",") if a]
    if unknown := set(arms) - set(ARMS):
        p.error(f"unknown arms {sorted(unknown)}; choose from {', '.join(ARMS)}")
    if args.window < 60 or args.seconds < args.window:
        p.error("--window must be at least 60 (the Batch API's shortest completion window) and --seconds at least "
                "the window (realtime runs throughout)")
    args.warm_up = True
    runs: list[StarvationRun] = []
    with one_engine(p, args, "hb-starvation-") as engine:
        warm = batch_lines(args.seed + 1, args.slots * 8, args.tokens, engine.model)
        if args.lines is None:
            per_line = asyncio.run(line_seconds(engine.url, warm, args.slots))
            args.lines = max(1, math.ceil(0.1 * args.slots * args.window / per_line))
            print(f"a line takes {per_line:.2f} s alone: {args.lines} lines need a tenth of the capacity", flush=True)
        lines = batch_lines(args.seed, args.lines, args.tokens, engine.model)
        for arm in arms:
            wait_idle(engine.url)
            with HoldbackUp(engine.url, engine.tmp, arm, engine.pin, NO_FLOOR if arm == "no-floor" else None,
                            args.out / "logs" / arm if args.out else None) as up:
                run = asyncio.run(one_arm(arm, up, warm, lines, args))
            runs.append(run)
            print(report([r for r in runs if r.arm == "realtime-alone"] + [run] if arm != "realtime-alone"
                         else [run], args).splitlines()[-1], flush=True)
    text = report(runs, args)
    print(text)
    write_out(args, text, {"runs": [asdict(r) for r in runs]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
