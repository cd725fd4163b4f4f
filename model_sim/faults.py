"""Injected failures: error answers at given rates, an added delay, and errors forced per request.

One uniform draw per request picks 429, 500, 503 or none, so the rates must sum to at most 1.
The `x-sim-force-error: <status>` request header forces that status regardless of the rates.
Settings can be replaced at runtime through `POST /admin/faults`.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, replace

FORCE_ERROR_HEADER = "x-sim-force-error"
FAULT_STATUSES = (429, 500, 503)


@dataclass(frozen=True)
class FaultSettings:
    rate_429: float = 0.0
    rate_500: float = 0.0
    rate_503: float = 0.0
    delay_ms: float = 0.0

    def validate(self) -> None:
        for name in ("rate_429", "rate_500", "rate_503"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be between 0 and 1, got {value}")
        total = self.rate_429 + self.rate_500 + self.rate_503
        if total > 1.0 + 1e-9:
            raise ValueError(f"rate_429 + rate_500 + rate_503 must be at most 1, got {total:g}")
        if self.delay_ms < 0:
            raise ValueError(f"delay_ms must not be negative, got {self.delay_ms}")

    def updated(self, changes: dict) -> "FaultSettings":
        """A copy with `changes` applied; raises ValueError naming any unknown or invalid field."""
        known = set(asdict(self))
        unknown = sorted(set(changes) - known)
        if unknown:
            raise ValueError(f"unknown fault setting(s) {unknown}; use any of {sorted(known)}")
        values = {}
        for key, value in changes.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{key} must be a number, got {value!r}")
            values[key] = float(value)
        new = replace(self, **values)
        new.validate()
        return new


class FaultInjector:
    def __init__(self, settings: FaultSettings, seed: int = 0):
        settings.validate()
        self.settings = settings
        self._rng = random.Random(seed)
        self.injected: dict[int, int] = {s: 0 for s in FAULT_STATUSES}

    def update(self, changes: dict) -> FaultSettings:
        self.settings = self.settings.updated(changes)
        return self.settings

    @property
    def delay_seconds(self) -> float:
        return self.settings.delay_ms / 1000.0

    def choose(self, forced: str | None) -> int | None:
        """The error status to answer with, or None to serve the request."""
        if forced:
            status = int(forced)
            self.injected[status] = self.injected.get(status, 0) + 1
            return status
        s = self.settings
        if not (s.rate_429 or s.rate_500 or s.rate_503):
            return None
        u = self._rng.random()
        for status, rate in ((429, s.rate_429), (500, s.rate_500), (503, s.rate_503)):
            if u < rate:
                self.injected[status] += 1
                return status
            u -= rate
        return None

    def as_dict(self) -> dict:
        return {**asdict(self.settings), "injected": {str(k): v for k, v in self.injected.items()}}
