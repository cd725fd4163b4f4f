"""KV-cache usage of one replica over time: a bounded history sampled on a fixed period.

Sampled by its own task rather than per engine step, so the drop after an abort (which frees blocks
without a step) and idle periods show up on time.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from typing import Callable

SAMPLE_SECONDS = 0.25
# 20 minutes at the default period; older samples are dropped first.
MAX_SAMPLES = 4800


class KvUsageHistory:
    def __init__(self, usage: Callable[[], float], period: float = SAMPLE_SECONDS, max_samples: int = MAX_SAMPLES):
        self._usage = usage
        self.period = period
        self.samples: deque[tuple[float, float]] = deque(maxlen=max_samples)
        self._task: asyncio.Task | None = None

    def sample(self) -> None:
        """Record (wall-clock seconds, usage fraction) now."""
        self.samples.append((time.time(), self._usage()))

    def as_list(self, since: float | None = None) -> list[list[float]]:
        return [[t, round(u, 6)] for t, u in self.samples if since is None or t >= since]

    async def _run(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(self.period)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="model_sim-kv-usage")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
