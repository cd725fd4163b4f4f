"""Server-rendered inline SVG line charts: a time axis over the last window, a nice-number value axis,
one polyline per series. No JavaScript; colours are presentation attributes, so the page's CSP holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from markupsafe import Markup, escape

WIDTH, HEIGHT = 640, 220
LEFT, RIGHT, TOP, BOTTOM = 58, 14, 12, 28
# A gap longer than this between samples breaks the line instead of drawing across an outage.
GAP_SECONDS = 16.0


@dataclass
class Series:
    name: str
    colour: str
    points: list[tuple[float, float]]  # (unix time, value)


def value_ticks(top_value: float, most: int = 5) -> list[float]:
    """0 and up to `most` evenly spaced ticks at a 1, 2 or 5 × 10^k step, the last at or above top_value."""
    if top_value <= 0:
        return [0.0, 1.0]
    exponent = math.floor(math.log10(top_value / most))
    for base in (1, 2, 5, 10, 20):
        step = base * 10.0 ** exponent
        n = math.ceil(top_value / step - 1e-9)
        if n <= most:
            return [round(i * step, 12) for i in range(n + 1)]
    step = 10.0 ** (exponent + 2)
    return [i * step for i in range(math.ceil(top_value / step) + 1)]


def seconds_label(value: float) -> str:
    if value == 0:
        return "0"
    if value < 1:
        return f"{value * 1000:.0f} ms"
    return f"{value:.3g} s"


def rate_label(value: float) -> str:
    return f"{value:.3g}/s" if value else "0"


def count_label(value: float) -> str:
    return f"{value:,.0f}" if value >= 1 or not value else f"{value:g}"


def percent_label(value: float) -> str:
    return f"{value * 100:.3g}%" if value else "0"


def fold(points: list[tuple[float, float]], step: float, how: Callable[[list[float]], float]) -> list[tuple[float, float]]:
    """Points of runs `step` seconds long folded into one each (at the run's last time), so a long range
    draws as many points as a short one; `how` is max for peaks (latency, usage), a mean for rates."""
    runs: dict[int, list[tuple[float, float]]] = {}
    for t, v in points:
        runs.setdefault(int(t // step), []).append((t, v))
    return [(max(t for t, _ in run), how([v for _, v in run])) for _, run in sorted(runs.items())]


def time_step_minutes(window: float, most: int = 8) -> int:
    """Minutes between the time axis' ticks: the smallest of 1, 2, 5, 10, 15, 30, 60, 120 giving at most `most`."""
    minutes = window / 60
    return next((m for m in (1, 2, 5, 10, 15, 30, 60, 120) if minutes / m <= most), 120)


def _ago_label(minutes: int) -> str:
    if minutes == 0:
        return "now"
    return f"−{minutes // 60} h" if minutes >= 60 and minutes % 60 == 0 else f"−{minutes} min"


def line_chart(series: list[Series], *, now: float, window: float, label: Callable[[float], str],
               title: str, empty: str, gap: float = GAP_SECONDS) -> Markup:
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    start = now - window
    values = [v for s in series for t, v in s.points if t >= start]
    # A little headroom: a line at the maximum stays clear of the top grid line.
    ticks = value_ticks(max(values) * 1.08 if values else 0.0)
    top = ticks[-1]

    def x(t: float) -> float:
        return LEFT + (t - start) / window * plot_w

    def y(v: float) -> float:
        return TOP + plot_h - (v / top) * plot_h

    parts = [f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="{escape(title)}" '
             f'xmlns="http://www.w3.org/2000/svg">', f"<title>{escape(title)}</title>"]
    for v in ticks:
        parts.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y(v):.1f}" y2="{y(v):.1f}" '
                     f'stroke="#e3e7ee" stroke-width="1"/>')
        parts.append(f'<text x="{LEFT - 6}" y="{y(v) + 4:.1f}" text-anchor="end" font-size="11" '
                     f'fill="#5b6472">{escape(label(v))}</text>')
    minutes = int(window // 60)
    for m in range(0, minutes + 1, time_step_minutes(window)):
        t = now - m * 60
        text = _ago_label(m)
        parts.append(f'<line x1="{x(t):.1f}" x2="{x(t):.1f}" y1="{TOP}" y2="{TOP + plot_h}" stroke="#f0f2f6"/>')
        parts.append(f'<text x="{x(t):.1f}" y="{HEIGHT - 8}" text-anchor="middle" font-size="11" '
                     f'fill="#5b6472">{text}</text>')
    parts.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{TOP + plot_h}" y2="{TOP + plot_h}" stroke="#aab2bf"/>')
    for s in series:
        for run in _runs([(t, v) for t, v in s.points if t >= start], gap):
            coords = " ".join(f"{x(t):.1f},{y(v):.1f}" for t, v in run)
            if len(run) == 1:
                t, v = run[0]
                parts.append(f'<circle cx="{x(t):.1f}" cy="{y(v):.1f}" r="2.5" fill="{s.colour}"/>')
            else:
                parts.append(f'<polyline points="{coords}" fill="none" stroke="{s.colour}" stroke-width="2" '
                             f'stroke-linejoin="round" stroke-linecap="round"/>')
    if not values:
        parts.append(f'<text x="{LEFT + plot_w / 2:.0f}" y="{TOP + plot_h / 2:.0f}" text-anchor="middle" '
                     f'font-size="13" fill="#5b6472">{escape(empty)}</text>')
    parts.append("</svg>")
    return Markup("".join(parts))


def _runs(points: list[tuple[float, float]], gap: float) -> list[list[tuple[float, float]]]:
    runs: list[list[tuple[float, float]]] = []
    for point in sorted(points):
        if runs and point[0] - runs[-1][-1][0] <= gap:
            runs[-1].append(point)
        else:
            runs.append([point])
    return runs
