"""The seed's holdback-and-eviction study, run against a real holdback stack.

Each scenario starts a fresh stack (simulated replicas, gateway, Batch API, processor, workers),
submits one real batch job through the Batch API, starts the workers `lead` seconds before realtime
traffic, then sends the same seeded realtime schedule to the gateway for `window` seconds. After the
window it lets every evicted request finish its retry, reads the figures through public interfaces
(Batch API, admin API, gateway and simulator metrics), cancels the rest of the batch, checks its output
file for duplicates and writes one raw record per run. `bench.report` turns the raw records into the
summary, the Markdown report and the plots.
"""

from __future__ import annotations

import asyncio
import gzip
import io
import json
import random
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import httpx

from bench.lib.stack import Stack, StackSpec
from bench.lib.traffic import prompt_text, run_realtime, schedule
from holdback.progress import Progress


@dataclass(frozen=True)
class StudyWorkload:
    """What every scenario sends; the same for all of them within one study."""

    lead_s: float = 60.0  # batch workers start this long before realtime traffic
    window_s: float = 300.0
    burst: int = 32
    rate: float = 4.0
    realtime_prompt_words: int = 230  # about 256 prompt tokens with the chat template (17 KV blocks)
    realtime_max_tokens: int = 8
    # Batch lines vary in length (seeded), as real batch inputs do; fixed lengths would make every
    # batch request dispatched together finish together, in waves no real workload has. Batch holds more KV per
    # request than realtime: longer documents and longer answers, whose blocks grow as they decode.
    batch_prompt_words: tuple[int, int] = (150, 300)  # uniform range; about 170..335 prompt tokens
    batch_max_tokens: tuple[int, int] = (48, 160)  # uniform range, mean 104
    batch_requests: int = 4000
    worker_concurrency: int = 64
    max_concurrency: int = 48
    backoff_base: float = 2.0
    backoff_cap: float = 60.0
    # The simulator's calibration (docs/study/README.md). KV blocks from the model and the GPU: a 32B dense model in
    # bf16 on one 80 GB GPU at 90% memory use keeps about 950 blocks of 16 tokens beside its weights, and 48 batch
    # requests fill 96% of them on average as they decode, so 48 is where the pool is full. Step timing fitted
    # to the seed's realtime-only p95 TTFT: a decode step dominates, so time to first token is mostly "wait for
    # the step in progress, then one step".
    sim_args: tuple[str, ...] = (
        "--step-overhead-ms", "5", "--prefill-ms-per-token", "0.015", "--decode-base-ms", "155",
        "--decode-ms-per-seq", "0.2", "--max-num-seqs", "256", "--max-num-batched-tokens", "8192",
        "--num-blocks", "950", "--block-size", "16", "--jitter", "0.05",
    )
    # Longest wait after the window for evicted requests to finish their retries (ends as soon as they have): at
    # a 25% batch ceiling a retry queues behind about 50 batch requests for 12 places.
    retry_wait_s: float = 300.0


QUICK = StudyWorkload(lead_s=8.0, window_s=60.0, batch_requests=1500, backoff_base=1.0, backoff_cap=8.0,
                 retry_wait_s=60.0)
FULL = StudyWorkload()


