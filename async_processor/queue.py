"""The request queue in RQ's own Redis structures, as an asyncio worker with many jobs in flight uses it.

Keys are RQ's layout, read from RQ in `holdback.jobs` (`rq:queue:<name>`, `rq:job:<id>`, `rq:wip:<name>` =
StartedJobRegistry, `rq:scheduled:<name>`, `rq:failed:<name>`, `rq:execution:<job>:<exec>`,
`rq:worker:<name>:executions`); this module keeps only the claim scripts that move jobs between them,
so `rq info`, RQ's registries and the dashboard count queued/started/scheduled/failed jobs as usual.
Every change of a job's place is one Lua script, so a job is always in exactly one of: the queue, the
started registry (with a live execution), the scheduled registry, the failed registry, or deleted —
there is no window in which a killed worker loses it. Job id = request row id (the processor's contract);
the job's arguments are never deserialized here: the database row is the truth.
"""

from __future__ import annotations

import base64
import time
import uuid
import zlib
from dataclasses import dataclass

import redis.asyncio as aioredis

from holdback import jobs
from holdback.jobs import EXECUTION_PREFIX, EXECUTIONS_REGISTRY_PREFIX, JOB_PREFIX, RESULTS_PREFIX

# Pop up to N job ids and start an execution for each, as RQ's prepare_execution + prepare_job_execution do.
_CLAIM = """
-- KEYS: queue, started registry, worker executions set
-- ARGV: n, score, now(float), now(utc string), worker, ttl, job prefix, execution prefix, executions prefix,
--       then n execution ids
local n = tonumber(ARGV[1])
local ttl = tonumber(ARGV[6])
local claimed = {}
local missing = 0
for i = 1, n do
  local job_id = redis.call('LPOP', KEYS[1])
  if not job_id then break end
  local job_key = ARGV[7] .. job_id
  if redis.call('EXISTS', job_key) == 1 then
    local exec_id = ARGV[9 + i]
    local composite = job_id .. ':' .. exec_id
    redis.call('HSET', job_key, 'status', 'started', 'worker_name', ARGV[5], 'started_at', ARGV[4],
               'last_heartbeat', ARGV[4])
    redis.call('PERSIST', job_key)
    local exec_key = ARGV[8] .. composite
    redis.call('HSET', exec_key, 'id', exec_id, 'job_id', job_id, 'created_at', ARGV[3],
               'last_heartbeat', ARGV[3], 'worker_name', ARGV[5])
    redis.call('EXPIRE', exec_key, ttl)
    redis.call('ZADD', ARGV[9] .. job_id, tonumber(ARGV[2]) + 60, exec_id)
    redis.call('EXPIRE', ARGV[9] .. job_id, ttl + 60)
    redis.call('ZADD', KEYS[2], ARGV[2], composite)
    redis.call('SADD', KEYS[3], composite)
    claimed[#claimed + 1] = job_id
    claimed[#claimed + 1] = exec_id
  else
    missing = missing + 1
  end
end
if #claimed > 0 then redis.call('EXPIRE', KEYS[3], ttl + 60) end
claimed[#claimed + 1] = tostring(missing)
return claimed
"""

# End one execution and move its job: delete | failed | schedule | requeue | none (execution only).
_FINISH = """
-- KEYS: started registry, worker executions set, worker key, queue, scheduled registry, failed registry
-- ARGV: job id, execution id, mode, when(float: schedule time or failed-registry expiry), now(utc),
--       job prefix, execution prefix, executions prefix, results prefix, counter field, seconds worked,
--       failure ttl, failure reason (zlib+base64 as RQ's Result stores exc_string, or ''), worker name
local job_id, exec_id, mode = ARGV[1], ARGV[2], ARGV[3]
local composite = job_id .. ':' .. exec_id
local job_key = ARGV[6] .. job_id
redis.call('ZREM', KEYS[1], composite)
redis.call('DEL', ARGV[7] .. composite)
redis.call('ZREM', ARGV[8] .. job_id, exec_id)
redis.call('SREM', KEYS[2], composite)
if redis.call('EXISTS', KEYS[3]) == 1 then
  redis.call('HINCRBY', KEYS[3], ARGV[10], 1)
  redis.call('HINCRBYFLOAT', KEYS[3], 'total_working_time', ARGV[11])
end
if mode == 'delete' then
  redis.call('DEL', job_key, job_key .. ':dependents', job_key .. ':dependencies', ARGV[9] .. job_id,
             ARGV[8] .. job_id)
  return 1
end
if mode == 'none' or redis.call('EXISTS', job_key) == 0 then return 0 end
if mode == 'schedule' then
  redis.call('HSET', job_key, 'status', 'scheduled', 'ended_at', ARGV[5])
  redis.call('ZADD', KEYS[5], ARGV[4], job_id)
elseif mode == 'failed' then
  redis.call('HSET', job_key, 'status', 'failed', 'ended_at', ARGV[5])
  redis.call('EXPIRE', job_key, ARGV[12])
  redis.call('ZADD', KEYS[6], ARGV[4], job_id)
  if ARGV[13] ~= '' then
    -- A FAILED Result (type 2), so job.latest_result() and the dashboards show why the row failed.
    local results_key = ARGV[9] .. job_id
    redis.call('XADD', results_key, 'MAXLEN', 10, '*', 'type', '2', 'worker_name', ARGV[14],
               'exc_string', ARGV[13], 'execution_id', exec_id)
    redis.call('EXPIRE', results_key, ARGV[12])
  end
elseif mode == 'requeue' then
  redis.call('HSET', job_key, 'status', 'queued', 'enqueued_at', ARGV[5])
  redis.call('LPUSH', KEYS[4], job_id)
end
return 1
"""

