"""The dashboard's sign-in: the admin key checked (failed attempts throttled per address), a server-side session
in a cookie, and signing out, which ends the session on the server.
"""

from __future__ import annotations

import logging
from typing import Annotated

from fastapi import APIRouter, Form, Request
from fastapi.responses import RedirectResponse, Response

from batch_api.auth import ContextDep, is_admin_key
from batch_api.dashboard.rendering import render
from batch_api.dashboard.session import (CheckedPost, clear_cookie, close_session, open_session, safe_next, set_cookie,
                                         signed_in)
from batch_api.dashboard.throttle import LOGIN_ATTEMPTS, LoginThrottle
from holdback.logs import log_event

log = logging.getLogger("batch_api.dashboard")
router = APIRouter(include_in_schema=False)


@router.get("/login")
def login_form(request: Request, context: ContextDep, next: str | None = None) -> Response:  # noqa: A002
    admin_key = context.settings.admin_key
    if admin_key and signed_in(request, context):
        return RedirectResponse(safe_next(next), status_code=303)
    return render(request, "login.html", next=safe_next(next), error=None, disabled=not admin_key)


@router.post("/login")
def login(
    request: Request, context: ContextDep, admin_key: Annotated[str, Form()] = "",
    next: Annotated[str, Form()] = "/dashboard",  # noqa: A002
) -> Response:
    if not context.settings.admin_key:
        return render(request, "login.html", next=safe_next(next), error=None, disabled=True, status_code=403)
    connection, namespace = context.require_redis(), context.settings.redis_namespace
    client = request.client.host if request.client else "unknown"
    throttle = LoginThrottle(connection, namespace)
    wait = throttle.admit(client)
    if wait:
        log_event(log, "dashboard.login_throttled", level=logging.WARNING, client=client, retry_after_s=wait)
        return render(request, "login.html", next=safe_next(next), disabled=False, status_code=429,
                      headers={"retry-after": str(wait)},
                      error=f"Too many failed sign-ins from your address ({LOGIN_ATTEMPTS} a minute); "
                            f"try again in {wait} s.")
    if not is_admin_key(context, admin_key.strip()):
        log_event(log, "dashboard.login_failed", level=logging.WARNING, client=client)
        return render(request, "login.html", next=safe_next(next), disabled=False, status_code=401,
                      error="That is not the admin key. Use the value of HOLDBACK_ADMIN_KEY the API server runs with.")
    throttle.succeeded(client)
    response = RedirectResponse(safe_next(next), status_code=303)
    token = open_session(connection, namespace, context.settings.admin_key)
    set_cookie(response, token, secure=request.url.scheme == "https")
    log_event(log, "dashboard.login", client=client)
    return response


@router.post("/logout")
def logout(request: Request, session: CheckedPost, context: ContextDep) -> Response:
    # Ended on the server: the cookie is worthless even if a copy of it survives the browser's.
    close_session(context.require_redis(), context.settings.redis_namespace, session.token)
    response = Response(status_code=204, headers={"HX-Redirect": "/dashboard/login"})
    clear_cookie(response, secure=request.url.scheme == "https")
    log_event(log, "dashboard.logout", client=request.client.host if request.client else None)
    return response
