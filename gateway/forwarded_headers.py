"""Which headers pass between the caller and a replica, each way."""

from __future__ import annotations

from typing import Iterable

from multidict import CIMultiDict

from gateway.cache_salt import PRIORITY_HEADER
from holdback import tracing
from holdback.contract import REQUEST_ID_HEADER

HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer", "trailers",
    "transfer-encoding", "upgrade", "host", "content-length",
})
# Our own request headers are not forwarded (the gateway key is ours, not the replica's), nor a caller's
# priority for the replica's queue (the gateway decides the order).
NOT_FORWARDED = HOP_BY_HOP | {"authorization", PRIORITY_HEADER}


def to_replica(headers: Iterable[tuple[str, str]], request_id: str, key: str | None) -> CIMultiDict:
    """The caller's headers as the replica gets them: ours and hop-by-hop ones left out, the request id and the
    trace context set, and the replica's own key."""
    out: CIMultiDict = CIMultiDict()
    for k, v in headers:
        if k.lower() not in NOT_FORWARDED:
            out.add(k, v)
    out[REQUEST_ID_HEADER] = request_id
    tracing.inject(out)
    if key:
        out["Authorization"] = f"Bearer {key}"
    return out


def to_caller(headers: Iterable[tuple[str, str]], request_id: str) -> CIMultiDict:
    """A replica's answer headers as the caller gets them: hop-by-hop ones left out, the request id set."""
    out: CIMultiDict = CIMultiDict()
    for k, v in headers:
        if k.lower() not in HOP_BY_HOP:
            out.add(k, v)
    out[REQUEST_ID_HEADER] = request_id
    return out
