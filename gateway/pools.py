"""Model pools: which replicas serve which model names, each pool with its own flow control.

One `ReplicaPool` checks, identifies and scrapes every replica; each pool's `FlowController` sees its members
only, through `PoolReplicas`. `ModelPools` owns the pools: one per `pools` entry (its replicas by URL), and
for replicas listed without a pool one per model they report in /v1/models (without `pools`, the first of
these is `default`, which also holds replicas that have not said what they serve). `PoolRouting` maps a
request's `model` to its pool, the same way in one process and in a relay of `--workers N`.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Callable

from gateway.flow.controller import HISTORY, FlowController
from gateway.flow.replica_checks import check_files
from gateway.flow.request import DropReason
from gateway.replicas import Replica, ReplicaPool
from gateway.settings import LoadedConfig, PoolSettings

if TYPE_CHECKING:
    from gateway.settings import ReplicaEngine
    from gateway.metrics import GatewayMetrics

# The pool of replicas listed without `pools` before one of them said what it serves.
DEFAULT_POOL = "default"


class PoolReplicas:
    """One pool's replicas: a view of the gateway's ReplicaPool, which is what its FlowController calls `pool`."""

    def __init__(self, shared: ReplicaPool, name: str):
        self.shared = shared
        self.name = name
        # Set by the pool's controller (its calibration and growth-room checks) and its config's engine settings.
        self.on_identify: Callable[[Replica], None] = lambda replica: None
        self.engine_of: Callable[[str], ReplicaEngine] | None = None

    @property
    def replicas(self) -> list[Replica]:
        return [r for r in self.shared.replicas if r.pool == self.name]

    @property
    def scrape_interval(self) -> float:
        return self.shared.scrape_interval

    def healthy(self) -> list[Replica]:
        return [r for r in self.shared.healthy() if r.pool == self.name]

    def mark_down(self, replica: Replica, reason: str) -> None:
        self.shared.mark_down(replica, reason)

    def mark_unauthorized(self, replica: Replica, path: str, status: int) -> None:
        self.shared.mark_unauthorized(replica, path, status)

    def apply_engine(self, replica: Replica) -> None:
        if self.engine_of is not None:
            replica.take_engine(self.engine_of(replica.url))


@dataclasses.dataclass
class ModelPool:
    name: str
    controller: FlowController
    replicas: PoolReplicas
    # Configured model names, or (grouped by model) the ones its replicas reported.
    models: list[str]
    endpoints: tuple[str, ...] | None = None
    configured: bool = False

    def served(self) -> list[str]:
        """Its model names and the LoRA adapters its replicas list with one of them as parent."""
        names = list(self.models)
        for replica in self.replicas.replicas:
            for name, parent in replica.listed:
                if parent in self.models and name not in names:
                    names.append(name)
        return names


class PoolRouting:
    """A request's `model` to its pool's name, from each pool's served names (`ModelPools.describe`)."""

    def __init__(self, pools: list[dict]):
        self.pools = pools
        self.by_model = {model: p["name"] for p in reversed(pools) for model in p["models"]}

    def route(self, model: object) -> str | None:
        """The pool for `model`; an absent or empty one means the first pool's (vLLM serves its first name).
        None: no pool serves it (the gateway answers 404 model_not_found)."""
        if not self.pools:
            return None
        if not model or not isinstance(model, str):
            return self.pools[0]["name"]
        name = self.by_model.get(model)
        if name is not None:
            return name
        # Replicas that have not said what they serve yet answer for themselves, as without pools.
        learning = next((p for p in self.pools if p["name"] == DEFAULT_POOL and not p["models"]
                         and not p["configured"]), None)
        return learning["name"] if learning is not None else None

    def served(self) -> list[str]:
        return [model for p in self.pools for model in p["models"]]

    def endpoints(self, name: str) -> tuple[str, ...] | None:
        pool = next(p for p in self.pools if p["name"] == name)
        return tuple(pool["endpoints"]) if pool["endpoints"] is not None else None


