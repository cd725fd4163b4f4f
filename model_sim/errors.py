"""Errors as vLLM sends them: the envelope {"error": {"message", "type", "param", "code"}}, and FastAPI's bare bodies.

`code` is the HTTP status and `type` the name of vLLM's exception class for it (BadRequestError, NotFoundError,
InternalServerError, ...); `param` names the request field to change. A route that does not exist answers as
FastAPI does, `{"detail": "Not Found"}`, and a missing or wrong API key as vLLM's middleware does,
`{"error": "Unauthorized"}`.
"""

from __future__ import annotations

import json
from http import HTTPStatus

from aiohttp import web

# vLLM's `create_error_response` (its OpenAI server's error handling); a status it
# has no class for is named by its HTTP phrase, as vLLM names a GracefulHTTPError.
ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    422: "UnprocessableEntityError",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
}


def type_for_status(status: int) -> str:
    if status in ERROR_TYPES:
        return ERROR_TYPES[status]
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "InternalServerError" if status >= 500 else "BadRequestError"


class EnvelopeError(Exception):
    """An answer in vLLM's error envelope: the status, the message, the field at fault and vLLM's type name."""

    def __init__(self, status: int, message: str, param: str | None = None, error_type: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.error_type = error_type or type_for_status(status)


class InvalidRequest(EnvelopeError):
    """400: the caller sent something this server cannot serve; the message says what to change."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(400, message, param)


class ValidationFailed(InvalidRequest):
    """400 worded as vLLM's VLLMValidationError: the message ends with `(parameter=..., value=...)`."""

    def __init__(self, message: str, param: str | None = None, value=None, *, show_param: bool = True):
        extras = []
        if param is not None and show_param:
            extras.append(f"parameter={param}")
        if value is not None:
            extras.append(f"value={value}")
        super().__init__(f"{message} ({', '.join(extras)})" if extras else message, param)


class FieldTypeError(EnvelopeError):
    """400 as vLLM answers a body field of the wrong type: its request model's (pydantic's) error, reworded by
    vLLM's validation handler into the envelope with type "Bad Request" and `param` the field's location."""

    def __init__(self, field: str, kind: str, msg: str, value):
        detail = {"type": kind, "loc": f"body.{field}", "msg": msg, "input": value}
        super().__init__(400, f"1 validation error:\n  {detail!r}", f"body.{field}", "Bad Request")


class BareError(Exception):
    """An answer that is not the envelope: FastAPI's `{"detail": ...}` or the auth middleware's body."""

    def __init__(self, status: int, body: dict):
        super().__init__(json.dumps(body))
        self.status = status
        self.body = body


def error_body(status: int, message: str, type_: str, param: str | None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": status}}


def json_dumps(body) -> str:
    """JSON as Starlette's JSONResponse writes it (vLLM's answers): compact, UTF-8 as is."""
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"))


def json_response(body, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=json_dumps(body).encode(), content_type="application/json",
                        headers=headers)


def error_response(err: EnvelopeError, headers: dict[str, str] | None = None) -> web.Response:
    return json_response(error_body(err.status, err.message, err.error_type, err.param), err.status, headers)


def bare_response(err: BareError) -> web.Response:
    return json_response(err.body, err.status)
