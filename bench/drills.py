"""The KV policy's failure drills, run against a real holdback stack on simulated replicas.

One stack (two replicas, each its own simulator process so one can be killed; gateway, Batch API,
processor, workers) runs the whole timeline: batch jobs throughout; off-peak realtime; a ramp that raises
the rate step by step until the gateway rejects, then holds (the peak); off-peak again; a single-tenant
burst; a cancellation storm; a bad scheduling config pushed live, judged by its tail latency and rolled
back; kill -9 of a worker and of a replica. The replicas run without preemption, so any KV over-commitment
shows as a counted out-of-memory instead of being hidden by recompute. Everything observed goes into one
raw record; `bench.gates` turns it into figures and gates, `bench.drill_report` into the report.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import math
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import aiohttp
import httpx

from holdback.contract import FAIRNESS_HEADER, OBJECTIVE_HEADER, REQUEST_ID_HEADER
from bench.gates import NOT_CAPACITY, capacity_refused, served_ttfts
from bench.stats import percentile
from bench.lib.prometheus import series_labels
from bench.lib.stack import Stack, StackSpec
from bench.lib.traffic import stream_chat
from bench.lib.workload import RequestSpec, Shapes, Workload

log = logging.getLogger("bench.drills")


@dataclass(frozen=True)
class DrillPlan:
    """Durations, rates and sizes of one drills run."""

    offpeak_rate: float = 1.5
    offpeak_s: float = 30.0
    # Off-peak after the peak: long enough for the peak's longest requests (1,024 tokens) to finish and batch to
    # come back.
    offpeak_after_s: float = 45.0
    ramp_rates: tuple[float, ...] = (2.0, 3.0, 4.5, 6.75, 10.0, 15.0, 22.0, 30.0, 40.0)
    ramp_step_s: float = 15.0
    hold_s: float = 40.0
    burst_requests: int = 96
    burst_tenant: int = 3
    burst_s: float = 20.0
    storm_requests: int = 64
    storm_cancel_after_s: float = 4.0
    storm_s: float = 15.0
    bad_config_s: float = 40.0
    verify_s: float = 40.0
    kill_s: float = 40.0
    kill_long_requests: int = 16
    kill_idle_wait_s: float = 120.0  # longest wait for the survivors to run dry with batch dispatch paused
    batch_jobs: int = 2
    batch_lines: int = 1500
    worker_concurrency: int = 96
    drain_s: float = 240.0
    replicas: int = 2
    shapes: Shapes = Shapes()
    # The simulated replica: 8192 blocks of 16 tokens (a 32K-token input takes a quarter of it), 128 sequences.
    sim_args: tuple[str, ...] = (
        "--step-overhead-ms", "4", "--prefill-ms-per-token", "0.002", "--decode-base-ms", "30",
        "--decode-ms-per-seq", "0.3", "--max-num-seqs", "128", "--max-num-batched-tokens", "16384",
        "--num-blocks", "8192", "--block-size", "16", "--max-model-len", "40960", "--enable-prefix-caching",
        "--enable-prompt-tokens-details", "--preemption", "none", "--jitter", "0.05",
    )
    # Gateway concurrency per replica, half the replica's 128 sequences: every running sequence slows a simulated
    # step, and the peak must be one this two-core machine can generate and serve without running out of CPU
    # itself (the drills judge the policy, not the machine); 32K-token inputs still run out of KV first.
    max_concurrency: int = 64


QUICK = DrillPlan(
    offpeak_s=12.0, offpeak_after_s=30.0,
    ramp_rates=(2.0, 4.0, 7.0, 11.0, 16.0, 22.0, 28.0, 34.0, 40.0), ramp_step_s=7.0, hold_s=25.0, burst_requests=64,
    burst_s=10.0, storm_requests=40, storm_cancel_after_s=3.0, storm_s=10.0, bad_config_s=18.0, verify_s=18.0,
    kill_s=20.0, kill_long_requests=12, kill_idle_wait_s=90.0, batch_lines=450, drain_s=150.0,
    shapes=Shapes(mix=(0.5, 0.15, 0.2, 0.15)),
)
FULL = DrillPlan(shapes=Shapes(mix=(0.5, 0.15, 0.2, 0.15)))
# One drill at minimal sizes, for the test suite.
SMOKE = replace(
    QUICK, offpeak_s=4.0, offpeak_after_s=8.0, ramp_rates=(2.0, 6.0), ramp_step_s=4.0, hold_s=4.0, batch_jobs=1, batch_lines=60,
    storm_requests=16, storm_s=6.0, worker_concurrency=16, drain_s=90.0,
    shapes=Shapes(tenants=4, long_output_max_tokens=(64, 128), mix=(0.6, 0.1, 0.15, 0.15)),
)
PLANS = {"quick": QUICK, "full": FULL, "smoke": SMOKE}
DRILLS = ("ramp", "burst", "storm", "rollback", "kill")


def gateway_settings(plan: DrillPlan, admission: bool) -> dict:
    """The scheduling config under test: the seed's KV admission settings plus holdback and eviction."""
    settings = {
        "saturation": {"detector": "concurrency", "maxConcurrency": plan.max_concurrency, "headroom": 0.0},
        "usageLimit": {"policy": "static", "threshold": 1.0},
        # Critical requests keep 40% of the slots that interactive ones may not take (at the peak the replicas'
        # steps slow down with every running sequence; fewer interactive ones keep critical TTFT short), and a
        # request that cannot start within its class's patience is turned away (429, the client may retry) rather
        # than left to wait past any use: 1 s for critical (its TTFT goal is 0.9 s), 4 s for interactive. At
        # overload the gateway rejects; the ramp stops there.
        "flowControl": {"bands": [{"priority": 100, "ceiling": 1.0, "ttl": 1.0},
                                  {"priority": 0, "ceiling": 0.6, "ttl": 4.0},
                                  {"priority": -10, "ceiling": 0.5, "fairness": "round-robin"}]},
        "eviction": {"enabled": True, "maxPerDecision": 2},
        "admission": {"enabled": admission, "hardWatermark": 0.92, "admissionWatermark": 0.82,
                      "interactiveReserve": 0.25, "tenantMaxShare": 0.15, "queueDeadlineMs": 8000,
                      "maxNewTokensDefault": 1024},
    }
    # Keys this build's gateway may or may not have: reserve exactly the worst case (the reservation check
    # compares blocks one to one) and pause batch at the seed's 88%.
    from gateway.config import Admission

    optional = {"safetyFactor": 1.0, "batchPauseWatermark": 0.88,
                "kvPoolBlocks": int(plan.sim_args[list(plan.sim_args).index("--num-blocks") + 1])}
    for key, value in optional.items():
        if key in Admission.model_fields and not (key == "kvPoolBlocks" and "safetyFactor" in Admission.model_fields):
            settings["admission"][key] = value
    return settings


