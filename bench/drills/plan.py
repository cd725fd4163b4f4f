"""The drills' plans (durations, rates and sizes of a run: quick, full, smoke) and the scheduling config under
test, with the bad one the rollback drill pushes."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

from bench.lib.workload import Shapes


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
                      "maxNewTokensDefault": 1024,
                      # Reserve exactly the worst case (the reservation check compares blocks one to one) and pause
                      # batch at the seed's 88%.
                      "safetyFactor": 1.0, "batchPauseWatermark": 0.88},
    }
    return settings


def bad_settings(good: dict) -> dict:
    """The bad push: a concurrency limit cut to 6 per replica, batch may take every slot and block, no tenant
    limit, no eviction. Critical requests then wait for slots held by long requests: tail latency."""
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
        bad["admission"].update(loose)
    return bad


# How far below the config's own admission watermark a rollback keeps it.
ROLLBACK_WATERMARK_STEP = 0.04
