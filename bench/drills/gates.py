"""The deployment gates of the KV policy, each computed with its figure from one drills raw record.

A gate passes, fails, or is `n/a` when its drill did not run or had nothing to judge (said in its note).
A gate whose data the stack does not export fails and says which export is missing: a gate that cannot
be measured has not been passed. Tail percentiles carry a 95% interval and say whether the goal is decided.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from bench.stats import Estimate, decide, histogram_quantile, percentile, quantile_interval

RELEASE_GATE_S = 2.0
EVICTED_COMPLETE_GATE = 0.99
RELEASE_METRIC = "holdback_gateway_kv_release_seconds"
PAUSED_LEVELS = ("pause-batch", "evict")
BATCH_PRIORITY = "-10"  # the batch band of the drills' gateway config
PAUSE_MIN_S = 3.0  # the shortest stretch of no batch dispatch, with batch waiting, that counts as a pause
NOT_CAPACITY = ("quota", "context", "cancel")  # the caller's own limits, or the caller gone: not a full gateway


@dataclass
class Gate:
    name: str
    goal: str
    figure: str
    status: str  # pass | fail | n/a
    note: str = ""

    @property
    def failed(self) -> bool:
        return self.status == "fail"

    def to_json(self) -> dict:
        return asdict(self)


def tail_verdict(values: list[float], q: float, limit: float) -> tuple[float | None, str, str]:
    """(estimate, status, 'p95 X ms [lo, hi], decided|undecided'): the gate passes on the point estimate; it is
    decided when the interval lies on one side of the limit."""
    est = percentile(values, q)
    if est is None:
        return None, "fail", "no samples"
    lo, hi = quantile_interval(values, q)
    status = "pass" if est <= limit else "fail"
    decided = decide(Estimate(est, lo, hi), limit, at_least=False) in ("met", "missed")
    interval = f"[{lo * 1000:.0f}, {hi * 1000:.0f}]" if lo is not None else "[no interval under 20 samples]"
    text = f"p{int(q * 100)} {est * 1000:.0f} ms {interval} n={len(values)}, {'decided' if decided else 'undecided'}"
    return est, status, text


def _phase(record: dict, name: str) -> dict | None:
    return next((p for p in record.get("phases", []) if p["name"] == name), None)


def _in(t: float, phase: dict | None) -> bool:
    return phase is not None and phase["start"] <= t < (phase["end"] if phase["end"] is not None else math.inf)


def capacity_refused(record: dict) -> bool:
    """A request the stack did not serve for lack of capacity or by failing: a 429 that is not about the caller's
    own quota or context, or an error. Quota rejections are the policy holding a tenant to its share."""
    if record["status"] == 429:
        return not any(w in (record.get("drop_reason") or "") for w in NOT_CAPACITY)
    return record["status"] != 200 and record["status"] != 499


def critical_ttfts(records: list[dict]) -> list[float]:
    """TTFTs of the critical requests served, and an infinite one for each refused for capacity or failed: a
    request that never got its first token missed the goal."""
    critical = [r for r in records if r["klass"] == "critical"]
    return served_ttfts(critical) + [math.inf] * sum(1 for r in critical if capacity_refused(r))


def served_ttfts(records: list[dict], klass: str = "critical") -> list[float]:
    """TTFTs of the requests of `klass` that were served."""
    return [r["ttft_s"] for r in records if r["klass"] == klass and r["status"] == 200 and r["ttft_s"] is not None]


def _has_ledger(record: dict) -> bool:
    return any(s.get("kv") for s in record.get("samples", []))


NO_LEDGER = "the gateway's /admin/state has no `kv` ledger (KV admission not in this build, or turned off)"


# -- each gate ---------------------------------------------------------------------------------------------
def oom_gate(record: dict) -> Gate:
    per_replica: dict[str, int] = {}
    failed: dict[str, int] = {}
    for s in record.get("samples", []):
        for i, r in (s.get("replicas") or {}).items():
            if r.get("kv_oom") is not None:
                per_replica[i] = max(per_replica.get(i, 0), int(r["kv_oom"]))
                failed[i] = max(failed.get(i, 0), int(r.get("kv_oom_failed_requests") or 0))
    for i, r in (record.get("replicas_final") or {}).items():
        if r.get("kv_oom") is not None:
            per_replica[i] = max(per_replica.get(i, 0), int(r["kv_oom"]))
            failed[i] = max(failed.get(i, 0), int(r.get("kv_oom_failed_requests") or 0))
    if not per_replica:
        return Gate("zero OOMs", "0 out-of-memory events", "no data", "fail", "the replicas export no kv_oom")
    total = sum(per_replica.values())
    return Gate("zero OOMs", "0 out-of-memory events in the run", f"{total} OOMs, {sum(failed.values())} requests failed",
                "pass" if total == 0 else "fail")


def release_gate(record: dict) -> Gate:
    storm = record.get("storm")
    goal = f"reserved blocks released within {RELEASE_GATE_S:.0f} s at p99 after cancellation"
    if not storm:
        return Gate("release after cancel", goal, "-", "n/a", "storm drill not run")
    before, after = storm["metrics_before"], storm["metrics_after"]
    delta = {k: v - before.get(k, 0.0) for k, v in after.items() if k.startswith(RELEASE_METRIC)}
    count = sum(v for k, v in delta.items() if k.startswith(f"{RELEASE_METRIC}_count"))
    if not any(k.startswith(RELEASE_METRIC) for k in after):
        return Gate("release after cancel", goal, "no data", "fail", f"the gateway exports no {RELEASE_METRIC}")
    if count <= 0:
        return Gate("release after cancel", goal, "0 releases observed", "fail", "no release during the storm")
    p99 = histogram_quantile(delta, RELEASE_METRIC, 0.99)
    figure = f"p99 {p99 * 1000:.1f} ms over {count:.0f} releases (histogram, storm window)"
    return Gate("release after cancel", goal, figure, "pass" if p99 is not None and p99 <= RELEASE_GATE_S else "fail",
                "interpolated within histogram buckets; every end, cancel and eviction in the window counts")


def _excluded_window(record: dict) -> dict | None:
    """When the config under test was not running: the bad push, and everything after it if the rollback failed."""
    bad = _phase(record, "bad_config")
    rb = record.get("rollback") or {}
    if bad is not None and rb and not rb.get("digest_after"):
        bad = {"start": bad["start"], "end": None}
    return bad


def good_config(record: dict) -> list[dict]:
    """Requests sent while the config under test ran."""
    bad = _excluded_window(record)
    return [r for r in record.get("requests", []) if not _in(r["sent_t"], bad)]


def ttft_gate(record: dict) -> Gate:
    limit = record.get("ttft_gate_s", 0.9)
    recs = good_config(record)
    critical = [r for r in recs if r["klass"] == "critical"]
    refused = [r for r in critical if capacity_refused(r)]
    est, status, text = tail_verdict(critical_ttfts(recs), 0.95, limit)
    other = sum(1 for r in critical if r["status"] != 200) - len(refused)
    return Gate("critical p95 TTFT", f"p95 time to first token of critical realtime <= {limit * 1000:.0f} ms",
                text, status, f"{len(refused)}/{len(critical)} critical requests refused for capacity or failed, "
                f"counted as misses; {other} rejected for their tenant's quota or cancelled, not counted; "
                "bad config excluded"
                + ("" if (record.get("rollback") or {}).get("digest_after") or not record.get("rollback")
                   else " (and everything after it: the rollback failed)"))


def tenant_share_gate(record: dict) -> Gate:
    limit = float(((record.get("gateway_settings") or {}).get("admission") or {}).get("tenantMaxShare", 0.15))
    goal = f"no tenant's actual KV share above its hard limit {limit:.0%}"
    samples = [s for s in record.get("samples", []) if s.get("replicas")]
    if not samples or not any("tenant_blocks" in s for s in samples):
        return Gate("tenant share", goal, "no data", "fail", "no replica samples with per-request blocks")
    pool = sum(int(r.get("num_blocks") or 0) for r in samples[0]["replicas"].values())
    excluded = _excluded_window(record)
    worst, who, when = 0.0, None, None
    for s in samples:
        if excluded is not None and _in(s["t"], excluded):
            continue
        for tenant, blocks in (s.get("tenant_blocks") or {}).items():
            if blocks / pool > worst:
                worst, who, when = blocks / pool, tenant, s["t"]
    ledger = max((float(v.get("share") or 0.0) for s in samples if s.get("kv")
                  for v in ((s["kv"].get("tenants") or {}).values())), default=None)
    figure = f"max actual {worst:.1%} ({who}, t={when:.0f} s)" if who else "no tenant held blocks"
    note = (f"actual = blocks the replicas hold for the tenant's requests, sampled every 0.5 s, over the "
            f"{pool}-block pool, bad config excluded; ")
    note += f"ledger max reserved share {ledger:.1%}" if ledger is not None else "no ledger share exported"
    return Gate("tenant share", goal, figure, "pass" if worst <= limit + 1e-9 else "fail", note)


def evicted_gate(record: dict) -> Gate:
    rows = record.get("rows") or []
    evicted = [r for r in rows if (r.get("evictions") or 0) > 0]
    goal = f"more than {EVICTED_COMPLETE_GATE:.0%} of preempted or evicted requests eventually complete"
    preempted = sum(int(r.get("num_preemptions") or 0) for r in (record.get("replicas_final") or {}).values())
    if not evicted:
        return Gate("evicted complete", goal, "0 evicted", "n/a",
                    f"nothing was evicted in this run (replica preemptions: {preempted})")
    done = sum(1 for r in evicted if r.get("status") == "succeeded")
    share = done / len(evicted)
    return Gate("evicted complete", goal, f"{done}/{len(evicted)} = {share:.1%}",
                "pass" if share > EVICTED_COMPLETE_GATE else "fail", f"replica preemptions: {preempted}")


def batch_rate(samples: list[dict], start: float, end: float) -> float | None:
    """Batch requests completed per second between two times (all jobs together)."""
    def done(s: dict) -> int:
        return sum(int(b.get("completed") or 0) + int(b.get("failed") or 0) for b in (s.get("batches") or {}).values())

    inside = [s for s in samples if start <= s["t"] <= end and s.get("batches")]
    if len(inside) < 2 or inside[-1]["t"] <= inside[0]["t"]:
        return None
    return (done(inside[-1]) - done(inside[0])) / (inside[-1]["t"] - inside[0]["t"])


def levels(sample: dict) -> list[str]:
    return [str(v.get("level")) for v in ((sample.get("kv") or {}).get("replicas") or {}).values()]


def _batch_band(sample: dict) -> dict | None:
    band = (sample.get("bands") or {}).get(BATCH_PRIORITY)
    return band if band and band.get("dispatched") is not None else None


def paused_stretches(samples: list[dict], start: float, end: float) -> list[tuple[float, float]]:
    """Stretches of [start, end) in which batch waited at the gateway and none of it was dispatched.

    Between two consecutive samples the batch band counts as paused when it had requests queued at both and its
    dispatch count did not move: the offline queue was there and the gateway sent nothing of it.
    """
    inside = [s for s in samples if start <= s["t"] < end and _batch_band(s)]
    stretches: list[tuple[float, float]] = []
    opened: float | None = None
    for a, b in zip(inside, inside[1:]):
        ba, bb = _batch_band(a), _batch_band(b)
        held = (ba["queued"] or 0) > 0 and (bb["queued"] or 0) > 0 and bb["dispatched"] == ba["dispatched"]
        if held and opened is None:
            opened = a["t"]
        elif not held and opened is not None:
            stretches.append((opened, a["t"]))
            opened = None
    if opened is not None and inside:
        stretches.append((opened, inside[-1]["t"]))
    return stretches


def first_dispatch_after(samples: list[dict], start: float, end: float) -> float | None:
    """When the batch band's dispatch count first moved in [start, end), or None."""
    inside = [s for s in samples if start <= s["t"] < end and _batch_band(s)]
    for a, b in zip(inside, inside[1:]):
        if _batch_band(b)["dispatched"] > _batch_band(a)["dispatched"]:
            return b["t"]
    return None


