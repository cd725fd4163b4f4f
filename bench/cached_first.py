"""Cached-first dispatch (gateway/flow/cached_first.py) on the simulator: batch-priority requests sent straight to
the gateway (no Batch API, so no processor plan), documents × questions shuffled, with the gateway's lookahead on
(`--lookahead`, the shipped 64) against off (0).

Each arm starts its own simulator (`--enable-prefix-caching`, sized as bench/real_engine/prefix.py sizes the real
engine: 104 blocks of 128 tokens, 8 slots, 192 tokens a step) and a gateway with the shipped config
(gateway/default.yaml; the batch's one tenant may use the whole KV pool), so neither arm finds what the other
cached. `--concurrency` clients send the file's lines in file order, as a worker's requests arrive. Per round both
arms, in alternating order. Figures per arm: the simulator's prefix-cache hit rate (`vllm:prefix_cache_hits` ÷
`_queries` moved), the prompt tokens it computed (queried less hit), the makespan, and how many requests the gateway
sent ahead (`/admin/state` totals `cached_first`). Reported: medians over rounds of on ÷ off, with bootstrap
intervals.

    python -m bench.cached_first --rounds 5 --out docs/study/cached-first
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from bench.lib.holdback_up import BUILT_IN_CONFIG
from bench.lib.processes import Children, start_gateway, start_sims
from bench.prefix import SYSTEM, questions_about, ratios
from bench.real_engine.prefix import cache_counters
from bench.stats import bootstrap_median
from holdback.contract import OBJECTIVE_HEADER

ARMS = ("on", "off")
MODEL = "sim-model"


def sim_flags(args: argparse.Namespace) -> list[str]:
    return ["--enable-prefix-caching", "--scheduling-policy", "priority", "--max-num-seqs", str(args.slots),
            "--num-blocks", str(args.kv_blocks), "--block-size", "128", "--max-model-len", "2048",
            "--max-num-batched-tokens", str(args.step_tokens), *args.sim_arg]


def gateway_config(lookahead: int) -> str:
    """The shipped config with the lookahead, and the batch's one tenant allowed the whole KV pool."""
    config = yaml.safe_load(BUILT_IN_CONFIG.read_text())
    config["flowControl"]["cachedFirstLookahead"] = lookahead
    config["admission"].update(tenantMaxShare=1.0, tenantSoftShare=1.0)
    return yaml.safe_dump(config)


async def send(gateway: str, prompts: list[str], args: argparse.Namespace) -> None:
    """Every prompt as a batch-priority completion, `--concurrency` at a time, in order."""
    waiting = iter(prompts)
    async with httpx.AsyncClient(base_url=gateway, timeout=args.timeout) as client:
        async def client_loop() -> None:
            for prompt in waiting:
                r = await client.post("/v1/completions", headers={OBJECTIVE_HEADER: "batch"}, json={
                    "model": MODEL, "prompt": prompt, "max_tokens": args.max_tokens, "ignore_eos": True})
                if r.status_code != 200:
                    raise SystemExit(f"a batch request failed: {r.status_code} {r.text[:300]}")

        await asyncio.gather(*(client_loop() for _ in range(args.concurrency)))