class ModelPools:
    """The gateway's pools in one process (the flow-control process of `--workers N` too)."""

    def __init__(self, loaded: LoadedConfig, shared: ReplicaPool, metrics: GatewayMetrics):
        self.shared = shared
        self.replicas = shared  # FlowPools: every replica (the proxy reports failures here)
        self.metrics = metrics
        self.pools: dict[str, ModelPool] = {}
        self.loaded = loaded
        self._routing: PoolRouting | None = None
        # The configs applied, as written, oldest first (rollback goes to the one before the running one).
        self.history: list[tuple[LoadedConfig, float]] = []
        # How prompts are counted (the proxy's PromptCounter.state), in every pool's /admin/state section.
        self.tokenizer_state: Callable[[], dict] = lambda: {}
        shared.on_identify = self._identified
        shared.engine_of = self._engine_of
        # Called when a pool is added or a replica changes pools (the dispatch loops start, relays are told).
        self.on_pools: list[Callable[[], None]] = []
        self.configure(loaded)

    # -- configuration --------------------------------------------------------------------------------------
    def configure(self, loaded: LoadedConfig) -> None:
        """Apply a validated config to every pool: configured pools by name, pools grouped by model with the
        top-level settings. A configured pool the new config drops loses its replicas (they are grouped by
        model again) and its models; it goes now, or at a later reload once nothing it holds is left."""
        cfg = loaded.config
        for settings in [None, *cfg.pools]:  # what can refuse the config, before anything changes
            check_files(cfg.of_pool(settings))
        self.loaded = loaded
        self.history.append((loaded, time.time()))
        del self.history[:-HISTORY]
        self._routing = None
        shared = self.shared
        shared.health_interval = cfg.health.intervalSeconds
        shared.health_timeout = cfg.health.timeoutSeconds
        shared.failures_to_down = cfg.health.failuresToDown
        shared.scrape_interval = cfg.metrics.scrapeIntervalSeconds
        urls = [url for p in cfg.pools for url in p.replicas] + cfg.replicas
        if [r.url for r in shared.replicas] != urls:
            shared.set_urls(urls)
        owner = {url: p.name for p in cfg.pools for url in p.replicas}
        configured = {p.name for p in cfg.pools}
        for replica in shared.replicas:
            if replica.url in owner:
                replica.pool = owner[replica.url]
            elif replica.pool in configured or replica.pool not in self.pools or self.pools[replica.pool].configured:
                replica.pool = None
                self._group(replica)
        for name in [n for n, p in self.pools.items() if p.configured and n not in configured]:
            dropped = self.pools[name]
            dropped.models = []  # routed to no more
            if not dropped.controller.in_flight and not dropped.controller.total_queued:
                del self.pools[name]
        for settings in cfg.pools:
            self._apply(settings.name, loaded, settings)
        for name, pool in self.pools.items():
            if not pool.configured:
                self._apply(name, loaded, None)
        if not cfg.pools and DEFAULT_POOL not in self.pools:
            self._apply(DEFAULT_POOL, loaded, None)
            for replica in shared.replicas:
                self._group(replica)

    def _apply(self, name: str, loaded: LoadedConfig, settings: PoolSettings | None) -> ModelPool:
        own = dataclasses.replace(loaded, config=loaded.config.of_pool(settings))
        pool = self.pools.get(name)
        if pool is None:
            view = PoolReplicas(self.shared, name)
            controller = FlowController(own, view, self.metrics, pool_name=name, owns_replicas=False)
            controller.tokenizer_state = lambda: self.tokenizer_state()
            pool = self.pools[name] = ModelPool(name, controller, view, [])
            added = True
        else:
            pool.controller.apply_config(own)
            added = False
        pool.configured = settings is not None
        if settings is not None:
            pool.models = list(settings.models)
        pool.endpoints = tuple(settings.endpoints) if settings is not None and settings.endpoints is not None \
            else None
        if added:
            self._routing = None
            self._pools_changed()
        return pool

    # -- membership of replicas listed without a pool -------------------------------------------------------
    def _group(self, replica: Replica) -> None:
        """A replica listed without a pool joins the pool serving the model it reports, else a pool of its own
        model (without `pools`, `default` takes the first model, and replicas whose model is not known yet)."""
        if replica.url in {u for p in self.loaded.config.pools for u in p.replicas}:
            return
        model = replica.model
        if model is None:
            if not self.loaded.config.pools and replica.pool is None:
                replica.pool = DEFAULT_POOL
            return
        home = self.pools.get(replica.pool) if replica.pool is not None else None
        if home is None or model not in home.models:
            home = next((p for p in self.pools.values() if model in p.models), None)
        if home is None:
            default = self.pools.get(DEFAULT_POOL)
            if default is not None and not default.configured and not default.models:
                home = default
            else:
                home = self._apply(model, self.loaded, None)
        if not home.configured:  # its served names (vLLM's aliases), not its adapters
            for name in [n for n, parent in replica.listed if parent is None] or [model]:
                if name not in home.models:
                    home.models.append(name)
        changed = replica.pool != home.name
        replica.pool = home.name
        self._routing = None
        if changed:
            self._pools_changed()

    def _pools_changed(self) -> None:
        for listener in self.on_pools:
            listener()

    def _identified(self, replica: Replica) -> None:
        self._routing = None  # what it lists may name LoRA adapters
        self._group(replica)
        pool = self.pools.get(replica.pool) if replica.pool is not None else None
        if pool is not None:
            pool.replicas.apply_engine(replica)
            pool.replicas.on_identify(replica)

    def _engine_of(self, url: str) -> ReplicaEngine:
        replica = next((r for r in self.shared.replicas if r.url == url), None)
        pool = self.pools.get(replica.pool) if replica is not None and replica.pool is not None else None
        cfg = pool.controller.loaded.config if pool is not None else self.loaded.config
        return cfg.engine.of(url)

    # -- reading --------------------------------------------------------------------------------------------
    def ordered(self) -> list[ModelPool]:
        """Configured pools in the config's order, then the ones grouped by model as they appeared."""
        order = {p.name: i for i, p in enumerate(self.loaded.config.pools)}
        return sorted(self.pools.values(), key=lambda p: order.get(p.name, len(order)))

    def default(self) -> ModelPool:
        """The first pool: requests without a model go there, its state is /admin/state's top level."""
        return self.ordered()[0]

    def describe(self) -> list[dict]:
        """What routing needs of each pool, the default first (also sent to the relays)."""
        return [{"name": p.name, "models": p.served(),
                 "endpoints": list(p.endpoints) if p.endpoints is not None else None, "configured": p.configured}
                for p in self.ordered()]

    def routing(self) -> PoolRouting:
        if self._routing is None:
            self._routing = PoolRouting(self.describe())
        return self._routing

    def flow(self, name: str) -> FlowController:
        return self.pools[name].controller

    def flows(self) -> list[FlowController]:
        return [p.controller for p in self.ordered()]

    def refuse_waiting(self, reason: DropReason) -> int:
        """Every pool's queued requests refused with `reason` (the process is at its drain deadline)."""
        return sum(controller.refuse_waiting(reason) for controller in self.flows())

    def snapshot(self) -> dict:
        """/admin/state: the default pool's document at the top level (as with one pool), and `pools`, one
        section per pool with the models it serves."""
        sections = {}
        for pool in self.ordered():
            section = pool.controller.snapshot()
            section.update(pool=pool.name, models=pool.served(), configured=pool.configured,
                           endpoints=list(pool.endpoints) if pool.endpoints is not None else None)
            sections[pool.name] = section
        default = sections[self.default().name]
        return {**default, "pools": sections}

    def wake(self) -> None:
        for controller in self.flows():
            controller.wake()
