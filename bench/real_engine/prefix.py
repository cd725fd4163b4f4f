"""Issue 50 on the real engine: a batch of documents × questions planned for vLLM's prefix cache and run through
the whole product, against vLLM's own priority scheduler fed the same file in file order; realtime beside both.

One engine serves the run: the real-engine tier's vLLM (`--engine vllm`: pinned to CPU 0, `--scheduling-policy
priority`, its prefix cache on as vLLM V1 has it by default) or `holdback sim --enable-prefix-caching`; this
process and the holdback stack run on CPU 1. The engine is sized so that order matters: its KV pool (`--kv-blocks`
blocks of 128 tokens) holds what its slots run plus a few documents, far fewer than the file's documents;
its step token budget (`--step-tokens`, vLLM's `--max-num-batched-tokens`) makes a document's prefill take several
engine steps, as a long prompt's prefill costs several decode steps of a 7-8B model on a GPU. Workloads (the texts
of bench/prefix.py, sent as completions): `shared`, `--documents` × `--questions` shuffled in the file;
`no-shared`, as many lines each with a document of its own; `system-prompt`, one long system prompt for every line
and each line's own input; `branched`, `--documents` conversations of five turns, each branched `--questions` ways
after a turn drawn at random (prefixes of different lengths, a tree). By default `shared` and `no-shared`.

Arms, per group in alternating order, each in a cache scope of its own (a `cache_salt` for vLLM alone, a new tenant
in holdback) so that none finds what another cached:
- `vllm-priority`: every line sent straight to the engine at once, file order (bench/makespan.py `vllm_arm`).
- `plan`: `holdback up` as shipped (the processor's prefix plan on), the file run as one batch through the Batch
  API, the processor, the workers and the gateway, after a warm-up batch of other prompts (the gateway learns the
  engine's slots, as in a stack already serving).
- `plan-off`: the same with `HOLDBACK_PROCESSOR_PREFIX_PLAN=off` (rows in line order): the plan's own share. The
  gateway's cached-first dispatch is on in both (as shipped).
- `line-order`: the plan off and the gateway's cached-first dispatch off too (`flowControl.cachedFirstLookahead:
  0`): rows dispatched in line order, holdback before either; `plan-off` ÷ `line-order` is cached-first's share.
The no-shared workload runs `plan` and `line-order` only, the system-prompt workload `vllm-priority`, `plan` and
`line-order` (one prefix: there is nothing to order). With `--replicas 2` two engines serve the run, one pinned to
each CPU, and the stack and this process run unpinned ahead of them (a nice of -15 for their sessions, the engines
at 0: the stack takes what it needs and the engines the rest, as in the real-engine tier); each workload's arms are
then `least-loaded` and `prefix-affinity`: holdback as shipped (the plan on) with the gateway's picker by load (its
default) or by prefix (gateway/policies/prefix_affinity.py), the plan on in both (`--picker-plan off`: off in
both), and batch tokens per second (wall clock, the two engines together) is the figure the picker moves. Realtime
throughout every arm: Poisson `--rate`/s streamed completions of 8 tokens (bench/makespan.py `realtime`).

Figures per arm: batch output tokens per engine step (the completed lines' tokens ÷ the engine's steps,
`vllm:iteration_tokens_total_count`, moved during the arm), makespan, realtime p95 TTFT, and the prefix cache's hit
rate (`vllm:prefix_cache_hits` ÷ `vllm:prefix_cache_queries` moved). The report (bench/real_engine/prefix_report.py)
gives medians of per-group ratios with bootstrap intervals and the goals' verdicts.

    python -m bench.real_engine.prefix --engine sim --groups 3
    HOLDBACK_VLLM_PYTHON=... HOLDBACK_VLLM_MODEL=... python -m bench.real_engine.prefix --engine vllm --groups 3 \\
        --out docs/study/prefix
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from bench.lib.engines import CPU_BLOCK_TOKENS, KV_BOUND_CONTEXT, one_engine, wait_idle
from bench.lib.holdback_up import HoldbackUp, warm_up
from bench.lib.prometheus import metric_sum, parse_prometheus
from bench.makespan import MakespanRun, batch_lines, holdback_arm, vllm_arm
from bench.prefix import SYSTEM, branched_conversations, one_system_prompt, questions_about
from bench.real_engine.prefix_report import make_plots, markdown, summarise
from bench.stats import percentile

WORKLOADS = {"shared": ("vllm-priority", "plan", "plan-off", "line-order"), "no-shared": ("plan", "line-order"),
             "system-prompt": ("vllm-priority", "plan", "line-order"),
             "branched": ("vllm-priority", "plan", "plan-off", "line-order")}
# With two replicas (`--replicas 2`), every workload: holdback as shipped (the plan on) with the gateway's picker by
# load (the shipped default) and by prefix (gateway/policies/prefix_affinity.py).
PICKERS = ("least-loaded", "prefix-affinity")
PLAN_ENV = "HOLDBACK_PROCESSOR_PREFIX_PLAN"


@dataclass
class PrefixRun:
    workload: str
    arm: str
    group: int
    makespan: float  # seconds: first line sent (vLLM) or `POST /v1/batches` (holdback) → the last line done
    batch_tokens: int  # output tokens of the lines completed
    steps: float  # the engine's steps during the arm
    tokens_per_step: float
    hits: float  # prefix-cache tokens hit ÷ queried during the arm
    queries: float
    hit_rate: float
    tokens_per_second: float = 0.0  # batch_tokens ÷ makespan
    ttft: list[float] = field(default_factory=list)  # realtime's, seconds; inf: no first token
    ttft_p95: float | None = None
    lines_failed: int = 0
    realtime_failed: int = 0
    evictions: int = 0
    cached_first: int = 0  # holdback: requests the gateway sent ahead of their flow's head (cached-first dispatch)
    engine: dict[str, float] = field(default_factory=dict)  # the engine's counters moved (bench/makespan.py)


def completion_lines(args: argparse.Namespace, model: str, workload: str, seed: int) -> list[dict]:
    """A workload's texts (bench/prefix.py) as completions: the system line, then documents × questions (`shared`;
    `no-shared`: each line a document of its own), one long system prompt and each line's own input
    (`system-prompt`), or `--documents` conversations branched `--questions` ways (`branched`), `--doc-words` words
    of shared text a document, system prompt or conversation; `--max-tokens` output tokens each (`ignore_eos`)."""
    if workload == "system-prompt":
        texts = one_system_prompt(args.documents * args.questions, args.doc_words, seed)
    elif workload == "branched":
        texts = branched_conversations(args.documents, args.questions, args.doc_words, seed)
    else:
        texts = questions_about(args.documents, args.questions, args.doc_words, workload == "shared", seed)
    return [{"model": model, "prompt": f"{SYSTEM}\n\n{text}", "max_tokens": args.max_tokens, "ignore_eos": True}
            for _, text in texts]


def cache_counters(engine: str) -> tuple[float, float]:
    """The engine's prefix-cache hits and queries (tokens) so far (summed over several, comma-separated)."""
    hits = queries = 0.0
    for url in engine.split(","):
        m = parse_prometheus(httpx.get(url + "/metrics", timeout=10).text)
        hits += metric_sum(m, "vllm:prefix_cache_hits_total")
        queries += metric_sum(m, "vllm:prefix_cache_queries_total")
    return hits, queries


