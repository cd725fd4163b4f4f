"""Makespan: one batch as users run it (the Batch API, the processor, the workers, the shipped gateway), realtime
arriving throughout, against vLLM's own priority scheduler fed the same lines with the same streaming.

One engine serves the whole run: the simulator (`holdback sim --scheduling-policy priority`, the default) or
the real-engine tier's vLLM (`--engine vllm`, pinned to CPU 0 with `--scheduling-policy priority`; this process
and the holdback stack pinned to CPU 1). Each group runs both arms back to back on it, in alternating order, once
the engine is idle, and each in a prefix-cache scope of its own (every group's lines are the same, and an arm
that found an earlier arm's blocks cached would skip their prefill):
- `vllm-priority`: every line of the batch sent straight to the engine at once as a streamed completion with
  `X-Vllm-Priority: 10`, realtime with `-100`, all with the group's own `cache_salt`; makespan = first send →
  last line finished.
- `holdback`: `holdback up --replicas ENGINE` with its built-in gateway config (a fresh data dir each group;
  `--slots-known` adds `engine.maxNumSeqs`, else the gateway learns the engine's slots in its first seconds),
  the same lines uploaded as a JSONL file and run as one batch; realtime through the gateway with the realtime
  key (the stack's tenants are new each group, and so are their salts; its warm-up batch has lines of its own);
  makespan = `POST /v1/batches` → the batch seen `completed` (polled every 0.1 s). Afterwards every evicted row's attempts are
  read from the operator API: evictions per row, and the wait from an evicted attempt's end to the row's next
  attempt.
Realtime in both arms: the same seeded Poisson arrivals at `--rate`/s from the arm's start until its batch is
done, each a streamed completion of 8 tokens; its figure is time to first token.
Figures: per group, holdback's makespan ÷ vLLM priority's and realtime p95 ÷ vLLM priority's; the report gives
each ratio's median over the groups with a bootstrap interval and the goals' verdicts (makespan ≤ 1.03×,
realtime p95 ≤ 0.2×), the most evictions of one row and the longest eviction → next-attempt wait.

    python -m bench.makespan --groups 3                                   # the simulator
    HOLDBACK_VLLM_PYTHON=... HOLDBACK_VLLM_MODEL=... python -m bench.makespan --engine vllm --groups 3 \\
        --out docs/study/makespan
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import httpx
import psutil

from bench.lib.engines import one_engine, wait_idle
from bench.lib.holdback_up import HoldbackUp, create_batch, finished, upload, warm_up
from bench.lib.process_cpu import CpuSampler
from bench.lib.traffic import schedule
from bench.real_engine.study import cpu_role
from bench.real_engine.traffic import BROKEN, Streamed, prompt, stream
from bench.stats import bootstrap_median, percentile, verdict

ARMS = ("vllm-priority", "holdback")
MAKESPAN_GOAL, REALTIME_GOAL = 1.03, 0.2
# What the workers ask of a resumable stream besides `return_token_ids` (holdback/attempts/resume.py).
WORKERS_STREAM_OPTIONS = {"include_usage": True, "continuous_usage_stats": True}
# The workers' default tokens per event of such a stream (`holdback worker --stream-interval`).
WORKERS_STREAM_INTERVAL = 8


@dataclass
class MakespanRun:
    arm: str
    group: int
    makespan: float = 0.0
    ttft: list[float] = field(default_factory=list)  # seconds; inf: no first token
    realtime_failed: int = 0
    lines_failed: int = 0
    # holdback: seconds from `POST /v1/batches` to the first attempt, and from the last row's end to the batch
    # seen completed (what the pipeline adds before and after the engine's work)
    lead_in: float = 0.0
    lead_out: float = 0.0
    # holdback: the engine's slots the gateway knew when the measured batch began (told, or learned in the warm-up)
    slots_known: int | None = None
    # How far the engine's counters moved during the arm (its steps, prompt and output tokens): where the time went.
    engine: dict[str, float] = field(default_factory=dict)
    # CPU seconds each part spent during the arm: vLLM's API server and its engine (core and worker), holdback's
    # processes, this process (the load). On this machine the API server shares the engine's core.
    cpu: dict[str, float] = field(default_factory=dict)
    evictions: list[int] = field(default_factory=list)  # per row (holdback)
    eviction_waits: list[float] = field(default_factory=list)  # evicted attempt's end → the row's next attempt


def batch_lines(seed: int, n: int, tokens: tuple[int, int], model: str) -> list[dict]:
    """The batch: `n` completions of a 40-word prompt, each of a seeded length in `tokens` (`ignore_eos`)."""
    rng = random.Random(seed)
    return [{"model": model, "prompt": prompt(rng, 40), "max_tokens": rng.randint(*tokens), "ignore_eos": True}
            for _ in range(n)]


async def realtime(session: aiohttp.ClientSession, url: str, headers: dict, model: str, rate: float, seed: int,
                   done: asyncio.Event, run: MakespanRun, extra: dict | None = None) -> None:
    """Poisson arrivals at `rate`/s from now until `done`, each a streamed completion of 8 tokens (`extra`: more
    of its body)."""
    start, rng, sent = time.monotonic(), random.Random(seed), []

    async def one(text: str) -> None:
        try:
            got = await stream(session, url, {"model": model, "prompt": text, "max_tokens": 8, **(extra or {})},
                               headers)
        except aiohttp.ClientConnectionError:
            got = Streamed(BROKEN)
        if got.status != 200 or got.first is None:
            run.realtime_failed += 1
            run.ttft.append(float("inf"))
        else:
            run.ttft.append(got.first)

    for at in schedule(seed, 0, rate, 7200.0):  # more than any arm lasts
        try:
            await asyncio.wait_for(done.wait(), max(0.0, start + at - time.monotonic()))
            break
        except asyncio.TimeoutError:
            sent.append(asyncio.create_task(one(prompt(rng, 24))))
    await asyncio.gather(*sent)


async def vllm_arm(engine: str, lines: list[dict], args: argparse.Namespace, group: int,
                   salt: str | None = None) -> MakespanRun:
    """`salt`: a `cache_salt` for every line and realtime request, so that the arm finds nothing an earlier arm
    left in the engine's prefix cache (the holdback arm's tenant is new each group, and its salt with it)."""
    run = MakespanRun("vllm-priority", group)
    before = engine_counters(engine)
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    scope = {"cache_salt": salt} if salt else {}
    lines = [{**line, **scope} for line in lines]
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        done = asyncio.Event()
        rt = asyncio.create_task(realtime(session, engine, {"X-Vllm-Priority": "-100"}, lines[0]["model"],
                                          args.rate, args.seed + group, done, run, scope))
        # With --workers-streaming, the workers' own stream options (a usage object on every event).
        # With --stream-interval N as well, the events N tokens at a time, as the workers ask then.
        extra = {"stream_options": WORKERS_STREAM_OPTIONS} if args.workers_streaming else {}
        if args.workers_streaming and args.stream_interval > 1:
            extra["stream_interval"] = args.stream_interval

        async def line(body: dict) -> None:
            if args.vllm_whole:  # --vllm-whole: each answer whole, as vLLM's own batch runner asks
                async with session.post(engine + "/v1/completions", json={**body, "stream": False},
                                        headers={"X-Vllm-Priority": "10"}) as resp:
                    answer = await resp.json() if resp.status == 200 else {}
                run.lines_failed += not (answer.get("choices") and answer["choices"][0].get("finish_reason"))
                return
            got = await stream(session, engine, {**body, **extra}, {"X-Vllm-Priority": "10"})
            run.lines_failed += not (got.status == 200 and got.finished)

        with CpuSampler(cpu_part, interval=0.5) as sampler:
            start = time.monotonic()
            await asyncio.gather(*(line(body) for body in lines))
            run.makespan = time.monotonic() - start
        run.cpu = cpu_seconds(sampler)
        run.engine = counters_since(engine, before)
        done.set()
        await rt
    return run


async def holdback_arm(up: HoldbackUp, engine: str, lines: list[dict], args: argparse.Namespace,
                       group: int) -> MakespanRun:
    run = MakespanRun("holdback", group)
    if args.warm_up:  # lines of its own: the measured batch's prompts are new to the engine, as vLLM alone's are
        warm = batch_lines(args.seed + 1000 + group, 8 * args.slots, (8, 8), lines[0]["model"])
        run.slots_known = await warm_up(up, warm, args)
        wait_idle(engine)
    before = engine_counters(engine)
    async with httpx.AsyncClient(base_url=up.api, headers=up.tenant, timeout=60) as api:
        file_id = await upload(api, lines)
        timeout = aiohttp.ClientTimeout(total=args.timeout)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
            done = asyncio.Event()
            rt = asyncio.create_task(realtime(session, up.gateway, up.realtime, lines[0]["model"], args.rate,
                                              args.seed + group, done, run))
            with CpuSampler(cpu_part, interval=0.5) as sampler:
                start, posted = time.monotonic(), time.time()
                batch = await create_batch(api, file_id)
                batch = await finished(api, batch, start, args, up.log)
                run.makespan, seen = time.monotonic() - start, time.time()
            run.cpu = cpu_seconds(sampler)
            done.set()
            await rt
    counts = batch["request_counts"]
    run.lines_failed = counts["total"] - counts["completed"]
    run.engine = counters_since(engine, before)
    rows, run.eviction_waits = eviction_record(up, batch["id"])
    run.evictions = [row["evictions"] for row in rows]
    run.lead_in = min(row["first_attempt_at"] or seen for row in rows) - posted
    run.lead_out = seen - max(row["finished_at"] or posted for row in rows)
    return run


def cpu_part(proc: psutil.Process) -> str | None:
    """What a process of the run is, for its CPU seconds: vLLM's parts as the real-engine study names them, else
    holdback (`holdback up` and what it starts) or the simulator."""
    part = cpu_role(proc)
    if part is None or part == "gateway":
        return "holdback"
    return part


def cpu_seconds(sampler: CpuSampler) -> dict[str, float]:
    shares = sampler.shares
    return {part: round(cores * shares.seconds, 2) for part, cores in shares.by_role.items()} if shares else {}


def eviction_record(up: HoldbackUp, batch_id: str) -> tuple[list[dict], list[float]]:
    """The batch's rows, and each evicted attempt's end → its row's next attempt, from the operator API."""
    rows, after = [], None
    with httpx.Client(base_url=up.api, headers=up.admin, timeout=60) as api:
        while True:
            page = api.get(f"/admin/batches/{batch_id}/requests",
                           params={"limit": 1000, **({"after": after} if after else {})}).raise_for_status().json()
            rows += page["data"]
            if not page["has_more"]:
                break
            after = page["data"][-1]["id"]
        waits = []
        for row in rows:
            if not row["evictions"]:
                continue
            attempts = api.get(f"/admin/requests/{row['id']}/attempts").raise_for_status().json()["data"]
            waits += [later["started_at"] - earlier["ended_at"] for earlier, later in zip(attempts, attempts[1:])
                      if earlier["evicted"] and earlier["ended_at"] is not None]
    return rows, waits


