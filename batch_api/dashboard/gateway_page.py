"""The dashboard's Gateway page: the gateway's state and metrics (`gateway_view`), the tenants behind its fairness
ids, and its charts.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse
from starlette.concurrency import run_in_threadpool

from batch_api import admin_queries
from batch_api.auth import ContextDep
from batch_api.context import ApiContext
from batch_api.dashboard.gateway_view import fetch_gateway
from batch_api.dashboard.history import GATEWAY_CHARTS, chart_panels
from batch_api.dashboard.rendering import render
from batch_api.dashboard.session import SessionCookie

router = APIRouter(include_in_schema=False)


@router.get("/gateway")
async def gateway_page(request: Request, session: SessionCookie, context: ContextDep,
                       range: str | None = None) -> HTMLResponse:  # noqa: A002
    view = await fetch_gateway(context.settings.gateway_url, admin_key=context.settings.admin_key)
    return render(request, "gateway.html", session, page="gateway", gw=view,
                  fairness_names=await run_in_threadpool(_fairness_names, context, view),
                  charts=await run_in_threadpool(chart_panels, request, range, GATEWAY_CHARTS))


@router.get("/fragments/gateway")
async def gateway_fragment(request: Request, session: SessionCookie, context: ContextDep) -> HTMLResponse:
    view = await fetch_gateway(context.settings.gateway_url, admin_key=context.settings.admin_key)
    return render(request, "_gateway.html", session, gw=view,
                  fairness_names=await run_in_threadpool(_fairness_names, context, view))


def _fairness_names(context: ApiContext, view) -> dict[str, str]:  # noqa: ANN001 - a GatewayView
    """Tenant names of the fairness ids the gateway's pools report: the workers relay each batch's tenant id."""
    ids = sorted({fid for pool in view.pools for fid in ((pool.get("kv") or {}).get("tenants") or {})
                  if isinstance(fid, str)})
    if not ids:
        return {}
    with context.sessions() as db:
        return admin_queries.tenant_names(db, ids)