def new_tenant(up: HoldbackUp, name: str) -> dict[str, str]:
    """A tenant key made for one arm: its own cache salt, so the arm finds nothing the warm-up cached."""
    made = httpx.post(up.api + "/admin/keys", json={"tenant": name}, headers=up.admin, timeout=30)
    return {"Authorization": f"Bearer {made.raise_for_status().json()['key']}"}


def run_holdback(engine: str, tmp: Path, pin: bool, lines: list[dict], args: argparse.Namespace, label: str,
                 arm: str, group: int) -> tuple[MakespanRun, int]:
    """`holdback up` with the processor's plan on (`plan`) or off, the gateway's cached-first dispatch on or off
    (`line-order`): a warm-up batch of short prompts under the stack's own tenant, then the measured batch under a
    tenant of its own. Also how many of the batch's requests cached-first dispatch sent ahead."""
    keep = args.logs / label if args.logs else None
    # One tenant's batch is the whole load: its KV share is the pool's (the shipped 0.15 is a share among many
    # tenants, which would hold this batch to two documents' questions at a time on the small pool).
    config: dict = {"admission": {"tenantMaxShare": args.tenant_share, "tenantSoftShare": args.tenant_share}}
    if arm == "line-order":
        config["flowControl"] = {"cachedFirstLookahead": 0}
    if arm in PICKERS:
        config["picker"] = {"policy": arm}
    plan = "on" if arm == "plan" or (arm in PICKERS and args.picker_plan == "on") else "off"
    ahead = args.replicas > 1 and args.engine == "vllm" and not args.unpinned  # engines pinned on both CPUs
    with HoldbackUp(engine, tmp, label, pin, config, keep, env={PLAN_ENV: plan}, ahead=ahead) as up:
        warm = batch_lines(args.seed + 1000 + group, 8 * args.slots, (8, 8), lines[0]["model"])
        slots = asyncio.run(warm_up(up, warm, args))
        wait_idle(engine)
        up.tenant = new_tenant(up, label)
        before = sent_ahead(up)
        run = asyncio.run(holdback_arm(up, engine, lines, argparse.Namespace(**{**vars(args), "warm_up": False}),
                                       group))
        ahead = sent_ahead(up) - before
    run.slots_known = slots
    return run, ahead