def batch_pause_gate(record: dict) -> Gate:
    """The offline queue pauses during the peak and resumes after it, without starving.

    Judged by what the gateway did with the batch band (its `dispatched` count and queue in /admin/state, sampled
    twice a second), whichever rule held it (the holdback ceiling, the KV pause watermark or admission): paused =
    a stretch of at least `PAUSE_MIN_S` in the peak with batch waiting and nothing of it dispatched; resumed =
    batch dispatched again in the off-peak window after the peak and batch rows completed in that window.
    """
    goal = "offline queue paused during the peak and resumed after it"
    peak, before, after = _phase(record, "peak"), _phase(record, "offpeak_before"), _phase(record, "offpeak_after")
    if peak is None or after is None:
        return Gate("batch pause/resume", goal, "-", "n/a", "ramp drill not run")
    samples = record.get("samples", [])
    rates = [batch_rate(samples, p["start"], p["end"]) for p in (before, peak, after)]
    rows = "batch rows/s before / peak / after: " + " / ".join("-" if r is None else f"{r:.1f}" for r in rates)
    if not any(_batch_band(s) for s in samples):
        return Gate("batch pause/resume", goal, rows, "fail",
                    "the gateway's /admin/state bands have no `dispatched` count (older build)")
    stretches = paused_stretches(samples, peak["start"], peak["end"])
    longest = max((b - a for a, b in stretches), default=0.0)
    paused_s = sum(b - a for a, b in stretches)
    resumed_at = first_dispatch_after(samples, peak["end"], after["end"])
    by_kv = any(any(l in PAUSED_LEVELS for l in levels(s)) for s in samples
                if any(a <= s["t"] <= b for a, b in stretches))
    figure = (f"paused {paused_s:.1f} s of the {peak['end'] - peak['start']:.0f} s peak (longest {longest:.1f} s); "
              + ("resumed " + f"{resumed_at - peak['end']:.1f} s after it" if resumed_at is not None else "not resumed")
              + f"; {rows}")
    ok = longest >= PAUSE_MIN_S and resumed_at is not None and (rates[2] or 0) > 0
    note = ("paused = batch queued at the gateway and none dispatched between two samples (0.5 s apart); "
            f"what held it: {'the KV pause watermark (a replica at pause-batch or above)' if by_kv else 'the holdback ceiling or KV admission (no replica at the pause watermark)'}"
            if stretches else "batch was never held with work waiting during the peak")
    return Gate("batch pause/resume", goal, figure, "pass" if ok else "fail", note)


