"""Every figure of one study run, derived from its raw record; and the harvest, which reads three runs of one
repeat."""

from __future__ import annotations

import statistics

from bench.lib.prometheus import metric_sum
from bench.stats import histogram_quantile, percentile, quantile_interval


BURST_SETTLE_S = 10.0
OBJECTIVE_PRIORITY = {"realtime": 100, "standard": 0}
BATCH_BAND = -10  # the batch band's priority in the study's gateway config


def _completed_at(samples: list[dict], t: float) -> float | None:
    """Completed count at time t, interpolated between the two samples around it."""
    pts = [(s["t"], s["completed"]) for s in samples if "completed" in s]
    if not pts:
        return None
    before = [p for p in pts if p[0] <= t]
    after = [p for p in pts if p[0] >= t]
    if not before:
        return after[0][1]
    if not after:
        return before[-1][1]
    (t0, c0), (t1, c1) = before[-1], after[0]
    return c0 if t1 == t0 else c0 + (c1 - c0) * (t - t0) / (t1 - t0)


def figures(record: dict) -> dict:
    """Every figure of one run, derived from its raw record."""
    rt = record.get("realtime", [])
    ok = [r for r in rt if r["status"] == 200 and r["ttft_s"] is not None]
    ttfts = [r["ttft_s"] * 1000 for r in ok]
    rows = record.get("rows") or []
    samples = record.get("samples") or []
    win = record.get("window") or {}
    f: dict = {
        "scenario": record["scenario"]["name"],
        "repeat": record["repeat"],
        "replicas": record["scenario"].get("replicas", 1),
        "realtime_requests": len(rt),
        "realtime_ok": len(ok),
        "realtime_errors": len(rt) - len(ok),
        "p95_ttft_ms": percentile(ttfts, 0.95),
        # 95% order-statistic interval of this run's p95 (about ±7 ranks over 280 requests, ±15 over 1,230).
        **dict(zip(("p95_ttft_lo_ms", "p95_ttft_hi_ms"), quantile_interval(ttfts, 0.95))),
        "p50_ttft_ms": percentile(ttfts, 0.50),
        # Diagnostic only (never a headline): p95 over requests sent after the opening burst has drained.
        # A short window makes the burst's aftermath a large share of all requests; this shows how much.
        "p95_ttft_after_burst_ms": percentile([r["ttft_s"] * 1000 for r in ok if r["sent_s"] >= BURST_SETTLE_S], 0.95),
        "realtime_queued_p95_ms": percentile([r["queue_ms"] for r in rt if r.get("queue_ms") is not None], 0.95),
        "realtime_output_tps": sum(r.get("output_tokens") or 0 for r in ok) / win["window_s"] if win.get("window_s") else None,
        # Mean interactive requests in flight over the window (Little's law: their summed lifetimes ÷ the window),
        # the places of the pool interactive traffic needs on average.
        "realtime_in_flight_mean": sum(r.get("e2e_s") or 0 for r in ok) / win["window_s"] if win.get("window_s") else None,
        # The gateway's holdback policy as the run configured it (records before it was kept have none).
        "usage_limit": (record.get("gateway_overrides") or {}).get("usageLimit"),
    }
    f["preemptions"] = int(sum(metric_sum(m, "vllm:num_preemptions_total") for m in record.get("sim_metrics") or []))
    if not record["scenario"]["batch"]:
        return f
    start = win.get("realtime_start", 0.0)
    c0, c1 = _completed_at(samples, start), _completed_at(samples, start + win.get("window_s", 0.0))
    f["batch_completions"] = None if c0 is None or c1 is None else round(c1 - c0)
    f["batch_output_tps"] = _batch_output_tps(rows, win)
    ceilings = [x["batch_ceiling"] for x in samples
                if x.get("batch_ceiling") is not None and start <= x["t"] <= start + win.get("window_s", 0.0)]
    f["batch_ceiling_mean"] = statistics.fmean(ceilings) if ceilings else None
    # How far the ceiling moved in the window (a fixed reserve: not at all; an adaptive one: with its forecast).
    f["batch_ceiling_p10"] = percentile(ceilings, 0.10)
    f["batch_ceiling_p90"] = percentile(ceilings, 0.90)
    f["batch_in_flight_mean"] = band_in_flight_mean(record, BATCH_BAND)
    evicted_rows = [r for r in rows if r.get("evictions", 0) > 0]
    f["evictions"] = sum(r.get("evictions", 0) for r in rows)
    f["evicted_requests"] = len(evicted_rows)
    f["evicted_completed"] = sum(1 for r in evicted_rows if r["status"] == "succeeded")
    ids = record.get("output_custom_ids") or []
    f["duplicate_final_results"] = len(ids) - len(set(ids))
    f["duplicates_suppressed"] = sum(r.get("duplicates", 0) for r in rows)
    f["gateway_evictions"] = metric_sum(record.get("gateway_metrics", {}), "holdback_gateway_evictions_total",
                                        outcome="issued")
    # Work the replicas computed and then threw away because the gateway evicted the request (the
    # simulator counts computed tokens of aborted requests; the batch is cancelled only after this read).
    sim = record.get("sim_metrics") or []
    f["recomputed_tokens"] = int(sum(metric_sum(m, "sim:aborted_computed_tokens_total") for m in sim))
    e2e = [r["finished_at"] - r["first_attempt_at"] for r in rows
           if r["status"] == "succeeded" and r.get("first_attempt_at") and r.get("finished_at")]
    f["batch_p95_e2e_s"] = percentile(e2e, 0.95)
    gm = record.get("gateway_metrics", {})
    # Blocked arrival -> capacity released: interactive requests that found no room, from their arrival to the
    # release of the slot they were dispatched into (the gateway's blocked_release histogram, the scenario's
    # interactive band). Records from a gateway without that histogram show none.
    band = str(OBJECTIVE_PRIORITY.get(record["scenario"].get("objective", "realtime"), 100))
    for q, key in ((0.5, "release_p50_ms"), (0.99, "release_p99_ms")):
        f[key] = _ms(histogram_quantile(gm, "holdback_gateway_blocked_release_seconds", q, band=band))
    f["blocked_arrivals"] = int(metric_sum(gm, "holdback_gateway_blocked_release_seconds_count", band=band))
    # Diagnostic: eviction decision -> the victim's upstream closed.
    f["eviction_confirm_p99_ms"] = _ms(histogram_quantile(gm, "holdback_gateway_eviction_confirmation_seconds", 0.99))
    f["evicted_all_done"] = record.get("evicted_all_done")
    return f