def bad_settings(good: dict) -> dict:
    """The bad push: a concurrency limit cut to 6 per replica, batch may take every slot and block, no tenant
    limit, no eviction. Critical requests then wait for slots held by long requests: tail latency."""
    from gateway.config import Admission

    bad = json.loads(json.dumps(good))
    bad["saturation"]["maxConcurrency"] = 6
    bad["flowControl"]["bands"] = [{"priority": 100, "ceiling": 1.0}, {"priority": 0, "ceiling": 1.0},
                                   {"priority": -10, "ceiling": 1.0, "fairness": "round-robin"}]
    bad["eviction"] = {**bad["eviction"], "enabled": False}
    if bad["admission"]["enabled"]:
        # As loose as the gateway accepts: it refuses a hard watermark that leaves less than one scheduling
        # cycle of growth (one block per running sequence) above it.
        loose = {"hardWatermark": 0.95, "batchPauseWatermark": 0.95, "admissionWatermark": 0.95,
                 "interactiveReserve": 0.0, "tenantMaxShare": 1.0, "tenantSoftShare": 1.0}
        bad["admission"].update({k: v for k, v in loose.items() if k in Admission.model_fields})
    return bad


# How far below the config's own admission watermark a rollback keeps it.
ROLLBACK_WATERMARK_STEP = 0.04