def kill_gate(record: dict) -> Gate:
    goal = "after kill -9, reservations on the remaining replicas equal what runs there"
    kill = record.get("kill")
    if not kill:
        return Gate("reservations after kill", goal, "-", "n/a", "kill drill not run")
    checks = [c for c in kill.get("checks", []) if "error" not in c and c.get("replicas")]
    if not checks or all(r.get("reserved_blocks") is None for c in checks for r in c["replicas"].values()):
        return Gate("reservations after kill", goal, "no data", "fail", NO_LEDGER)

    def matches(c: dict) -> bool:
        # One block of slack per sequence: the gateway's prompt token count may round differently.
        return all(r["stable"] and abs(r["reserved_blocks"] - r["actual_blocks"]) <= r["sequences"]
                   for r in c["replicas"].values())

    matching = [c for c in checks if matches(c)]
    stable = [c for c in checks if all(r["stable"] for r in c["replicas"].values())]
    last = checks[-1]["replicas"]
    idle = all(r["sequences"] == 0 for r in last.values())
    stale = sum(r["reserved_blocks"] or 0 for r in last.values()) if idle else None
    figure = (f"{len(matching)}/{len(stable)} stable checks equal"
              + (f"; once idle: {stale} blocks reserved for 0 sequences" if idle else "; survivors never idle"))
    # A stale reservation never goes away: an idle replica with blocks still reserved is one; so is a run
    # where no stable check ever matched. A transient difference (a request between gateway and replica) is not.
    ok = stale == 0 if idle else bool(matching)
    return Gate("reservations after kill", goal, figure, "pass" if ok else "fail",
                f"{len(checks)} checks with batch dispatch paused; a check is stable when two ledger reads "
                "around the replica read agree")


