"""The RQ queues and workers behind dispatch, as the operator API and the dashboard count, pause and retry them.

RQ's layout is `holdback.jobs`'; pausing is `holdback.broker`'s pause key; which failed jobs go back on the
queue is the database's call (`batch_api.admin_queries.row_statuses`).
"""

from __future__ import annotations

import logging

import redis
from sqlalchemy.orm import Session

from batch_api.admin_queries import row_statuses
from batch_api.errors import NotFound
from holdback import jobs
from holdback.broker import is_paused, set_paused
from holdback.contract import queue_name_prefix, requests_queue_name
from holdback.logs import log_event
from holdback.models import RequestStatus

log = logging.getLogger("batch_api.admin")

# Rows whose job belongs in RQ: a failed job of such a row is requeued by retry-failed.
DISPATCHED = (RequestStatus.queued.value, RequestStatus.running.value, RequestStatus.retry_wait.value)


def queue_redis(context) -> redis.Redis:  # noqa: ANN001 - ApiContext
    return context.require_redis()


def queue_names(connection: redis.Redis, namespace: str) -> list[str]:
    """The request queue, plus every other queue RQ knows whose name starts with `<namespace>-`."""
    names = {requests_queue_name(namespace)} | jobs.queue_names_with_prefix(connection, queue_name_prefix(namespace))
    return sorted(names)


def known_queue(connection: redis.Redis, namespace: str, name: str) -> str:
    if name not in queue_names(connection, namespace):
        raise NotFound(f"No queue named '{name}' in namespace '{namespace}'. GET /admin/queues lists them; "
                       f"the request queue is '{requests_queue_name(namespace)}'.", param="name")
    return name


def queue_counts(connection: redis.Redis, namespace: str, name: str) -> dict:
    counts = jobs.queue_counts(connection, name)
    return {
        "object": "queue", "name": name, "paused": is_paused(connection, namespace, name), "queued": counts["queued"],
        **{registry: counts[registry] for registry in jobs.REGISTRY_TEMPLATES}, "workers": counts["workers"],
    }


def set_queue_paused(context, name: str, paused: bool) -> dict:  # noqa: ANN001 - ApiContext
    connection, namespace = queue_redis(context), context.settings.redis_namespace
    known_queue(connection, namespace, name)
    changed = set_paused(connection, namespace, name, paused)
    log_event(log, "queue.paused" if paused else "queue.resumed", queue=name, changed=changed)
    return {**queue_counts(connection, namespace, name), "changed": changed}


def retry_failed(connection: redis.Redis, session: Session, queue_name: str) -> dict:
    """Requeue each failed job whose row is queued, running or retry_wait; the database decides."""
    job_ids = jobs.failed_ids(connection, queue_name)
    statuses = row_statuses(session, job_ids)
    requeued = kept = cleared = 0
    for job_id in job_ids:
        if statuses.get(job_id) not in DISPATCHED:
            kept += 1  # final (the record of a failed request), pending (the processor's), or no row at all
            continue
        outcome = jobs.requeue_failed(connection, queue_name, job_id)
        if outcome == jobs.REQUEUED:
            requeued += 1
        elif outcome == jobs.CLEARED:
            cleared += 1
    return {"object": "queue.retry_failed", "queue": queue_name, "examined": len(job_ids),
            "requeued": requeued, "kept": kept, "cleared": cleared}


def workers(connection: redis.Redis, queues: list[str]) -> list[dict]:
    """The live workers registered on these queues, as GET /admin/workers lists them."""
    return jobs.workers(connection, queues)
