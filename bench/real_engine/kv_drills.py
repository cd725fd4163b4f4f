"""The KV policy's failure drills on a real vLLM whose KV runs out before its slots (issue #47).

One KV-bound vLLM (the real-engine tier's CPU build and tiny model, `--num-gpu-blocks-override 40
--max-model-len 2048 --max-num-seqs 8 --scheduling-policy priority`: 5,120 tokens of KV in 128-token blocks)
runs the whole run pinned to CPU 0; two `holdback gateway`s in front of it (KV admission on, and off, every other
setting the shipped default's but the engine's slots and priority policy) and this process (the load and the
samplers) run on CPU 1. Prompts are token ids, so every request's KV need is exact. Each drill is run, per group,
in four arms adjacent in time, in a seeded shuffled order: realtime alone through the gateway (its latency
baseline), vLLM alone (no gateway: realtime with priority -100, the rest 10 in the body), and the gateway with
admission off and on. The drills:

- `long-session`: a session of turns whose prompt grows by 250 tokens a turn (300 to 1,800) while short
  realtime requests arrive (2/s) and batch loops keep long requests (800 + 400 tokens) in flight;
- `surge`: the same batch loops, then 16 standard requests (500 + 300 tokens) within a second, and realtime;
- `realtime-burst`: batch loops of 900 + 600 tokens hold most of the KV, then bursts of 6 realtime requests.

Every 100 ms a sampler reads the gateway's reserved blocks on the replica (/admin/state) and vLLM's
`vllm:kv_cache_usage_perc`; each run records vLLM's preemptions (`vllm:num_preemptions_total`), its engine steps
(`vllm:iteration_tokens_total` count) and the batch output tokens received within the window, and every realtime
request's time to first token. bench/real_engine/kv_drills_report.py turns the records into the report.

    python -m tests.real_vllm.engine_env ensure      # prints HOLDBACK_VLLM_PYTHON=... HOLDBACK_VLLM_MODEL=...
    HOLDBACK_VLLM_PYTHON=... HOLDBACK_VLLM_MODEL=... holdback bench drills --engine vllm --groups 3 \\
        --out docs/drills/real-vllm
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import httpx

from bench.lib.engines import ENGINE_CPU, KV_BOUND_BLOCKS, NICE, RELAY_CPU, SLOTS, engine_paths, favour, pin_load, \
    pinned, start_vllm, wait_idle
from bench.lib.processes import Children, holdback
from bench.lib.readiness import free_port, wait_http
from bench.real_engine.kv_drills_report import ARMS, write_report
from bench.real_engine.traffic import BROKEN, Streamed, stream
from holdback.contract import FAIRNESS_HEADER, OBJECTIVE_HEADER

ADMIN_KEY = "hb-kv-drills-admin"
CONFIG = """anonymous: {enabled: true, objectives: [realtime, standard, batch], defaultObjective: batch,
            relaysTenants: true}
