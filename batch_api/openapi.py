"""The API's OpenAPI document as clients meet the API: every error status a route answers, each with the
OpenAI error envelope, 400 where FastAPI would list 422, and the multipart body of `POST /v1/files`
(which the route reads as a stream, so FastAPI cannot see it).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from batch_api.schemas import EXPIRES_AFTER_MAX, EXPIRES_AFTER_MIN, UPLOAD_PURPOSES


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """The OpenAI error envelope every error answer uses."""

    error: ErrorDetail


def _error(description: str) -> dict[str, Any]:
    return {"model": ErrorResponse, "description": description}


BAD_REQUEST = _error("Invalid request; the message says what to change and `param` names the field.")
UNAUTHORIZED = _error("Missing or invalid API key (`Authorization: Bearer <key>`).")
SERVER_ERROR = _error("Internal error; the message names the request id to look up in the server's log.")
NOT_FOUND = _error("No such id (or cursor) for this key.")

TOO_LARGE = _error("The request body is larger than the route accepts.")
TENANT_ERRORS: dict[int | str, dict[str, Any]] = {
    400: BAD_REQUEST,
    401: UNAUTHORIZED,
    403: _error("The admin key was sent to /v1; /v1 takes tenant keys."),
    404: NOT_FOUND,
    413: TOO_LARGE,
    500: SERVER_ERROR,
}
ADMIN_ERRORS: dict[int | str, dict[str, Any]] = {
    400: BAD_REQUEST,
    401: UNAUTHORIZED,
    403: _error("A tenant key was sent to an operator route, or no admin key is configured."),
    404: NOT_FOUND,
    413: TOO_LARGE,
    500: SERVER_ERROR,
    503: _error("Redis is unreachable; retry after the seconds in `Retry-After`."),
}
UPLOAD_ERRORS: dict[int | str, dict[str, Any]] = {
    413: _error("The file is larger than the server accepts for its purpose (or the upload's total size is)."),
}
NOT_READY = {503: _error("The database or Redis does not answer; `checks` says which.")}

UPLOAD_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["purpose", "file"],
                    "properties": {
                        "purpose": {"type": "string", "enum": list(UPLOAD_PURPOSES),
                                    "description": "'batch' for a batch input file (JSONL, named *.jsonl)."},
                        "file": {"type": "string", "format": "binary",
                                 "description": "The file, as a part with a filename."},
                        "expires_after[anchor]": {"type": "string", "enum": ["created_at"]},
                        "expires_after[seconds]": {"type": "integer", "minimum": EXPIRES_AFTER_MIN,
                                                   "maximum": EXPIRES_AFTER_MAX},
                    },
                },
                "encoding": {"file": {"contentType": "application/octet-stream"}},
            }
        },
    }
}

# FastAPI's own validation-error models: the API never answers with them.
_UNUSED_SCHEMAS = ("HTTPValidationError", "ValidationError")


def install_openapi(app: FastAPI) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _as_answered(get_openapi(
                title=app.title, version=app.version, description=app.description, routes=app.routes,
            ))
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _as_answered(schema: dict[str, Any]) -> dict[str, Any]:
    for operations in schema.get("paths", {}).values():
        for operation in operations.values():
            operation.get("responses", {}).pop("422", None)
    components = schema.get("components", {}).get("schemas", {})
    for name in _UNUSED_SCHEMAS:
        components.pop(name, None)
    return schema
