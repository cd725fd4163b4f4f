"""The band registry: every priority band, highest priority first, with the ceiling and floor its holdback policy
gives it.

The bands are the ones the config provisions (objective priorities, 0, the listed bands) and, while they hold
work, a band of a priority outside it. Ceilings are computed again when the band list changes and, under a
policy that follows demand (adaptive-reserve), whenever the policy says they moved. A band's floor is the
ceiling it keeps at any demand: what it holds above it is on loan, and eviction takes it back
(gateway/flow/eviction.py).
"""

from __future__ import annotations

from gateway.flow.band import PriorityBand
from gateway.policies.holdback import HoldbackPolicy, band_ceilings, configured_policy
from gateway.settings import GatewayConfig


class BandRegistry:
    def __init__(self) -> None:
        self.by_priority: dict[int, PriorityBand] = {}
        self.desc: list[PriorityBand] = []
        self.ceilings: dict[int, float] = {}
        self.floors: dict[int, float] = {}
        self.configured: set[int] = set()
        self.policy: HoldbackPolicy

    def __getitem__(self, priority: int) -> PriorityBand:
        return self.by_priority[priority]

    def configure(self, cfg: GatewayConfig) -> list[PriorityBand]:
        """Apply a config's bands and holdback policy; returns the bands that existed already (reconfigured)."""
        configured = cfg.band_priorities()
        kept = []
        for p in configured:
            s = cfg.band_settings(p)
            kwargs = dict(max_requests=s.maxRequests, ttl=s.ttl, fairness=s.fairness, ordering=s.ordering,
                          ceiling_override=s.ceiling)
            if p in self.by_priority:
                self.by_priority[p].configure(**kwargs)
                kept.append(self.by_priority[p])
            else:
                self.by_priority[p] = PriorityBand(p, **kwargs)
        self._drop_idle(keep=set(configured))
        self.configured = set(configured)
        self.policy = configured_policy(cfg.usageLimit)
        self.refresh_ceilings()
        return kept

    def band_for(self, priority: int, cfg: GatewayConfig) -> PriorityBand:
        band = self.by_priority.get(priority)
        if band is None:
            # Only reachable for a priority outside the config (cannot happen via objectives); give it the
            # default band settings rather than failing the request.
            s = cfg.band_settings(priority)
            band = self.by_priority[priority] = PriorityBand(priority, max_requests=s.maxRequests, ttl=s.ttl,
                                                             fairness=s.fairness, ordering=s.ordering,
                                                             ceiling_override=s.ceiling)
            self.refresh_ceilings()
        return band

    def forget_if_idle(self, band: PriorityBand) -> None:
        """A band outside the config goes once it holds nothing."""
        if band.priority not in self.configured and not band.queued and not band.in_flight:
            self._drop_idle(keep=self.configured)
            self.refresh_ceilings()

    def _drop_idle(self, keep: set[int]) -> None:
        for p in [p for p, b in self.by_priority.items() if p not in keep and not b.queued and not b.in_flight]:
            del self.by_priority[p]

    def refresh_ceilings(self) -> None:
        self.desc = sorted(self.by_priority.values(), key=lambda b: -b.priority)
        priorities = [b.priority for b in self.desc]
        overrides = {b.priority: b.ceiling_override for b in self.desc}
        self.ceilings = band_ceilings(self.policy, priorities, overrides)
        self.floors = band_ceilings(self.policy, priorities, overrides, floors=True)

    def follow_demand(self, capacity: int, now: float) -> None:
        """Feed a demand-following policy the bands' queued + in-flight counts against `capacity` (the healthy
        replicas' capacity); recompute the ceilings if they moved."""
        policy = self.policy
        if policy.follows_demand and policy.observe(
                [(b.priority, b.queued + b.in_flight) for b in self.desc], capacity, now):
            self.refresh_ceilings()

    def queued_at_or_above(self, priority: int) -> bool:
        for band in self.desc:
            if band.priority < priority:
                return False
            if band.queued:
                return True
        return False
