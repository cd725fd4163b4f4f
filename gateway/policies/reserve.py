"""The adaptive reserve: a holdback policy whose ceiling for sheddable bands follows realtime demand.

Protected demand is the queued plus in-flight requests of every band at or above `protectedPriority`, as a
share of the pool's request budget (healthy replicas × maxConcurrency). Its forecast is the larger of an
exponentially weighted average and the peak seen within a short window, so a burst lowers the ceiling at
once (queued requests count) while an idle spell raises it only after the window has passed. Bands below
get 1 − forecast − margin, clamped to [minCeiling, maxCeiling]; eviction covers what the forecast misses.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass
from typing import Iterable, Sequence


@dataclass(frozen=True)
class ReserveSettings:
    protected_priority: int = 0
    margin: float = 0.1
    half_life: float = 10.0
    peak_window: float = 30.0
    min_ceiling: float = 0.25
    max_ceiling: float = 1.0


class DemandForecast:
    """Protected demand over time: an EWMA with a half-life plus a sliding-window peak (a monotonic deque)."""

    def __init__(self, half_life: float, peak_window: float):
        self.half_life = half_life
        self.peak_window = peak_window
        self.ewma = 0.0
        self.current = 0.0
        self._at: float | None = None
        # (time, demand) with demand strictly decreasing from the front: the front is the window's peak.
        self._peaks: collections.deque[tuple[float, float]] = collections.deque()

    def observe(self, demand: float, now: float) -> None:
        if self._at is None:
            self.ewma = demand
        else:
            # The average holds the previous reading for the time since it was taken.
            dt = max(0.0, now - self._at)
            self.ewma += (self.current - self.ewma) * (1.0 - math.pow(2.0, -dt / self.half_life))
        self._at = now
        self.current = demand
        peaks = self._peaks
        while peaks and peaks[-1][1] <= demand:
            peaks.pop()
        peaks.append((now, demand))

    def peak(self, now: float) -> float:
        peaks = self._peaks
        # Keep the newest entry even when older than the window: it is the reading still in force.
        while len(peaks) > 1 and peaks[0][0] < now - self.peak_window:
            peaks.popleft()
        return peaks[0][1] if peaks else 0.0

    def value(self, now: float) -> float:
        return max(self.ewma, self.peak(now))


class AdaptiveReservePolicy:
    """Bands at or above `protected_priority` get the whole pool (1.0); bands below get 1 − forecast − margin."""

    name = "adaptive-reserve"
    follows_demand = True

    def __init__(self, settings: ReserveSettings):
        s = settings
        if not 0 <= s.min_ceiling <= s.max_ceiling <= 1:
            raise ValueError(f"need 0 <= minCeiling ({s.min_ceiling}) <= maxCeiling ({s.max_ceiling}) <= 1")
        self.settings = s
        self.forecast = DemandForecast(s.half_life, s.peak_window)
        self.sheddable_ceiling = s.max_ceiling
        self._now = 0.0

    def observe(self, bands: Iterable[tuple[int, int]], capacity: int, now: float) -> bool:
        """Record protected demand from (priority, queued + in-flight) per band; True when the ceiling moved."""
        wanted = sum(n for p, n in bands if p >= self.settings.protected_priority)
        # No healthy replica: nothing to share out; count the demand against one request slot.
        self.forecast.observe(wanted / max(capacity, 1), now)
        self._now = now
        s = self.settings
        ceiling = min(s.max_ceiling, max(s.min_ceiling, 1.0 - self.forecast.value(now) - s.margin))
        # Ceilings are compared and reported at this precision; a smaller move is not a decision.
        ceiling = round(ceiling, 4)
        moved = ceiling != self.sheddable_ceiling
        self.sheddable_ceiling = ceiling
        return moved

    def ceilings(self, priorities: Sequence[int]) -> dict[int, float]:
        s = self.settings
        return {p: 1.0 if p >= s.protected_priority else self.sheddable_ceiling for p in priorities}

    def floors(self, priorities: Sequence[int]) -> dict[int, float]:
        """What a band keeps at any demand: bands below the line hold more than minCeiling only on loan."""
        s = self.settings
        return {p: 1.0 if p >= s.protected_priority else s.min_ceiling for p in priorities}

    def state(self) -> dict:
        f = self.forecast
        return {"protected_priority": self.settings.protected_priority,
                "demand": round(f.current, 4), "ewma": round(f.ewma, 4), "peak": round(f.peak(self._now), 4),
                "forecast": round(f.value(self._now), 4), "margin": self.settings.margin,
                "sheddable_ceiling": self.sheddable_ceiling}
