"""The job queue: RQ's Redis layout, and the job moves the processor and the API make on it, in one place.

One RQ job per request row (job id = row id, `holdback.contract` names the queue and the job function). RQ's
private key layout (queue lists, registries, executions, worker sets, the scheduler lock) is read from RQ here
and nowhere else: the worker's claim scripts (`async_processor.queue`) take their keys from this module too, and
pyproject pins RQ to the release line `tests/async_processor/test_rq_layout.py` checks that layout against.
"""

from __future__ import annotations

import time
from typing import Iterable

import redis
from rq.defaults import RQ_KEY_PREFIX
from rq.exceptions import InvalidJobOperation, NoSuchJobError
from rq.executions import WORKER_EXECUTIONS_KEY_TEMPLATE, ExecutionRegistry
from rq.intermediate_queue import IntermediateQueue
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.registry import (
    DeferredJobRegistry,
    FailedJobRegistry,
    FinishedJobRegistry,
    ScheduledJobRegistry,
    StartedJobRegistry,
)
from rq.results import Result
from rq.scheduler import SCHEDULER_KEY_TEMPLATE, RQScheduler
from rq.scripts import ACQUIRE_OR_REFRESH_LOCK_SCRIPT, RELEASE_LOCK_SCRIPT
from rq.utils import now as rq_now, utcformat, utcparse
from rq.version import VERSION
from rq.worker_registration import REDIS_WORKER_KEYS, WORKERS_BY_QUEUE_KEY

from holdback.contract import JOB_FUNCTION

# ---- RQ's key layout -------------------------------------------------------------------------------------

QUEUE_PREFIX = Queue.redis_queue_namespace_prefix  # rq:queue:<name>, a list of job ids
QUEUES_KEY = Queue.redis_queues_keys  # rq:queues, the set of every queue's key
JOB_PREFIX = Job.redis_job_namespace_prefix  # rq:job:<id>, the job hash
WORKER_PREFIX = f"{RQ_KEY_PREFIX}:worker:"  # rq:worker:<name>, the worker hash
WORKERS_KEY = REDIS_WORKER_KEYS  # rq:workers, every worker's key
EXECUTION_PREFIX = f"{RQ_KEY_PREFIX}:execution:"  # rq:execution:<job id>:<execution id>
EXECUTIONS_REGISTRY_PREFIX = ExecutionRegistry.key_template.format("")  # rq:executions:<job id>
RESULTS_PREFIX = Result.get_key("")  # rq:results:<job id>
# The registries an operator counts, by the name GET /admin/queues gives each (`started` is rq:wip:<queue>).
REGISTRY_TEMPLATES = {
    "started": StartedJobRegistry.key_template,
    "scheduled": ScheduledJobRegistry.key_template,
    "failed": FailedJobRegistry.key_template,
    "deferred": DeferredJobRegistry.key_template,
    "finished": FinishedJobRegistry.key_template,
}
# RQ's own scheduler lock scripts: a plain `rq worker --with-scheduler` takes turns with ours.
SCHEDULER_LOCK_SCRIPT = ACQUIRE_OR_REFRESH_LOCK_SCRIPT
SCHEDULER_RELEASE_SCRIPT = RELEASE_LOCK_SCRIPT

RQ_VERSION = VERSION  # what a worker writes into its hash, as RQ's own workers do

# RQ kills a job that runs longer than this; a request's own deadline is enforced by the worker.
JOB_TIMEOUT_SECONDS = 1800
PUSH_CHUNK = 1000


def queue_key(queue_name: str) -> str:
    return QUEUE_PREFIX + queue_name


def intermediate_key(queue_name: str) -> str:
    """Where RQ's own workers keep a job between popping it and starting it."""
    return IntermediateQueue.get_intermediate_queue_key(queue_key(queue_name))


def job_key(job_id: str) -> str:
    return Job.key_for(job_id)


def registry_key(registry: str, queue_name: str) -> str:
    """The key of a queue's registry by its `REGISTRY_TEMPLATES` name."""
    return REGISTRY_TEMPLATES[registry].format(queue_name)


def started_key(queue_name: str) -> str:
    return registry_key("started", queue_name)


def scheduled_key(queue_name: str) -> str:
    return registry_key("scheduled", queue_name)


def failed_key(queue_name: str) -> str:
    return registry_key("failed", queue_name)


def workers_by_queue_key(queue_name: str) -> str:
    return WORKERS_BY_QUEUE_KEY % queue_name


def worker_key(worker_name: str) -> str:
    return WORKER_PREFIX + worker_name


def worker_executions_key(worker_name: str) -> str:
    return WORKER_EXECUTIONS_KEY_TEMPLATE.format(worker_name)


def scheduler_lock_key(queue_name: str) -> str:
    return RQScheduler.get_locking_key(queue_name)


def scheduler_key(worker_name: str) -> str:
    return SCHEDULER_KEY_TEMPLATE % worker_name


def timestamp() -> str:
    """Now, in the format RQ writes its timestamps (job and worker hashes)."""
    return utcformat(rq_now())


