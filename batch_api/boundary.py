"""The checks every request passes after routing and before its route runs: the caller's key first, then
every path and query string, then a JSON body (UTF-8, standard JSON, not too deep, no NUL characters).

FastAPI parses a body before it solves any dependency, so without this a malformed body would be refused
before an unauthenticated caller was; and PostgreSQL's text cannot hold NUL, so a NUL must be refused here,
where SQLite and PostgreSQL answer alike, rather than fail as a database error.
"""

from __future__ import annotations

import email.message
import json
from typing import Any, Awaitable, Callable

from fastapi import params
from fastapi.routing import APIRoute
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from batch_api.context import ApiContext, get_context
from batch_api.errors import BadRequest, PayloadTooLarge
from holdback import strict_json

# Deeper than any request body we accept needs; bounds the walk below and Python's recursive parser.
MAX_JSON_DEPTH = 32
# The largest JSON body a route takes (a batch with full metadata) is under 20 KB.
MAX_JSON_BODY_BYTES = 1 << 20
NON_STANDARD_CONSTANTS = ("NaN", "Infinity", "-Infinity")

Authenticate = Callable[[Request, ApiContext], object]


def guarded_route(authenticate: Authenticate | None) -> type[APIRoute]:
    """A route class whose requests are authenticated with `authenticate` (None: by the route itself),
    then checked as this module says, before FastAPI reads the body."""

    class GuardedRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
            handle = super().get_route_handler()
            takes_json = self.body_field is not None and not isinstance(self.body_field.field_info, params.Form)

            async def guarded(request: Request) -> Response:
                if authenticate is not None:
                    await run_in_threadpool(authenticate, request, get_context(request))
                check_path_and_query(request)
                if takes_json:
                    await check_json_body(request)
                return await handle(request)

            return guarded

    return GuardedRoute


def reject_nul(value: str, param: str, where: str) -> None:
    if "\x00" in value:
        raise BadRequest(
            f"The {where} '{param}' contains a NUL character (\\u0000, %00), which no id, name or value may "
            "hold; remove it.",
            param=param,
            code="invalid_characters",
        )


def check_path_and_query(request: Request) -> None:
    for name, value in request.path_params.items():
        if isinstance(value, str):
            reject_nul(value, name, "path parameter")
    for name, value in request.query_params.multi_items():
        reject_nul(name, name, "query parameter name")
        reject_nul(value, name, "query parameter")


async def check_json_body(request: Request) -> None:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_JSON_BODY_BYTES:
        raise _too_large()  # refused before a byte of it is read
    raw = await request.body()  # Starlette keeps it; FastAPI reads the same bytes next
    if len(raw) > MAX_JSON_BODY_BYTES:
        raise _too_large()
    if not raw:
        return  # FastAPI answers the missing body with the field it needed
    content_type = request.headers.get("content-type")
    if not _is_json(content_type):
        raise BadRequest(
            f"Send the request body as JSON with 'Content-Type: application/json'; got {content_type or 'none'!r}.",
            code="unsupported_content_type",
        )
    parse_json_body(raw)


def parse_json_body(raw: bytes) -> Any:
    """The JSON value of a request body, or a BadRequest that says what is wrong with it."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequest(
            f"The request body is not valid UTF-8: byte 0x{raw[exc.start]:02x} at offset {exc.start} starts no "
            "UTF-8 character. Encode the JSON body as UTF-8.",
            code="invalid_encoding",
        ) from None
    try:
        value = strict_json.loads(text)
    except strict_json.NonStandardConstant as exc:
        raise BadRequest(
            f"The request body is not valid JSON: {exc.detail}; send a finite number, or null.",
            code="invalid_json",
        ) from None
    except json.JSONDecodeError as exc:
        raise BadRequest(
            f"The request body is not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}); "
            "send a JSON object with Content-Type: application/json.",
            code="invalid_json",
        ) from None
    except RecursionError:
        raise _too_deep(None) from None
    _check_value(value, (), 0)
    return value


def _check_value(value: Any, path: tuple[str, ...], depth: int) -> None:
    if depth > MAX_JSON_DEPTH:
        raise _too_deep(_param(path))
    if isinstance(value, str):
        reject_nul(value, _param(path) or "body", "value of")
    elif isinstance(value, dict):
        for key, item in value.items():
            # A key is named by its parent: "metadata" for a bad key inside metadata.
            reject_nul(key, _param(path) or "body", "object key in")
            _check_value(item, (*path, key), depth + 1)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _check_value(item, (*path, str(index)), depth + 1)


def _param(path: tuple[str, ...]) -> str | None:
    return ".".join(path) or None


def _too_deep(param: str | None) -> BadRequest:
    return BadRequest(
        f"The request body is nested more than {MAX_JSON_DEPTH} levels deep; no field of this API needs that. "
        "Send the documented object.",
        param=param,
        code="invalid_json",
    )


def _too_large() -> PayloadTooLarge:
    return PayloadTooLarge(
        f"The JSON request body is larger than {MAX_JSON_BODY_BYTES} bytes; no route of this API takes one "
        "that large. Send the documented object.",
        code="request_too_large",
    )


def _is_json(content_type: str | None) -> bool:
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))
