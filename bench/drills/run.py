"""One drills run: the whole timeline on one stack (off-peak, ramp and hold, burst, storm, rollback, kill), its
raw record written to OUT/raw/drills-admission-on|off.json."""

from __future__ import annotations

import asyncio
import io
import json
import math
import time
from dataclasses import asdict
from pathlib import Path

import httpx

from bench.drills.gates import NOT_CAPACITY, capacity_refused, served_ttfts
from bench.drills.plan import DRILLS, ROLLBACK_WATERMARK_STEP, DrillPlan, bad_settings, gateway_settings
from bench.drills.sampler import DrillSampler
from bench.drills.timeline import Timeline
from bench.drills.traffic import Traffic
from bench.lib.prometheus import series_labels
from bench.lib.stack import Stack, StackSpec
from bench.lib.workload import RequestSpec, Workload
from bench.stats import percentile


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

    async def _kill(self, traffic: Traffic, stack: Stack, sampler: DrillSampler) -> None:
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
    async def _timeline(self, stack: Stack, model: str, sampler: DrillSampler, good: dict) -> None:
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
            sampler = DrillSampler(stack, self.timeline, batch_ids)
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
