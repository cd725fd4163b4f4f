"""Prometheus text expositions as the benchmarks read them: flat {'name{labels}': value} dicts, a series'
labels, and a metric summed over the series whose labels match. Quantiles of histograms are in bench.stats."""

from __future__ import annotations


def parse_prometheus(text: str) -> dict[str, float]:
    """Flat {'name{labels}': value} of a Prometheus text exposition."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        try:
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
        except ValueError:
            continue
    return out


def series_labels(key: str) -> dict[str, str]:
    """The labels of one `name{a="x",b="y"}` key of `parse_prometheus`."""
    if "{" not in key:
        return {}
    pairs = (part.split("=", 1) for part in key[key.index("{") + 1:-1].split(","))
    return {k: v.strip('"') for k, v in pairs}


def metric_sum(metrics: dict[str, float], name: str, **labels: str) -> float:
    """Sum of a metric over every series whose labels include `labels`."""
    total = 0.0
    for key, value in metrics.items():
        base = key.split("{", 1)[0]
        if base != name:
            continue
        if all(f'{k}="{v}"' in key for k, v in labels.items()):
            total += value
    return total
