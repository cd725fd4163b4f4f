"""Dashboard sign-in: the admin key, typed once into /dashboard/login, becomes a session cookie.

The cookie holds `<issued>.<nonce>.<mac>`, where mac = HMAC-SHA256(admin key, "session:<issued>.<nonce>"):
never the key itself, valid for `SESSION_SECONDS`, and void as soon as the admin key changes. It is HttpOnly
and SameSite=Strict (Secure over https). Every POST also needs `X-CSRF-Token`, HMAC(admin key,
"csrf:<cookie>"), which the page hands to htmx through `hx-headers`: a forged cross-site request has
neither the cookie (SameSite) nor the token.

A signed cookie alone cannot be taken back, so each session is also recorded in Redis (shared by every API
process of the namespace) under a hash of the cookie, with the admin key's fingerprint and the session's
lifetime: signing out deletes the record, and a record made under another admin key does not count.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass
from typing import Annotated
from urllib.parse import quote

import redis
from fastapi import Depends, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from batch_api.auth import ContextDep
from batch_api.context import ApiContext
from batch_api.errors import ApiError

COOKIE = "holdback_dashboard"
SESSION_SECONDS = 12 * 3600
CSRF_HEADER = "x-csrf-token"
LOGIN_PATH = "/dashboard/login"


def _mac(admin_key: str, purpose: str, message: str) -> str:
    return hmac.new(admin_key.encode(), f"{purpose}:{message}".encode(), hashlib.sha256).hexdigest()


def issue_session(admin_key: str, now: float | None = None) -> str:
    body = f"{int(time.time() if now is None else now)}.{secrets.token_hex(8)}"
    return f"{body}.{_mac(admin_key, 'session', body)}"


def session_valid(admin_key: str, token: str, now: float | None = None) -> bool:
    issued, _, rest = token.partition(".")
    nonce, _, mac = rest.partition(".")
    if not (issued.isdigit() and nonce and mac):
        return False
    age = (time.time() if now is None else now) - int(issued)
    if not -60 <= age <= SESSION_SECONDS:
        return False
    return hmac.compare_digest(mac, _mac(admin_key, "session", f"{issued}.{nonce}"))


def session_key(namespace: str, token: str) -> str:
    """Where Redis records a session: a hash of the cookie, so Redis never holds a usable cookie."""
    return f"{namespace}:dashboard:session:{hashlib.sha256(token.encode()).hexdigest()}"


def _fingerprint(admin_key: str) -> str:
    return _mac(admin_key, "fingerprint", "dashboard-session")


def open_session(connection: redis.Redis, namespace: str, admin_key: str) -> str:
    """A new signed session cookie, recorded in Redis for its lifetime."""
    token = issue_session(admin_key)
    connection.set(session_key(namespace, token), _fingerprint(admin_key), ex=SESSION_SECONDS)
    return token


def session_open(connection: redis.Redis, namespace: str, admin_key: str, token: str) -> bool:
    """The cookie is signed with this admin key, unexpired, and its session was not ended."""
    if not session_valid(admin_key, token):
        return False
    recorded = connection.get(session_key(namespace, token))
    recorded_text = recorded.decode() if isinstance(recorded, bytes) else recorded
    return recorded_text is not None and hmac.compare_digest(recorded_text, _fingerprint(admin_key))


def close_session(connection: redis.Redis, namespace: str, token: str) -> None:
    connection.delete(session_key(namespace, token))


def signed_in(request: Request, context: ApiContext) -> str | None:
    """This request's open session cookie, or None."""
    admin_key = context.settings.admin_key
    token = request.cookies.get(COOKIE, "")
    if not admin_key or not token:
        return None
    if not session_open(context.require_redis(), context.settings.redis_namespace, admin_key, token):
        return None
    return token


def csrf_token(admin_key: str, session_token: str) -> str:
    return _mac(admin_key, "csrf", session_token)


def safe_next(target: str | None) -> str:
    """Where to go after sign-in: a dashboard path on this site, nothing else."""
    if target and target.startswith("/dashboard") and not target.startswith("//") and "\\" not in target:
        return target
    return "/dashboard"


@dataclass(frozen=True)
class DashboardSession:
    token: str
    csrf: str


class LoginRequired(ApiError):
    """No valid session: a page goes to the login form, an htmx fragment tells the browser to go there."""

    status = 401

    def __init__(self, request: Request):
        super().__init__("Sign in to the dashboard with the admin key.", code="login_required")
        self.htmx = request.headers.get("hx-request") == "true"
        self.next = request.url.path + (f"?{request.url.query}" if request.url.query else "")

    def response(self) -> Response:
        if self.htmx:
            return Response(status_code=401, headers={"HX-Redirect": LOGIN_PATH})
        return RedirectResponse(f"{LOGIN_PATH}?next={quote(self.next)}", status_code=303)


class CsrfRejected(ApiError):
    status = 403

    def __init__(self) -> None:
        super().__init__("This action needs the page's CSRF token; reload the page and try again.",
                         code="csrf_token_invalid")

    def response(self) -> Response:
        return HTMLResponse(
            '<div class="flash flash-error" role="alert">Refused: the request did not carry this page\'s '
            "security token. Reload the page and try again.</div>",
            status_code=403,
        )


def current_session(request: Request, context: ContextDep) -> DashboardSession:
    token = signed_in(request, context)
    if token is None:
        raise LoginRequired(request)
    return DashboardSession(token, csrf_token(context.settings.admin_key, token))


SessionCookie = Annotated[DashboardSession, Depends(current_session)]


def checked_post(request: Request, session: SessionCookie) -> DashboardSession:
    """A signed-in session whose POST carries the matching CSRF token."""
    if not hmac.compare_digest(request.headers.get(CSRF_HEADER, ""), session.csrf):
        raise CsrfRejected()
    return session


CheckedPost = Annotated[DashboardSession, Depends(checked_post)]


def set_cookie(response: Response, token: str, secure: bool) -> None:
    response.set_cookie(COOKIE, token, max_age=SESSION_SECONDS, path="/dashboard", httponly=True,
                        samesite="strict", secure=secure)


def clear_cookie(response: Response, secure: bool) -> None:
    response.delete_cookie(COOKIE, path="/dashboard", httponly=True, samesite="strict", secure=secure)
