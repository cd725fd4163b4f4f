"""Batches planned for the prefix cache (issue 50) on the simulator: documents × questions through the Batch API,
the processor and the workers, in file order (`--prefix-plan off`, today's) against the processor's prefix plan.

The workload: `--documents` documents of `--doc-tokens` words (the simulator's tokenizer counts about one token a
word), `--questions` questions about each, every line the document then its question, shuffled in the file; each
answer `--max-tokens` tokens. The no-shared-prefix workload: as many lines, each its own document. The replicas
are `holdback sim --enable-prefix-caching` with `--num-blocks` KV blocks, sized so that a few documents stay cached
beside what runs (what runs must not fit the whole file, or order would not matter).

One stack (simulator, gateway, API, processor, workers) per replica count; an arm restarts only the processor (its
`HOLDBACK_PROCESSOR_PREFIX_PLAN`) and runs its batch under a tenant of its own, so each arm has its own cache salt
and finds nothing another arm cached. Per round, both arms in alternating order; figures per arm: batch output
tokens per second (the replicas' `vllm:generation_tokens` moved ÷ `POST /v1/batches` → completed) and the prefix
cache's hit rate (`vllm:prefix_cache_hits` ÷ `_queries` moved, over the replicas). Reported: the medians of the
per-round ratios plan ÷ file order, with bootstrap intervals.

    python -m bench.prefix --rounds 3 --replicas 1 2 --out docs/study/prefix-sim
"""

from __future__ import annotations

import argparse
import io
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.lib.prometheus import metric_sum, parse_prometheus
from bench.lib.stack import Stack, StackSpec
from bench.stats import bootstrap_median

ARMS = ("file-order", "plan")
MODEL = "sim-model"
SYSTEM = "Answer from the document."


def document(rng: random.Random, words: int) -> str:
    return " ".join(f"w{rng.randrange(50_000)}" for _ in range(words))


def questions_about(documents: int, questions: int, doc_tokens: int, shared: bool, seed: int) -> list[tuple[str, str]]:
    """Documents × questions, shuffled, as (custom id, the document then its question); `shared=False`: every
    line a document of its own. The real-engine study (bench/real_engine/prefix.py) sends the same texts."""
    rng = random.Random(seed)
    docs = [document(rng, doc_tokens) for _ in range(documents)]
    out = []
    for d in range(documents):
        for q in range(questions):
            text = docs[d] if shared else document(rng, doc_tokens)
            out.append((f"d{d}-q{q}", f"{text}\n\nQuestion {q}: what does it say of item {q}?"))
    rng.shuffle(out)
    return out


def one_system_prompt(lines: int, words: int, seed: int) -> list[tuple[str, str]]:
    """Every line the same long instructions (`words` words, as an eval's system prompt or few-shot block), then an
    input of its own (40 words) and its question: one prefix shared by the whole file."""
    rng = random.Random(seed)
    instructions = document(rng, words)
    return [(f"s{i}", f"{instructions}\n\nInput {i}: {document(rng, 40)}\nWhat does input {i} say?")
            for i in range(lines)]


def branched_conversations(conversations: int, branches: int, words: int, seed: int) -> list[tuple[str, str]]:
    """Conversations of five turns (`words` words in all), each branched `branches` ways after a turn drawn at
    random: the transcript up to that turn, then the branch's own message; shuffled. The branches of a conversation
    share prefixes of different lengths, a tree, not one block."""
    rng = random.Random(seed)
    out = []
    for c in range(conversations):
        turns = [f"User: {document(rng, words // 10)}\nAssistant: {document(rng, words // 10)}" for _ in range(5)]
        for b in range(branches):
            depth = rng.randint(1, len(turns))
            out.append((f"c{c}-b{b}", "\n".join(turns[:depth]) + f"\nUser: branch {b}: go on from turn {depth}."))
    rng.shuffle(out)
    return out


