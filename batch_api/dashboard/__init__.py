"""The operator dashboard at /dashboard: server-rendered Jinja2 pages that htmx keeps live.

Modules: a page each, with its fragments and actions: `login_page` (sign-in and out), `batches_page` (batches, a
batch, its requests and their attempts; the charts' fragment), `queues_page` (queues and workers, pause, resume and
retry), `gateway_page` (the gateway's state and charts), `keys_page` (create, list and revoke tenant keys),
`usage_page` (each tenant's usage over a period), `alerts` (the banner every page shows while dispatch is paused or
the gateway or a replica is down); and beside them `rendering` (templates, filters, `render`, `flash`), `session`
(admin-key session cookie, CSRF), `outcomes` (succeeded, failed and cancelled apart), `gateway_view` (the gateway's
state and metrics), `sampler` (the charts' history in Redis), `history` (the charts drawn from it), `charts`
(inline SVG).
Data and actions come from the operator API's functions in `batch_api.admin`.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from starlette.staticfiles import StaticFiles

from batch_api.dashboard import alerts, batches_page, gateway_page, keys_page, login_page, queues_page, usage_page
from batch_api.dashboard.outcomes import OutcomeCollector
from batch_api.dashboard.sampler import DashboardSampler

PAGES = (login_page, batches_page, queues_page, gateway_page, keys_page, usage_page, alerts)
router = APIRouter(include_in_schema=False)
for page in PAGES:
    # Each page's paths are relative to /dashboard (the Batches page is /dashboard itself).
    router.include_router(page.router, prefix="/dashboard")

STATIC_DIR = Path(__file__).parent / "static"


def static_files() -> StaticFiles:
    """htmx, the stylesheet, the icon: mounted at /dashboard/static."""
    return StaticFiles(directory=STATIC_DIR)


__all__ = ["router", "static_files", "DashboardSampler", "OutcomeCollector"]