# The simulator flags that turn prefix caching on and report its hits in usage (the workers' cached_tokens).
CACHE = ("--enable-prefix-caching", "--enable-prompt-tokens-details")
# Prefix caching with a host-memory tier behind it (vLLM's CPU offloading connector): 10x the GPU's 950 blocks,
# about 38 GiB of host memory at 4 MiB a block (a 32B model's KV of 16 tokens in bf16), ordinary on a GPU server.
OFFLOAD = (*CACHE, "--kv-offload-blocks", "9500")
ADAPTIVE_RESERVE = {"protectedPriority": 0, "margin": 0.05, "halfLifeSeconds": 5.0, "peakWindowSeconds": 5.0}


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    batch: bool = True
    batch_ceiling: float | None = 0.5  # None: no holdback (batch may fill the whole budget)
    eviction: bool = False
    replicas: int = 1
    objective: str = "realtime"  # what the interactive traffic asks for
    # Variations for the eviction-cost bench: the gateway's victim policy (None: its default), extra
    # simulator flags (prefix caching) and worker flags (--no-resume).
    eviction_policy: str | None = None
    sim_extra: tuple[str, ...] = ()
    worker_args: tuple[str, ...] = ()
    # The adaptive reserve: batch's ceiling follows realtime demand (gateway usageLimit adaptive-reserve)
    # instead of the fixed `batch_ceiling`, which is then its floor.
    adaptive: bool = False
    # The most of the pool batch may borrow under the adaptive reserve (its `maxCeiling`).
    max_ceiling: float = 1.0
    # False: no realtime traffic; the window only measures batch alone (the harvest's denominator).
    realtime: bool = True
    # True: the gateway's KV admission on, with gateway/default.yaml's settings but no per-tenant share (the
    # study's batch is one tenant's), off in the seed's scenarios, which compare request-count control only.
    kv_admission: bool = False
    # The gateway's picker.evictedAffinity: an evicted request's retry goes back to the replica it ran on.
    evicted_affinity: bool = True
    # Realtime burst and rate are per replica: two replicas get twice the traffic, so each replica sees the
    # pressure the one-replica runs see and eviction is exercised across replicas.

    def gateway_overrides(self, w: StudyWorkload) -> dict:
        # Explicit ceilings per band: realtime and standard may use the whole pool, batch stops at its ceiling
        # (no holdback: batch may fill the whole request budget too).
        batch_ceiling = 1.0 if self.batch_ceiling is None else self.batch_ceiling
        batch_band = {"priority": -10, "fairness": "round-robin"}
        if self.adaptive:
            # The fixed ceiling is the floor. A realtime request lives about 1.5 s here, so a 5 s peak window (the
            # gateway default is 30 s) still covers several lifetimes of arrival noise, and a 5% margin (the
            # default 10%) is two realtime requests of the 48: eviction covers the rest. Quick runs at 10 s and
            # 10% held batch at a mean ceiling of 0.61, fewer completions than the fixed 25% reserve.
            usage = {"policy": "adaptive-reserve", "minCeiling": batch_ceiling, "maxCeiling": self.max_ceiling,
                     "adaptive": ADAPTIVE_RESERVE}
        else:
            usage = {"policy": "static", "threshold": 1.0}
            batch_band["ceiling"] = batch_ceiling
        bands = [{"priority": 100, "ceiling": 1.0}, {"priority": 0, "ceiling": 1.0}, batch_band]
        return {
            "saturation": {"detector": "concurrency", "maxConcurrency": w.max_concurrency, "headroom": 0.0},
            "usageLimit": usage,
            "flowControl": {"bands": bands},
            "eviction": {"enabled": self.eviction, "maxPerDecision": 2,
                         **({"policy": self.eviction_policy} if self.eviction_policy else {})},
            **({} if self.evicted_affinity else {"picker": {"evictedAffinity": False}}),
            **({"admission": {"enabled": True, "tenantMaxShare": 1.0, "tenantSoftShare": 1.0}}
               if self.kv_admission else {}),
        }


SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario("realtime_only", "Realtime only", batch=False),
    Scenario("batch_alone", "Batch alone, whole pool", batch_ceiling=None, realtime=False),
    Scenario("no_controls", "Realtime + batch, no controls", batch_ceiling=None),
    Scenario("holdback_50", "Priority holdback (50% reserve)", batch_ceiling=0.5),
    Scenario("holdback_50_evict", "Holdback (50%) + eviction and retry", batch_ceiling=0.5, eviction=True),
    Scenario("reserve_25_evict", "Reserve 25% + eviction", batch_ceiling=0.75, eviction=True),
    # No reserve at all: batch may fill the pool, and realtime takes its slots back by eviction (the real-engine
    # study's best configuration; docs/study/no-reserve/ says why it is not the default).
    Scenario("no_reserve_evict", "No reserve + eviction", batch_ceiling=None, eviction=True),
    # The same, the fixed 50% reserve and the adaptive one (gateway/default.yaml's usageLimit), each with KV
    # admission as the default has it.
    Scenario("no_reserve_evict_kv", "No reserve + eviction, KV admission", batch_ceiling=None, eviction=True,
             kv_admission=True),
    Scenario("holdback_50_evict_kv", "Holdback (50%) + eviction, KV admission", batch_ceiling=0.5, eviction=True,
             kv_admission=True),
    Scenario("adaptive_evict_kv", "Adaptive reserve + eviction, KV admission", batch_ceiling=0.5, eviction=True,
             adaptive=True, kv_admission=True),
    Scenario("reserve_75_evict", "Reserve 75% + eviction", batch_ceiling=0.25, eviction=True),
    Scenario("reserve_25_noevict", "Reserve 25%, eviction off", batch_ceiling=0.75, eviction=False),
    Scenario("two_replicas", "Holdback (50%) + eviction, two replicas", batch_ceiling=0.5, eviction=True, replicas=2),
    Scenario("adaptive_evict", "Adaptive reserve + eviction", batch_ceiling=0.5, eviction=True, adaptive=True),
    Scenario("standard_check", "Standard (priority 0) reclaims from batch", batch_ceiling=0.5, eviction=True,
             objective="standard"),
    # What an eviction costs, at the fixed 50% reserve (bench/eviction_cost.py runs the same arms on their own):
    # today's newest-first victims restarted from scratch against cost-ranked victims resumed from their
    # partial output, each with the replica's prefix caching off and on.
    Scenario("evict_newest_restart", "Newest-first + restart (50%), cache off", eviction=True,
             eviction_policy="newest-first", worker_args=("--no-resume",)),
    Scenario("evict_cost_resume", "Cost-ranked + resume (50%), cache off", eviction=True,
             eviction_policy="cost-ranked"),
    Scenario("evict_newest_restart_cache", "Newest-first + restart (50%), cache on", eviction=True,
             eviction_policy="newest-first", worker_args=("--no-resume",), sim_extra=CACHE),
    Scenario("evict_cost_resume_cache", "Cost-ranked + resume (50%), cache on", eviction=True,
             eviction_policy="cost-ranked", sim_extra=CACHE),
)}