adminKeys: [{key: %(admin)s}]
engine: {schedulingPolicy: priority, maxNumSeqs: %(slots)d}
admission: {enabled: %(admission)s%(tuned)s}
"""
DRILLS = ("long-session", "surge", "realtime-burst")
# With --tuned: admission on with other settings (e.g. a smaller interactive reserve), as one more arm.
TUNED = "admission-tuned"
# vLLM's priority (lower first) for each objective, where no gateway passes it on.
VLLM_PRIORITY = {"realtime": -100, "standard": 0, "batch": 10}


@dataclass
class KvDrillRun:
    drill: str
    arm: str
    group: int
    window_s: float
    ttft: list[float] = field(default_factory=list)  # realtime's, seconds; inf: refused or failed
    realtime_refused: dict[str, int] = field(default_factory=dict)  # status -> count
    other: dict[str, int] = field(default_factory=dict)  # the session's / surge's outcomes: status -> count
    batch_tokens: int = 0
    batch_refused: int = 0
    batch_evicted: int = 0
    steps: float | None = None
    preemptions: float | None = None
    # (t, gateway reserved blocks or None, vLLM used blocks) every 100 ms
    samples: list[tuple[float, int | None, float | None]] = field(default_factory=list)
    # The drill's window in the samples' time (seconds since the sampler started, `origin` monotonic).
    window: tuple[float, float] | None = None
    origin: float = 0.0


class KvDrillLoad:
    """The requests of one run, to the gateway (objective and tenant headers) or straight to vLLM (priority in the
    body)."""

    def __init__(self, session: aiohttp.ClientSession, url: str, direct: bool, run: KvDrillRun, seed: int):
        self.session, self.url, self.direct, self.run = session, url, direct, run
        self.rng = random.Random(seed)
        self.tenant = 0

    def body(self, prompt: int, output: int, objective: str) -> tuple[dict, dict]:
        body = {"model": "tiny", "prompt": [self.rng.randrange(10, 400) for _ in range(prompt)],
                "max_tokens": output, "ignore_eos": True}
        if self.direct:
            return {**body, "priority": VLLM_PRIORITY[objective]}, {}
        self.tenant += 1  # each request a tenant (user) of its own: no tenant's share is under test here
        return body, {OBJECTIVE_HEADER: objective, FAIRNESS_HEADER: f"{objective}-{self.tenant}"}

    async def send(self, prompt: int, output: int, objective: str, arrived=None) -> Streamed:
        body, headers = self.body(prompt, output, objective)
        try:
            return await stream(self.session, self.url, body, headers, arrived)
        except aiohttp.ClientConnectionError:
            return Streamed(BROKEN)

    async def realtime(self, at: list[float], t0: float, prompt: int = 64, output: int = 16) -> None:
        async def one(offset: float) -> None:
            await asyncio.sleep(max(0.0, t0 + offset - time.monotonic()))
            got = await self.send(prompt, output, "realtime")
            if got.status == 200 and got.first is not None:
                self.run.ttft.append(got.first)
            else:
                self.run.ttft.append(float("inf"))
                self.run.realtime_refused[str(got.status)] = self.run.realtime_refused.get(str(got.status), 0) + 1
        await asyncio.gather(*(one(a) for a in at))

    async def batch_loop(self, window: tuple[float, float], prompt: int, output: int) -> None:
        def arrived(n: int) -> None:
            if window[0] <= time.monotonic() <= window[1]:
                self.run.batch_tokens += n
        while time.monotonic() < window[1]:
            got = await self.send(prompt, output, "batch", arrived)
            if got.status == 429 and got.first is not None:
                self.run.batch_evicted += 1
            elif got.status != 200:
                self.run.batch_refused += 1
                await asyncio.sleep(0.2)  # the workers back off too

    async def other(self, prompt: int, output: int, objective: str, at: float) -> None:
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        got = await self.send(prompt, output, objective)
        self.run.other[str(got.status)] = self.run.other.get(str(got.status), 0) + 1


async def steps_in(engine: str, window: tuple[float, float]) -> float | None:
    """vLLM's engine steps (its vllm:iteration_tokens_total count) between the window's start and end."""
    name = "vllm:iteration_tokens_total_count"
    counts = []
    with httpx.Client() as client:
        for at in window:
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            counts.append((await asyncio.to_thread(vllm_values, client, engine, (name,))).get(name))
    return None if None in counts else counts[1] - counts[0]


async def drill(load: KvDrillLoad, name: str, batch: bool, window_s: float, lead_s: float, engine: str) -> None:
    """One drill's traffic: batch loops from `lead_s` before the window, the drill's own requests in it."""
    t0 = time.monotonic() + (lead_s if batch else 0.5)
    window = (t0, t0 + window_s)
    load.run.window = (round(t0 - load.run.origin, 2), round(t0 + window_s - load.run.origin, 2))
    steps = asyncio.create_task(steps_in(engine, window))
    shape = (900, 600, 5) if name == "realtime-burst" else (800, 400, 4)
    loops = [asyncio.create_task(load.batch_loop(window, shape[0], shape[1])) for _ in range(shape[2] if batch else 0)]
    if name == "long-session":
        async def session() -> None:
            await asyncio.sleep(max(0.0, t0 - time.monotonic()))
            for turn in range(7):
                await load.other(300 + 250 * turn, 120, "standard", 0.0)
        work = [session(), load.realtime([i * 0.5 for i in range(int(window_s * 2))], t0)]
    elif name == "surge":
        work = [*(load.other(500, 300, "standard", t0 + 2.0 + i / 16) for i in range(16)),
                load.realtime([i * 0.5 for i in range(int(window_s * 2))], t0)]
    else:
        bursts = [at for k in range(int(window_s // 4)) for at in [2.0 + 4 * k] * 6]
        work = [load.realtime(bursts, t0)]
    await asyncio.gather(*work, asyncio.sleep(max(0.0, window[1] - time.monotonic())))
    load.run.steps = await steps
    for task in loops:
        task.cancel()
    await asyncio.gather(*loops, return_exceptions=True)


def vllm_values(client: httpx.Client, engine: str, names: tuple[str, ...]) -> dict[str, float]:
    text = client.get(engine + "/metrics", timeout=5).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in names:
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


class Sampler(threading.Thread):
    """The gateway's reserved blocks on the replica and vLLM's used blocks, every `interval` s."""

    def __init__(self, run: KvDrillRun, engine: str, gateway: str | None, interval: float = 0.1):
        super().__init__(daemon=True)
        self.record, self.engine, self.gateway, self.interval = run, engine, gateway, interval
        self.stopped = threading.Event()

    def run_once(self, client: httpx.Client, t0: float) -> None:
        reserved = None
        try:
            if self.gateway:
                kv = client.get(self.gateway + "/admin/state", timeout=5,
                                headers={"Authorization": f"Bearer {ADMIN_KEY}"}).json().get("kv") or {}
                reserved = ((kv.get("replicas") or {}).get(self.engine) or {}).get("reserved_blocks")
            usage = vllm_values(client, self.engine, ("vllm:kv_cache_usage_perc",)).get("vllm:kv_cache_usage_perc")
        except (httpx.HTTPError, ValueError):
            return
        # vLLM's usage leaves out its null block: of the pool's blocks, one less can be used.
        used = None if usage is None else round(usage * (KV_BOUND_BLOCKS - 1), 2)
        self.record.samples.append((round(time.monotonic() - t0, 2), reserved, used))

    def run(self) -> None:
        t0 = self.record.origin
        with httpx.Client() as client:
            while not self.stopped.is_set():
                self.run_once(client, t0)
                self.stopped.wait(self.interval)


COUNTERS = ("vllm:num_preemptions_total",)


def one_run(engine: str, gateways: dict[str, str], drill_name: str, arm: str, group: int,
            args: argparse.Namespace) -> KvDrillRun:
    run = KvDrillRun(drill_name, arm, group, args.window)
    url = engine if arm == "vllm-alone" else gateways[{"admission-off": "off", TUNED: "tuned"}.get(arm, "on")]
    wait_idle(engine)
    with httpx.Client() as client:
        before = vllm_values(client, engine, COUNTERS)
    run.origin = time.monotonic()
    sampler = Sampler(run, engine, None if arm == "vllm-alone" else url)
    sampler.start()

    async def go() -> None:
        timeout = aiohttp.ClientTimeout(total=300)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
            load = KvDrillLoad(session, url, arm == "vllm-alone", run, args.seed * 1000 + group)
            await drill(load, drill_name, arm != "realtime-alone", args.window, args.lead, engine)
    asyncio.run(go())
    wait_idle(engine)
    sampler.stopped.set()
    sampler.join(5)
    with httpx.Client() as client:
        after = vllm_values(client, engine, COUNTERS)
    run.preemptions = after["vllm:num_preemptions_total"] - before["vllm:num_preemptions_total"]
    print(f"group {group} {drill_name:14s} {arm:14s}: preemptions {run.preemptions:.0f}, batch tokens "
          f"{run.batch_tokens}, realtime {len(run.ttft)} ({sum(run.realtime_refused.values())} refused), other "
          f"{run.other}", file=sys.stderr, flush=True)
    return run


def start_gateway(children: Children, tmp: Path, engine: str, admission: bool, tuned: str = "") -> str:
    """A gateway in front of `engine`; `tuned`: more admission settings (YAML flow mapping entries)."""
    port = free_port()
    name = "tuned" if tuned else "on" if admission else "off"
    path = tmp / f"gateway-{name}.yaml"
    path.write_text(CONFIG % {"admin": ADMIN_KEY, "slots": SLOTS, "admission": str(admission).lower(),
                              "tuned": f", {tuned}" if tuned else ""})
    proc = children.start([*pinned(RELAY_CPU, True), *holdback(
        "gateway", "--config", str(path), "--port", str(port), "--replicas", engine, "--log-level", "WARNING")],
        tmp / f"gateway-{name}.log")
    favour(proc.pid, NICE)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/v1/models", proc, timeout=60, what="gateway")
    return url


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--groups", type=int, default=3, help="groups of every drill's four arms (default %(default)s)")
    p.add_argument("--drills", default=",".join(DRILLS), help="comma-separated subset of: " + ", ".join(DRILLS))
    p.add_argument("--window", type=float, default=12.0, help="seconds of each drill's traffic (default %(default)s)")
    p.add_argument("--lead", type=float, default=3.0, help="seconds batch runs before the window (default %(default)s)")
    p.add_argument("--seed", type=int, default=47)
    p.add_argument("--out", type=Path, required=True, help="folder for raw/ and report.md")
    p.add_argument("--arms", default=",".join(ARMS), help="comma-separated subset of: " + ", ".join(ARMS)
                   + f" (and {TUNED} with --tuned); ratios need realtime-alone and vllm-alone")
    p.add_argument("--tuned", default="", metavar="SETTINGS",
                   help=f"run one more arm, {TUNED}: admission on with these settings, e.g. "
                        "'interactiveReserve: 0.1, batchPauseWatermark: 0.92'")
    args = p.parse_args(argv)
    arm_names = [a.strip() for a in args.arms.split(",") if a.strip()] + ([TUNED] if args.tuned else [])
    if [a for a in arm_names if a not in (*ARMS, TUNED)]:
        p.error(f"unknown arm(s) in --arms; choose from {', '.join(ARMS)}")
    drills = [d.strip() for d in args.drills.split(",") if d.strip()]
    unknown = [d for d in drills if d not in DRILLS]
    if unknown:
        p.error(f"unknown drill(s) {', '.join(unknown)}; choose from {', '.join(DRILLS)}")
    if args.groups < 1:
        p.error("--groups must be at least 1")
    python, model = engine_paths(p)
    favoured = pin_load(p)
    tmp = Path(tempfile.mkdtemp(prefix="kv-drills-"))
    children = Children()
    runs: list[KvDrillRun] = []
    order = random.Random(args.seed)
    raw = args.out / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    started = time.time()

    def save() -> None:  # after every run: a run stopped part-way keeps what it measured
        (raw / "runs.json").write_text(json.dumps({
            "args": {k: str(v) for k, v in vars(args).items()}, "favoured": favoured, "started": started,
            "engine": {"kv_blocks": KV_BOUND_BLOCKS, "block_size": 128, "slots": SLOTS, "cpu": ENGINE_CPU},
            "runs": [asdict(r) for r in runs]}))
    try:
        engine = start_vllm(children, tmp, python, model, SLOTS, pin=True, cpu=ENGINE_CPU, kv_blocks=KV_BOUND_BLOCKS)
        gateways = {"on": start_gateway(children, tmp, engine, True),
                    "off": start_gateway(children, tmp, engine, False)}
        if args.tuned:
            gateways["tuned"] = start_gateway(children, tmp, engine, True, args.tuned)
        for group in range(args.groups):
            for name in drills:
                arms = list(arm_names)
                order.shuffle(arms)
                for arm in arms:
                    runs.append(one_run(engine, gateways, name, arm, group, args))
                    save()
    finally:
        children.close()
        shutil.rmtree(tmp, ignore_errors=True)
    print(write_report(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
