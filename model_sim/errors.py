"""Errors as the OpenAI envelope: {"error": {"message", "type", "param", "code"}}.

`code` is the HTTP status, as vLLM sends it; `param` names the request field to change.
"""

from __future__ import annotations

import json

from aiohttp import web

ERROR_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, error_type: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.error_type = error_type or ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


class InvalidRequest(ApiError):
    """400: the caller sent something this server cannot serve; the message says what to change."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(400, message, param)


def error_body(status: int, message: str, error_type: str, param: str | None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": status}}


def error_response(err: ApiError, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        status=err.status,
        body=json.dumps(error_body(err.status, err.message, err.error_type, err.param)),
        content_type="application/json",
        headers=headers,
    )
