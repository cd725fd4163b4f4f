"""The banner every dashboard page shows while something stops batch work: dispatch paused on a queue, the
gateway unreachable, a replica the gateway marks down, or Redis unreachable; and while a batch will not finish
inside its window at its pace so far (holdback.risk), before it expires.

Pages load it from `/dashboard/fragments/alerts` when they open and every 5 s after, so a slow gateway
(2 s timeout) never delays a page.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis
from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse
from sqlalchemy import select
from starlette.concurrency import run_in_threadpool

from batch_api import queues
from batch_api.auth import ContextDep
from batch_api.context import ApiContext
from batch_api.dashboard.gateway_view import fetch_gateway
from batch_api.dashboard.rendering import render
from batch_api.dashboard.session import SessionCookie
from holdback.contract import pause_key
from holdback.models import Batch, BatchStatus, Tenant
from holdback.risk import pace

router = APIRouter(include_in_schema=False)


# At most this many at-risk batches are named; the banner counts the rest.
AT_RISK_NAMED = 5


@dataclass(frozen=True)
class Alert:
    kind: str  # paused, gateway, replica, redis, at-risk
    subject: str  # the queue, the gateway's or replica's URL, the batch
    message: str
    link: str | None = None  # where to act on it
    link_text: str = "Gateway"


def at_risk_batches(context: ApiContext) -> list[Alert]:
    """Batches in progress that will not finish inside their window at their pace so far."""
    now = time.time()
    with context.sessions() as session:
        rows = session.execute(
            select(Batch.id, Tenant.name, Batch.in_progress_at, Batch.expires_at, Batch.total, Batch.completed,
                   Batch.failed).join(Tenant, Tenant.id == Batch.tenant_id)
            .where(Batch.status == BatchStatus.in_progress.value)).all()
    found = []
    for row in rows:
        p = pace(now, row.in_progress_at, row.expires_at, row.total, row.completed + row.failed)
        if not p.at_risk:
            continue
        needs = "more than is left (nothing finished yet)" if p.rate == 0 else \
            f"about {_minutes(p.needs or 0)} at {p.rate:.2f} requests/s"
        found.append(Alert("at-risk", row.id, f"Batch {row.id} of {row.name} is at risk of expiring: its {p.left} "
                                              f"requests left need {needs}, and its window closes in "
                                              f"{_minutes(p.remaining)}. The gateway gives its requests the at-risk "
                                              "floor; more replicas, or less realtime traffic, would finish it.",
                           f"/dashboard/batches/{row.id}", "Batch"))
    if len(found) > AT_RISK_NAMED:
        more = len(found) - AT_RISK_NAMED
        found = found[:AT_RISK_NAMED] + [Alert("at-risk", "more", f"{more} more batches are at risk of expiring.",
                                               "/dashboard?status=in_progress", "Batches")]
    return found


def paused_queues(context: ApiContext) -> list[Alert]:
    connection, namespace = context.require_redis(), context.settings.redis_namespace
    found = []
    for name in queues.queue_names(connection, namespace):
        since = connection.get(pause_key(namespace, name))
        if since is None:
            continue
        try:
            ago = f" for {_minutes(time.time() - float(since))}"
        except ValueError:
            ago = ""
        found.append(Alert("paused", name, f"Dispatch is paused on queue {name}{ago}: workers take no new jobs "
                                           "from it, and batch deadlines keep running. Resume it on the Queues page.",
                           "/dashboard/queues", "Queues"))
    return found


async def current_alerts(context: ApiContext) -> list[Alert]:
    try:
        found = await run_in_threadpool(paused_queues, context)
    except (redis.RedisError, OSError) as exc:
        found = [Alert("redis", context.settings.redis_url or "embedded",
                       f"Redis is unreachable ({type(exc).__name__}); queues and live pages cannot be read.")]
    except Exception as exc:  # noqa: BLE001 - require_redis before start-up is done: say so, do not fail the page
        found = [Alert("redis", "", f"Redis is not connected yet ({exc}).")]
    found += await run_in_threadpool(at_risk_batches, context)
    gateway = await fetch_gateway(context.settings.gateway_url, admin_key=context.settings.admin_key)
    if not gateway.reachable:
        found.append(Alert("gateway", gateway.url, f"The gateway at {gateway.url} is unreachable ({gateway.error}): "
                                                   "no batch request is dispatched until it answers.",
                           "/dashboard/gateway"))
    for replica in (r for pool in gateway.pools for r in pool.get("replicas") or []):
        if not replica.get("healthy", True):
            url = str(replica.get("url", "?"))
            found.append(Alert("replica", url, f"Replica {url} is unreachable: the gateway sends it nothing until "
                                               "it answers its health checks again.", "/dashboard/gateway"))
    return found


def _minutes(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds} s" if seconds < 120 else f"{seconds // 60} min"


@router.get("/fragments/alerts")
async def alerts_fragment(request: Request, session: SessionCookie, context: ContextDep) -> HTMLResponse:
    return render(request, "_alerts.html", session, alerts=await current_alerts(context))
