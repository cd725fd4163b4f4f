"""The drills' clock: phases and events in seconds since the run started, shared by the sampler, the traffic
and the drills."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field


log = logging.getLogger("bench.drills")


@dataclass
class Timeline:
    """Seconds since the run's t0 (monotonic), shared by the sampler, the traffic and the phases."""

    t0: float = field(default_factory=time.monotonic)
    phases: list[dict] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def phase(self, name: str, start: float, end: float | None = None) -> dict:
        p = {"name": name, "start": start, "end": end}
        self.phases.append(p)
        return p

    def event(self, name: str, **extra) -> None:  # noqa: ANN003
        self.events.append({"name": name, "t": self.now(), **extra})
        log.info("drill event=%s %s", name, json.dumps(extra, default=str)[:300])
