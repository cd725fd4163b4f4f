"""What one eviction costs a real vLLM replica's batch work, taken apart: the resume itself, and the prefill of
the tokens its prefix cache does not hold.

One vLLM server (the real-engine tier's CPU build, `--max-num-seqs 8`) pinned to CPU 0; this process (the load)
on CPU 1. Batch loops, one per slot, keep streamed completions of 200–400 tokens (`ignore_eos`) in flight
straight to the engine (no gateway: only the engine's cost is measured). Four arms, the same seeded traffic:

- `steady`: no request is cut;
- `split`: each request asks for the output up to `cut-1`'s position (`max_tokens`) and ends there, and is
  continued from its token ids as `cut-1` resumes it: the same requests and prefill without an abort;
- `cut-1`: each request is cut once (its connection closed, as the gateway's eviction closes it; vLLM aborts
  it) at the first position past a random point where its prompt and received output fill whole KV blocks
  plus one token, and resumed at once from the prompt's and output's token ids for the tokens it still owes:
  the prefix cache holds everything but the one token vLLM always computes again;
- `cut-block`: the same, cut where prompt and output fill whole blocks exactly: the resume computes the last
  block's `--block-size` tokens again.

`steady` against `split` is what one more request costs (vLLM's API server handling it on the engine's core,
the round trip); `split` against `cut-1` is what the abort costs beyond it; `cut-1` against `cut-block` is what
a block of re-prefill costs. The figures are batch output tokens received in the window, the same per engine
step (vLLM's step count: the machine's drift does not reach it), the tokens the engine generated meanwhile,
and the batch work one cut loses as the milliseconds of one slot's steady output it equals. Each round runs
the arms back to back in a shuffled order and the ratios are taken within the round; medians with 95%
bootstrap intervals. Prompts are token ids (40 drawn at random from the tiny model's 817), so every arm sends
the same tokens and a prompt's length is known without asking the engine.

    HOLDBACK_VLLM_PYTHON=... HOLDBACK_VLLM_MODEL=... python -m bench.real_engine.resume_cost --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import aiohttp

from bench.lib.engines import CPU_BLOCK_TOKENS, SLOTS, engine_paths, pin_load, start_vllm
from bench.lib.processes import Children
from bench.real_engine.traffic import Streamed, counters_in, stream
from bench.stats import bootstrap_median

ARMS = ("steady", "split", "cut-1", "cut-block")


@dataclass
class Run:
    arm: str
    round: int
    tokens: int = 0  # batch output tokens received within the window
    completed: int = 0
    cuts: int = 0
    generated: float = 0.0  # output tokens the engine generated meanwhile (its vllm:generation_tokens_total)
    steps: float = 0.0  # the engine's steps meanwhile (its vllm:iteration_tokens_total count)
    recomputed: list[int] = field(default_factory=list)  # per cut: prompt tokens the prefix cache cannot hold


def cut_here(arm: str, total: int, block: int) -> bool:
    """Whether a request whose prompt and received output are `total` tokens is cut now, in `arm`."""
    if arm in ("cut-1", "split"):
        return total % block == 1
    if arm == "cut-block":
        return total % block == 0
    return False


def recompute(total: int, block: int) -> int:
    """Tokens a resumed prompt of `total` tokens prefills again: all past its last whole cached block, and at
    least the last token (vLLM computes it again even on a full hit)."""
    return total - block * ((total - 1) // block)


async def one_stream(session: aiohttp.ClientSession, url: str, body: dict, cut: int | None,
                     counted: Callable[[int], None]) -> Streamed:
    """A streamed completion read to its end, or closed once prompt and output reach `cut` tokens; `counted`
    gets each event's new tokens as they arrive."""
    def reached(out: Streamed) -> bool:
        return cut is not None and out.prompt_ids is not None and len(out.prompt_ids) + out.tokens >= cut

    return await stream(session, url, body, {}, counted, reached)


async def batch_loop(session, url: str, arm: str, seed: int, window: tuple[float, float], run: Run,
                     block: int) -> None:
    """Requests one after another until the window ends; in a cut arm each is cut once and resumed. Tokens
    count when they arrive within the window."""
    def counted(n: int) -> None:
        if window[0] <= time.monotonic() <= window[1]:
            run.tokens += n

    rng = random.Random(seed)
    while time.monotonic() < window[1]:
        ids, owed = [rng.randint(2, 800) for _ in range(40)], rng.randint(200, 400)
        earliest = rng.randint(10, 60)  # output tokens before a cut may come (the same draws in every arm)
        # The first position past `earliest` where the arm cuts, leaving at least 10 tokens to resume.
        cut = next((t for t in range(len(ids) + earliest, len(ids) + owed - 10) if cut_here(arm, t, block)), None)
        body = {"model": "tiny", "max_tokens": owed, "ignore_eos": True}
        if arm == "split" and cut is not None:
            got = await one_stream(session, url, {**body, "prompt": ids, "max_tokens": cut - len(ids)}, None,
                                   counted)
            got.finished = False  # it ended where cut-1 cuts: what follows continues it
        else:
            got = await one_stream(session, url, {**body, "prompt": ids}, cut, counted)
        if cut is not None and not got.finished and got.prompt_ids is not None:
            kept = got.prompt_ids + (got.output_ids or [])
            if window[0] <= time.monotonic() <= window[1]:
                run.cuts += 1
                run.recomputed.append(recompute(len(kept), block))
            got = await one_stream(session, url, {**body, "prompt": kept,
                                                  "max_tokens": owed - len(got.output_ids or [])}, None, counted)
        if got.finished and window[0] <= time.monotonic() <= window[1]:
            run.completed += 1


