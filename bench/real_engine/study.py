"""Realtime latency and batch work on one real vLLM replica: holdback's controls against vLLM's own priority queue.

One vLLM server (the real-engine tier's CPU build and tiny model, `--scheduling-policy priority
--max-num-seqs 8`) runs for the whole study, pinned to CPU 0 (`taskset`, `VLLM_CPU_OMP_THREADS_BIND`); each
arm's `holdback gateway` and this process (the load generator) are pinned to CPU 1, so the relay does not
compete with the engine for its core; all of them run at nice −15 in sessions of that nice (`favour`), ahead of
other work on a shared machine. With `--replicas 2`, one server per core, the relay unpinned beside them, and
the traffic doubled. Every arm sends the same seeded traffic:

- realtime: a burst of `--burst` requests (larger than the replica's slots) at the start of the window, then
  Poisson arrivals at `--rate`/s, each a streamed completion of 8 tokens; the figure is its time to first token;
- batch: `--batch-inflight` requests kept in flight from `--lead` s before the window, each a streamed
  completion of 200–400 tokens (`ignore_eos`). An evicted one (429, or the gateway's `evicted` event in the
  stream) is resumed as the workers resume a completion: the prompt plus the text it kept, for the tokens it
  still owes. The figures are the batch requests completed within the window and the output tokens produced in it
  (the work: a count of completions in a short window is that work rounded to whole requests).

Arms: realtime alone through the gateway (the latency baseline); vLLM priority alone, no gateway (realtime
sent with `X-Vllm-Priority` -100, batch 10: the batch baseline); and holdback configurations, each named by
what it sets. The gateway's KV admission is off in every arm (request slots only), the same for all of them.
Each round runs every arm once, in a seeded shuffled order, and each arm in a group with the two baselines run
just before or after it: the engine's speed on a shared machine drifts by a fifth within a minute, so a ratio is
taken only between runs that met the same machine. A group's ratios are its arm's realtime p95 ÷ the group's
realtime-alone p95 and its batch completions (and tokens) ÷ the group's vLLM-priority ones; the report gives each
ratio's median over the groups with a bootstrap interval, and the goals' verdicts. The traffic itself is
bench/real_engine/traffic.py, the simulator fitted to the engine bench/real_engine/timing.py.

    python -m tests.real_vllm.engine_env ensure      # prints HOLDBACK_VLLM_PYTHON=... HOLDBACK_VLLM_MODEL=...
    HOLDBACK_VLLM_PYTHON=... HOLDBACK_VLLM_MODEL=... python -m bench.real_engine.study --rounds 3 \\
        --out docs/study/real-vllm
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import psutil

from bench.lib.engines import (CPU_BLOCK_TOKENS, ENGINE_CPU, NICE, RELAY_CPU, SLOTS, engine_paths, favour, pin_load,
                               pinned, start_vllm)
from bench.lib.process_cpu import CpuSampler
from bench.lib.processes import Children, holdback
from bench.lib.readiness import free_port, wait_http
from bench.real_engine.plots import make_plots
from bench.real_engine.report import fidelity, markdown, summarise
from bench.real_engine.timing import fit_timing, start_fitted_sim
from bench.real_engine.traffic import Arm, Record, run_arm
from bench.stats import percentile

# Every ratio is taken against these two, run next to the arm.
BASELINES = ("realtime-only", "vllm-priority")
# The gateway's keyless callers may use both objectives; KV admission off: request slots are what is compared.
CALLERS = "anonymous: {enabled: true, objectives: [realtime, batch], defaultObjective: batch}\n"
BASE_CONFIG = CALLERS + """admission: {enabled: false}
saturation: {detector: concurrency, maxConcurrency: %(slots)d}
"""


HOLDBACK_50 = "usageLimit: {policy: priority-holdback, minCeiling: 0.5}\n"


def arms(slots: int) -> list[Arm]:
    engine = f"engine: {{schedulingPolicy: priority, maxNumSeqs: {slots}}}\n"
    return [
        Arm("realtime-only", "realtime alone, through the gateway", engine + "eviction: {policy: none}\n",
            batch=False),
        Arm("vllm-priority", "vLLM priority alone (no gateway)", None),
        Arm("no-controls", "gateway, no holdback, no eviction",
            "usageLimit: {policy: static, threshold: 1.0}\neviction: {policy: none}\n"),
        # priority-holdback: batch at half the slots, realtime and standard the whole of them.
        Arm("holdback-50", "holdback 50%, no eviction", engine + HOLDBACK_50 + "eviction: {policy: none}\n"),
        Arm("evict-priority", "no reserve, eviction, slots = maxNumSeqs, priorities passed", engine
            + "usageLimit: {policy: static, threshold: 1.0}\neviction: {policy: newest-first, maxPerDecision: 16}\n"),
        Arm("evict-allowance", "the same + queueAllowance 2 (realtime waits inside vLLM, evicts there)",
            f"engine: {{schedulingPolicy: priority, maxNumSeqs: {slots}, queueAllowance: 2}}\n"
            "usageLimit: {policy: static, threshold: 1.0}\neviction: {policy: newest-first, maxPerDecision: 16}\n",
            default=False),
        # gateway/default.yaml's settings, nothing said about the engine: KV admission on, 48 requests a replica
        # until its slots are learned from its metrics, no reserve, eviction.
        Arm("shipped-default", "the shipped default: no engine settings, slots learned", "", shared=False),
        # The same with two requests kept waiting inside vLLM beyond the slots once they are learned.
        Arm("shipped-allowance", "the shipped default + queueAllowance 2 beyond the learned slots",
            "engine: {queueAllowance: 2}\n", shared=False, default=False),
        # The default before 2026-12-04: holdback 50% of maxConcurrency (48) + eviction, slots not learned.
        Arm("previous-default", "the previous default: holdback 50% of 48 + eviction, nothing learned",
            "usageLimit: {policy: priority-holdback, minCeiling: 0.5}\nengine: {learnMaxNumSeqs: false}\n",
            shared=False, default=False),
        Arm("holdback-50-evict", "holdback 50% + eviction, priorities passed", engine + HOLDBACK_50
            + "eviction: {policy: newest-first, maxPerDecision: 16}\n"),
        Arm("adaptive-evict", "adaptive reserve (floor 50%) + eviction, priorities passed", engine
            + "usageLimit: {policy: adaptive-reserve, minCeiling: 0.5, maxCeiling: 1.0, adaptive: "
            "{margin: 0.1, halfLifeSeconds: 10, peakWindowSeconds: 30}}\n"
            "eviction: {policy: newest-first, maxPerDecision: 16}\n"),
        # The reserve is realtime's own recent peak (no margin, no floor, a 3 s window): the slot realtime keeps
        # using stays free for it, and only an arrival beyond that peak evicts.
        Arm("adaptive-peak", "adaptive reserve = realtime's 3 s peak, no floor + eviction, priorities passed",
            engine + "usageLimit: {policy: adaptive-reserve, minCeiling: 0.0, maxCeiling: 1.0, adaptive: "
            "{margin: 0.0, halfLifeSeconds: 2, peakWindowSeconds: 3}}\n"
            "eviction: {policy: newest-first, maxPerDecision: 16}\n"),
    ]


# -- each arm's gateway ------------------------------------------------------------------------------------------

def start_gateway(children: Children, tmp: Path, arm: Arm, engines: list[str], slots: int, pin: bool = True,
                  log_level: str = "WARNING", log_name: str | None = None) -> str:
    port = free_port()
    path = tmp / f"{arm.name}.yaml"
    path.write_text((BASE_CONFIG % {"slots": slots} if arm.shared else CALLERS) + (arm.gateway or ""))
    p = children.start([*pinned(RELAY_CPU, pin), *holdback(
        "gateway", "--config", str(path), "--port", str(port), "--replicas", ",".join(engines), "--log-level", log_level)],
        tmp / f"{log_name or arm.name}-gateway.log")
    favour(p.pid, NICE)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", p, timeout=60, what=f"gateway {arm.name}")
    wait_http(url + "/v1/models", p, timeout=60, what=f"gateway {arm.name}")  # the replica is identified
    return url


def run_rounds(urls: list[str], engine: str, arm_list: list[Arm], rounds: int, args: argparse.Namespace,
               children: Children, tmp: Path) -> list[Record]:
    """Per round, every arm once in a seeded shuffled order, each in a group with the two baselines run just
    before or after it (the group's order shuffled too), against the replicas at `urls`."""
    records = []
    order_rng = random.Random(args.seed)
    baselines = [a for a in arm_list if a.name in BASELINES]
    group = 0
    for rnd in range(rounds):
        order = [a for a in arm_list if a.name not in BASELINES]
        order_rng.shuffle(order)
        for arm in order:
            runs = baselines + [arm]
            order_rng.shuffle(runs)
            for one in runs:
                records.append(run_one(urls, engine, one, rnd, group, args, children, tmp))
            group += 1
    return records


def cpu_role(proc: psutil.Process) -> str | None:
    """What a process of the study is, for its CPU share: this process (the load), a gateway, vLLM's API server or
    its engine (the engine core and its worker, which vLLM names `VLLM::...`), or a simulator."""
    if proc.pid == os.getpid():
        return "load"
    name, cmd = proc.name(), " ".join(proc.cmdline())
    if name.startswith("VLLM::") or cmd.startswith("VLLM::"):
        return "vLLM engine"
    if "vllm.entrypoints" in cmd:
        return "vLLM API server"
    if "holdback" in cmd and " gateway " in f" {cmd} ":
        return "gateway"
    if "holdback" in cmd and " sim " in f" {cmd} ":
        return "simulator"
    return None


def run_one(urls: list[str], engine: str, arm: Arm, rnd: int, group: int, args: argparse.Namespace,
            children: Children, tmp: Path) -> Record:
    """One run of `arm`: through a gateway of its own in front of the replicas, or (no gateway) each request to
    the next replica in turn."""
    target: str | list[str] = urls
    gateway: list = []
    if arm.gateway is not None:
        before = len(children.procs)
        target = start_gateway(children, tmp, arm, urls, args.slots, pin=relay_pinned(args),
                               log_level=args.gateway_log_level, log_name=f"{engine}-{group}-{arm.name}")
        gateway = children.procs[before:]
    with CpuSampler(cpu_role, interval=0.5) as sampler:
        rec = asyncio.run(run_arm(target, arm, rnd, args, engine=urls))
    rec.engine, rec.group = engine, group
    rec.cpu = {role: round(cores, 3) for role, cores in sampler.shares.by_role.items()}  # type: ignore[union-attr]
    print(f"{engine} round {rnd} group {group} {arm.name}: p95 {percentile(rec.ttft, 0.95) * 1000:.0f} ms, batch "
          f"{rec.batch_completed} ({rec.batch_tokens} tokens, {rec.batch_failed} refused), evictions "
          f"{rec.evictions}, broken {rec.broken}, realtime failed {rec.realtime_failed}; cores: "
          + ", ".join(f"{role} {cores:.2f}" for role, cores in sorted(rec.cpu.items())), file=sys.stderr, flush=True)
    for proc in gateway:  # the next arm gets a gateway of its own; this one's drain is not waited for
        proc.kill()
        proc.wait(30)
        children.procs.remove(proc)
    return rec


def relay_pinned(args: argparse.Namespace) -> bool:
    """Whether the gateway and the load have a core of their own: one replica, pinned. Two replicas take a core
    each, and the relay runs beside them."""
    return not args.unpinned and args.replicas == 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3, help="rounds of every arm on the engine (default %(default)s)")
    p.add_argument("--sim-rounds", type=int, default=2, help="rounds of every arm on the simulator (default "
                   "%(default)s: it is steadier)")
    p.add_argument("--window", type=float, default=30.0, help="seconds of realtime traffic per arm")
    p.add_argument("--lead", type=float, default=5.0, help="seconds batch runs before the window")
    p.add_argument("--replicas", type=int, default=1, help="vLLM replicas (default %(default)s), each pinned to a "
                   "core of its own; with two, the gateway and the load run beside them on both cores, and vLLM "
                   "priority alone is sent each request to the next replica in turn (a plain load balancer)")
    p.add_argument("--burst", type=int, default=10, help="realtime requests at the window's start, per replica")
    p.add_argument("--rate", type=float, default=3.0, help="realtime Poisson arrivals per second after it, per "
                   "replica")
    p.add_argument("--batch-inflight", type=int, default=10, help="batch requests kept in flight, per replica")
    p.add_argument("--batch-tokens", type=lambda v: tuple(int(x) for x in v.split(",")), default=(200, 400),
                   help="batch output tokens, uniform between LO,HI (default 200,400; the context is 512)")
    p.add_argument("--batch-stream-interval", type=int, default=1, help="batch streams carry this many tokens "
                   "per event (vLLM's per-request stream_interval; the workers' --stream-interval), in every arm")
    p.add_argument("--slots", type=int, default=SLOTS, help="the replica's --max-num-seqs")
    p.add_argument("--seed", type=int, default=3)
    p.add_argument("--arms", help="comma-separated arm names besides the two baselines (default: all but "
                   "evict-allowance)")
    p.add_argument("--no-sim", action="store_true", help="skip the simulator fitted to the engine")
    p.add_argument("--block-size", type=int, help="the engine's --block-size (default: the CPU backend's 128); a "
                   "resumed request's prefill is what its prefix-cached blocks do not cover")
    p.add_argument("--unpinned", action="store_true", help="pin nothing: the engine, the gateway and the load "
                   "share both cores (the regime where the relay's own CPU counts)")
    p.add_argument("--gateway-log-level", default="WARNING", help="each gateway's log level (INFO shows its "
                   "decisions: slots learned, evictions); the logs stay in the temporary directory printed at the end")
    p.add_argument("--out", type=Path, help="write raw.json, summary.json and report.md here")
    p.add_argument("--report", type=Path, metavar="DIR", help="run nothing: recompute DIR's summary.json and "
                   "report.md from its raw.json, with the settings that run recorded")
    args = p.parse_args(argv)
    if args.report:
        return rereport(p, args.report)
    python, model = engine_paths(p)
    if not 1 <= args.replicas <= len(os.sched_getaffinity(0)):
        p.error(f"--replicas {args.replicas}: each replica takes a core of its own; this machine lets the study use "
                f"{len(os.sched_getaffinity(0))}")
    # The traffic grows with the replicas: each meets what one meets alone.
    args.burst, args.rate, args.batch_inflight = (args.burst * args.replicas, args.rate * args.replicas,
                                                  args.batch_inflight * args.replicas)
    favoured = pin_load(p, pin=relay_pinned(args))
    arm_list = arms(args.slots)
    if args.arms:
        wanted = set(args.arms.split(",")) | set(BASELINES)
        unknown = wanted - {a.name for a in arm_list}
        if unknown:
            p.error(f"unknown arm(s) {', '.join(sorted(unknown))}; the arms are {', '.join(a.name for a in arm_list)}")
        arm_list = [a for a in arm_list if a.name in wanted]
    else:
        arm_list = [a for a in arm_list if a.default]
    children = Children()
    tmp = Path(tempfile.mkdtemp(prefix="hb-real-study-"))
    result: dict = {"args": {k: v for k, v in vars(args).items() if k != "out"}, "favoured": favoured}
    records: list[Record] = []
    try:
        cpus = [ENGINE_CPU + i for i in range(args.replicas)]
        engines = [start_vllm(children, tmp, python, model, args.slots, pin=not args.unpinned,
                              block_size=args.block_size, cpu=cpu) for cpu in cpus]
        timing = asyncio.run(fit_timing(engines[0], args.slots))  # the replicas are alike: one is measured
        result["timing"] = asdict(timing)
        records += run_rounds(engines, "vllm", arm_list, args.rounds, args, children, tmp)
        children.close()
        children.procs.clear()
        if not args.no_sim:
            sims = [start_fitted_sim(children, tmp, timing, args.slots, pin=not args.unpinned,
                              block_size=args.block_size or CPU_BLOCK_TOKENS, cpu=cpu) for cpu in cpus]
            records += run_rounds(sims, "sim", arm_list, args.sim_rounds, args, children, tmp)
    finally:
        children.close()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    report = conclude(result, records, arm_list, args, args.out)
    print(report)
    if args.out:
        # A realtime request that got no first token is recorded as Infinity (JSON's extension, as Python reads it).
        (args.out / "raw.json").write_text(json.dumps([asdict(r) for r in records], indent=1))
        (args.out / "summary.json").write_text(json.dumps(result, indent=1))
        (args.out / "report.md").write_text(report)
    print(f"logs in {tmp}", file=sys.stderr)
    return 0


