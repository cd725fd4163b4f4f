"""What the gateway adds in front of one real vLLM replica: time to first token and output tokens per second.

The engine (the real-engine tier's CPU build and tiny model) runs alone on CPU 0, the gateway and this load
generator on CPU 1, as in bench/real_engine/study.py. Every round measures both targets in a seeded shuffled
order and then in reverse (A B B A), so the machine's drift meets both alike:

- time to first token: `--requests` streamed completions of 1 token, one at a time (no queueing anywhere); the
  figure is the gateway's p50 − direct p50 within the round (goal ≤ 2 ms);
- throughput: the replica's slots kept full of streamed 200-token completions for `--seconds`; the figure is
  tokens/s through the gateway ÷ direct within the round (goal ≥ 0.97), and beside it the same tokens per step
  of the engine (its vllm:iteration_tokens_total count): what the relay makes of the steps the engine had,
  which the machine's drift within a round does not reach.

The report gives each figure's median over rounds with a bootstrap interval, and the verdict.

    HOLDBACK_VLLM_PYTHON=... HOLDBACK_VLLM_MODEL=... python -m bench.real_engine.overhead --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from bench.lib.engines import ENGINE_CPU, RELAY_CPU, engine_paths, pin_load, start_vllm
from bench.lib.processes import Children
from bench.real_engine.study import start_gateway
from bench.real_engine.traffic import Arm, counters_in, prompt, stream
from bench.stats import Estimate, bootstrap_median, verdict

def gateway_arm(slots: int) -> Arm:
    """The relay's cost, not a policy's: every request may run (no holdback, no eviction), priorities passed."""
    return Arm("overhead", "the gateway, no holdback, priorities passed",
               f"engine: {{schedulingPolicy: priority, maxNumSeqs: {slots}}}\n"
               "usageLimit: {policy: static, threshold: 1.0}\neviction: {policy: none}\n")


async def first_tokens(url: str, n: int, rng: random.Random) -> list[float]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        out = []
        for _ in range(n):
            got = await stream(session, url, {"model": "tiny", "prompt": prompt(rng, 24), "max_tokens": 1}, {})
            if got.status != 200 or got.first is None:
                raise RuntimeError(f"{url}: a streamed completion answered {got.status} with no first token")
            out.append(got.first)
        return out


async def throughput(url: str, engine: str, streams: int, seconds: float,
                     rng: random.Random) -> tuple[float, float | None]:
    """Output tokens/s with `streams` completions kept in flight, counted over `seconds` after a 2 s warm-up, and
    the same tokens per step of the `engine` behind `url` (None when it reports no step count)."""
    counted = 0
    start = time.monotonic()
    window = (start + 2.0, start + 2.0 + seconds)

    async def loop(session: aiohttp.ClientSession) -> None:
        nonlocal counted
        while time.monotonic() < window[1]:
            async with session.post(url + "/v1/completions", json={
                    "model": "tiny", "prompt": prompt(rng, 40), "max_tokens": 200, "ignore_eos": True,
                    "stream": True}) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"{url}: a streamed completion answered {resp.status}")
                async for line in resp.content:
                    now = time.monotonic()
                    if now >= window[1]:
                        return
                    if line.startswith(b"data: ") and b'"text"' in line and now >= window[0]:
                        counted += 1

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120),
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        counters = asyncio.create_task(counters_in(session, engine, window))
        await asyncio.gather(*(loop(session) for _ in range(streams)))
        taken = ((await counters) or {}).get("steps")
    return counted / seconds, (counted / taken if taken else None)


def shown(est: Estimate) -> str:
    """A figure and its interval (none from one round)."""
    if est.lo is None or est.hi is None:
        return f"{est.value:.3f} ({est.method})"
    return f"{est.value:.3f} [{est.lo:.3f}, {est.hi:.3f}]"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--requests", type=int, default=100, help="sequential first-token requests per target and pass")
    p.add_argument("--seconds", type=float, default=10.0, help="seconds of throughput per target and pass")
    p.add_argument("--slots", type=int, default=8, help="the replica's --max-num-seqs (and the streams kept)")
    p.add_argument("--seed", type=int, default=5)
    p.add_argument("--out", type=Path, help="write the figures here as JSON")
    args = p.parse_args(argv)
    python, model = engine_paths(p)
    favoured = pin_load(p)
    children = Children()
    tmp = Path(tempfile.mkdtemp(prefix="hb-real-overhead-"))
    rng, order_rng = random.Random(args.seed), random.Random(args.seed + 1)
    added, ratio, per_step, rows = [], [], [], []
    try:
        engine = start_vllm(children, tmp, python, model, args.slots)
        gateway = start_gateway(children, tmp, gateway_arm(args.slots), [engine], args.slots)
        asyncio.run(first_tokens(engine, 5, rng))  # warm both paths: the first requests compile and connect
        asyncio.run(first_tokens(gateway, 5, rng))
        for rnd in range(args.rounds):
            targets = [("direct", engine), ("gateway", gateway)]
            order_rng.shuffle(targets)
            ttft: dict[str, list[float]] = {"direct": [], "gateway": []}
            rate: dict[str, list[float]] = {"direct": [], "gateway": []}
            stepped: dict[str, list[float]] = {"direct": [], "gateway": []}
            for name, url in targets + targets[::-1]:
                ttft[name] += asyncio.run(first_tokens(url, args.requests // 2, rng))
                tokens_per_s, tokens_per_step = asyncio.run(throughput(url, engine, args.slots, args.seconds / 2, rng))
                rate[name].append(tokens_per_s)
                if tokens_per_step is not None:
                    stepped[name].append(tokens_per_step)
            p50 = {k: statistics.median(v) * 1000 for k, v in ttft.items()}
            tps = {k: statistics.mean(v) for k, v in rate.items()}
            tpstep = {k: statistics.mean(v) for k, v in stepped.items() if v}
            added.append(p50["gateway"] - p50["direct"])
            ratio.append(tps["gateway"] / tps["direct"])
            if len(tpstep) == 2:
                per_step.append(tpstep["gateway"] / tpstep["direct"])
            rows.append({"round": rnd, "ttft_p50_ms": p50, "tokens_per_s": tps, "tokens_per_step": tpstep})
            print(f"round {rnd}: TTFT p50 direct {p50['direct']:.1f} ms, gateway {p50['gateway']:.1f} ms; "
                  f"tokens/s direct {tps['direct']:.0f}, gateway {tps['gateway']:.0f}", file=sys.stderr, flush=True)
    finally:
        children.close()
    ttft_added, tokens, steps = bootstrap_median(added), bootstrap_median(ratio), bootstrap_median(per_step)
    result = {"args": {k: v for k, v in vars(args).items() if k != "out"}, "favoured": favoured, "rounds": rows,
              "ttft_p50_added_ms": ttft_added.as_dict(), "verdict_ttft": verdict(ttft_added, 2.0, at_least=False),
              "tokens_ratio": tokens.as_dict(), "verdict_tokens": verdict(tokens, 0.97, at_least=True),
              "tokens_per_step_ratio": steps.as_dict(), "verdict_per_step": verdict(steps, 0.97, at_least=True)}
    print(f"engine on CPU {ENGINE_CPU}, gateway and load on CPU {RELAY_CPU}, {args.rounds} rounds (A B B A)")
    print(f"TTFT p50 added by the gateway: {shown(ttft_added)} ms (goal ≤ 2 ms: {result['verdict_ttft']})")
    print(f"output tokens/s through the gateway ÷ direct: {shown(tokens)} (goal ≥ 0.97: {result['verdict_tokens']})")
    if per_step:
        print(f"the same per engine step (the machine's drift removed): {shown(steps)} (goal ≥ 0.97: "
              f"{result['verdict_per_step']})")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