def rollback_gate(record: dict) -> Gate:
    limit = record.get("ttft_gate_s", 0.9)
    goal = f"bad config detected by tail latency, rolled back, then critical p95 TTFT <= {limit * 1000:.0f} ms"
    rb = record.get("rollback")
    if not rb:
        return Gate("rollback", goal, "-", "n/a", "rollback drill not run")
    window = rb["verify_window"]
    after = [r for r in record.get("requests", []) if window[0] <= r["sent_t"] < window[1]]
    est, status, text = tail_verdict(critical_ttfts(after), 0.95, limit)
    bad = rb.get("bad_p95_ttft_s")
    resp = rb.get("response") or {}
    body = resp.get("body") if isinstance(resp.get("body"), dict) else {}
    problems = []
    if rb.get("bad_digest") is None:
        problems.append("the gateway did not apply the bad config (reload rejected or not seen)")
    if not rb.get("detected"):
        problems.append(f"bad config not detected (its p95 {bad * 1000:.0f} ms)" if bad else "bad config not detected")
    if resp.get("status") != 200:
        problems.append(f"POST /admin/rollback answered {resp.get('status')}")
    elif body.get("to_digest") != rb.get("good_digest"):
        problems.append(f"rolled back to {body.get('to_digest')}, not the previous {rb.get('good_digest')}")
    watermark = body.get("admissionWatermark")
    if resp.get("status") == 200 and (watermark is None or watermark >= (rb.get("good_admission_watermark") or 1.0)):
        problems.append(f"admission watermark after rollback {watermark} is not lower")
    bad_text = (f"bad config p95 {bad * 1000:.0f} ms; " if bad is not None
                else "bad config: no critical first token in its window; " if rb.get("detected") else "")
    ok = status == "pass" and not problems
    return Gate("rollback", goal, bad_text + "after: " + text, "pass" if ok else "fail",
                "; ".join(problems) or f"to {body.get('to_digest', '')[:19]}, admissionWatermark {watermark}")


GATES = (oom_gate, release_gate, ttft_gate, tenant_share_gate, evicted_gate, batch_pause_gate, kill_gate,
         rollback_gate)


def evaluate(record: dict) -> list[Gate]:
    return [gate(record) for gate in GATES]