@dataclass(eq=False)
class StudySampler(threading.Thread):
    """Samples batch progress and the gateway's state once per `interval` while a run goes on."""

    stack: Stack
    batch_id: str
    interval: float = 0.5
    samples: list[dict] = field(default_factory=list)
    t0: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        threading.Thread.__init__(self, daemon=True)
        self._stop_event = threading.Event()

    def run(self) -> None:
        headers = {"Authorization": f"Bearer {self.stack.tenant_key}"}
        with httpx.Client(timeout=5) as client:
            while not self._stop_event.is_set():
                t = time.monotonic() - self.t0
                sample: dict = {"t": t}
                try:
                    b = client.get(f"{self.stack.api_url}/v1/batches/{self.batch_id}", headers=headers).json()
                    sample["completed"] = (b.get("request_counts") or {}).get("completed", 0)
                    sample["failed"] = (b.get("request_counts") or {}).get("failed", 0)
                    st = client.get(f"{self.stack.gateway_url}/admin/state", headers=self.stack.admin_headers).json()
                    sample["bands"] = {str(x.get("priority")): {"queued": x.get("queued"), "in_flight": x.get("in_flight")}
                                       for x in st.get("bands", [])}
                    sample["evictions"] = _eviction_total(st)
                    sample["saturation"] = st.get("saturation")
                    sample["batch_ceiling"] = ((st.get("holdback") or {}).get("ceilings") or {}).get("-10")
                except (httpx.HTTPError, ValueError) as exc:
                    sample["error"] = repr(exc)[:120]
                self.samples.append(sample)
                self._stop_event.wait(self.interval)

    def stop(self) -> None:
        self._stop_event.set()
        self.join(10)


def _eviction_total(state: dict) -> int:
    """Evictions the gateway has issued since it started (`totals.evictions.issued` in /admin/state)."""
    return int(((state.get("totals") or {}).get("evictions") or {}).get("issued") or 0)


def batch_file(w: StudyWorkload, model: str, seed: int) -> bytes:
    rng = random.Random(seed + 2)
    out = io.StringIO()
    for i in range(w.batch_requests):
        out.write(json.dumps({
            "custom_id": f"req-{i:06d}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "max_tokens": rng.randint(*w.batch_max_tokens), "ignore_eos": True,
                     "messages": [{"role": "user", "content": prompt_text(rng, rng.randint(*w.batch_prompt_words))}]},
        }) + "\n")
    return out.getvalue().encode()