# The scheduler role: move due jobs from the ScheduledJobRegistry to the queue (sub-second scores).
# A due retry goes to the FRONT of the queue: it was admitted earlier than anything still waiting, and
# behind a deep batch window its wait would otherwise grow with the queue, not with its backoff.
# Walking the due ids from the last keeps them in due order at the front.
_MOVE_DUE = """
-- KEYS: scheduled registry, queue; ARGV: now(float), limit, job prefix, now(utc)
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[2]))
local moved = 0
for i = #ids, 1, -1 do
  local job_id = ids[i]
  redis.call('ZREM', KEYS[1], job_id)
  local job_key = ARGV[3] .. job_id
  if redis.call('EXISTS', job_key) == 1 then
    redis.call('HSET', job_key, 'status', 'queued', 'enqueued_at', ARGV[4])
    redis.call('LPUSH', KEYS[2], job_id)
    moved = moved + 1
  end
end
return moved
"""

# Executions whose heartbeat expired belong to a dead worker: put their jobs back on the queue (front).
_REQUEUE_ABANDONED = """
-- KEYS: started registry, queue; ARGV: now(float), job prefix, execution prefix, executions prefix, now(utc)
local entries = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, 1000)
local requeued = {}
for _, composite in ipairs(entries) do
  redis.call('ZREM', KEYS[1], composite)
  local job_id, exec_id = string.match(composite, '^(.*):([^:]*)$')
  if job_id then
    redis.call('DEL', ARGV[3] .. composite)
    redis.call('ZREM', ARGV[4] .. job_id, exec_id)
    local job_key = ARGV[2] .. job_id
    if redis.call('HGET', job_key, 'status') == 'started' then
      redis.call('HSET', job_key, 'status', 'queued', 'enqueued_at', ARGV[5])
      redis.call('LPUSH', KEYS[2], job_id)
      requeued[#requeued + 1] = job_id
    end
  end
end
return requeued
"""


@dataclass(frozen=True)
class Claim:
    job_id: str  # = the request row id
    execution_id: str
    claimed_at: float


class Finish:
    """What to do with a job when its execution ends."""

    delete = "delete"  # the row is final (succeeded, or nothing left to do): result_ttl=0, like RQ
    failed = "failed"  # the row failed: keep the job in the FailedJobRegistry for operators
    schedule = "schedule"  # run again at a time: ScheduledJobRegistry
    requeue = "requeue"  # back to the front of the queue (an evicted row's retry; a worker shutting down)
    none = "none"  # only end this execution (another one of the same job is still running)