COUNTERS = {"steps": "vllm:iteration_tokens_total_count", "prompt": "vllm:prompt_tokens_total",
            "generated": "vllm:generation_tokens_total", "cached": "vllm:prefix_cache_hits"}


def engine_counters(engine: str) -> dict[str, float]:
    """The engine's counters (summed over several, comma-separated)."""
    out = dict.fromkeys(COUNTERS, 0.0)
    for url in engine.split(","):
        for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
            for key, name in COUNTERS.items():
                if line.startswith(name):
                    out[key] += float(line.rsplit(" ", 1)[1])
    return out


def counters_since(engine: str, before: dict[str, float]) -> dict[str, float]:
    now = engine_counters(engine)
    return {k: now[k] - before[k] for k in now}


def common_arguments(p: argparse.ArgumentParser, timeout: float) -> None:
    """The flags every bench of a batch beside realtime on one engine takes (this one, bench/starvation.py)."""
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--timeout", type=float, default=timeout, help="seconds one batch may take (default %(default)s)")
    p.add_argument("--sim-arg", action="append", default=[], help="extra `holdback sim` flag (repeatable)")
    p.add_argument("--unpinned", action="store_true", help="vLLM: no CPU pinning")
    p.add_argument("--out", type=Path, help="write raw.json and summary.md here")