def band_in_flight_mean(record: dict, priority: int) -> float | None:
    """Mean requests of one priority band in flight at the gateway over the realtime window (the run's samples,
    twice a second): how many of the pool's places the band held."""
    win = record.get("window") or {}
    start = win.get("realtime_start", 0.0)
    end = start + win.get("window_s", 0.0)
    values = [x["bands"][str(priority)]["in_flight"] for x in record.get("samples") or []
              if start <= x["t"] <= end and str(priority) in (x.get("bands") or {})]
    return statistics.fmean(values) if values else None


def _batch_output_tps(rows: list[dict], win: dict) -> float | None:
    """Output tokens/s of batch requests that finished inside the realtime window (None: no wall-clock anchor,
    which records written before the anchor was added lack)."""
    start, length = win.get("realtime_start_wall"), win.get("window_s")
    if start is None or not length:
        return None
    tokens = sum(r.get("output_tokens") or 0 for r in rows
                 if r["status"] == "succeeded" and r.get("finished_at") and start <= r["finished_at"] <= start + length)
    return tokens / length


def run_harvest(run_figs: list[dict], name: str, repeat: int) -> float | None:
    """Batch output tokens/s under mixed load ÷ (pool output tokens/s with batch alone − realtime's alone), the
    three read from the same repeat of the same study: the share of the capacity realtime leaves spare that
    batch actually used."""
    def get(scenario: str, key: str) -> float | None:
        return next((f.get(key) for f in run_figs if f["scenario"] == scenario and f["repeat"] == repeat), None)

    mixed, alone, rt = get(name, "batch_output_tps"), get("batch_alone", "batch_output_tps"), \
        get("realtime_only", "realtime_output_tps")
    if mixed is None or alone is None or rt is None or alone - rt <= 0:
        return None
    # batch_alone and realtime_only run one replica; a scenario with more is compared per replica (its realtime
    # traffic is scaled by the replica count too).
    return mixed / (get(name, "replicas") or 1) / (alone - rt)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000
