"""The operator dashboard at /dashboard: server-rendered Jinja2 pages that htmx keeps live.

Modules: `session` (admin-key sign-in, session cookie, CSRF), `pages` (routes and actions), `keys_page`
(create, list and revoke tenant keys), `usage_page` (each tenant's usage over a period), `alerts` (the banner
every page shows while dispatch is paused or the gateway or a replica is down), `outcomes` (succeeded, failed
and cancelled apart), `gateway_view` (the gateway's state and metrics), `sampler` (the charts' history in
Redis), `charts` (inline SVG).
Data and actions come from the operator API's functions in `batch_api.admin`.
"""

from __future__ import annotations

from pathlib import Path

from starlette.staticfiles import StaticFiles

from batch_api.dashboard import alerts, keys_page, usage_page
from batch_api.dashboard.outcomes import OutcomeCollector
from batch_api.dashboard.pages import router
from batch_api.dashboard.sampler import DashboardSampler

router.include_router(keys_page.router)
router.include_router(usage_page.router)
router.include_router(alerts.router)

STATIC_DIR = Path(__file__).parent / "static"


def static_files() -> StaticFiles:
    """htmx, the stylesheet, the icon: mounted at /dashboard/static."""
    return StaticFiles(directory=STATIC_DIR)


__all__ = ["router", "static_files", "DashboardSampler", "OutcomeCollector"]