@dataclass
class Timeline:
    """Seconds since the run's t0 (monotonic), shared by the sampler, the traffic and the phases."""

    t0: float = field(default_factory=time.monotonic)
    phases: list[dict] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def phase(self, name: str, start: float, end: float | None = None) -> dict:
        p = {"name": name, "start": start, "end": end}
        self.phases.append(p)
        return p

    def event(self, name: str, **extra) -> None:  # noqa: ANN003
        self.events.append({"name": name, "t": self.now(), **extra})
        log.info("drill event=%s %s", name, json.dumps(extra, default=str)[:300])


@dataclass(eq=False)
class Sampler(threading.Thread):
    """Samples the gateway's KV ledger, every replica's KV usage and the batch jobs' progress."""

    stack: Stack
    timeline: Timeline
    batch_ids: list[str]
    interval: float = 0.5
    samples: list[dict] = field(default_factory=list)
    dead: set[int] = field(default_factory=set)  # replicas killed on purpose: not sampled any more

    def __post_init__(self) -> None:
        threading.Thread.__init__(self, daemon=True)
        self._stop_event = threading.Event()

    def one(self, client: httpx.Client) -> dict:
        sample: dict = {"t": self.timeline.now()}
        try:
            st = client.get(f"{self.stack.gateway_url}/admin/state", headers=self.stack.admin_headers).json()
            sample["kv"] = st.get("kv")
            sample["config_digest"] = (st.get("config") or {}).get("digest")
            sample["bands"] = {str(b.get("priority")): {"queued": b.get("queued"), "in_flight": b.get("in_flight"),
                                                        "dispatched": b.get("dispatched")}
                               for b in st.get("bands", [])}
            sample["evictions"] = int(((st.get("totals") or {}).get("evictions") or {}).get("issued") or 0)
        except (httpx.HTTPError, ValueError) as exc:
            sample["gateway_error"] = repr(exc)[:120]
        replicas = {}
        tenant_blocks: dict[str, int] = {}
        for i, url in enumerate(self.stack.replica_urls):
            if i in self.dead:
                continue
            try:
                s = client.get(f"{url}/admin/state", params={"history_since": time.time()}).json()
                replicas[str(i)] = {"usage": s["kv"]["usage"], "used": s["kv"]["used"],
                                    "num_blocks": s["kv"]["num_blocks"], "running": s["running"],
                                    "waiting": s["waiting"], "kv_oom": s.get("kv_oom"),
                                    "kv_oom_failed_requests": s.get("kv_oom_failed_requests")}
                # Blocks each tenant actually holds on the replica, by the request id the gateway passed on.
                for r in s["running_requests"] + s["waiting_requests"]:
                    tenant = tenant_of(r.get("external_id"))
                    if tenant is not None:
                        tenant_blocks[tenant] = tenant_blocks.get(tenant, 0) + int(r["num_blocks"])
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                replicas[str(i)] = {"error": repr(exc)[:120]}
        sample["replicas"] = replicas
        sample["tenant_blocks"] = tenant_blocks
        headers = {"Authorization": f"Bearer {self.stack.tenant_key}"}
        batches = {}
        for batch_id in self.batch_ids:
            try:
                b = client.get(f"{self.stack.api_url}/v1/batches/{batch_id}", headers=headers).json()
                counts = b.get("request_counts") or {}
                batches[batch_id] = {"completed": counts.get("completed", 0), "failed": counts.get("failed", 0),
                                     "total": counts.get("total", 0), "status": b.get("status")}
            except (httpx.HTTPError, ValueError) as exc:
                batches[batch_id] = {"error": repr(exc)[:120]}
        sample["batches"] = batches
        return sample

    def run(self) -> None:
        with httpx.Client(timeout=5) as client:
            while not self._stop_event.is_set():
                self.samples.append(self.one(client))
                self._stop_event.wait(self.interval)

    def stop(self) -> None:
        self._stop_event.set()
        self.join(15)


