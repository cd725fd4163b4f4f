"""The /admin/state document: flow control's state read out (the metrics' state gauges are read from it too).

Only reads; every figure is one the controller, its registry, ledger, tally and eviction already hold.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from gateway.flow.request import Status
from gateway.policies.admission import LEVELS, reported_pool_tokens

if TYPE_CHECKING:
    from gateway.flow.controller import FlowController


def snapshot(fc: FlowController) -> dict:
    now = fc.clock()
    healthy = fc.pool.healthy()
    saturation = fc.detector.saturation(healthy, now)
    cfg = fc.loaded.config
    bands, tally, evictor = fc.bands, fc.tally, fc.eviction.evictor
    return {
        "config": {"digest": fc.loaded.digest, "source": fc.loaded.source,
                   "history": [{"digest": c.digest, "applied_at": at} for c, at in fc.history]},
        "detector": fc.detector.name,
        "saturation": round(saturation, 6),
        "stale_replicas": fc.detector.stale_count(healthy, now),
        "queued": fc.total_queued,
        "in_flight": fc.in_flight,
        "bands": [
            {"priority": b.priority, "objectives": fc.objective_names.get(b.priority, []),
             "queued": b.queued, "in_flight": b.in_flight, "dispatched": b.dispatched,
             "ceiling": round(bands.ceilings[b.priority], 6),
             "blocked": bool(b.queued) and saturation >= bands.ceilings[b.priority],
             "max_requests": b.max_requests, "ttl": b.ttl, "fairness": b.fairness.name,
             "ordering": b.ordering.name, "queues": b.queue_sizes()}
            for b in bands.desc
        ],
        "replicas": [
            {"url": r.url, "healthy": r.healthy, "in_flight": r.in_flight,
             "limit": (r.capacity or cfg.saturation.maxConcurrency) * (1 + cfg.saturation.headroom),
             "max_num_seqs": r.max_num_seqs, "slots_learned": r.slots_learned,
             "kv_usage": r.kv_usage, "kv_usage_max": r.kv_usage_max, "waiting": r.waiting,
             "running": r.running, "model": r.model, "model_root": r.model_root,
             "max_model_len": r.max_model_len, "refused": r.refused, "unauthorized": r.unauthorized,
             "metrics_age_s": round(now - r.metrics_at, 3) if r.metrics_at else None}
            for r in fc.pool.replicas
        ],
        "holdback": {"policy": bands.policy.name,
                     "forecast": bands.policy.state(),
                     "ceilings": {str(p): round(c, 6) for p, c in bands.ceilings.items()}},
        "eviction": {"enabled": fc.eviction.enabled, "pending": len(evictor.pending),
                     "candidates": len(evictor.candidates)},
        "at_risk_floor": {"share": fc.floor.share, "in_flight": fc.floor.in_flight,
                          "waiting": sum(r.status is Status.QUEUED for *_k, r in fc.floor.waiting)},
        "admission": fc.admission.state() if fc.admission else {"enabled": False},
        "kv": kv_state(fc, now),
        "totals": {"dispatched": tally.dispatched, "evictions": dict(tally.evictions),
                   "rejections": dict(tally.rejections), "evicted_places_kept": tally.places_kept,
                   "evicted_replica_kept": tally.affinity_kept, "cached_first": tally.cached_first,
                   "evicted_places_waiting": len(fc.eviction.places)},
    }


def kv_state(fc: FlowController, now: float) -> dict:
    admission, ledger = fc.admission, fc.ledger
    assert ledger is not None
    replicas = {}
    total_pool = 0
    for r in fc.pool.replicas:
        totals = ledger.by_replica.get(r.url)
        reserved = totals.kv_tokens if totals else 0
        used = totals.used_kv_tokens if totals else 0
        # In KV tokens, and in blocks of the replica's own block size (what its vLLM counts).
        size = admission.block_size(r) if admission else (r.kv_block_size or ledger.block_tokens)
        pool = admission.pool_tokens(r) if admission else (reported_pool_tokens(r, size) or 0)
        if r.healthy and r.refused is None:
            total_pool += pool
        scraped = round((r.kv_usage or 0.0) * pool) if r.kv_usage is not None else None
        replicas[r.url] = {
            "block_size": size, "total_kv_tokens": pool, "reserved_kv_tokens": reserved, "used_kv_tokens": used,
            "scraped_used_kv_tokens": scraped, "total_blocks": pool // size,
            "reserved_blocks": math.ceil(reserved / size), "used_blocks": math.ceil(used / size),
            "scraped_used_blocks": round(scraped / size) if scraped is not None else None,
            "fragmentation": round((reserved - used) / reserved, 4) if reserved else 0.0,
            "level": admission.level(r) if admission else LEVELS[0]}
    tenants = {}
    ledger.accrue_all(now)
    for fid, totals in ledger.by_tenant.items():
        tenants[fid] = {"reserved_kv_tokens": totals.kv_tokens, "reserved_tokens": totals.reserved_tokens,
                        "share": round(totals.kv_tokens / total_pool, 6) if total_pool else 0.0,
                        "active_sequences": totals.active,
                        "token_seconds": round(ledger.token_seconds(fairness_id=fid, now=now, accrued=True), 1)}
    classes = {name: {"reserved_kv_tokens": t.kv_tokens, "reserved_tokens": t.reserved_tokens,
                      "active_sequences": t.active} for name, t in ledger.by_class.items()}
    waiting: dict[str, int] = {}
    wait_s: dict[str, float] = {}
    ahead = 0
    for band in fc.bands.desc:
        ahead += band.queued
        waiting[str(band.priority)] = band.queued
        # Everything queued at or above this band goes first, at the recent dispatch rate.
        wait_s[str(band.priority)] = fc.tally.estimated_wait(ahead, now)
    tally = fc.tally
    return {"enabled": admission is not None, "replicas": replicas, "tenants": tenants, "classes": classes,
            "rejected_tokens": dict(tally.rejected_tokens), "waiting_by_priority": waiting,
            "estimated_wait_s_by_priority": wait_s, "tokenizer_fallbacks": tally.tokenizer_fallbacks,
            "recent_releases": list(tally.recent_releases),
            "tokenizer": fc.tokenizer_state()}
