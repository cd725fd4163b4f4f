"""Fairness policies: which flow (fairness id) of a band dispatches next.

`global-strict` treats the band as one queue: the flow whose head sorts first wins, so there is no tenant
isolation. `round-robin` gives each non-empty flow one dispatch turn in the order of their ids.
A policy reads the band through its read-only view (gateway/flow/views.py) and names the queue to take from.
"""

from __future__ import annotations

import bisect
from typing import Protocol

from gateway.flow.views import BandView, QueueView
from gateway.settings.names import implemented


class FairnessPolicy(Protocol):
    name: str

    def pick(self, band: BandView) -> QueueView | None: ...

    def dispatched(self, fairness_id: str) -> None: ...


class GlobalStrict:
    """Compare the heads of every flow with the ordering key: one logical queue per band."""

    name = "global-strict"

    def pick(self, band: BandView) -> QueueView | None:
        best, best_key = None, None
        for flow in band.flows.values():
            head = flow.head()
            if head is not None and (best_key is None or head[0] < best_key):
                best, best_key = flow, head[0]
        return best

    def dispatched(self, fairness_id: str) -> None:
        return None


class RoundRobin:
    """One dispatch turn per flow, cycling over the sorted fairness ids and skipping empty flows."""

    name = "round-robin"

    def __init__(self) -> None:
        self._last: str | None = None

    def pick(self, band: BandView) -> QueueView | None:
        flows = band.flows
        ids = sorted(fid for fid, flow in flows.items() if flow.head() is not None)
        if not ids:
            return None
        start = 0 if self._last is None else bisect.bisect_right(ids, self._last)
        return flows[ids[start % len(ids)]]

    def dispatched(self, fairness_id: str) -> None:
        self._last = fairness_id


FAIRNESS_POLICIES: dict[str, type] = implemented("fairness", {"global-strict": GlobalStrict,
                                                               "round-robin": RoundRobin})


def fairness_policy(name: str) -> FairnessPolicy:
    try:
        return FAIRNESS_POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown fairness policy {name!r}; choose one of {sorted(FAIRNESS_POLICIES)}") from None
