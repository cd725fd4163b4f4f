"""The dashboard's charts of the sampler's history: which series each chart draws, how a longer range
(1 h, 6 h) folds runs of samples into one point, and the chart panels of the batches and gateway pages.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from fastapi import Request

from batch_api.context import ApiContext
from batch_api.dashboard import charts
from batch_api.dashboard.gateway_view import ttft_objective
from batch_api.dashboard.sampler import INTERVAL, Sample, recent_samples

# Series colours in the charts; objectives not listed get the last one.
OBJECTIVE_COLOURS = {"realtime": "#d9480f", "standard": "#1c7ed6"}
REPLICA_COLOURS = ("#7048e8", "#0ca678", "#f76707", "#1098ad", "#c2255c", "#5c940d")
# The workers' objective: its TTFT includes the holdback wait by design, so it is not charted with realtime.
BATCH_OBJECTIVE = "batch"
CHART_RANGES = {"15m": 900.0, "1h": 3600.0, "6h": 6 * 3600.0}  # the sampler keeps six hours
RANGE_LABELS = {"15m": "15 min", "1h": "1 hour", "6h": "6 hours"}
DEFAULT_RANGE = "15m"
CHART_POINTS = 240


@dataclass(frozen=True)
class ChartSpec:
    """One chart of the sampler's history: which values, how a longer range folds them, how they read."""

    key: str
    title: str
    unit: str
    series: Callable[[list[Sample]], list[charts.Series]]
    label: Callable[[float], str]
    fold: Callable[[list[float]], float]  # the value of a run of samples drawn as one point
    empty: str


def _ttft_series(samples: list[Sample]) -> list[charts.Series]:
    """Streamed answers' time to first token per objective, and non-streamed answers' whole time apart."""
    names = sorted({o for s in samples for o in s.ttft_p95 if ttft_objective(o) != BATCH_OBJECTIVE},
                   key=lambda o: (o != ttft_objective(o), ttft_objective(o) != "realtime", o))
    return [charts.Series(o, OBJECTIVE_COLOURS.get(o, "#495057"),
                          [(s.t, s.ttft_p95[o]) for s in samples if o in s.ttft_p95]) for o in names]


def _rate_series(*names: tuple[str, str, str]) -> Callable[[list[Sample]], list[charts.Series]]:
    def series(samples: list[Sample]) -> list[charts.Series]:
        return [charts.Series(name, colour, [(s.t, s.per_s[key]) for s in samples if key in s.per_s])
                for key, name, colour in names]
    return series


def _throughput_series(samples: list[Sample]) -> list[charts.Series]:
    found = _rate_series(("completed", "completed", "#2b8a3e"), ("failed", "failed", "#e03131"))(samples)
    # A failure line that stays at zero is noise.
    return [series for series in found if series.name == "completed" or any(v for _, v in series.points)]


def _depth_series(samples: list[Sample]) -> list[charts.Series]:
    return [charts.Series(name, colour, [(s.t, s.depth[key]) for s in samples if key in s.depth])
            for key, name, colour in (("queued", "RQ queued", "#1c7ed6"), ("retrying", "RQ retries waiting", "#fab005"),
                                      ("gateway", "gateway queue", "#7048e8"))
            if any(key in s.depth for s in samples)]


def _kv_series(samples: list[Sample]) -> list[charts.Series]:
    replicas = sorted({r for s in samples for r in s.kv})
    return [charts.Series(r.removeprefix("http://"), REPLICA_COLOURS[i % len(REPLICA_COLOURS)],
                          [(s.t, s.kv[r]) for s in samples if r in s.kv]) for i, r in enumerate(replicas)]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


CHARTS = {spec.key: spec for spec in (
    ChartSpec("ttft", "Realtime TTFT p95", "per 5 s, at the gateway", _ttft_series, charts.seconds_label, max,
              "No realtime requests in this range (or the gateway is down)"),
    ChartSpec("throughput", "Batch throughput", "requests/s finished, all batches", _throughput_series,
              charts.rate_label, _mean, "No samples yet: one is taken every 5 s"),
    ChartSpec("cancelled", "Cancelled", "requests/s closed by a batch cancel, apart from failures",
              _rate_series(("cancelled", "cancelled", "#868e96")), charts.rate_label, _mean,
              "No samples yet: one is taken every 5 s"),
    ChartSpec("depth", "Queue depth", "jobs waiting", _depth_series, charts.count_label, max,
              "No samples of the queues in this range"),
    ChartSpec("kv", "KV cache usage", "per replica, as the replica reports it", _kv_series, charts.percent_label,
              max, "No KV usage in this range (the gateway is down, or its /admin/state needs another key)"),
    ChartSpec("evictions", "Evictions", "per second, issued by the gateway",
              _rate_series(("evictions", "evictions", "#d9480f")), charts.rate_label, _mean,
              "No samples of the gateway in this range"),
)}
BATCHES_CHARTS = ("throughput", "cancelled", "depth", "ttft")
GATEWAY_CHARTS = ("ttft", "kv", "evictions", "depth")


def chart_panels(request: Request, range_name: str | None = None, which: tuple[str, ...] = BATCHES_CHARTS) -> dict:
    """The charts of one page over the chosen range (15m, 1h, 6h), each with its legend's latest values."""
    context: ApiContext = request.app.state.context
    now = time.time()
    range_name = range_name if range_name in CHART_RANGES else DEFAULT_RANGE
    window = CHART_RANGES[range_name]
    samples = recent_samples(context.redis, context.settings.redis_namespace, window) \
        if context.redis is not None else []
    # Longer ranges fold runs of samples into one point each, so a chart draws at most ~CHART_POINTS.
    step = max(INTERVAL, window / CHART_POINTS)
    drawn = []
    for key in which:
        spec = CHARTS[key]
        series = [charts.Series(s.name, s.colour, charts.fold(s.points, step, spec.fold)) for s in spec.series(samples)]
        drawn.append({
            "key": key, "title": spec.title, "unit": spec.unit, "label": spec.label,
            "svg": charts.line_chart(series, now=now, window=window, label=spec.label,
                                     title=f"{spec.title}, last {RANGE_LABELS[range_name]}", empty=spec.empty,
                                     gap=max(charts.GAP_SECONDS, 3 * step)),
            "legend": _legend(series, stale_before=now - max(3 * INTERVAL, 2 * step)),
        })
    return {"list": drawn, "range": range_name, "ranges": RANGE_LABELS, "samples": len(samples),
            "show": "gateway" if which == GATEWAY_CHARTS else "batches"}


def _legend(series: list[charts.Series], stale_before: float) -> list[tuple[str, str, float | None]]:
    """(name, colour, latest value) per series; no value ("—") when the latest point is older than `stale_before`
    (no traffic since: a p95 from minutes ago is not today's)."""
    return [(s.name, s.colour, latest[1] if (latest := max(s.points, default=None)) and latest[0] >= stale_before
             else None) for s in series]
