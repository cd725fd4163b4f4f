"""Responses the gateway writes itself, all in the OpenAI error envelope {"error": {message, type, param, code}}.

Drop reasons travel in the drop-reason header (`holdback.contract`): 429 while the pool has replicas, 503 when it has
none, with `Retry-After` so well-behaved callers back off.
"""

from __future__ import annotations

import json

from aiohttp import web

from holdback.contract import DROP_REASON_HEADER, REQUEST_ID_HEADER, DropReason

_DROPS: dict[DropReason, tuple[int, str, str]] = {
    # An eviction is the gateway's own scheduling: the retry may come at once, it keeps its place in line.
    DropReason.EVICTED: (429, "0", "The request was evicted by flow control to free capacity for "
                         "higher-priority work; retry it now: it keeps its place in the gateway's queue."),
    DropReason.SATURATED: (429, "1", "The gateway queue for this priority band is full; retry later."),
    DropReason.TTL_EXPIRED: (429, "1", "The request waited in the gateway queue past its TTL or deadline "
                             "without capacity to dispatch it; retry later or allow a longer TTL."),
    DropReason.NO_ENDPOINTS: (503, "2", "No model replica is available behind the gateway; retry later."),
    DropReason.CONTEXT_CANCELLED: (503, "1", "The request was cancelled by the caller."),
    DropReason.KV_CAPACITY: (429, "2", "KV-cache admission refused the request: its worst-case KV "
                             "commitment (prompt + max_tokens) does not fit; lower max_tokens or retry later."),
    # A request no replica may ever hold: retrying cannot help (a worker's row fails at once, saying why).
    DropReason.KV_NEVER_FITS: (400, "", "KV-cache admission refused the request: its worst-case KV commitment "
                               "(prompt + max_tokens) is more than a replica may ever hold; lower max_tokens or "
                               "shorten the prompt."),
    DropReason.QUOTA: (429, "2", "A KV quota of this tenant or traffic class is reached; retry after some of "
                       "its requests finish."),
    # Retrying cannot help a request longer than the context limit: 400, not 429.
    DropReason.CONTEXT_LENGTH: (400, "", "The request exceeds the context limit; shorten the prompt or lower "
                                "max_tokens."),
    DropReason.SHUTTING_DOWN: (503, "1", "The gateway process that held this request is shutting down (its drain "
                               "deadline came while the request waited in its queue); retry it: a load balancer "
                               "sends it to another gateway process."),
}


def error_body(message: str, err_type: str, code: str, param: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": err_type, "param": param, "code": code}}).encode()


def error_response(status: int, message: str, err_type: str, code: str, request_id: str | None = None,
                   headers: dict[str, str] | None = None, param: str | None = None) -> web.Response:
    h = dict(headers or {})
    if request_id:
        h[REQUEST_ID_HEADER] = request_id
    return web.Response(status=status, body=error_body(message, err_type, code, param), headers=h,
                        content_type="application/json")


def drop_response(reason: DropReason, request_id: str, message: str | None = None) -> web.Response:
    """The drop's envelope; `message` (say which quota, its limit and the usage) replaces the generic text."""
    status, retry_after, generic = _DROPS[reason]
    err_type = {429: "rate_limit_error", 400: "invalid_request_error"}.get(status, "service_unavailable")
    headers = {DROP_REASON_HEADER: reason.value}
    if retry_after != "":
        headers["Retry-After"] = retry_after
    return error_response(status, message or generic, err_type, reason.value, request_id, headers)


def embeddings_not_served(replica, request_id: str,  # noqa: ANN001 - a gateway.replicas.Replica, or None
                          pool: str | None = None) -> web.Response:
    """/v1/embeddings where the replicas serve a generation model (FastAPI's 404 for the path, not vLLM's), or
    to a pool whose `endpoints` leave it out."""
    if pool is not None:
        message = (f"The model pool {pool!r} that serves this model does not serve /v1/embeddings (its `endpoints` "
                   "leave it out). Name a model of a pool that serves embeddings, or add /v1/embeddings to the "
                   "pool's `endpoints` if its replicas run an embedding model.")
        return error_response(404, message, "invalid_request_error", "embeddings_not_served", request_id)
    serves = f" (they serve {replica.model!r}, a text-generation model)" if replica is not None and replica.model \
        else ""
    message = (f"The model replicas behind this gateway serve no embeddings model{serves}, so /v1/embeddings is "
               "not available here. Send embeddings requests to a gateway whose replicas were started with an "
               "embedding model (vLLM `--runner pooling`, e.g. `vllm serve BAAI/bge-small-en-v1.5 --runner "
               "pooling`), or point this gateway's `replicas` at such replicas.")
    return error_response(404, message, "invalid_request_error", "embeddings_not_served", request_id)


def model_not_found(model: object, served: list[str], request_id: str) -> web.Response:
    """A `model` no pool serves, answered as OpenAI and vLLM answer it (404), naming the models served here."""
    names = ", ".join(served) if served else "none yet (no replica has said what it serves)"
    message = (f"The model `{model}` does not exist. Models served by this gateway: {names}. Set `model` to one of "
               f"them (GET /v1/models lists them).")
    h = {REQUEST_ID_HEADER: request_id}
    return web.Response(status=404, body=error_body(message, "invalid_request_error", "model_not_found", "model"),
                        headers=h, content_type="application/json")


def endpoint_not_served(path: str, pool: str, endpoints: tuple[str, ...], request_id: str) -> web.Response:
    message = (f"The model pool {pool!r} that serves this model does not serve {path}; it serves "
               f"{', '.join(endpoints) or 'no endpoint'}. Send the request to one of those, or name a model of "
               f"another pool.")
    return error_response(404, message, "invalid_request_error", "endpoint_not_served", request_id)


def evicted_message() -> str:
    """What an evicted request is told: why, and to retry at once."""
    return _DROPS[DropReason.EVICTED][2]


def evicted_sse_event() -> bytes:
    """The last event of a chat or completions stream cut by eviction: the client sees an error, not a silent
    truncation (a Responses stream ends with its own events, gateway/responses_stream.py)."""
    payload = {"error": {"message": evicted_message(), "type": "rate_limit_error", "param": None,
                         "code": DropReason.EVICTED.value}}
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def models_union(answers: list[tuple[int, bytes, object]], request_id: str) -> web.Response:
    """GET /v1/models over several pools: every model each pool's replica listed, once, in the pools' order."""
    data: list[dict] = []
    for status, body, _headers in answers:
        try:
            doc = json.loads(body) if status < 300 else None
        except (ValueError, UnicodeDecodeError):
            doc = None
        cards = doc.get("data") if isinstance(doc, dict) else None
        for card in cards if isinstance(cards, list) else []:
            if isinstance(card, dict) and card.get("id") not in {c.get("id") for c in data}:
                data.append(card)
    return web.json_response({"object": "list", "data": data}, headers={REQUEST_ID_HEADER: request_id})
