"""What wraps every route of a simulated replica, as vLLM's server does: a span per inference request (while
tracing is on), errors answered in vLLM's envelope or FastAPI's bare bodies, `--api-key` guarding /v1/* as vLLM's
AuthenticationMiddleware does, and the replica's name and the caller's request id stamped on every answer.
"""

from __future__ import annotations

import hmac
import logging
from typing import TYPE_CHECKING

from aiohttp import web

from holdback import tracing
from holdback.contract import REQUEST_ID_HEADER, SIM_REPLICA_HEADER
from holdback.logs import log_event
from model_sim.errors import BareError, EnvelopeError, bare_response, error_response

if TYPE_CHECKING:
    from model_sim.replica import SimReplica

log = logging.getLogger("model_sim")
REPLICA_KEY: web.AppKey["SimReplica"] = web.AppKey("replica")
# The paths vLLM's AuthenticationMiddleware guards when --api-key is set.
GUARDED_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")


def middlewares() -> list:
    """The app's middlewares, outermost first."""
    # The span middleware is outermost, so a span's status is the answer the caller got; absent when tracing is off.
    return ([_trace_middleware] if tracing.enabled() else []) + [_errors_middleware, _auth_middleware]


async def stamp_headers(request: web.Request, response: web.StreamResponse) -> None:
    response.headers[SIM_REPLICA_HEADER] = request.app[REPLICA_KEY].name
    request_id = request.headers.get(REQUEST_ID_HEADER)
    if request_id is not None:
        response.headers[REQUEST_ID_HEADER] = request_id


@web.middleware
async def _trace_middleware(request: web.Request, handler):
    """A server span per inference request, continuing the caller's `traceparent` (holdback.tracing)."""
    if request.method != "POST" or not request.path.startswith("/v1/"):
        return await handler(request)
    with tracing.span(f"sim {request.path}", parent=request.headers, kind="server",
                      attributes={"request_id": request.headers.get(REQUEST_ID_HEADER),
                                  "holdback.replica": request.app[REPLICA_KEY].name}) as span:
        response = await handler(request)
        span.set_attribute("http.response.status_code", response.status)
        return response


@web.middleware
async def _errors_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except EnvelopeError as err:
        headers = {"retry-after": "1"} if err.status in (429, 503) else None
        return error_response(err, headers)
    except BareError as err:
        return bare_response(err)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        if exc.status in (404, 405):  # FastAPI's answers for an unknown route or method
            return bare_response(BareError(exc.status, {"detail": exc.reason}))
        return error_response(EnvelopeError(exc.status, f"{exc.reason}: {request.method} {request.path}"))
    except Exception:
        log_event(log, "unhandled_error", level=logging.ERROR, exc_info=True, method=request.method, path=request.path)
        return error_response(EnvelopeError(500, "Internal error in the simulator; see its log."))


@web.middleware
async def _auth_middleware(request: web.Request, handler):
    """vLLM's AuthenticationMiddleware: with an API key, /v1/* needs `Authorization: Bearer KEY` (OPTIONS aside)."""
    key = request.app[REPLICA_KEY].config.api_key
    if key is not None and request.method != "OPTIONS" and request.path.startswith(GUARDED_PREFIXES):
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), key.encode()):
            raise BareError(401, {"error": "Unauthorized"})
    return await handler(request)
