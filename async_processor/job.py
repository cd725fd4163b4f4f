"""The RQ job function `async_processor.job.run_request(row_id, batch_id)` for plain RQ workers.

`holdback worker` never calls it (it runs many attempts at once itself), but a stock `rq worker` on the
request queue can: it runs the same attempt code path synchronously. A retry is returned as RQ's
`Retry`, so RQ parks the job in its ScheduledJobRegistry and the worker process is free meanwhile;
RQ deletes the job once the row is final (the processor enqueues with result_ttl=0).
"""

from __future__ import annotations

import asyncio
import math
import time
from functools import cache

import aiohttp
from rq import Retry

from async_processor.config import WorkerSettings
from holdback.attempts import Disposition, InFlight, Jitter, RetryPolicy, Runtime, Skip, run_attempt
from holdback.settings import Settings

# The database row bounds retries (deadline, transient budget); RQ's own count must never stop them.
UNBOUNDED_RETRIES = 1_000_000


@cache
def _runtime() -> Runtime:
    # Read once per process: an RQ job is this component's edge, like the CLI.
    settings, env = Settings(), WorkerSettings()
    policy = RetryPolicy(base=env.backoff_base, cap=env.backoff_cap, jitter=Jitter(env.jitter),
                         transient_budget=env.transient_budget, closing_recheck=env.closing_recheck)
    return Runtime.build(settings.sqlalchemy_url, gateway_url=settings.gateway_url,
                         gateway_key=settings.gateway_key, policy=policy, worker_name="rq-job",
                         request_timeout=env.request_timeout, db_lanes=1, resume=env.resume,
                         stream_interval=env.stream_interval)


def run_request(row_id: str, batch_id: str) -> Retry | None:
    """One attempt of the request row; returns `Retry` when the row should run again later."""
    rt = _runtime()
    result = asyncio.run(_attempt(rt, row_id))
    wake_at = None
    if result.skip is Skip.closing:
        wake_at = time.time() + rt.policy.closing_recheck
    elif result.recorded is not None and result.recorded.disposition in (Disposition.retry, Disposition.closing):
        wake_at = result.recorded.wake_at
    if wake_at is None:
        return None
    return Retry(max=UNBOUNDED_RETRIES, interval=max(1, math.ceil(wake_at - time.time())))


async def _attempt(rt: Runtime, row_id: str):
    async with aiohttp.ClientSession() as http:
        return await run_attempt(rt, http, InFlight(row_id))