class ClaimQueue:
    """One RQ queue of request jobs, driven by an asyncio worker named `worker_name`."""

    def __init__(self, redis: aioredis.Redis, queue_name: str, worker_name: str, ttl: int, failure_ttl: int):
        self.redis = redis
        self.name = queue_name
        self.worker_name = worker_name
        self.ttl = ttl
        self.failure_ttl = failure_ttl
        self.key = jobs.queue_key(queue_name)
        self.started_key = jobs.started_key(queue_name)
        self.scheduled_key = jobs.scheduled_key(queue_name)
        self.failed_key = jobs.failed_key(queue_name)
        self.worker_key = jobs.worker_key(worker_name)
        self.executions_key = jobs.worker_executions_key(worker_name)
        self._claim = redis.register_script(_CLAIM)
        self._finish = redis.register_script(_FINISH)
        self._move_due = redis.register_script(_MOVE_DUE)
        self._requeue_abandoned = redis.register_script(_REQUEUE_ABANDONED)

    async def claim(self, n: int) -> tuple[list[Claim], int]:
        """Pop up to n jobs into the StartedJobRegistry; also returns how many popped ids had no job hash."""
        now = time.time()
        execution_ids = [uuid.uuid4().hex for _ in range(n)]
        raw = await self._claim(
            keys=[self.key, self.started_key, self.executions_key],
            args=[n, now + self.ttl, now, jobs.timestamp(), self.worker_name, self.ttl, JOB_PREFIX,
                  EXECUTION_PREFIX, EXECUTIONS_REGISTRY_PREFIX, *execution_ids],
        )
        missing = int(raw[-1])
        pairs = [x.decode() if isinstance(x, bytes) else x for x in raw[:-1]]
        return [Claim(pairs[i], pairs[i + 1], now) for i in range(0, len(pairs), 2)], missing

    async def finish(self, claim: Claim, mode: str, when: float | None = None, *, succeeded: bool = True,
                     reason: str | None = None) -> None:
        """End the claim's execution and move its job according to `mode` (see `Finish`); a failed job
        keeps `reason` (the row's failure) as its RQ result's exc_string."""
        now = time.time()
        exc_string = ""
        if mode == Finish.failed:
            when = now + self.failure_ttl
            if reason:
                exc_string = base64.b64encode(zlib.compress(reason.encode())).decode()
        await self._finish(
            keys=[self.started_key, self.executions_key, self.worker_key, self.key, self.scheduled_key,
                  self.failed_key],
            args=[claim.job_id, claim.execution_id, mode, repr(when or now), jobs.timestamp(), JOB_PREFIX,
                  EXECUTION_PREFIX, EXECUTIONS_REGISTRY_PREFIX, RESULTS_PREFIX,
                  "successful_job_count" if succeeded else "failed_job_count", repr(max(0.0, now - claim.claimed_at)),
                  self.failure_ttl, exc_string, self.worker_name],
        )

    async def heartbeat(self, claims: list[Claim]) -> None:
        """Keep in-flight executions in the StartedJobRegistry, re-adding any that Redis lost (a flush):
        while a request runs, reconciliation must see its job as live. A finished job's entry that a
        racing heartbeat re-adds expires harmlessly (requeue_abandoned only requeues `started` jobs)."""
        if not claims:
            return
        score = time.time() + self.ttl
        async with self.redis.pipeline(transaction=False) as pipe:
            for c in claims:
                composite = f"{c.job_id}:{c.execution_id}"
                pipe.zadd(self.started_key, {composite: score})
                pipe.expire(EXECUTION_PREFIX + composite, self.ttl)
            pipe.expire(self.executions_key, self.ttl + 60)
            await pipe.execute()

    async def forget(self, claims: list[Claim]) -> None:
        """Take these ended executions out of the StartedJobRegistry: a heartbeat that read them as in flight
        just before they ended may have added them back (`heartbeat`)."""
        if claims:
            await self.redis.zrem(self.started_key, *(f"{c.job_id}:{c.execution_id}" for c in claims))

    async def move_due(self, limit: int = 1000) -> int:
        """Move scheduled jobs whose time has come to the queue; returns how many were moved."""
        return int(await self._move_due(
            keys=[self.scheduled_key, self.key], args=[repr(time.time()), limit, JOB_PREFIX, jobs.timestamp()]))

    async def requeue_abandoned(self) -> list[str]:
        """Put jobs whose executions stopped heart-beating (their worker died) back on the queue."""
        ids = await self._requeue_abandoned(
            keys=[self.started_key, self.key],
            args=[repr(time.time()), JOB_PREFIX, EXECUTION_PREFIX, EXECUTIONS_REGISTRY_PREFIX, jobs.timestamp()])
        return [x.decode() if isinstance(x, bytes) else x for x in ids]

    async def depth(self) -> dict[str, int]:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.llen(self.key)
            pipe.zcard(self.started_key)
            pipe.zcard(self.scheduled_key)
            pipe.zcard(self.failed_key)
            queued, started, scheduled, failed = await pipe.execute()
        return {"queued": queued, "started": started, "scheduled": scheduled, "failed": failed}

    async def next_due_in(self) -> float | None:
        """Seconds until the earliest scheduled job is due (<= 0: due now), None if none is scheduled."""
        first = await self.redis.zrange(self.scheduled_key, 0, 0, withscores=True)
        return first[0][1] - time.time() if first else None
