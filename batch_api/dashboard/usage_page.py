"""The dashboard's Usage page: each tenant's batches, finished requests by outcome, tokens in and out,
rejected and evicted attempts over a chosen period, and its share of the requests running now. The figures
are `batch_api.admin_queries.tenant_usage`'s, as `GET /admin/usage` answers them.
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

from batch_api.admin_queries import tenant_usage
from batch_api.auth import SessionDep
from batch_api.dashboard.rendering import render
from batch_api.dashboard.session import SessionCookie

router = APIRouter(include_in_schema=False)

PERIODS = {"1h": (3600, "last hour"), "24h": (86400, "last 24 hours"), "7d": (7 * 86400, "last 7 days"),
           "30d": (30 * 86400, "last 30 days")}
DEFAULT_PERIOD = "24h"


def _usage(db, period: str | None) -> dict:  # noqa: ANN001 - a Session
    period = period if period in PERIODS else DEFAULT_PERIOD
    until = time.time()
    since = until - PERIODS[period][0]
    rows = tenant_usage(db, since, until)
    totals = {name: sum(getattr(u, name) for u in rows)
              for name in ("batches", "succeeded", "failed", "cancelled", "input_tokens", "output_tokens",
                           "rejections", "evictions", "in_flight")}
    return {"usage": rows, "totals": totals, "period": period, "periods": PERIODS, "since": since, "until": until}


@router.get("/usage")
def usage_page(request: Request, session: SessionCookie, db: SessionDep, period: str | None = None) -> HTMLResponse:
    return render(request, "usage.html", session, page="usage", **_usage(db, period))


@router.get("/fragments/usage")
def usage_fragment(request: Request, session: SessionCookie, db: SessionDep,
                   period: str | None = None) -> HTMLResponse:
    return render(request, "_usage.html", session, **_usage(db, period))