def run_one(scenario: Scenario, w: StudyWorkload, repeat: int, seed: int, out_dir: Path, log=print,  # noqa: ANN001
            collect: Callable[[Stack, list[dict]], dict] | None = None) -> dict:
    """One run; `collect(stack, rows)` adds its own read-outs while the stack is up (before the cancel)."""
    spec = StackSpec(replicas=scenario.replicas, sim_args=[*w.sim_args, *scenario.sim_extra],
                     gateway=scenario.gateway_overrides(w), worker_concurrency=w.worker_concurrency,
                     backoff_base=w.backoff_base, backoff_cap=w.backoff_cap, worker_args=list(scenario.worker_args))
    run_name = f"{scenario.name}-r{repeat}"
    record: dict = {"scenario": asdict(scenario), "repeat": repeat, "seed": seed, "workload": asdict(w),
                    "gateway_overrides": spec.gateway, "started_at": time.time()}
    with Stack(spec, out_dir / "logs" / run_name) as stack:
        from openai import OpenAI

        client = OpenAI(base_url=f"{stack.api_url}/v1", api_key=stack.tenant_key, max_retries=2)
        model = httpx.get(f"{stack.gateway_url}/v1/models",
                          headers={"Authorization": f"Bearer {stack.realtime_key}"}, timeout=10).json()["data"][0]["id"]
        batch_id = None
        if scenario.batch:
            f = client.files.create(file=("study.jsonl", io.BytesIO(batch_file(w, model, seed))), purpose="batch")
            batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                                          metadata={"scenario": scenario.name, "repeat": str(repeat)})
            batch_id = batch.id
            deadline = time.monotonic() + 60
            while client.batches.retrieve(batch_id).status == "validating":
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{run_name}: batch still validating after 60 s")
                time.sleep(0.2)
            stack.start_workers()
        sampler = StudySampler(stack, batch_id) if batch_id else None
        if sampler:
            sampler.start()
        time.sleep(w.lead_s if scenario.batch else 1.0)
        t_rt = time.monotonic()
        offsets = schedule(seed, w.burst * scenario.replicas, w.rate * scenario.replicas, w.window_s)
        if scenario.realtime:
            realtime = asyncio.run(run_realtime(stack.gateway_url, stack.realtime_key, model, offsets,
                                                objective=scenario.objective, prompt_words=w.realtime_prompt_words,
                                                max_tokens=w.realtime_max_tokens, seed=seed))
        else:
            realtime = []
            time.sleep(w.window_s)
        t_end = time.monotonic()
        record["realtime"] = [r.to_json() for r in realtime]
        record["window"] = {"realtime_start": (t_rt - sampler.t0) if sampler else 0.0,
                            # Wall clock of the same instant, to place the Batch API's timestamps in the window.
                            "realtime_start_wall": time.time() - (time.monotonic() - t_rt),
                            "window_s": w.window_s, "traffic_done": (t_end - sampler.t0) if sampler else t_end - t_rt}
        record["evicted_all_done"] = None
        if batch_id:
            record["evicted_all_done"] = stack.wait_evicted_done(batch_id, w.retry_wait_s)
        # Read before the cancel below: its aborts must not count as eviction recompute.
        record["sim_metrics"] = stack.sim_metrics()
        record["gateway_metrics"] = {k: v for k, v in stack.gateway_metrics().items() if k.startswith("holdback_gateway")}
        record["gateway_state"] = stack.gateway_state()
        if sampler:
            sampler.stop()
            record["samples"] = sampler.samples
        if batch_id:
            record["rows"] = stack.batch_rows(batch_id)
            if collect is not None:
                record["collected"] = collect(stack, record["rows"])
            client.batches.cancel(batch_id)
            deadline = time.monotonic() + 60
            b = client.batches.retrieve(batch_id)
            while b.status not in ("cancelled", "completed") and time.monotonic() < deadline:
                time.sleep(0.3)
                b = client.batches.retrieve(batch_id)
            record["batch_final"] = b.model_dump()
            lines = []
            if b.output_file_id:
                lines = [json.loads(x) for x in client.files.content(b.output_file_id).text.splitlines() if x.strip()]
            record["output_custom_ids"] = [x["custom_id"] for x in lines]
    record["finished_at"] = time.time()
    (out_dir / "raw").mkdir(parents=True, exist_ok=True)
    # Written whole or not at all: a run stopped mid-write leaves no record for --resume to trust.
    tmp = out_dir / "raw" / f".{run_name}.json.tmp"
    tmp.write_text(json.dumps(record))
    tmp.replace(out_dir / "raw" / f"{run_name}.json")
    return record


class StudyMismatch(ValueError):
    """The output folder holds records of another workload or seed: resuming would mix two studies."""


# Per run, beyond the batch lead and the window: starting the stack, submitting and validating the batch, waiting
# for evicted requests' retries, reading the rows and stopping (measured: 6-14 s in quick mode on two cores; full
# mode waits longer for retries and reads four times the rows). Used until the folder has records to measure.
RUN_OVERHEAD_S = 25.0


def _normalized(workload: StudyWorkload) -> dict:
    return json.loads(json.dumps(asdict(workload)))


def record_paths(out_dir: Path) -> list[Path]:
    """The raw run records in out_dir/raw: `<scenario>-r<repeat>.json`, or gzipped (`.json.gz`) once committed."""
    raw = out_dir / "raw"
    return sorted([*raw.glob("*.json"), *raw.glob("*.json.gz")])


def read_record(path: Path) -> dict:
    data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    return json.loads(data)