class Traffic:
    """Sends request specs to the gateway on one event loop and keeps every outcome."""

    def __init__(self, stack: Stack, timeline: Timeline, model: str):
        self.stack = stack
        self.timeline = timeline
        self.model = model
        self.records: list[dict] = []
        self.tasks: set[asyncio.Task] = set()
        self.session: aiohttp.ClientSession | None = None

    async def open(self) -> None:
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                             timeout=aiohttp.ClientTimeout(total=600))

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    async def _send(self, spec: RequestSpec) -> None:
        assert self.session is not None
        headers = {"Authorization": f"Bearer {self.stack.realtime_key}", OBJECTIVE_HEADER: spec.objective,
                   FAIRNESS_HEADER: spec.tenant, REQUEST_ID_HEADER: request_id(spec)}
        sent = self.timeline.now()
        outcome = await stream_chat(self.session, self.stack.gateway_url, headers, spec.body(self.model),
                                    spec.cancel_after)
        self.records.append({**spec.describe(), "sent_t": sent, **asdict(outcome)})

    async def play(self, specs: list[RequestSpec]) -> None:
        """Start each spec at its offset from now; returns when the last one is sent (not finished)."""
        start = time.monotonic()
        for spec in sorted(specs, key=lambda s: s.at):
            delay = start + spec.at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(self._send(spec))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def drain(self, timeout: float) -> int:
        """Wait for every request in flight; returns how many were still running at the timeout."""
        pending = set(self.tasks)
        if not pending:
            return 0
        _, still = await asyncio.wait(pending, timeout=timeout)
        return len(still)

    def since(self, t: float, phase: str | None = None) -> list[dict]:
        return [r for r in self.records if r["sent_t"] >= t and (phase is None or r["phase"] == phase)]


REQUEST_ID_PREFIX = "drill."


def request_id(spec: RequestSpec) -> str:
    """`drill.<tenant>.<index>`: the gateway passes it to the replica, whose /admin/state shows it."""
    return f"{REQUEST_ID_PREFIX}{spec.tenant}.{spec.index}"


def tenant_of(external_id: str | None) -> str | None:
    if not external_id or not external_id.startswith(REQUEST_ID_PREFIX):
        return None
    return external_id[len(REQUEST_ID_PREFIX):].rsplit(".", 1)[0]


def realtime_capacity_rejections(metrics: dict[str, float]) -> int:
    """Realtime requests the gateway has turned away for lack of capacity so far (its own counter, so a request
    still waiting for its 429 when a ramp step ends is counted as soon as the gateway gives up on it)."""
    total = 0.0
    for key, value in metrics.items():
        if not key.startswith("holdback_gateway_rejections_total{"):
            continue
        labels = series_labels(key)
        reason, band = labels.get("reason", ""), labels.get("band", "")
        if band.lstrip("-").isdigit() and int(band) >= 0 and not any(w in reason for w in NOT_CAPACITY):
            total += value
    return int(total)


def p95_ttft(records: list[dict], klass: str = "critical") -> float | None:
    return percentile(served_ttfts(records, klass), 0.95)