def conclude(result: dict, records: list[Record], arm_list: list[Arm], args: argparse.Namespace,
             plots_dir: Path | None) -> str:
    """Fill `result` with each engine's summary and the simulator's fidelity, draw the plots into `plots_dir`
    (None: none); the report's text."""
    result["engine"] = summarise([r for r in records if r.engine == "vllm"], arm_list)
    if any(r.engine == "sim" for r in records):
        result["sim"] = summarise([r for r in records if r.engine == "sim"], arm_list)
        result["fidelity"] = fidelity(result["engine"], result["sim"])
    plots = make_plots(plots_dir, result, records) if plots_dir is not None else []
    return markdown(result, args, ENGINE_CPU, RELAY_CPU, plots)


def rereport(p: argparse.ArgumentParser, out: Path) -> int:
    """`--report DIR`: the figures again from DIR's raw records, by today's summary (a run is not repeated to
    report it better)."""
    try:
        raw = json.loads((out / "raw.json").read_text())
        result = json.loads((out / "summary.json").read_text())
    except (OSError, ValueError) as exc:
        p.error(f"--report {out}: needs the raw.json and summary.json a run with --out wrote there ({exc})")
    args = argparse.Namespace(**{**vars(p.parse_args([])), **result["args"]})
    records = [Record(**r) for r in raw]
    ran = {r.arm for r in records}
    arm_list = [a for a in arms(args.slots) if a.name in ran]
    result = {k: v for k, v in result.items() if k not in ("engine", "sim", "fidelity")}
    report = conclude(result, records, arm_list, args, out)
    (out / "summary.json").write_text(json.dumps(result, indent=1))
    (out / "report.md").write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
