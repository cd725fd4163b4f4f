"""A pool's flow control built from a loaded config: the policies its names choose, with their parameters.

`assemble` reads the config's sections and returns the parts `FlowController.apply_config` swaps in: the saturation
detector, the endpoint picker, the KV ledger (kept across configs: reservations outlive them) and KV admission;
`configure_replicas` applies the replicas' settings, `objectives_by_priority` what the bands are called.
The names were checked when the config was loaded (gateway/settings/names.py); each policy module maps them to
its implementation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from gateway.calibration import Profile
from gateway.flow.ledger import KvLedger
from gateway.flow.replica_checks import check_files
from gateway.flow.views import ReplicaView
from gateway.policies.admission import KvAdmission
from gateway.policies.picker import EndpointPicker
from gateway.policies.saturation import SaturationDetector, saturation_detector
from gateway.replicas import ReplicaPool
from gateway.settings import GatewayConfig


@dataclass(frozen=True)
class Parts:
    detector: SaturationDetector
    picker: EndpointPicker
    ledger: KvLedger
    admission: KvAdmission | None
    profile: Profile | None


def assemble(cfg: GatewayConfig, ledger: KvLedger | None,
             occupancy: Callable[[ReplicaView], float]) -> Parts:
    """The parts of a pool's flow control under `cfg`; `ledger`, the one in use, is reconfigured, not replaced.
    Raises ConfigError (before anything is built) when a file the config names cannot be read."""
    profile = check_files(cfg)
    sat, adm = cfg.saturation, cfg.admission
    detector = saturation_detector(
        sat.detector, max_concurrency=sat.maxConcurrency, headroom=sat.headroom,
        queue_depth_threshold=sat.queueDepthThreshold, kv_util_threshold=sat.kvCacheUtilThreshold,
        staleness=sat.metricsStalenessSeconds, scrape_interval=cfg.metrics.scrapeIntervalSeconds)
    picker = EndpointPicker(max_concurrency=sat.maxConcurrency, policy=cfg.picker.policy,
                            in_flight_weight=cfg.picker.inFlightWeight, kv_usage_weight=cfg.picker.kvUsageWeight,
                            occupancy=occupancy)
    # A calibration profile's measured factor raises the configured one, never lowers it.
    safety = max(adm.safetyFactor, profile.safety_factor if profile else 1.0)
    settings = dict(block_tokens=adm.blockTokens, safety_factor=safety, window=adm.tokenSecondsWindowSeconds)
    if ledger is None:
        ledger = KvLedger(**settings)
    else:
        ledger.configure(**settings)
    admission = KvAdmission(adm, ledger, profile) if adm.enabled else None
    return Parts(detector, picker, ledger, admission, profile)


def objectives_by_priority(cfg: GatewayConfig) -> tuple[dict[int, str], dict[int, list[str]]]:
    """Each band priority's traffic class and the objective names that map to it."""
    classes = {obj.priority: obj.traffic_class() for obj in cfg.objectives.values()}
    names: dict[int, list[str]] = {}
    for name, obj in cfg.objectives.items():
        names.setdefault(obj.priority, []).append(name)
    return classes, names


def configure_replicas(pool: ReplicaPool, cfg: GatewayConfig, owns_replicas: bool) -> None:
    """The replicas' engine settings and, where this flow control owns the replicas (not a model pool's view),
    their list, health checks and scrapes."""
    if owns_replicas:
        pool.health_interval = cfg.health.intervalSeconds
        pool.health_timeout = cfg.health.timeoutSeconds
        pool.failures_to_down = cfg.health.failuresToDown
        pool.scrape_interval = cfg.metrics.scrapeIntervalSeconds
        if [r.url for r in pool.replicas] != cfg.replicas:
            pool.set_urls(cfg.replicas)
    pool.engine_of = cfg.engine.of
    for replica in pool.replicas:
        pool.apply_engine(replica)
