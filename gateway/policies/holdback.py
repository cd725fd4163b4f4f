"""Usage-limit policies ("priority holdback"): one ceiling in [0, 1] per priority band.

A band dispatches only while pool saturation is below its ceiling, so lower bands stop earlier as the pool
fills and the rest stays reserved for higher ones. `static` and `priority-holdback` ceilings depend only on
the band list, so they are computed once per config; `adaptive-reserve` (gateway/policies/reserve.py) follows demand
and the flow controller recomputes them as it observes. Explicit per-band `ceiling` overrides win.
A band's floor is the ceiling it keeps at any demand: the same as its ceiling for the fixed policies,
`minCeiling` for bands below the adaptive reserve's line. What a band holds above its floor is borrowed,
and the evictor takes it back in one decision (gateway/flow/eviction.py).
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping, Protocol, Sequence

from gateway.policies.reserve import AdaptiveReservePolicy, ReserveSettings
from gateway.settings import UsageLimit
from gateway.settings.names import implemented


class HoldbackPolicy(Protocol):
    name: str
    # True: the controller feeds it band demand (`observe`) and recomputes ceilings when it says they moved.
    follows_demand: bool

    def ceilings(self, priorities: Sequence[int]) -> dict[int, float]: ...

    def floors(self, priorities: Sequence[int]) -> dict[int, float]: ...

    def observe(self, bands: Iterable[tuple[int, int]], capacity: int, now: float) -> bool: ...

    def state(self) -> dict | None: ...


class _FixedCeilings:
    """Policies whose ceilings ignore demand: nothing to observe, no forecast to show."""

    follows_demand = False

    def floors(self, priorities: Sequence[int]) -> dict[int, float]:
        """Fixed ceilings do not move, so a band never holds more than its ceiling allows: nothing is borrowed."""
        return self.ceilings(priorities)  # type: ignore[attr-defined]  # each fixed policy defines ceilings

    def observe(self, bands: Iterable[tuple[int, int]], capacity: int, now: float) -> bool:
        return False

    def state(self) -> dict | None:
        return None


class StaticPolicy(_FixedCeilings):
    """The same threshold for every band (1.0: no holdback)."""

    name = "static"

    def __init__(self, threshold: float = 1.0):
        self.threshold = threshold

    def ceilings(self, priorities: Sequence[int]) -> dict[int, float]:
        return {p: self.threshold for p in priorities}


class PriorityHoldbackPolicy(_FixedCeilings):
    """Linear ceilings from maxCeiling (highest band) down to minCeiling (lowest band).

    rank:  c_i = max − i·(max − min)/(N − 1), i = 0 for the highest priority.
    value: c_i = min + (p_i − p_min)/(p_max − p_min)·(max − min).
    One band (or all bands of equal priority) gets maxCeiling.
    """

    name = "priority-holdback"

    def __init__(self, min_ceiling: float, max_ceiling: float = 1.0, domain: str = "rank"):
        if not 0 <= min_ceiling <= max_ceiling <= 1:
            raise ValueError(f"need 0 <= minCeiling ({min_ceiling}) <= maxCeiling ({max_ceiling}) <= 1")
        if domain not in ("rank", "value"):
            raise ValueError(f"unknown holdback domain {domain!r}; choose rank or value")
        self.min_ceiling = min_ceiling
        self.max_ceiling = max_ceiling
        self.domain = domain

    def ceilings(self, priorities: Sequence[int]) -> dict[int, float]:
        ordered = sorted(set(priorities), reverse=True)
        n = len(ordered)
        lo, hi = self.min_ceiling, self.max_ceiling
        if n <= 1:
            return {p: hi for p in ordered}
        if self.domain == "rank":
            step = (hi - lo) / (n - 1)
            return {p: hi - i * step for i, p in enumerate(ordered)}
        p_max, p_min = ordered[0], ordered[-1]
        return {p: lo + (p - p_min) / (p_max - p_min) * (hi - lo) for p in ordered}


def band_ceilings(policy: HoldbackPolicy, priorities: Sequence[int],
                  overrides: Mapping[int, float | None], *, floors: bool = False) -> dict[int, float]:
    """Each band's ceiling (or, with `floors`, the ceiling it keeps at any demand); overrides win for both."""
    ceilings = policy.floors(priorities) if floors else policy.ceilings(priorities)
    for p, value in overrides.items():
        if value is not None and p in ceilings:
            ceilings[p] = value
    return ceilings


USAGE_LIMIT_POLICIES: dict[str, Callable[..., HoldbackPolicy]] = implemented("usage limit", {
    "static": lambda *, threshold, **_: StaticPolicy(threshold),
    "priority-holdback": lambda *, min_ceiling, max_ceiling, domain, **_: PriorityHoldbackPolicy(
        min_ceiling, max_ceiling, domain),
    "adaptive-reserve": lambda *, min_ceiling, max_ceiling, reserve=None, **_: AdaptiveReservePolicy(
        reserve or ReserveSettings(min_ceiling=min_ceiling, max_ceiling=max_ceiling)),
})


def holdback_policy(name: str, *, min_ceiling: float, max_ceiling: float, domain: str,
                    threshold: float, reserve: ReserveSettings | None = None) -> HoldbackPolicy:
    try:
        build = USAGE_LIMIT_POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown usage-limit policy {name!r}; choose one of {sorted(USAGE_LIMIT_POLICIES)}") \
            from None
    return build(min_ceiling=min_ceiling, max_ceiling=max_ceiling, domain=domain, threshold=threshold,
                 reserve=reserve)


def configured_policy(limit: UsageLimit) -> HoldbackPolicy:
    """The policy `usageLimit` names, with its parameters."""
    r = limit.reserve()
    return holdback_policy(limit.policy, min_ceiling=limit.minCeiling, max_ceiling=limit.maxCeiling,
                           domain=limit.domain, threshold=limit.threshold, reserve=ReserveSettings(
                               protected_priority=r.protectedPriority, margin=r.margin, half_life=r.halfLifeSeconds,
                               peak_window=r.peakWindowSeconds, min_ceiling=limit.minCeiling,
                               max_ceiling=limit.maxCeiling))
