"""The deployment gates judged on hand-built drill records: each gate passes on good data and fails on bad."""

from __future__ import annotations

from bench.drills.gates import batch_pause_gate, evaluate, kill_gate, oom_gate, tail_verdict, tenant_share_gate, ttft_gate
from bench.stats import quantile_interval

PLAN = {"sim_args": ["--num-blocks", "100", "--block-size", "16"]}


def record(**extra) -> dict:
    base = {"seed": 1, "admission": True, "plan": PLAN, "ttft_gate_s": 0.9,
            "gateway_settings": {"admission": {"tenantMaxShare": 0.15}},
            "samples": [{"t": 0.0, "replicas": {"0": {"num_blocks": 100, "used": 0, "kv_oom": 0}}}],
            "requests": [], "phases": []}
    return base | extra


def req(t: float, tenant: str = "a", klass: str = "critical", ttft: float | None = 0.1, e2e: float = 1.0,
        prompt: int = 16, out: int = 16, status: int = 200) -> dict:
    return {"sent_t": t, "tenant": tenant, "klass": klass, "ttft_s": ttft, "e2e_s": e2e, "prompt_tokens": prompt,
            "output_tokens": out, "status": status, "queue_ms": None, "drop_reason": None, "phase": "x"}


def test_an_oom_on_any_replica_fails_the_oom_gate():
    assert oom_gate(record()).status == "pass"
    bad = record(samples=[{"t": 0.0, "replicas": {"0": {"kv_oom": 0}, "1": {"kv_oom": 2, "kv_oom_failed_requests": 5}}}])
    gate = oom_gate(bad)
    assert gate.status == "fail" and gate.figure.startswith("2 OOMs, 5 requests")


def test_a_replica_that_exports_no_oom_count_fails_rather_than_passes():
    assert oom_gate(record(samples=[{"t": 0.0, "replicas": {"0": {"usage": 0.1}}}])).status == "fail"


def test_tenant_share_is_the_largest_sampled_share_outside_the_bad_config_window():
    # Pool of 100 blocks (one replica); the limit is 15%.
    samples = [{"t": 0.0, "replicas": {"0": {"num_blocks": 100}}, "tenant_blocks": {"a": 14, "b": 3}},
               {"t": 1.0, "replicas": {"0": {"num_blocks": 100}}, "tenant_blocks": {"a": 15}},
               {"t": 5.0, "replicas": {"0": {"num_blocks": 100}}, "tenant_blocks": {"b": 40}}]
    bad_window = [{"name": "bad_config", "start": 4.0, "end": 6.0}]
    gate = tenant_share_gate(record(samples=samples, phases=bad_window, rollback={"digest_after": "sha256:x"}))
    assert gate.status == "pass" and gate.figure.startswith("max actual 15.0% (a")
    assert tenant_share_gate(record(samples=samples)).status == "fail"
    # A failed rollback leaves the bad config running: everything after the push is excluded.
    later = samples + [{"t": 9.0, "replicas": {"0": {"num_blocks": 100}}, "tenant_blocks": {"c": 90}}]
    assert tenant_share_gate(record(samples=later, phases=bad_window, rollback={"digest_after": None})).status == "pass"
    assert tenant_share_gate(record(samples=[{"t": 0.0, "replicas": {"0": {"num_blocks": 100}}}])).status == "fail"


def test_ttft_gate_uses_critical_requests_outside_the_bad_config_window():
    fast = [req(float(i), ttft=0.2) for i in range(100)]
    slow_in_window = [req(200.0 + i, ttft=3.0) for i in range(50)]
    phases = [{"name": "bad_config", "start": 200.0, "end": 260.0}]
    assert ttft_gate(record(requests=fast + slow_in_window, phases=phases)).status == "pass"
    assert ttft_gate(record(requests=fast + slow_in_window)).status == "fail"
    interactive_slow = [req(float(i), klass="interactive", ttft=5.0) for i in range(100)]
    assert ttft_gate(record(requests=fast + interactive_slow)).status == "pass"


def test_critical_requests_refused_for_capacity_count_as_misses_and_quota_rejections_do_not():
    fast = [req(float(i), ttft=0.2) for i in range(90)]

    def refused(t: float, reason: str | None, status: int = 429) -> dict:
        return req(t, ttft=None, status=status) | {"drop_reason": reason}

    quota = [refused(100.0 + i, "rejected-quota") for i in range(10)]
    assert ttft_gate(record(requests=fast + quota)).status == "pass"
    expired = [refused(100.0 + i, "rejected-ttl-expired") for i in range(10)]
    gate = ttft_gate(record(requests=fast + expired))
    assert gate.status == "fail" and gate.note.startswith("10/100 critical requests refused")
    failed = [refused(100.0 + i, None, status=502) for i in range(10)]
    assert ttft_gate(record(requests=fast + failed)).status == "fail"


