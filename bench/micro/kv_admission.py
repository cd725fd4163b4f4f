"""KV admission off against on, the same load in one run, on simulated replicas whose KV cache runs out.

Load phase (once per mode, fresh replicas and gateway each time, identical gateway configs except
`admission.enabled`, every other admission key at its default): `--replicas` simulated replicas with
`--num-blocks` KV blocks each; batch tenants run closed loops of long requests (long prompts and outputs, more
than the pool holds at the gateway's request limit), a realtime caller streams short requests, and (admission
on) `--cancel-loops` cancellation loops open streams and close them after the first chunk. Reported per mode: completed,
failed (a non-2xx answer that is not a gateway drop), rejected (429 with a drop reason; the caller retries), the
simulator's preemptions, realtime TTFT p95 with a bootstrap 95 % interval, the largest tenant reserved share in
100 ms samples of /admin/state, and release after cancellation, timed from the client's socket shutdown: to
the release time the gateway records (`kv.recent_releases`, wall clock on the same host; read 100 ms later),
and, on every fourth cancel instead, to the first /admin/state poll (every `--release-poll-ms`) that shows the
reservation gone (an upper bound: it adds the poll's interval and round trip), plus the gateway's histogram.

Overhead phase: one zero-latency replica, a pair of gateways (admission off, admission on) per variant, side
by side; rounds of sequential requests, the variants taking turns request by request, each turn in the order
off, on, on, off; the added p50 is on − off within a round, and the figure is the median over rounds (the
range over 7 rounds is a 98 % interval for that median). Variants: distinct prompts with the default config
(`tokenizer: auto`: the simulator's tokenizer in the gateway once it has agreed with the replica's
/tokenize), distinct prompts with `tokenizer: replica` (one /tokenize round trip each), one repeated prompt
with `tokenizer: replica` (the token-count cache), and a control: a second admission-off gateway in the place
of "on", which shows what the end-to-end difference of two identical gateway processes reads on this host.
Also per variant: the median over every turn of mean(on) − mean(off), with a bootstrap 95 % interval.

Path phase (in one process, so client and network noise stay out): the gateway's own admission work per
request — parse the body, count the prompt, `FlowController.submit` + `finish` — against `submit` + `finish`
with admission off, per round in the order off, on, on, off; the added p50 per round and its median; for the
default `auto`, `replica` and a `local` tokenizer.json.

    python -m bench.micro.kv_admission --num-blocks 600 --replicas 2 --duration 40 --rounds 7 --requests 60
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from bench.lib.processes import Children, start_sims
from bench.micro.kv_load import WORDS, load_phase, over_rounds, overhead_phase, prompt
from bench.stats import decide


def _word_level_tokenizer(tmp: Path) -> str | None:
    """A synthetic word-level tokenizer.json over the bench's words (None without the tokenizers package)."""
    try:
        from tokenizers import Tokenizer
        from tokenizers.models import WordLevel
        from tokenizers.pre_tokenizers import Whitespace
    except ImportError:
        return None
    vocab = {"[UNK]": 0, **{f"{w}{d}": i * 10 + d + 1 for i, w in enumerate(WORDS) for d in range(10)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    path = tmp / "tokenizer.json"
    tok.save(str(path))
    return str(path)


def path_phase(args: argparse.Namespace, children: Children, tmp: Path) -> dict:
    """The admission path's own cost, in process: off vs on (the default `auto`, replica /tokenize, a
    tokenizer.json)."""
    from gateway.settings import parse_config
    from gateway.flow.controller import FlowController
    from gateway.flow.request import Ask, FlowRequest
    from gateway.metrics import GatewayMetrics
    from gateway.replicas import ReplicaPool
    from gateway.tokenization import PromptCounter

    [sim] = start_sims(children, tmp, "sim-path", 1, "--zero-latency")
    rng = random.Random(args.seed)

    def controller(admission: bool, tokenizer: str) -> tuple[FlowController, PromptCounter]:
        pool = ReplicaPool([sim])
        replica = pool.replicas[0]
        replica.healthy = True
        replica.num_gpu_blocks = args.num_blocks
        replica.model, replica.runtime_version = "sim-model", "model_sim"  # as the pool identifies `holdback sim`
        loaded = parse_config(f"replicas: [{sim}]\nsaturation: {{maxConcurrency: 1024}}\n"
                              f"admission: {{enabled: {str(admission).lower()}, tokenizer: {tokenizer}}}\n", "bench")
        return FlowController(loaded, pool, GatewayMetrics()), PromptCounter(loaded.config.admission)

    variants = {"off": controller(False, "replica"), "auto": controller(True, "auto"),
                "replica": controller(True, "replica")}
    hf = _word_level_tokenizer(tmp)
    if hf is not None:
        variants["hf"] = controller(True, f"local, tokenizerFile: {hf}")

    async def one(session, name: str, body: bytes, i: int) -> float:
        fc, counter = variants[name]
        t0 = time.perf_counter()
        ask = Ask(request_id=str(i), objective="standard", priority=0, fairness_id="t", tenant="t",
                  arrived=time.monotonic())
        if fc.admission is not None:
            count = await counter.count(json.loads(body), "/v1/completions", session, fc.pool.replicas[0])
            ask = dataclasses.replace(ask, prompt_tokens=count.prompt_tokens, max_new_tokens=count.max_new_tokens)
        req = FlowRequest(ask)
        fc.submit(req)
        fc.finish(req)
        return (time.perf_counter() - t0) * 1000

    async def run() -> dict:
        kinds = [("default_tokenizer", "auto"), ("replica_tokenizer", "replica")]
        if "hf" in variants:
            kinds.append(("hf_tokenizer_json", "hf"))
        added: dict[str, list[float]] = {kind: [] for kind, _ in kinds}
        async with aiohttp.ClientSession() as session:
            auto = variants["auto"][1]  # its first count starts the check against the replica; wait for it
            await auto.count({"prompt": "warm up"}, "/v1/completions", session, variants["auto"][0].pool.replicas[0])
            deadline = time.monotonic() + 60
            while not auto.state()["replicas"] and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if not any(r["in_process"] for r in auto.state()["replicas"].values()):
                raise RuntimeError(f"tokenizer: auto found no in-process tokenizer: {auto.state()}")
            i = 0
            for _ in range(args.rounds):
                for kind, target in kinds:
                    samples: dict[str, list[float]] = {"off": [], "on": []}
                    for name in ("off", "on", "on", "off"):
                        for _ in range(args.requests * 5):
                            i += 1
                            body = json.dumps({"model": "sim-model", "prompt": prompt(rng, 200),
                                               "max_tokens": 16}).encode()
                            samples[name].append(await one(session, target if name == "on" else "off", body, i))
                    added[kind].append(statistics.median(samples["on"]) - statistics.median(samples["off"]))
        return {kind: {"median_ms": round(statistics.median(v), 4), "min_ms": round(min(v), 4),
                       "max_ms": round(max(v), 4), "per_round": [round(x, 4) for x in v],
                       "goal_1ms": decide(over_rounds(v), 1.0, at_least=False)} for kind, v in added.items()}

    try:
        return asyncio.run(run())
    finally:
        children.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-blocks", type=int, default=600, help="KV blocks per simulated replica (default 600)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--max-concurrency", type=int, default=32, help="gateway saturation.maxConcurrency")
    p.add_argument("--duration", type=float, default=40.0, help="seconds of load per mode")
    p.add_argument("--batch-tenants", type=int, default=6)
    p.add_argument("--loops-per-tenant", type=int, default=4)
    p.add_argument("--realtime-rate", type=float, default=4.0, help="realtime requests per second")
    p.add_argument("--rounds", type=int, default=5, help="overhead rounds")
    p.add_argument("--requests", type=int, default=40, help="sequential requests per overhead run")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--cancel-loops", type=int, default=6,
                   help="concurrent cancellation loops with admission on (more release samples; default 6)")
    p.add_argument("--release-poll-ms", type=float, default=10.0,
                   help="interval of the /admin/state poll that watches a cancelled reservation go (default 10)")
    p.add_argument("--phases", default="load,overhead,path",
                   help="comma-separated phases to run: load, overhead (end to end), path (in process)")
    p.add_argument("--out", help="write the JSON result here too")
    args = p.parse_args(argv)
    children = Children()
    result: dict = {"args": vars(args)}
    with tempfile.TemporaryDirectory(prefix="hb-kvbench-") as tmpdir:
        tmp = Path(tmpdir)
        try:
            phases = set(args.phases.split(","))
            if "load" in phases:
                result["load"] = load_phase(args, children, tmp)
            if "overhead" in phases:
                result["overhead_added_p50"] = overhead_phase(args, children, tmp)
            if "path" in phases:
                result["admission_path_added_p50"] = path_phase(args, children, tmp)
        finally:
            children.close()
    text = json.dumps(result, indent=2, default=str)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