def sent_ahead(up: HoldbackUp) -> int:
    """The gateway's count of requests cached-first dispatch sent ahead so far (`/admin/state` totals)."""
    state = httpx.get(up.gateway + "/admin/state", headers=up.admin, timeout=30).raise_for_status().json()
    return state["totals"]["cached_first"]


def run_arm(engine: str, tmp: Path, pin: bool, workload: str, arm: str, lines: list[dict], args: argparse.Namespace,
            group: int) -> PrefixRun:
    label = f"{workload}-{arm}-{group}"
    wait_idle(engine)
    hits, queries = cache_counters(engine)
    ahead = 0
    if arm == "vllm-priority":
        salted = [{**line, "cache_salt": label} for line in lines]
        run = asyncio.run(vllm_arm(engine, salted, args, group))
    else:
        run, ahead = run_holdback(engine, tmp, pin, lines, args, label, arm, group)
    hits_now, queries_now = cache_counters(engine)
    done = len(lines) - run.lines_failed
    steps = run.engine.get("steps", 0.0)
    return PrefixRun(
        workload, arm, group, run.makespan, done * args.max_tokens, steps,
        done * args.max_tokens / steps if steps else 0.0, hits_now - hits, queries_now - queries,
        (hits_now - hits) / (queries_now - queries) if queries_now > queries else 0.0,
        done * args.max_tokens / run.makespan if run.makespan else 0.0, run.ttft,
        percentile(run.ttft, 0.95), run.lines_failed, run.realtime_failed, sum(run.evictions), ahead, run.engine)


def sim_flags(args: argparse.Namespace) -> list[str]:
    """The simulator sized as the real engine is (`kv_bound_args`'s context, vLLM's CPU blocks)."""
    return ["--num-blocks", str(args.kv_blocks), "--block-size", str(CPU_BLOCK_TOKENS), "--max-model-len",
            str(KV_BOUND_CONTEXT), "--max-num-batched-tokens", str(args.step_tokens)]


def run_groups(p: argparse.ArgumentParser, args: argparse.Namespace) -> list[PrefixRun]:
    runs: list[PrefixRun] = []
    if args.engine == "sim":
        args.sim_arg = [*sim_flags(args), *args.sim_arg]
    flags = ["--max-num-batched-tokens", str(args.step_tokens)]
    with one_engine(p, args, "hb-prefix-", kv_blocks=args.kv_blocks, vllm_flags=flags,
                    replicas=args.replicas) as engine:
        for group in range(args.groups):
            for workload in args.workloads:
                lines = completion_lines(args, engine.model, workload, args.seed + group)
                arms = WORKLOADS[workload] if args.replicas == 1 else PICKERS
                for arm in (arms if group % 2 == 0 else arms[::-1]):
                    run = run_arm(engine.url, engine.tmp, engine.pin, workload, arm, lines, args, group)
                    runs.append(run)
                    print(f"group {group} {workload} {arm}: {run.tokens_per_step:.3f} batch tokens/step "
                          f"({run.steps:.0f} steps), {run.tokens_per_second:.1f} tokens/s, makespan "
                          f"{run.makespan:.1f} s, hit rate {run.hit_rate:.2f}, "
                          f"realtime p95 {run.ttft_p95 or 0:.3f} s ({len(run.ttft)}), evictions {run.evictions}, "
                          f"sent ahead {run.cached_first}, lines failed {run.lines_failed}", flush=True)
    return runs