def recorded_runs(out_dir: Path, w: StudyWorkload, seed: int) -> dict[tuple[str, int], dict]:
    """The (scenario, repeat) runs already recorded under out_dir/raw, checked to be of this workload and seed."""
    done: dict[tuple[str, int], dict] = {}
    want = _normalized(w)
    for path in record_paths(out_dir):
        try:
            record = read_record(path)
        except (ValueError, OSError, EOFError):
            continue  # unreadable (a run stopped mid-write): run again
        repeat = record.get("repeat", 0)
        if record.get("workload") != want or record.get("seed") != seed + repeat:
            changed = [f"{k} {(record.get('workload') or {}).get(k)!r} against {want[k]!r}" for k in sorted(want)
                       if (record.get("workload") or {}).get(k) != want[k]]
            if record.get("seed") != seed + repeat:
                changed.append(f"seed {record.get('seed')} against {seed + repeat}")
            raise StudyMismatch(
                f"{path} was recorded with another workload or seed ({'; '.join(changed)}): pass the same mode, "
                f"--window, --lead and --seed as the interrupted run, or a new --out")
        done[(record["scenario"]["name"], repeat)] = record
    return done


def run_seconds(scenario: Scenario, w: StudyWorkload, overhead: float) -> float:
    return (w.lead_s if scenario.batch else 1.0) + w.window_s + overhead


def measured_overhead(records: list[dict]) -> float | None:
    """Median seconds a recorded run took beyond its lead and window (None without records)."""
    extra = []
    for r in records:
        if r.get("finished_at") and r.get("started_at"):
            lead = r["workload"]["lead_s"] if r["scenario"].get("batch", True) else 1.0
            extra.append(r["finished_at"] - r["started_at"] - lead - r["workload"]["window_s"])
    return statistics.median(extra) if extra else None


def format_duration(seconds: float) -> str:
    minutes = round(seconds / 60)
    return f"{minutes // 60} h {minutes % 60:02d} min" if minutes >= 60 else f"{minutes} min"


def run_study(names: list[str], w: StudyWorkload, repeats: int, seed: int, out_dir: Path, resume: bool = False,
              log: Callable[[str], None] = print) -> list[Path]:
    """Run every (scenario, repeat) not yet recorded in out_dir (with `resume`; without it the folder must have no
    records) and return the raw record paths of the whole plan."""
    out_dir.mkdir(parents=True, exist_ok=True)
    done = recorded_runs(out_dir, w, seed)
    if done and not resume:
        raise StudyMismatch(f"{out_dir} already holds {len(done)} run record(s): pass --resume to skip them and run "
                            f"the rest, or choose a new --out")
    meta_path = out_dir / "study.json"
    if meta_path.exists():
        old = json.loads(meta_path.read_text())
        names = list(dict.fromkeys([*old.get("scenarios", []), *names]))
        repeats = max(repeats, old.get("repeats", 0))
    meta_path.write_text(json.dumps({"workload": asdict(w), "repeats": repeats, "seed": seed, "scenarios": names},
                                    indent=2))
    plan = [(SCENARIOS[n], r) for r in range(repeats) for n in names]
    todo = [(sc, r) for sc, r in plan if (sc.name, r) not in done]
    overhead = measured_overhead(list(done.values()))
    per_run = RUN_OVERHEAD_S if overhead is None else max(overhead, 0.0)
    total = sum(run_seconds(sc, w, per_run) for sc, _ in todo)
    log(f"holdback bench study: {len(todo)} run(s) to do of {len(plan)} ({len(plan) - len(todo)} already recorded) "
        f"-> {out_dir}; estimated {format_duration(total)} (each: batch lead {w.lead_s:.0f} s + window "
        f"{w.window_s:.0f} s + about {per_run:.0f} s to start, drain retries and stop, "
        f"{'measured on the recorded runs' if overhead is not None else 'until runs are recorded'})")
    progress = Progress(len(todo), "runs", every=0)
    for i, (scenario, repeat) in enumerate(todo):
        progress.update(i, f"{scenario.name} (repeat {repeat + 1}/{repeats})")
        # Same traffic schedule for every scenario within a repeat; a new one per repeat.
        run_one(scenario, w, repeat, seed + repeat, out_dir)
    progress.update(len(todo), "done", force=True)
    progress.close()
    return [out_dir / "raw" / f"{sc.name}-r{r}.json" for sc, r in plan]


def with_overrides(w: StudyWorkload, **kw) -> StudyWorkload:  # noqa: ANN003
    return replace(w, **{k: v for k, v in kw.items() if v is not None})