def parse_timestamp(value: str) -> float:
    """Unix seconds of a timestamp RQ wrote; ValueError if it is not one."""
    return utcparse(value).timestamp()


# ---- the processor's moves: push, remove, and what RQ still holds ------------------------------------------


def rq_queue(connection: redis.Redis, queue_name: str) -> Queue:
    """RQ's own handle on a queue (its `key`, `name`, registries), for callers that read it as RQ does."""
    return Queue(queue_name, connection=connection)


def push(connection: redis.Redis, queue_name: str, jobs: Iterable[tuple[str, str]], at_front: bool = False) -> int:
    """Enqueue (row_id, batch_id) pairs in order (`at_front`: ahead of everything waiting, still in this
    order); returns how many were pushed. Each job: `JOB_FUNCTION(row_id, batch_id)`, job id = row id,
    `result_ttl=0`, no RQ retries (the database drives retries)."""
    queue = Queue(queue_name, connection=connection)
    pushed = 0
    batch: list = []
    # Each front push goes before the previous one: push in reverse to keep the given order.
    for row_id, batch_id in (reversed(list(jobs)) if at_front else jobs):
        batch.append(Queue.prepare_data(
            JOB_FUNCTION, args=(row_id, batch_id), job_id=row_id, result_ttl=0, timeout=JOB_TIMEOUT_SECONDS,
            at_front=at_front,
        ))
        if len(batch) >= PUSH_CHUNK:
            pushed += _push(connection, queue, batch)
            batch = []
    if batch:
        pushed += _push(connection, queue, batch)
    return pushed


def _push(connection: redis.Redis, queue: Queue, datas: list) -> int:
    with connection.pipeline() as pipe:
        queue.enqueue_many(datas, pipeline=pipe)
        pipe.execute()
    return len(datas)


def remove(connection: redis.Redis, queue_name: str, row_ids: Iterable[str]) -> None:
    """Take jobs that have not started out of the queue and the scheduled registry, and delete them.

    A job a worker already took stays; the worker finds its row final and does nothing, or is
    told to abort by the cancel event."""
    ids = list(row_ids)
    for start in range(0, len(ids), PUSH_CHUNK):
        chunk = ids[start:start + PUSH_CHUNK]
        with connection.pipeline(transaction=False) as pipe:
            for row_id in chunk:
                pipe.lrem(queue_key(queue_name), 0, row_id)
            pipe.zrem(scheduled_key(queue_name), *chunk)
            pipe.execute()
        # Only delete the hashes of jobs no worker holds: a started job's hash is the worker's to clean.
        started = started_ids(connection, queue_name)
        idle = [row_id for row_id in chunk if row_id not in started]
        if idle:
            connection.delete(*(job_key(row_id) for row_id in idle))


def live_ids(connection: redis.Redis, queue_name: str) -> set[str]:
    """Job ids RQ holds somewhere: waiting, being taken, running (live heartbeat) or scheduled.

    One MULTI/EXEC, so the four reads are a single snapshot: a job moving between them (a due
    retry going back to the queue, a dead worker's job requeued) is seen exactly where it is.
    A job that finished before the snapshot has changed its row's state, which the caller's
    conditional UPDATE notices."""
    with connection.pipeline(transaction=True) as pipe:
        pipe.lrange(queue_key(queue_name), 0, -1)
        pipe.lrange(intermediate_key(queue_name), 0, -1)
        pipe.zrangebyscore(started_key(queue_name), time.time(), "+inf")
        pipe.zrange(scheduled_key(queue_name), 0, -1)
        queued, taking, started, scheduled = pipe.execute()
    live = {_text(x) for x in queued} | {_text(x) for x in taking} | {_text(x) for x in scheduled}
    live.update(_text(entry).split(":", 1)[0] for entry in started)
    return live


def started_ids(connection: redis.Redis, queue_name: str) -> set[str]:
    """Ids of the jobs a live worker is running."""
    # Entries are "<job id>:<execution id>" scored by heartbeat expiry; an expired one is a dead worker.
    entries = connection.zrangebyscore(started_key(queue_name), time.time(), "+inf")
    return {_text(entry).split(":", 1)[0] for entry in entries}


def heartbeating_ids(connection: redis.Redis, row_ids: Iterable[str], within: float) -> set[str]:
    """Of these job ids, those whose job hash says started with a heartbeat in the last `within` s
    (a worker that keeps `Job.heartbeat` fresh without RQ's started registry)."""
    ids = list(row_ids)
    if not ids:
        return set()
    with connection.pipeline(transaction=False) as pipe:
        for row_id in ids:
            pipe.hmget(job_key(row_id), "status", "last_heartbeat")
        replies = pipe.execute()
    cutoff = time.time() - within
    alive = set()
    for row_id, (status, heartbeat) in zip(ids, replies):
        if status is not None and _text(status) == "started" and heartbeat is not None:
            if _heartbeat_ts(_text(heartbeat)) >= cutoff:
                alive.add(row_id)
    return alive