def run_arm(arm: str, prompts: list[str], args: argparse.Namespace, tmp: Path) -> dict:
    children = Children()
    try:
        (sim,) = start_sims(children, tmp, f"sim-{arm}", 1, *sim_flags(args))
        gateway = start_gateway(children, tmp, f"gateway-{arm}", [sim],
                                gateway_config(args.lookahead if arm == "on" else 0))
        httpx.get(gateway + "/v1/models", timeout=30).raise_for_status()
        hits, queries = cache_counters(sim)
        start = time.monotonic()
        asyncio.run(send(gateway, prompts, args))
        makespan = time.monotonic() - start
        hits_now, queries_now = cache_counters(sim)
        admin = {"Authorization": f"Bearer {os.environ['HOLDBACK_ADMIN_KEY']}"} if os.environ.get(
            "HOLDBACK_ADMIN_KEY") else {}  # the shipped config's admin key, when this environment sets one
        totals = httpx.get(gateway + "/admin/state", headers=admin, timeout=30).raise_for_status().json()["totals"]
    finally:
        children.close()
    hit, queried = hits_now - hits, queries_now - queries
    return {"arm": arm, "makespan": makespan, "hit_rate": hit / queried if queried else 0.0,
            "computed_prompt_tokens": queried - hit, "sent_ahead": totals["cached_first"]}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.cached_first", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="rounds of both arms (default %(default)s)")
    p.add_argument("--lookahead", type=int, default=64, help="the on arm's cachedFirstLookahead (default %(default)s)")
    p.add_argument("--documents", type=int, default=60, help="distinct documents (default %(default)s)")
    p.add_argument("--questions", type=int, default=10, help="questions per document (default %(default)s)")
    p.add_argument("--doc-words", type=int, default=200, help="words per document (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=16, help="each answer's tokens (default %(default)s)")
    p.add_argument("--concurrency", type=int, default=64, help="requests in flight, as a worker's (default %(default)s)")
    p.add_argument("--slots", type=int, default=8, help="the simulator's --max-num-seqs (default %(default)s)")
    p.add_argument("--kv-blocks", type=int, default=104, help="KV blocks of 128 tokens (default %(default)s)")
    p.add_argument("--step-tokens", type=int, default=192, help="tokens per engine step (default %(default)s)")
    p.add_argument("--sim-arg", action="append", default=[], help="extra `holdback sim` flag (repeatable)")
    p.add_argument("--seed", type=int, default=50, help="seeds the documents and their order (default %(default)s)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take (default %(default)s)")
    p.add_argument("--out", type=Path, help="write results.json here")
    args = p.parse_args(argv)
    for name in ("rounds", "lookahead", "documents", "questions", "doc_words", "max_tokens", "concurrency", "slots",
                 "kv_blocks", "step_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    tmp = Path(tempfile.mkdtemp(prefix="bench-cached-first-"))
    runs = []
    for r in range(args.rounds):
        prompts = [f"{SYSTEM}\n\n{text}" for _, text in
                   questions_about(args.documents, args.questions, args.doc_words, True, args.seed + r)]
        for arm in (ARMS if r % 2 == 0 else ARMS[::-1]):
            run = {**run_arm(arm, prompts, args, tmp), "round": r}
            runs.append(run)
            print(f"round {r} {arm}: hit rate {run['hit_rate']:.3f}, prompt tokens computed "
                  f"{run['computed_prompt_tokens']:.0f}, makespan {run['makespan']:.1f} s, sent ahead "
                  f"{run['sent_ahead']}", flush=True)
    summary = {"rounds": args.rounds, "makespan_on_over_off": ratios(runs, "makespan", "on", "off"),
               "computed_prompt_tokens_on_over_off": ratios(runs, "computed_prompt_tokens", "on", "off"),
               "hit_rate": {arm: bootstrap_median([r["hit_rate"] for r in runs if r["arm"] == arm]).as_dict()
                            for arm in ARMS}}
    for name in ("makespan_on_over_off", "computed_prompt_tokens_on_over_off"):
        e = summary[name]
        interval = f" [{e['lo']:.3f}, {e['hi']:.3f}]" if e["lo"] is not None else ""
        print(f"{name.replace('_', ' ')}: {e['value']:.3f}{interval}")
    print(f"hit rate: on {summary['hit_rate']['on']['value']:.3f}, off {summary['hit_rate']['off']['value']:.3f}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        flags = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        (args.out / "results.json").write_text(json.dumps({"args": flags, "runs": runs, "summary": summary},
                                                          indent=1))
    return summary


if __name__ == "__main__":
    main()
