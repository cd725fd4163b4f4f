"""The published figures of the study this benchmark reproduces, which the report prints beside ours:
the only numbers in a report not computed from raw records."""

from __future__ import annotations


SEED = {
    "realtime_only": {"p95_ttft_ms": 342},
    "no_controls": {"p95_ttft_ms": 561},
    "holdback_50": {"p95_ttft_ms": 341, "batch_completions": 1648},
    "holdback_50_evict": {"p95_ttft_ms": 348, "batch_completions": 1798, "evictions": 38, "evicted_completed": 38},
    "reserve_25_evict": {"p95_ttft_ms": 1055, "evictions": 25, "recomputed_tokens": 9076, "batch_p95_e2e_s": 12.24},
    "reserve_75_evict": {"p95_ttft_ms": 1019},
    "reserve_25_noevict": {"p95_ttft_ms": 1350, "batch_p95_e2e_s": 8.51},
}