def write_out(args: argparse.Namespace, text: str, record: dict) -> None:
    """With `--out`: the record (and the run's flags) as raw.json, the report as summary.md."""
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        flags = {k: v for k, v in vars(args).items() if k != "out"}
        (args.out / "raw.json").write_text(json.dumps({"args": flags, **record}, indent=1, default=str))
        (args.out / "summary.md").write_text(text + "\n")


def summarise(runs: list[MakespanRun]) -> dict:
    groups = sorted({r.group for r in runs})
    by = {(r.arm, r.group): r for r in runs}
    makespan, latency = [], []
    for g in groups:
        ours, theirs = by.get(("holdback", g)), by.get(("vllm-priority", g))
        if ours is None or theirs is None:
            continue
        makespan.append(ours.makespan / theirs.makespan)
        p95, base = percentile(ours.ttft, 0.95), percentile(theirs.ttft, 0.95)
        latency.append(p95 / base if base else float("inf"))
    ours = [r for r in runs if r.arm == "holdback"]
    m, lat = bootstrap_median(makespan), bootstrap_median(latency)
    return {
        "groups": len(makespan),
        "makespan_ratio": {**m.as_dict(), "per_group": makespan, "goal": MAKESPAN_GOAL,
                           "verdict": verdict(m, MAKESPAN_GOAL, at_least=False)},
        "realtime_p95_ratio": {**lat.as_dict(), "per_group": latency, "goal": REALTIME_GOAL,
                               "verdict": verdict(lat, REALTIME_GOAL, at_least=False)},
        "most_evictions_of_a_row": max((max(r.evictions, default=0) for r in ours), default=0),
        "evictions_per_group": [sum(r.evictions) for r in ours],
        "longest_eviction_wait_s": max((max(r.eviction_waits, default=0.0) for r in ours), default=0.0),
        "median_eviction_wait_s": percentile([w for r in ours for w in r.eviction_waits], 0.5),
        "engine_cpu_seconds_ratio": {part: bootstrap_median(per_group).as_dict() for part, per_group in
                                     cpu_ratios(runs, groups).items()},
        "lines_failed": sum(r.lines_failed for r in runs),
        "realtime_failed": sum(r.realtime_failed for r in runs),
    }


