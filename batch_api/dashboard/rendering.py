"""How the dashboard's pages render: the Jinja2 templates and their filters, `render` (every answer with the
security headers) and `flash` (an action's answer). Pages render their fragments inline on first load; each live
region then re-fetches its fragment (`/dashboard/fragments/...`) on a timer and whenever an action answers with
`HX-Trigger: refresh`.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlencode

from fastapi import Request
from fastapi.responses import HTMLResponse

from batch_api.context import ApiContext
from batch_api.dashboard import charts
from batch_api.dashboard.gateway_view import DROP_REASON_MEANINGS

if TYPE_CHECKING:
    from fastapi.templating import Jinja2Templates

SECURITY_HEADERS = {
    "content-security-policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; frame-ancestors 'none'; form-action 'self'; base-uri 'none'",
    "x-frame-options": "DENY",
    "x-content-type-options": "nosniff",
    "referrer-policy": "same-origin",
    "cache-control": "no-store",
}


def _ts(value: float | None) -> str:
    if value is None:
        return "—"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(value)) + " UTC"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    seconds = max(0.0, seconds)
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 60:
        return f"{seconds:.0f} s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m {secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours}h {minutes:02d}m"
    return f"{hours // 24}d {hours % 24}h"


def _clock(value: float | None) -> str:
    """Time of day with milliseconds (UTC): attempts of one request are seconds apart."""
    if value is None:
        return "—"
    return time.strftime("%H:%M:%S", time.gmtime(value)) + f".{int(value % 1 * 1000):03d}"


def _ago(value: float | None) -> str:
    if value is None:
        return "—"
    age = time.time() - value
    if age < 1:
        return "just now"
    return f"{int(age)} s ago" if age < 60 else f"{_duration(age)} ago"


def _percent(value: float | None) -> str:
    return "—" if value is None else f"{value * 100:.0f}%"


def _seconds(value: float | None) -> str:
    return "—" if value is None else charts.seconds_label(value)


def _query(**params: object) -> str:
    """A query string of the params that are set, for the URLs live regions poll."""
    return urlencode({k: v for k, v in params.items() if v not in (None, "")})


@functools.cache
def templates() -> Jinja2Templates:
    """The templates with their filters, made with the first page: an API process that serves none (most of
    them in the tests) never imports Jinja2."""
    from fastapi.templating import Jinja2Templates

    made = Jinja2Templates(directory=str(Path(__file__).parent / "templates"))
    made.env.filters.update(ts=_ts, clock=_clock, duration=_duration, ago=_ago, percent=_percent, seconds=_seconds)
    made.env.globals.update(query=_query, meanings=DROP_REASON_MEANINGS)
    return made


def render(request: Request, name: str, session: object | None = None, status_code: int = 200,
           headers: dict[str, str] | None = None, **values: object) -> HTMLResponse:
    context: ApiContext = request.app.state.context
    values.setdefault("namespace", context.settings.redis_namespace)
    values.setdefault("csrf", getattr(session, "csrf", ""))
    values.setdefault("now_ts", time.time())
    response = templates().TemplateResponse(request, name, values, status_code=status_code)
    response.headers.update(SECURITY_HEADERS)
    if headers:
        response.headers.update(headers)
    return response


def flash(request: Request, message: str, *, ok: bool = True, status_code: int = 200) -> HTMLResponse:
    """An action's answer: the toast text, and a trigger that refreshes every live region at once."""
    return render(request, "_flash.html", ok=ok, message=message, status_code=status_code,
                  headers={"HX-Trigger": "refresh"})
