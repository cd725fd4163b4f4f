"""Every error the API returns, in the OpenAI envelope `{"error": {message, type, param, code}}`.

Routes raise `ApiError` (or a subclass); the handlers installed by `install_error_handlers` turn it,
FastAPI's validation errors, Starlette's 404/405 (with an `Allow` naming every method of the path), an
unreachable Redis (503) and any unexpected exception into that envelope. 409 is never used: the OpenAI
SDK retries it, and our conflicts are permanent.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from holdback.contract import REQUEST_ID_HEADER
from holdback.storage import StorageFull

log = logging.getLogger("batch_api.errors")

REDIS_RETRY_AFTER_S = 5
HTTP_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


class ApiError(Exception):
    status = 400
    type = "invalid_request_error"
    code: str | None = None

    def __init__(
        self, message: str, *, param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None
    ):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.headers = headers

    def envelope(self) -> dict:
        return envelope(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.envelope(), status_code=self.status, headers=self.headers)


class BadRequest(ApiError):
    status = 400
    code = "invalid_value"


class Unauthorized(ApiError):
    status = 401
    code = "invalid_api_key"

    def __init__(self, message: str, *, code: str | None = None):
        super().__init__(message, code=code, headers={"www-authenticate": "Bearer"})


class Forbidden(ApiError):
    status = 403
    type = "permission_error"
    code = "permission_denied"


class NotFound(ApiError):
    status = 404
    code = "not_found"


class Conflict(ApiError):
    status = 409
    code = "conflict"


class RequestTimeout(ApiError):
    status = 408
    code = "upload_too_slow"


class PayloadTooLarge(ApiError):
    status = 413
    code = "file_too_large"


class ServerError(ApiError):
    status = 500
    type = "server_error"
    code = "internal_error"


class LimitReached(ApiError):
    """A tenant at one of its limits (holdback.tenant_limits): 429, and `x-should-retry: false` so the SDKs do
    not re-send at once a request that stays refused until earlier work finishes."""

    status = 429
    type = "rate_limit_error"

    def __init__(self, message: str, *, code: str):
        super().__init__(message, code=code, headers={"x-should-retry": "false"})


class InsufficientStorage(ApiError):
    """The file store is full (holdback.storage.StorageFull): 507, and `x-should-retry: false` (read by the
    OpenAI SDKs), since re-sending a whole upload to a full store fails the same way each time."""

    status = 507
    type = "server_error"
    code = "storage_full"

    def __init__(self, message: str):
        super().__init__(message, headers={"x-should-retry": "false"})


class ServiceUnavailable(ApiError):
    status = 503
    type = "server_error"
    code = "not_ready"


def envelope(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _param_name(loc: tuple) -> str | None:
    # ("body", "metadata", "k") -> "metadata.k"; ("query", "limit") -> "limit"
    parts = [str(p) for p in loc[1:]] if loc and loc[0] in ("body", "query", "path", "header") else [str(p) for p in loc]
    return ".".join(parts) or None


def _validation_message(err: dict) -> str:
    kind = err.get("type", "")
    param = _param_name(tuple(err.get("loc", ())))
    if kind == "json_invalid":
        return "The request body is not valid JSON; send a JSON object with Content-Type: application/json."
    if kind == "extra_forbidden":
        return f"Unrecognized request argument: '{param}'. Remove it."
    if kind == "missing":
        if param is None:
            return "The request body is missing; send a JSON object."
        return f"Missing required parameter: '{param}'."
    msg = str(err.get("msg", "invalid value"))
    # Our own validators raise ValueError with a complete sentence; pydantic prefixes it.
    msg = msg.removeprefix("Value error, ")
    if not msg.endswith((".", "?", "!")):
        msg += "."
    if param is None:
        return f"Invalid request: {msg}"
    return f"Invalid value for '{param}': {msg}"


async def _on_api_error(_request: Request, exc: ApiError) -> JSONResponse:
    return exc.response()


async def _on_validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {}
    param = _param_name(tuple(first.get("loc", ())))
    code = "missing_required_parameter" if first.get("type") == "missing" else "invalid_value"
    return JSONResponse(
        envelope(_validation_message(first), "invalid_request_error", param, code), status_code=400
    )


async def _on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    if exc.status_code == 404:
        message = (
            f"Unknown route {request.method} {request.url.path}. The API serves /v1/files and /v1/batches; "
            "check the base URL (it should end in /v1)."
        )
        code = "not_found"
    elif exc.status_code == 405:
        allowed = allowed_methods(request)
        message = f"Method {request.method} is not allowed on {request.url.path}." + (
            f" Use one of: {allowed}." if allowed else ""
        )
        code = "method_not_allowed"
        headers = {**(exc.headers or {}), "allow": allowed}
        headers.pop("Allow", None)
        return JSONResponse(envelope(message, "invalid_request_error", None, code), status_code=405, headers=headers)
    else:
        message = str(exc.detail)
        code = "invalid_body" if exc.status_code == 400 else None
    type_ = "server_error" if exc.status_code >= 500 else "invalid_request_error"
    return JSONResponse(envelope(message, type_, None, code), status_code=exc.status_code, headers=exc.headers)


def allowed_methods(request: Request) -> str:
    """Every method some route serves at this path: the router answers 405 with the first route's alone.

    Each method is tried against the routing table, so routes inside included routers count too."""
    allowed = []
    for method in HTTP_METHODS:
        scope = {**request.scope, "method": method}
        if any(route.matches(scope)[0] == Match.FULL for route in request.app.router.routes):
            allowed.append(method)
    return ", ".join(allowed)


async def _on_redis_down(request: Request, exc: Exception) -> JSONResponse:
    log.warning(
        "request.redis_unreachable",
        extra={"fields": {"method": request.method, "path": request.url.path, "error": repr(exc)}},
    )
    return ServiceUnavailable(
        "Redis, which holds the dispatch queues, is unreachable; retry in a few seconds. "
        "Operators: GET /readyz names the failing dependency; check REDIS_URL and the Redis server.",
        code="redis_unavailable",
        headers={"retry-after": str(REDIS_RETRY_AFTER_S)},
    ).response()


async def _on_storage_full(request: Request, exc: StorageFull) -> JSONResponse:
    log.error("request.storage_full", extra={"fields": {"method": request.method, "path": request.url.path,
                                                       "store": exc.where, "error": exc.detail}})
    return InsufficientStorage(
        f"The file store ({exc.where}) is full or over its quota ({exc.detail}); nothing of this request was "
        "kept. Retrying will fail the same way until the operator frees space or raises the quota.",
    ).response()


async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    # This handler runs outside the request middleware, so it repeats the request id itself.
    request_id = request.scope.get("state", {}).get("request_id", "")
    log.error(
        "request.failed",
        exc_info=exc,
        extra={"fields": {"request_id": request_id, "method": request.method, "path": request.url.path, "error": repr(exc)}},
    )
    return JSONResponse(
        envelope(
            "The server hit an internal error; the request may be retried. If it keeps failing, "
            f"the operator will find the cause in the API server's log under request id {request_id}.",
            "server_error",
            None,
            "internal_error",
        ),
        status_code=500,
        headers={REQUEST_ID_HEADER: request_id},
    )


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, _on_api_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(RedisConnectionError, _on_redis_down)
    app.add_exception_handler(RedisTimeoutError, _on_redis_down)
    app.add_exception_handler(StorageFull, _on_storage_full)
    app.add_exception_handler(Exception, _on_unexpected)