def lines(documents: int, questions: int, doc_tokens: int, max_tokens: int, shared: bool, seed: int) -> bytes:
    """The batch file: `questions_about` as chat completions."""
    out = [{"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "max_tokens": max_tokens, "ignore_eos": True, "messages": [
                {"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]}}
           for cid, text in questions_about(documents, questions, doc_tokens, shared, seed)]
    return b"".join(json.dumps(line).encode() + b"\n" for line in out)


def sim_args(args: argparse.Namespace) -> list[str]:
    return ["--enable-prefix-caching", "--num-blocks", str(args.num_blocks), "--max-num-seqs", str(args.max_num_seqs),
            "--prefill-ms-per-token", str(args.prefill_ms_per_token)]


def use_processor(stack: Stack, plan: bool) -> None:
    """Replace the stack's processor with one whose prefix plan is on or off (between batches: none is held)."""
    stack.kill("processor")
    env = {**stack.env, "HOLDBACK_PROCESSOR_PREFIX_PLAN": "on" if plan else "off"}
    log = open(stack.log_dir / "processor.log", "ab")
    stack.procs["processor"] = subprocess.Popen(
        [sys.executable, "-m", "holdback.cli", "processor", "--poll-interval", "0.1"], env=env, stdout=log,
        stderr=subprocess.STDOUT, start_new_session=True)
    log.close()


def counters(stack: Stack) -> dict[str, float]:
    out = {"generated": 0.0, "hits": 0.0, "queries": 0.0}
    for url in stack.replica_urls:
        m = parse_prometheus(httpx.get(f"{url}/metrics", timeout=10).text)
        out["generated"] += metric_sum(m, "vllm:generation_tokens_total")
        out["hits"] += metric_sum(m, "vllm:prefix_cache_hits_total")
        out["queries"] += metric_sum(m, "vllm:prefix_cache_queries_total")
    return out


def run_arm(stack: Stack, arm: str, content: bytes, timeout: float) -> dict:
    """One batch under a new tenant (a cache salt of its own); its tokens/s and prefix-cache hit rate."""
    use_processor(stack, arm == "plan")
    admin = stack.admin_headers
    key = httpx.post(f"{stack.api_url}/admin/keys", json={"tenant": f"prefix-{arm}-{time.monotonic_ns()}"},
                     headers=admin, timeout=10).raise_for_status().json()["key"]
    tenant = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=stack.api_url, headers=tenant, timeout=60) as api:
        file_id = api.post("/v1/files", files={"file": ("prefix.jsonl", io.BytesIO(content))},
                           data={"purpose": "batch"}).raise_for_status().json()["id"]
        before, start = counters(stack), time.monotonic()
        batch = api.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/chat/completions",
                                              "completion_window": "24h"}).raise_for_status().json()
        deadline = start + timeout
        while batch["status"] not in ("completed", "failed", "expired", "cancelled"):
            if time.monotonic() > deadline:
                raise SystemExit(f"{arm}: batch {batch['id']} not done after {timeout:.0f} s ({batch['status']})")
            time.sleep(0.25)
            batch = api.get(f"/v1/batches/{batch['id']}").raise_for_status().json()
        seconds = time.monotonic() - start
    moved = {k: v - before[k] for k, v in counters(stack).items()}
    counts = batch["request_counts"]
    if batch["status"] != "completed" or counts["failed"]:
        raise SystemExit(f"{arm}: batch {batch['id']} ended {batch['status']} with {counts}")
    return {"arm": arm, "seconds": seconds, "tokens_per_second": moved["generated"] / seconds,
            "hit_rate": moved["hits"] / moved["queries"] if moved["queries"] else 0.0, "requests": counts["total"]}


def ratios(runs: list[dict], name: str, num: str = "plan", den: str = "file-order") -> dict:
    """Median over rounds of arm `num` ÷ arm `den` for the figure `name`, with its bootstrap interval and the
    per-round ratios."""
    per_round: dict[int, dict[str, float]] = {}
    for r in runs:
        per_round.setdefault(r["round"], {})[r["arm"]] = r[name]
    values = [arms[num] / arms[den] for arms in per_round.values() if arms.get(den) and num in arms]
    return {**bootstrap_median(values).as_dict(), "per_round": values}


def run_setting(args: argparse.Namespace, replicas: int, shared: bool, out: Path) -> dict:
    name = f"{replicas}-replica{'s' if replicas > 1 else ''}{'' if shared else '-no-shared-prefix'}"
    spec = StackSpec(replicas=replicas, sim_args=sim_args(args), worker_concurrency=args.worker_concurrency)
    runs: list[dict] = []
    with Stack(spec, out / "logs" / name) as stack:
        stack.start_workers()
        for r in range(args.rounds):
            content = lines(args.documents, args.questions, args.doc_tokens, args.max_tokens, shared, args.seed + r)
            for arm in (ARMS if r % 2 == 0 else ARMS[::-1]):
                result = {**run_arm(stack, arm, content, args.timeout), "round": r}
                print(f"{name} round {r} {arm}: {result['tokens_per_second']:.0f} tok/s, "
                      f"hit rate {result['hit_rate']:.2f}, {result['seconds']:.1f} s", flush=True)
                runs.append(result)
    hit = {arm: bootstrap_median([r["hit_rate"] for r in runs if r["arm"] == arm]).as_dict() for arm in ARMS}
    return {"setting": name, "replicas": replicas, "shared": shared, "runs": runs,
            "tokens_per_second_ratio": ratios(runs, "tokens_per_second"), "hit_rate": hit}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.prefix", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    p.add_argument("--documents", type=int, default=100)
    p.add_argument("--questions", type=int, default=10)
    p.add_argument("--doc-tokens", type=int, default=1500)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=2500, help="KV blocks of 16 tokens per replica")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--prefill-ms-per-token", type=float, default=0.02)
    p.add_argument("--worker-concurrency", type=int, default=32)
    p.add_argument("--no-shared", action="store_true", help="also run the no-shared-prefix workload (1 replica)")
    p.add_argument("--seed", type=int, default=50)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one batch may take")
    p.add_argument("--out", type=Path, default=None, help="where results.json and the logs go (default: a temp dir)")
    args = p.parse_args(argv)
    for name in ("rounds", "documents", "questions", "doc_tokens", "max_tokens", "num_blocks", "max_num_seqs"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if any(r < 1 for r in args.replicas):
        p.error("--replicas must be at least 1 each")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="bench-prefix-"))
    out.mkdir(parents=True, exist_ok=True)
    settings = [run_setting(args, n, True, out) for n in args.replicas]
    if args.no_shared:
        settings.append(run_setting(args, 1, False, out))
    report = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "settings": settings}
    (out / "results.json").write_text(json.dumps(report, indent=1))
    for s in settings:
        t, h = s["tokens_per_second_ratio"], s["hit_rate"]
        interval = f" [{t['lo']:.2f}, {t['hi']:.2f}]" if t["lo"] is not None else ""
        print(f"{s['setting']}: plan ÷ file order tokens/s {t['value']:.2f}{interval}; hit rate "
              f"file order {h['file-order']['value']:.2f}, plan {h['plan']['value']:.2f}")
    print(f"results: {out / 'results.json'}")
    return report


if __name__ == "__main__":
    main()
