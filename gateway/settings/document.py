"""The whole of the gateway's config: its sections, its replicas and pools, its keys and objectives, and the checks
that span sections."""

from __future__ import annotations

from pydantic import field_validator, model_validator

from gateway.settings.base import SettingsModel
from gateway.settings.engine import EngineSettings
from gateway.settings.keys import AdminKey, Anonymous, KeyEntry
from gateway.settings.pools import PoolSettings, check_pools, pool_config, replica_urls
from gateway.settings.sections import (Admission, BandSettings, Eviction, FlowControlSettings, Health, Metrics,
                                       Objective, Picker, ResponsesSettings, Saturation, Upstream,
                                       UsageLimit)
from holdback.contract import BATCH_OBJECTIVE, REALTIME_OBJECTIVE, STANDARD_OBJECTIVE


class GatewayConfig(SettingsModel):
    replicas: list[str] = []
    # Model pools; replicas listed only in `replicas` are grouped by the model they report in /v1/models.
    pools: list[PoolSettings] = []
    objectives: dict[str, Objective] = {
        REALTIME_OBJECTIVE: Objective(priority=100),
        STANDARD_OBJECTIVE: Objective(priority=0),
        BATCH_OBJECTIVE: Objective(priority=-10),
    }
    defaultObjective: str = STANDARD_OBJECTIVE
    anonymous: Anonymous = Anonymous()
    keys: list[KeyEntry] = []
    # Keys for /admin/* (state, rollback); required there as soon as any key is configured.
    adminKeys: list[AdminKey] = []
    flowControl: FlowControlSettings = FlowControlSettings()
    saturation: Saturation = Saturation()
    usageLimit: UsageLimit = UsageLimit()
    eviction: Eviction = Eviction()
    admission: Admission = Admission()
    picker: Picker = Picker()
    health: Health = Health()
    metrics: Metrics = Metrics()
    upstream: Upstream = Upstream()
    engine: EngineSettings = EngineSettings()
    responses: ResponsesSettings = ResponsesSettings()

    @field_validator("replicas")
    @classmethod
    def _urls(cls, urls: list[str]) -> list[str]:
        return replica_urls(urls)

    @model_validator(mode="after")
    def _pools_apart(self) -> "GatewayConfig":
        check_pools(self)
        return self

    def of_pool(self, pool: PoolSettings | None) -> "GatewayConfig":
        """The config one pool's flow control runs with: its own sections over the top-level ones, its replicas
        (None: the top-level config for replicas grouped by model, without pools)."""
        return pool_config(self, pool)

    @model_validator(mode="after")
    def _objective_names(self) -> "GatewayConfig":
        names = set(self.objectives)
        if self.defaultObjective not in names:
            raise ValueError(f"defaultObjective {self.defaultObjective!r} is not one of objectives: {sorted(names)}")
        grants = [("anonymous", self.anonymous.objectives, self.anonymous.defaultObjective)]
        grants += [(f"key of tenant {k.tenant!r}", k.objectives, k.defaultObjective) for k in self.keys]
        for who, allowed, default in grants:
            for name in allowed:
                if name != "*" and name not in names:
                    raise ValueError(f"{who} allows unknown objective {name!r}; configured: {sorted(names)}")
            if default is not None and default not in names:
                raise ValueError(f"{who} has unknown defaultObjective {default!r}")
        return self

    @model_validator(mode="after")
    def _growth_room(self) -> "GatewayConfig":
        """The hard watermark must leave one scheduling cycle of growth: every running sequence one block."""
        adm = self.admission
        if not adm.enabled:
            return self
        running = adm.maxRunningSequences or self.engine.maxNumSeqs or self.saturation.maxConcurrency
        pool = adm.default_pool_blocks()
        room = adm.growth_room(pool)
        if room < running:
            need = 1.0 - running / pool
            raise ValueError(
                f"admission.hardWatermark {adm.hardWatermark} leaves {room} of {pool} KV blocks above it, less "
                f"than one scheduling cycle of growth ({running} running sequences x 1 block); lower "
                f"hardWatermark to at most {max(need, 0):.4f}, lower admission.maxRunningSequences / "
                f"saturation.maxConcurrency, or set admission.kvPoolBlocks to the real pool size")
        return self

    @model_validator(mode="after")
    def _protected_split(self) -> "GatewayConfig":
        """The adaptive reserve needs bands on both sides of its protected priority."""
        if self.usageLimit.policy != "adaptive-reserve":
            return self
        line = self.usageLimit.reserve().protectedPriority
        bands = self.band_priorities()
        if not any(p >= line for p in bands):
            raise ValueError(f"usageLimit.adaptive.protectedPriority {line} is above every band {bands}: no demand "
                             f"would be protected; set it to the lowest priority realtime traffic uses")
        if not any(p < line for p in bands):
            raise ValueError(f"usageLimit.adaptive.protectedPriority {line} leaves no band below it {bands}: the "
                             f"adaptive reserve would limit nothing; set it above the batch band's priority")
        return self

    def capacity(self, url: str) -> int:
        """The most requests the gateway may have in flight on the replica at `url`: its maxNumSeqs and queue
        allowance when set (engine), else saturation.maxConcurrency (and the allowance beyond slots learned up to
        it)."""
        engine = self.engine.of(url)
        if engine.maxNumSeqs is None:
            return self.saturation.maxConcurrency + (engine.queueAllowance if engine.learnMaxNumSeqs else 0)
        return engine.maxNumSeqs + engine.queueAllowance

    def traffic_class(self, priority: int) -> str:
        for obj in self.objectives.values():
            if obj.priority == priority:
                return obj.traffic_class()
        return "batch" if priority < 0 else "interactive"

    def band_priorities(self) -> list[int]:
        """Every provisioned band, highest priority first: objectives, the default 0, and listed bands."""
        prios = {o.priority for o in self.objectives.values()} | {0}
        prios |= {b.priority for b in self.flowControl.bands if b.priority is not None}
        return sorted(prios, reverse=True)

    def band_settings(self, priority: int) -> BandSettings:
        """The band's own settings merged over `flowControl.defaultBand`."""
        base = self.flowControl.defaultBand
        own = next((b for b in self.flowControl.bands if b.priority == priority), None)
        merged = {k: getattr(base, k) for k in BandSettings.model_fields}
        if own is not None:
            merged.update({k: v for k, v in own.model_dump().items() if v is not None})
        merged["priority"] = priority
        if merged["ttl"] is None:
            merged["ttl"] = self.flowControl.defaultRequestTTL
        if merged["maxRequests"] is None:
            merged["maxRequests"] = 5000
        merged["fairness"] = merged["fairness"] or "global-strict"
        merged["ordering"] = merged["ordering"] or "fcfs"
        return BandSettings(**merged)