class DrillRun:
    """One timeline on one stack; `run()` returns the raw record."""

    def __init__(self, plan: DrillPlan, admission: bool, seed: int, out_dir: Path, drills: tuple[str, ...] = DRILLS,
                 ttft_gate_s: float = 0.9):
        self.plan = plan
        self.admission = admission
        self.seed = seed
        self.out_dir = out_dir
        self.drills = drills
        self.ttft_gate_s = ttft_gate_s
        self.workload = Workload(seed, plan.shapes)
        self.timeline = Timeline()
        self.record: dict = {"seed": seed, "admission": admission, "plan": asdict(plan), "drills": list(drills),
                             "ttft_gate_s": ttft_gate_s, "started_at": time.time()}

    # -- helpers ----------------------------------------------------------------------------------------
    def _gateway_metrics(self, stack: Stack) -> dict[str, float]:
        return {k: v for k, v in stack.gateway_metrics().items() if k.startswith("holdback_gateway")}

    def _digest(self, stack: Stack) -> str | None:
        return (stack.gateway_state().get("config") or {}).get("digest")

    async def _wait_digest(self, stack: Stack, changed_from: str | None, timeout: float = 20.0) -> str | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            digest = await asyncio.to_thread(self._digest, stack)
            if digest != changed_from:
                return digest
            await asyncio.sleep(0.2)
        return None

    async def _run_phase(self, traffic: Traffic, name: str, specs: list[RequestSpec], seconds: float) -> dict:
        phase = self.timeline.phase(name, self.timeline.now())
        await asyncio.gather(traffic.play(specs), asyncio.sleep(seconds))
        phase["end"] = self.timeline.now()
        return phase

    # -- drills -----------------------------------------------------------------------------------------
    async def _offpeak(self, traffic: Traffic, name: str, seconds: float) -> None:
        p = self.plan
        await self._run_phase(traffic, name, self.workload.realtime(name, p.offpeak_rate, seconds), seconds)

    async def _ramp(self, traffic: Traffic, stack: Stack) -> None:
        """Raise the rate step by step until the gateway rejects, then hold that rate (the peak)."""
        p = self.plan
        steps = []
        peak = self.timeline.phase("peak", self.timeline.now())
        hold_rate = p.ramp_rates[-1]
        before = realtime_capacity_rejections(await asyncio.to_thread(stack.gateway_metrics))
        for k, rate in enumerate(p.ramp_rates):
            start = self.timeline.now()
            await traffic.play(self.workload.realtime(f"ramp-{k}", rate, p.ramp_step_s))
            await asyncio.sleep(max(0.0, start + p.ramp_step_s - self.timeline.now()))
            seen = traffic.since(peak["start"])
            at_gateway = realtime_capacity_rejections(await asyncio.to_thread(stack.gateway_metrics)) - before
            n_rejected = max(sum(1 for r in seen if capacity_refused(r) and r["status"] == 429), at_gateway)
            steps.append({"rate": rate, "start": start, "end": self.timeline.now(), "rejected_so_far": n_rejected})
            if n_rejected:
                hold_rate = rate
                break
        self.record["ramp"] = {"steps": steps, "hold_rate": hold_rate, "reached_rejection": steps[-1]["rejected_so_far"] > 0}
        self.timeline.event("ramp_hold", rate=hold_rate, rejected=steps[-1]["rejected_so_far"])
        hold = self.timeline.phase("hold", self.timeline.now())
        await traffic.play(self.workload.realtime("hold", hold_rate, p.hold_s))
        await asyncio.sleep(max(0.0, hold["start"] + p.hold_s - self.timeline.now()))
        hold["end"] = peak["end"] = self.timeline.now()

    async def _burst(self, traffic: Traffic) -> None:
        p = self.plan
        specs = self.workload.burst("burst", p.burst_tenant, p.burst_requests)
        specs += self.workload.realtime("burst-background", p.offpeak_rate, p.burst_s)
        self.record["burst"] = {"tenant": specs[0].tenant, "requests": p.burst_requests}
        await self._run_phase(traffic, "burst", specs, p.burst_s)

    async def _storm(self, traffic: Traffic, stack: Stack) -> None:
        p = self.plan
        before = await asyncio.to_thread(self._gateway_metrics, stack)
        specs = self.workload.storm("storm", p.storm_requests, p.storm_cancel_after_s)
        specs += self.workload.realtime("storm-background", p.offpeak_rate, p.storm_s)
        phase = await self._run_phase(traffic, "storm", specs, p.storm_s)
        # Every storm request has been cancelled by now; give the releases time to be observed.
        await asyncio.sleep(3.0)
        after = await asyncio.to_thread(self._gateway_metrics, stack)
        self.record["storm"] = {"cancel_t": phase["start"] + p.storm_cancel_after_s, "metrics_before": before,
                                "metrics_after": after, "requests": p.storm_requests}

    async def _rollback(self, traffic: Traffic, stack: Stack, good: dict) -> None:
        """Push a bad config live (SIGHUP), judge it by critical p95 TTFT, roll it back, judge again."""
        p = self.plan
        rate = (self.record.get("ramp") or {}).get("hold_rate") or p.ramp_rates[len(p.ramp_rates) // 2]
        good_digest = await asyncio.to_thread(self._digest, stack)
        await asyncio.to_thread(stack.push_gateway_config, bad_settings(good))
        bad_digest = await self._wait_digest(stack, good_digest)
        self.timeline.event("bad_config_pushed", good_digest=good_digest, bad_digest=bad_digest)
        phase = await self._run_phase(traffic, "bad_config", self.workload.realtime("bad_config", rate, p.bad_config_s),
                                      p.bad_config_s)
        seen = [r for r in traffic.records if phase["start"] <= r["sent_t"] < phase["end"]]
        bad_p95 = p95_ttft(seen)
        detected = bad_p95 is None or bad_p95 > self.ttft_gate_s
        self.timeline.event("tail_latency_judged", p95_ttft_s=bad_p95, detected=detected)
        # Roll back whether or not the monitor fired, so the kill drill runs on the good config.
        response: dict = {}
        try:
            lower = round(good["admission"]["admissionWatermark"] - ROLLBACK_WATERMARK_STEP, 4)
            r = await asyncio.to_thread(httpx.post, f"{stack.gateway_url}/admin/rollback",
                                        json={"admissionWatermark": lower}, headers=stack.admin_headers, timeout=10)
            response = {"status": r.status_code, "body": _json_or_text(r)}
        except httpx.HTTPError as exc:
            response = {"status": 0, "body": repr(exc)[:200]}
        rolled_to = await self._wait_digest(stack, bad_digest, timeout=10.0) if response["status"] == 200 else None
        self.timeline.event("rolled_back", response=response, digest=rolled_to)
        verify = await self._run_phase(traffic, "after_rollback",
                                       self.workload.realtime("after_rollback", rate, p.verify_s), p.verify_s)
        self.record["rollback"] = {"rate": rate, "good_digest": good_digest, "bad_digest": bad_digest,
                                   "bad_window": [phase["start"], phase["end"]], "bad_p95_ttft_s": bad_p95,
                                   "detected": detected, "response": response, "digest_after": rolled_to,
                                   "verify_window": [verify["start"], verify["end"]],
                                   "good_admission_watermark": good["admission"].get("admissionWatermark")}

    async def _kill(self, traffic: Traffic, stack: Stack, sampler: Sampler) -> None:
        """kill -9 a worker and a replica mid-run, then compare the survivors' reservations with what runs there."""
        p = self.plan
        phase = self.timeline.phase("kill", self.timeline.now())
        background_s = p.kill_s / 2
        specs = self.workload.long_outputs("kill-long", p.kill_long_requests)
        specs += self.workload.realtime("kill-background", p.offpeak_rate, background_s)
        play = asyncio.create_task(traffic.play(specs))
        await asyncio.sleep(min(3.0, background_s / 2))
        victim = p.replicas - 1
        await asyncio.to_thread(stack.kill, "worker")
        self.timeline.event("worker_killed")
        await asyncio.to_thread(stack.kill, stack.sim_process(victim))
        sampler.dead.add(victim)
        self.timeline.event("replica_killed", replica=victim, url=stack.replica_urls[victim])
        await asyncio.sleep(2.0)
        await asyncio.to_thread(stack.start_workers)
        self.timeline.event("worker_restarted")
        # The gateway needs its health checks to mark the replica down. Then batch dispatch is paused (admin
        # API) and the realtime background has ended, so the ledger moves only when a request finishes and a
        # check can find a moment when gateway and replica agree; the long requests are still running.
        await play
        await asyncio.sleep(2.0)
        paused = await asyncio.to_thread(set_batch_dispatch, stack, False)
        self.timeline.event("batch_dispatch_paused", queues=paused)
        survivors = [i for i in range(p.replicas) if i != victim]
        checks = []
        # Until the survivors have nothing left (the last check then compares an idle ledger with idle
        # replicas: a stale reservation would still be there) or the time is up.
        deadline = self.timeline.now() + p.kill_idle_wait_s
        while self.timeline.now() < deadline:
            check = await asyncio.to_thread(reservation_check, stack, survivors, self.timeline)
            checks.append(check)
            if check.get("replicas") and all(r["sequences"] == 0 for r in check["replicas"].values()):
                break
            await asyncio.sleep(0.2)
        await asyncio.to_thread(set_batch_dispatch, stack, True)
        self.timeline.event("batch_dispatch_resumed")
        phase["end"] = self.timeline.now()
        self.record["kill"] = {"replica": victim, "url": stack.replica_urls[victim], "checks": checks}

    # -- the run ----------------------------------------------------------------------------------------
    async def _timeline(self, stack: Stack, model: str, sampler: Sampler, good: dict) -> None:
        traffic = Traffic(stack, self.timeline, model)
        await traffic.open()
        try:
            await self._offpeak(traffic, "offpeak_before", self.plan.offpeak_s)
            if "ramp" in self.drills:
                await self._ramp(traffic, stack)
                await self._offpeak(traffic, "offpeak_after", self.plan.offpeak_after_s)
            if "burst" in self.drills:
                await self._burst(traffic)
            if "storm" in self.drills:
                await self._storm(traffic, stack)
            if "rollback" in self.drills:
                await self._rollback(traffic, stack, good)
            if "kill" in self.drills:
                await self._kill(traffic, stack, sampler)
            drain = self.timeline.phase("drain", self.timeline.now())
            self.record["unfinished_requests"] = await traffic.drain(self.plan.drain_s)
            drain["end"] = self.timeline.now()
        finally:
            for task in list(traffic.tasks):
                task.cancel()
            await traffic.close()
        self.record["requests"] = traffic.records

    def run(self) -> dict:
        p = self.plan
        good = gateway_settings(p, self.admission)
        spec = StackSpec(replicas=p.replicas, sim_args=list(p.sim_args), gateway=good,
                         worker_concurrency=p.worker_concurrency, backoff_base=1.0, backoff_cap=8.0,
                         sim_per_replica=True)
        self.record["gateway_settings"] = good
        with Stack(spec, self.out_dir / "logs" / self.name) as stack:
            from openai import OpenAI

            client = OpenAI(base_url=f"{stack.api_url}/v1", api_key=stack.tenant_key, max_retries=2)
            model = httpx.get(f"{stack.gateway_url}/v1/models", headers={"Authorization": f"Bearer {stack.realtime_key}"},
                              timeout=10).json()["data"][0]["id"]
            batch_ids = []
            for job in range(p.batch_jobs):
                f = client.files.create(file=(f"drills-{job}.jsonl", io.BytesIO(self.workload.batch_file(job, p.batch_lines, model))),
                                        purpose="batch")
                batch_ids.append(client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                       completion_window="24h", metadata={"drills": self.name}).id)
            deadline = time.monotonic() + 60
            while any(client.batches.retrieve(b).status == "validating" for b in batch_ids):
                if time.monotonic() > deadline:
                    raise RuntimeError("drills: batch jobs still validating after 60 s")
                time.sleep(0.2)
            self.timeline = Timeline()
            sampler = Sampler(stack, self.timeline, batch_ids)
            sampler.start()
            stack.start_workers()
            self.timeline.event("batch_started", jobs=batch_ids)
            try:
                asyncio.run(self._timeline(stack, model, sampler, good))
                until = time.monotonic() + p.drain_s
                self.record["evicted_all_done"] = all(stack.wait_evicted_done(b, max(1.0, until - time.monotonic()))
                                                      for b in batch_ids)
            finally:
                sampler.stop()
            alive = [i for i in range(p.replicas) if i not in sampler.dead]
            states = stack.sim_states(alive, history_since=time.time() - self.timeline.now() - 5)
            self.record["replicas_final"] = {str(i): {k: v for k, v in s.items()
                                                      if k not in ("running_requests", "waiting_requests")}
                                             for i, s in zip(alive, states)}
            self.record["gateway_metrics"] = self._gateway_metrics(stack)
            self.record["gateway_state"] = stack.gateway_state()
            self.record["rows"] = [r for b in batch_ids for r in stack.batch_rows(b)]
            self.record["batches_final"] = [client.batches.retrieve(b).model_dump() for b in batch_ids]
            for b in batch_ids:
                if client.batches.retrieve(b).status not in ("completed", "failed", "cancelled", "expired"):
                    client.batches.cancel(b)
        self.record["samples"] = sampler.samples
        self.record["phases"] = self.timeline.phases
        self.record["events"] = self.timeline.events
        self.record["finished_at"] = time.time()
        return self.record

    @property
    def name(self) -> str:
        return f"drills-admission-{'on' if self.admission else 'off'}"


