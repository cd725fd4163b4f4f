"""Ordering policies: which request of one flow's queue goes first.

A policy turns a request into a sort key; smaller keys go first. Keys end with the request's place in line
(its arrival sequence number, or an evicted earlier attempt's) and then its arrival, so ties always fall back
to first-come-first-served.
"""

from __future__ import annotations

from typing import Protocol

from gateway.flow.views import RequestView
from gateway.settings.names import implemented


class OrderingPolicy(Protocol):
    name: str

    def key(self, req: RequestView) -> tuple: ...


class FCFS:
    """First come, first served: the logical arrival order (an evicted request's retry keeps its first place)."""

    name = "fcfs"

    def key(self, req: RequestView) -> tuple:
        return (req.place, req.seq)


class EarliestDeadline:
    """Earliest deadline first: the request's own deadline, else its queue expiry; none sorts last."""

    name = "edf"

    def key(self, req: RequestView) -> tuple:
        return (min(req.deadline, req.expires_at), req.place, req.seq)


ORDERING_POLICIES: dict[str, type] = implemented("ordering", {"fcfs": FCFS, "edf": EarliestDeadline})


def ordering_policy(name: str) -> OrderingPolicy:
    try:
        return ORDERING_POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown ordering policy {name!r}; choose one of {sorted(ORDERING_POLICIES)}") from None