def cpu_ratios(runs: list[MakespanRun], groups: list[int]) -> dict[str, list[float]]:
    """Per group, the CPU seconds each of the engine's parts spent in holdback's arm ÷ in vLLM priority's (where
    the engine spent the makespan's difference; the real engine only)."""
    by = {(r.arm, r.group): r for r in runs}
    out: dict[str, list[float]] = {}
    for part in ("vLLM API server", "vLLM engine"):
        for g in groups:
            ours, theirs = by.get(("holdback", g)), by.get(("vllm-priority", g))
            if ours and theirs and theirs.cpu.get(part):
                out.setdefault(part, []).append(ours.cpu.get(part, 0.0) / theirs.cpu[part])
    return out


def fig(e: dict) -> str:
    """A median and its interval, as the reports print them."""
    if e.get("value") is None:
        return "—"
    interval = f" [{e['lo']:.3f}, {e['hi']:.3f}]" if e.get("lo") is not None else ""
    return f"{e['value']:.3f}{interval}"


def markdown(summary: dict, args: argparse.Namespace) -> str:
    m, lat = summary["makespan_ratio"], summary["realtime_p95_ratio"]
    return "\n".join([
        f"Makespan ({args.engine}{', slots told' if args.slots_known else ''}"
        f"{', vLLM fed the workers streaming' if args.workers_streaming else ''}"
        f"{', vLLM asked for whole answers' if args.vllm_whole else ''}"
        f", workers --stream-interval {args.stream_interval}"
        f"{'' if args.warm_up else ', no warm-up'}, {args.lines} lines of {args.tokens[0]}–{args.tokens[1]} tokens, realtime "
        f"{args.rate}/s, {summary['groups']} groups)",
        f"- makespan, holdback ÷ vLLM priority: {fig(m)} (per group {', '.join(f'{x:.3f}' for x in m['per_group'])}); "
        f"goal ≤ {MAKESPAN_GOAL}: {m['verdict']}",
        f"- realtime p95 TTFT, holdback ÷ vLLM priority: {fig(lat)} (per group "
        f"{', '.join(f'{x:.3f}' for x in lat['per_group'])}); goal ≤ {REALTIME_GOAL}: {lat['verdict']}",
        f"- evictions per group {summary['evictions_per_group']}; most of one row {summary['most_evictions_of_a_row']}"
        f"; eviction → next attempt: median {summary['median_eviction_wait_s'] or 0:.3f} s, longest "
        f"{summary['longest_eviction_wait_s']:.3f} s",
        f"- lines not completed {summary['lines_failed']}; realtime without a first token {summary['realtime_failed']}",
        *(f"- {part}'s CPU seconds, holdback ÷ vLLM priority: {fig(e)}"
          for part, e in summary["engine_cpu_seconds_ratio"].items()),
    ])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=("sim", "vllm"), default="sim", help="the engine (default %(default)s)")
    p.add_argument("--groups", type=int, default=3, help="groups of both arms (default %(default)s)")
    p.add_argument("--lines", type=int, default=300, help="the batch's lines (default %(default)s)")
    p.add_argument("--tokens", type=lambda s: tuple(int(x) for x in s.split(",")), default=(200, 400),
                   help="each line's output tokens, min,max (default 200,400: the real-engine study's)")
    p.add_argument("--rate", type=float, default=3.0, help="realtime arrivals per second (default %(default)s)")
    p.add_argument("--slots", type=int, default=8, help="the engine's --max-num-seqs (default %(default)s)")
    p.add_argument("--slots-known", action="store_true",
                   help="give the gateway the engine's slots (`engine.maxNumSeqs`) rather than let it learn them")
    p.add_argument("--workers-streaming", action="store_true",
                   help="feed vLLM priority the lines with the workers' stream options (a usage object on every "
                        "event), so the ratio leaves out what those cost the engine's API server")
    p.add_argument("--vllm-whole", action="store_true",
                   help="feed vLLM priority each line unstreamed (its answer whole, as vLLM's own batch runner "
                        "asks): the least its API server can do for the batch")
    p.add_argument("--stream-interval", type=int, default=WORKERS_STREAM_INTERVAL,
                   help="the workers' --stream-interval (tokens per event of a batch stream; 1: every token; "
                        "default %(default)s, the workers' own)")
    p.add_argument("--no-warm-up", dest="warm_up", action="store_false",
                   help="measure a stack's very first batch (by default a first batch without realtime runs before "
                        "the measured one, as in a stack already serving: the gateway learns the engine's slots)")
    common_arguments(p, timeout=1800.0)
    args = p.parse_args(argv)
    if args.rate <= 0 or args.lines < 1 or args.groups < 1 or args.stream_interval < 1:
        p.error("--rate, --lines, --groups and --stream-interval must be positive")
    if args.vllm_whole and args.workers_streaming:
        p.error("--vllm-whole and --workers-streaming say two ways to feed vLLM priority: give one")
    env = {"HOLDBACK_WORKER_STREAM_INTERVAL": str(args.stream_interval)}
    runs: list[MakespanRun] = []
    with one_engine(p, args, "hb-makespan-") as engine:
        lines = batch_lines(args.seed, args.lines, args.tokens, engine.model)
        for group in range(args.groups):
            for arm in (ARMS if group % 2 == 0 else ARMS[::-1]):
                wait_idle(engine.url)
                if arm == "vllm-priority":
                    run = asyncio.run(vllm_arm(engine.url, lines, args, group, salt=f"makespan-vllm-{group}"))
                else:
                    # With --slots-known, the engine's slots told, as an operator who knows them does.
                    told = {"engine": {"maxNumSeqs": args.slots}} if args.slots_known else None
                    with HoldbackUp(engine.url, engine.tmp, group, engine.pin, told,
                                    args.out / "logs" / f"group-{group}" if args.out else None, env) as up:
                        run = asyncio.run(holdback_arm(up, engine.url, lines, args, group))
                runs.append(run)
                print(f"group {group} {arm}: makespan {run.makespan:.1f} s (lead-in {run.lead_in:.1f}, lead-out "
                      f"{run.lead_out:.1f}), realtime p95 "
                      f"{percentile(run.ttft, 0.95) or 0:.3f} s ({len(run.ttft)}), evictions {sum(run.evictions)}, "
                      f"lines failed {run.lines_failed}; engine {run.engine}; slots known {run.slots_known}", flush=True)
    summary = summarise(runs)
    text = markdown(summary, args)
    print(text)
    write_out(args, text, {"runs": [asdict(r) for r in runs], "summary": summary})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