def test_tail_verdict_is_undecided_when_the_interval_straddles_the_goal():
    values = [i / 100 for i in range(100)]  # p95 = 0.94
    assert tail_verdict(values, 0.95, 0.94)[2].endswith("undecided")
    assert tail_verdict(values, 0.95, 5.0)[2].endswith(", decided")
    lo, hi = quantile_interval(values, 0.95)
    assert lo <= 0.94 <= hi


def _check(reserved: int | None, again: int | None, actual: int, seqs: int = 3) -> dict:
    return {"t": 1.0, "replicas": {"0": {"reserved_blocks": reserved, "reserved_blocks_again": again,
                                          "stable": reserved == again, "actual_blocks": actual, "sequences": seqs}}}


def test_kill_gate_judges_the_idle_ledger_and_otherwise_needs_one_matching_stable_check():
    idle_clean = record(kill={"checks": [_check(130, 120, 100), _check(0, 0, 0, seqs=0)]})
    assert kill_gate(idle_clean).status == "pass"
    idle_stale = record(kill={"checks": [_check(101, 101, 100), _check(40, 40, 0, seqs=0)]})
    gate = kill_gate(idle_stale)
    assert gate.status == "fail" and "40 blocks reserved for 0 sequences" in gate.figure
    busy_match = record(kill={"checks": [_check(130, 130, 100), _check(100, 101, 100), _check(101, 101, 100)]})
    assert kill_gate(busy_match).status == "pass"
    busy_stale = record(kill={"checks": [_check(160, 160, 100), _check(170, 170, 110), _check(90, 95, 90)]})
    assert kill_gate(busy_stale).status == "fail"
    assert kill_gate(record(kill={"checks": [_check(None, None, 100)]})).status == "fail"


def test_drills_that_did_not_run_are_not_applicable_not_passed():
    gates = {g.name: g.status for g in evaluate(record())}
    assert gates["release after cancel"] == gates["reservations after kill"] == gates["rollback"] == "n/a"
    assert gates["batch pause/resume"] == "n/a"


def _batch_samples(dispatched_by_t: list[tuple[float, int, int]], completed_by_t: dict[float, int]) -> list[dict]:
    """Samples of the batch band: (t, queued, dispatched so far), with batch rows completed so far."""
    return [{"t": t, "bands": {"-10": {"queued": q, "in_flight": 4, "dispatched": d}},
             "batches": {"b": {"completed": completed_by_t.get(t, 0), "failed": 0}}}
            for t, q, d in dispatched_by_t]


def _pause_record(samples: list[dict]) -> dict:
    phases = [{"name": "offpeak_before", "start": 0.0, "end": 10.0}, {"name": "peak", "start": 10.0, "end": 20.0},
              {"name": "offpeak_after", "start": 20.0, "end": 30.0}]
    return record(samples=samples, phases=phases)


def test_batch_pause_gate_needs_a_held_stretch_in_the_peak_and_dispatch_again_after_it():
    ts = [i * 0.5 for i in range(61)]
    # Dispatching until t=12, nothing dispatched with batch waiting from 12 to 20, dispatching again from 22.
    held = [(t, 10, int(min(t, 12) * 2 + max(0.0, t - 22) * 2)) for t in ts]
    done = {t: int(t) for t in ts}
    gate = batch_pause_gate(_pause_record(_batch_samples(held, done)))
    assert gate.status == "pass", gate
    assert "longest 7.5 s" in gate.figure and "resumed 2.5 s after it" in gate.figure

    never_held = [(t, 10, int(t * 2)) for t in ts]
    assert batch_pause_gate(_pause_record(_batch_samples(never_held, done))).status == "fail"

    # Held with nothing waiting is not a pause: an empty queue has nothing to hold back.
    idle = [(t, 0, int(min(t, 12) * 2 + max(0.0, t - 22) * 2)) for t in ts]
    assert batch_pause_gate(_pause_record(_batch_samples(idle, done))).status == "fail"

    starved = [(t, 10, int(min(t, 12) * 2)) for t in ts]
    gate = batch_pause_gate(_pause_record(_batch_samples(starved, {t: int(min(t, 12)) for t in ts})))
    assert gate.status == "fail" and "not resumed" in gate.figure


def test_batch_pause_gate_fails_on_a_gateway_that_reports_no_dispatch_count():
    samples = [{"t": t, "bands": {"-10": {"queued": 3, "in_flight": 1}}, "batches": {}} for t in (0.0, 15.0, 25.0)]
    gate = batch_pause_gate(_pause_record(samples))
    assert gate.status == "fail" and "dispatched" in gate.note