async def run_arm(url: str, arm: str, rnd: int, args: argparse.Namespace) -> Run:
    run = Run(arm, rnd)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120),
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        t0 = time.monotonic() + args.lead
        window = (t0, t0 + args.window)
        loops = [asyncio.create_task(batch_loop(session, url, arm, args.seed * 100 + i, window, run, args.block))
                 for i in range(args.slots)]
        moved = await counters_in(session, url, window) or {}
        run.generated, run.steps = moved.get("generated", 0.0), moved.get("steps", 0.0)
        for task in loops:
            task.cancel()
        await asyncio.gather(*loops, return_exceptions=True)
    return run


def summarise(runs: list[Run], args: argparse.Namespace) -> dict:
    by_round: dict[int, dict[str, Run]] = {}
    for r in runs:
        by_round.setdefault(r.round, {})[r.arm] = r
    out: dict = {}
    for arm in ARMS:
        ratios, costs, per_step = [], [], []
        for group in by_round.values():
            mine, base = group[arm], group["steady"]
            ratios.append(mine.tokens / base.tokens)
            if mine.steps and base.steps:
                per_step.append((mine.tokens / mine.steps) / (base.tokens / base.steps))
            if mine.cuts:
                # Slot-seconds of batch work lost per cut, in engine steps' worth: the steady rate is
                # tokens ÷ window across all slots, so lost tokens ÷ (tokens per slot-second) ÷ cuts.
                lost = base.tokens - mine.tokens
                costs.append(lost / (base.tokens / args.window / args.slots) / mine.cuts * 1000)
        out[arm] = {"tokens": [by_round[k][arm].tokens for k in sorted(by_round)],
                    "cuts": [by_round[k][arm].cuts for k in sorted(by_round)],
                    "generated": [round(by_round[k][arm].generated) for k in sorted(by_round)],
                    "mean_recomputed": [round(sum(g[arm].recomputed) / len(g[arm].recomputed), 1)
                                        if g[arm].recomputed else 0 for g in by_round.values()],
                    "tokens_ratio": asdict(bootstrap_median(ratios)),
                    "tokens_per_step": [round(by_round[k][arm].tokens / by_round[k][arm].steps, 3)
                                        if by_round[k][arm].steps else None for k in sorted(by_round)],
                    "per_step_ratio": asdict(bootstrap_median(per_step)) if per_step else None,
                    "slot_ms_per_cut": asdict(bootstrap_median(costs)) if costs else None}
    return out


def markdown(summary: dict, args: argparse.Namespace) -> str:
    lines = [f"One vLLM replica (`--max-num-seqs {args.slots}`, KV blocks of {args.block} tokens) on CPU 0, the load "
             f"on CPU 1; {args.slots} batch loops straight to the engine, {args.window:.0f} s windows, {args.rounds} "
             "rounds, ratios within a round, medians with 95% bootstrap intervals.", "",
             "| arm | batch tokens received per round | generated by the engine | cuts per round | tokens recomputed "
             "per cut (mean) | tokens ÷ steady | slot-ms lost per cut | tokens per engine step | tokens per step ÷ "
             "steady's |", "|---|---|---|---|---|---|---|---|---|"]

    def fmt(e: dict | None) -> str:
        if not e or e.get("value") is None:
            return "—"
        if e.get("lo") is None:
            return f"{e['value']:.3f}"
        return f"{e['value']:.3f} [{e['lo']:.3f}, {e['hi']:.3f}]"

    for arm, s in summary.items():
        lines.append(f"| {arm} | {', '.join(map(str, s['tokens']))} | {', '.join(map(str, s['generated']))} | "
                     f"{', '.join(map(str, s['cuts']))} | "
                     f"{', '.join(map(str, s['mean_recomputed']))} | {fmt(s['tokens_ratio'])} | "
                     f"{fmt(s['slot_ms_per_cut'])} | {', '.join(map(str, s['tokens_per_step']))} | "
                     f"{fmt(s['per_step_ratio'])} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--window", type=float, default=20.0, help="seconds measured per arm")
    p.add_argument("--lead", type=float, default=4.0, help="seconds the loops run before the window")
    p.add_argument("--block-size", dest="block", type=int, default=CPU_BLOCK_TOKENS,
                   help="the engine's --block-size (default: the CPU backend's %(default)s)")
    p.add_argument("--slots", type=int, default=SLOTS, help="the engine's --max-num-seqs and the batch loops")
    p.add_argument("--seed", type=int, default=3)
    p.add_argument("--out", type=Path, help="write summary.json and report.md here")
    args = p.parse_args(argv)
    python, model = engine_paths(p)
    pin_load(p)
    children, tmp = Children(), Path(tempfile.mkdtemp(prefix="hb-resume-cost-"))
    runs: list[Run] = []
    rng = random.Random(args.seed)
    try:
        url = start_vllm(children, tmp, python, model, args.slots,
                         block_size=None if args.block == CPU_BLOCK_TOKENS else args.block)
        for rnd in range(args.rounds):
            order = list(ARMS)
            rng.shuffle(order)
            for arm in order:
                run = asyncio.run(run_arm(url, arm, rnd, args))
                runs.append(run)
                print(f"round {rnd} {arm}: {run.tokens} tokens, {run.completed} completed, {run.cuts} cuts",
                      file=sys.stderr, flush=True)
    finally:
        children.close()
    summary = summarise(runs, args)
    report = markdown(summary, args)
    print(report)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "summary.json").write_text(json.dumps({"args": {k: v for k, v in vars(args).items()
                                                                     if k != "out"}, "arms": summary,
                                                            "runs": [asdict(r) for r in runs]}, indent=1, default=str))
        (args.out / "report.md").write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