def set_batch_dispatch(stack: Stack, running: bool) -> list[str]:
    """Pause (or resume) every worker queue through the admin API; returns the queue names."""
    base = f"{stack.api_url}/admin/queues"
    names = [q["name"] for q in httpx.get(base, headers=stack.admin_headers, timeout=10).json()["data"]]
    for name in names:
        httpx.post(f"{base}/{name}/{'resume' if running else 'pause'}", headers=stack.admin_headers,
                   timeout=10).raise_for_status()
    return names


def reservation_check(stack: Stack, survivors: list[int], timeline: Timeline) -> dict:
    """The gateway's reserved blocks on each surviving replica against the worst-case blocks of what runs there.

    Read gateway, replicas, gateway: a check counts only when the two gateway reads agree (nothing moved
    in between), so it never compares two different moments.
    """
    out: dict = {"t": timeline.now(), "replicas": {}}
    try:
        first = stack.gateway_state().get("kv") or {}
        sims = stack.sim_states(survivors)
        second = stack.gateway_state().get("kv") or {}
    except (httpx.HTTPError, ValueError) as exc:
        out["error"] = repr(exc)[:200]
        return out
    for i, sim in zip(survivors, sims):
        url = stack.replica_urls[i]
        a = ((first.get("replicas") or {}).get(url) or {}).get("reserved_blocks")
        b = ((second.get("replicas") or {}).get(url) or {}).get("reserved_blocks")
        block = sim["kv"]["block_size"]
        live = sim["running_requests"] + sim["waiting_requests"]
        actual = sum(math.ceil((r["num_prompt_tokens"] + r["max_tokens"]) / block) for r in live)
        out["replicas"][str(i)] = {"reserved_blocks": a, "reserved_blocks_again": b, "stable": a is not None and a == b,
                                   "actual_blocks": actual, "sequences": len(live)}
    return out


def _json_or_text(r: httpx.Response) -> object:
    try:
        return r.json()
    except ValueError:
        return r.text[:300]


def run_drills(plan: DrillPlan, admission: bool, seed: int, out_dir: Path,
               drills: tuple[str, ...] = DRILLS) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    run = DrillRun(plan, admission, seed, out_dir, drills)
    record = run.run()
    (out_dir / "raw").mkdir(parents=True, exist_ok=True)
    path = out_dir / "raw" / f"{run.name}.json"
    path.write_text(json.dumps(record))
    return path