def parse(argv: list[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    p = argparse.ArgumentParser(prog="python -m bench.real_engine.prefix", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--engine", choices=("sim", "vllm"), default="sim", help="the engine (default %(default)s)")
    p.add_argument("--groups", type=int, default=3, help="groups of every arm (default %(default)s)")
    p.add_argument("--workloads", nargs="+", choices=tuple(WORKLOADS), default=["shared", "no-shared"],
                   help="which workloads each group runs (default: shared no-shared)")
    p.add_argument("--documents", type=int, default=60, help="distinct documents in the file (default %(default)s)")
    p.add_argument("--questions", type=int, default=10, help="questions per document (default %(default)s)")
    p.add_argument("--doc-words", type=int, default=200,
                   help="words per document; the tiny model's tokenizer makes about 5 tokens of each, the "
                        "simulator's about 2 (default %(default)s: about 1,000 tokens on vLLM)")
    p.add_argument("--max-tokens", type=int, default=16, help="each answer's tokens (default %(default)s)")
    p.add_argument("--rate", type=float, default=2.0, help="realtime arrivals per second (default %(default)s)")
    p.add_argument("--slots", type=int, default=8, help="the engine's --max-num-seqs (default %(default)s)")
    p.add_argument("--replicas", type=int, choices=(1, 2), default=1,
                   help="engines (default %(default)s); 2: one on each CPU, the stack and the load run ahead of them "
                        "unpinned, and each workload's arms are the gateway's picker by load against by prefix "
                        "(the plan on in both, or off: --picker-plan)")
    p.add_argument("--picker-plan", choices=("on", "off"), default="on",
                   help="with --replicas 2: the processor's prefix plan in both picker arms (default %(default)s; "
                        "off: rows in line order, what the picker alone finds)")
    p.add_argument("--kv-blocks", type=int, default=104,
                   help="the engine's KV pool in blocks of 128 tokens (vLLM --num-gpu-blocks-override, with a "
                        "2,048-token context: the tiny model's; default %(default)s: eight unshared sequences of a "
                        "document and a question, 72 blocks, plus four documents)")
    p.add_argument("--step-tokens", type=int, default=192,
                   help="the engine's token budget per step, --max-num-batched-tokens (default %(default)s: a "
                        "1,000-token prefill takes about 5 steps)")
    p.add_argument("--tenant-share", type=float, default=1.0,
                   help="the gateway's admission.tenantMaxShare and tenantSoftShare for the batch's tenant (default "
                        "%(default)s: one tenant's batch may use the pool; the shipped 0.15 is a share among many)")
    p.add_argument("--seed", type=int, default=50, help="seeds the documents, the order and realtime's arrivals")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one batch may take (default %(default)s)")
    p.add_argument("--sim-arg", action="append", default=[], help="extra `holdback sim` flag (repeatable)")
    p.add_argument("--unpinned", action="store_true", help="vLLM: no CPU pinning")
    p.add_argument("--out", type=Path, help="write raw.json, summary.md and the plots here")
    p.add_argument("--logs", type=Path, help="copy each holdback arm's component logs here")
    args = p.parse_args(argv)
    for name in ("groups", "documents", "questions", "doc_words", "max_tokens", "slots", "kv_blocks", "step_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.rate <= 0:
        p.error("--rate must be positive: realtime runs beside every arm")
    if not 0 < args.tenant_share <= 1:
        p.error("--tenant-share must be in (0, 1]: a share of the KV pool")
    args.workers_streaming = args.vllm_whole = False  # bench/makespan.py's vllm_arm: vLLM alone fed plain streams
    return p, args


def main(argv: list[str] | None = None) -> dict:
    p, args = parse(argv)
    started = time.time()
    runs = run_groups(p, args)
    summary = summarise([asdict(r) for r in runs])
    text = markdown(summary, args)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        flags = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        record = {"args": flags, "started": started, "runs": [asdict(r) for r in runs], "summary": summary}
        (args.out / "raw.json").write_text(json.dumps(record, indent=1))
        plots = make_plots(args.out, summary, [asdict(r) for r in runs])
        (args.out / "summary.md").write_text(text + "\n" + "".join(f"\n![{n}]({n})\n" for n in plots))
    return summary


if __name__ == "__main__":
    main()