def worker_capacity(connection: redis.Redis, queue_name: str) -> int:
    """Requests the queue's live workers can run at once: each holdback worker's `concurrency`, 1 for a
    plain `rq worker`; registrations that ended (`death`) or expired do not count."""
    keys = list(connection.smembers(workers_by_queue_key(queue_name)))
    if not keys:
        return 0
    with connection.pipeline(transaction=False) as pipe:
        for key in keys:
            pipe.hmget(key, "birth", "death", "concurrency")
        fields = pipe.execute()
    return sum(int(concurrency or 1) for birth, death, concurrency in fields if birth and not death)


def depth(connection: redis.Redis, queue_name: str) -> int:
    """Jobs waiting in the queue."""
    return int(connection.llen(queue_key(queue_name)))


# ---- the operator's reads and moves (the admin API and the dashboard) ---------------------------------------


def queue_names_with_prefix(connection: redis.Redis, prefix: str) -> set[str]:
    """Every queue RQ knows whose name starts with `prefix`."""
    names = set()
    for key in connection.smembers(QUEUES_KEY):
        name = _text(key).removeprefix(QUEUE_PREFIX)
        if name.startswith(prefix):
            names.add(name)
    return names


def queue_counts(connection: redis.Redis, queue_name: str) -> dict[str, int]:
    """`queued` (the list), each registry of `REGISTRY_TEMPLATES` by its name, and the `workers` registered."""
    with connection.pipeline(transaction=False) as pipe:
        pipe.llen(queue_key(queue_name))
        for registry in REGISTRY_TEMPLATES:
            pipe.zcard(registry_key(registry, queue_name))
        pipe.scard(workers_by_queue_key(queue_name))
        queued, *registry_counts, worker_count = pipe.execute()
    return {"queued": queued, **dict(zip(REGISTRY_TEMPLATES, registry_counts)), "workers": worker_count}


def failed_ids(connection: redis.Redis, queue_name: str) -> list[str]:
    """The job ids in the queue's FailedJobRegistry."""
    return [_text(x) for x in connection.zrange(failed_key(queue_name), 0, -1)]


REQUEUED, CLEARED = "requeued", "cleared"


def requeue_failed(connection: redis.Redis, queue_name: str, job_id: str) -> str | None:
    """Move a failed job back to its queue: `REQUEUED`; `CLEARED` if no failed job was behind the registry's
    entry (the job expired, or reconciliation already dispatched the row again under the same id) and the entry
    was removed, or someone else took it out meanwhile; None if the entry was already gone."""
    registry = FailedJobRegistry(queue_name, connection=connection)
    try:
        job = Job.fetch(job_id, connection=connection)
    except NoSuchJobError:
        job = None
    if job is None or job.get_status(refresh=False) != JobStatus.FAILED:
        return CLEARED if connection.zrem(registry.key, job_id) else None
    try:
        registry.requeue(job)
        return REQUEUED
    except InvalidJobOperation:
        return CLEARED  # someone else took it out of the registry meanwhile


def workers(connection: redis.Redis, queues: list[str]) -> list[dict]:
    """The live workers registered on these queues, from their worker hashes and execution sets."""
    keys = sorted({_text(k) for name in queues for k in connection.smembers(workers_by_queue_key(name))})
    with connection.pipeline(transaction=False) as pipe:
        for key in keys:
            pipe.hgetall(key)
            pipe.smembers(worker_executions_key(key.removeprefix(WORKER_PREFIX)))
        replies = pipe.execute()
    found = []
    now = time.time()
    for i, key in enumerate(keys):
        fields = {_text(k): _text(v) for k, v in replies[2 * i].items()}
        if not fields or "death" in fields:
            continue  # expired or shut down: RQ drops the set member lazily
        jobs = sorted({_text(x).rsplit(":", 1)[0] for x in replies[2 * i + 1]})
        heartbeat = fields.get("last_heartbeat")
        found.append({
            "name": key.removeprefix(WORKER_PREFIX),
            "queues": [q for q in fields.get("queues", "").split(",") if q],
            "state": fields.get("state"),
            "hostname": fields.get("hostname"),
            "pid": _int(fields.get("pid")),
            "birth": fields.get("birth"),
            "last_heartbeat": heartbeat,
            "heartbeat_age_s": round(now - parse_timestamp(heartbeat), 1) if heartbeat else None,
            "concurrency": _int(fields.get("concurrency")),
            "in_flight": _int(fields.get("in_flight")) or len(jobs),
            "current_jobs": jobs[:50],
            "successful_job_count": _int(fields.get("successful_job_count")) or 0,
            "failed_job_count": _int(fields.get("failed_job_count")) or 0,
            "total_working_time": float(fields.get("total_working_time") or 0.0),
        })
    return found


def delete_jobs(connection: redis.Redis, job_ids: list[str]) -> None:
    """Delete these jobs' hashes (a measurement's clean-up; the queue's list is the caller's)."""
    for start in range(0, len(job_ids), PUSH_CHUNK):
        connection.delete(*(job_key(i) for i in job_ids[start:start + PUSH_CHUNK]))


def _heartbeat_ts(value: str) -> float:
    try:
        return parse_timestamp(value)
    except ValueError:
        return 0.0


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
