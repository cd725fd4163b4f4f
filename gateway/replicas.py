"""The model replicas behind the gateway: their health, their scraped vLLM metrics and our own load on them.

`ReplicaPool` owns the list. A background task GETs each replica's /health (a replica is taken out after
`failuresToDown` failed checks, or at once when its port refuses connections, and is put back on the first
success once it said what it serves) and scrapes /metrics (read by gateway/vllm_metrics.py) for the utilization
detector, the KV admission policy and /admin/state. A replica that answers 401/403 (vLLM started with
`--api-key` the gateway does not send) is out until it accepts the gateway's key (`upstream.apiKey`,
`upstream.replicaKeys`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import aiohttp

from gateway.log import log_event
from gateway.settings.keys import UPSTREAM_KEY_ENV
from gateway.slot_learning import SlotLearning
from gateway.vllm_metrics import FILTERED_METRICS, METRICS_HEADERS, parse_vllm_metrics

if TYPE_CHECKING:
    from gateway.settings import ReplicaEngine

logger = logging.getLogger("gateway.replicas")

# A replica's answers that mean the gateway's key is missing or wrong.
UNAUTHORIZED = (401, 403)


@dataclass(eq=False)
class Replica(SlotLearning):
    url: str
    healthy: bool = False
    failures: int = 0
    # Requests the gateway has dispatched here and not yet seen finish.
    in_flight: int = 0
    # What its engine runs with (the gateway's `engine` settings): the requests it runs at once (vLLM's
    # --max-num-seqs; None: unknown), and the requests the gateway may have in flight here (None: the
    # detector's saturation.maxConcurrency).
    max_num_seqs: int | None = None
    capacity: int | None = None
    # Its slots as learned from its metrics (engine.learnMaxNumSeqs, used while maxNumSeqs is unset), when and at
    # what running count the scrapes in a row that show it full began, and the most it has run (`see_slots`).
    learned_slots: int | None = None
    slots_seen: tuple[float, int] | None = None
    slots_dipped: bool = False  # the last scrape of that run showed fewer running while requests waited
    peak_running: int = 0
    # The prompts (tokens; 0: not counted exactly) of the requests flow control sent here that have not answered
    # yet, which vLLM may hold in its waiting queue (told with KV admission on, which counts them), and the most of
    # them and the largest prompt since the last scrape began, whose numbers may show any of them waiting.
    awaited: collections.Counter[int] = field(default_factory=collections.Counter)
    awaited_seen: tuple[int, int | None] = (0, 0)  # (count, largest prompt; None: one was not counted exactly)
    engine: ReplicaEngine | None = None
    # Scraped from /metrics; metrics_at is the monotonic time of the last good scrape (0: never).
    kv_usage: float | None = None  # vllm:kv_cache_usage_perc averaged over data-parallel engines
    kv_usage_max: float | None = None  # ... and the fullest engine's (one full engine preempts alone)
    waiting: float | None = None
    running: float | None = None
    # The KV pool from `vllm:cache_config_info`: blocks and tokens of the whole replica (every data-parallel
    # engine), and tokens per block.
    num_gpu_blocks: int | None = None
    kv_cache_size_tokens: int | None = None
    kv_block_size: int | None = None
    # Its prefix cache is on (`enable_prefix_caching` of the same series; None: not reported): running requests
    # that share a prompt prefix hold its blocks once there (gateway/flow/ledger.py).
    prefix_caching: bool | None = None
    # What the replica says it serves (GET /v1/models, /version), read before it takes work, again after it was
    # down: `model` is the served name (vLLM's `id`), `model_root` where its weights came from (a path or a hub
    # name, where its tokenizer is).
    identified: bool = False
    model: str | None = None
    # Every entry of its /v1/models as (id, parent): its served names (parent None) and its LoRA adapters.
    listed: tuple[tuple[str, str | None], ...] = ()
    # The model pool it serves (gateway/pools.py): its configured pool, else the pool of the model it reports.
    pool: str | None = None
    model_root: str | None = None
    runtime_version: str | None = None
    max_model_len: int | None = None
    # Why the replica refuses the gateway's key (it answered 401/403): it gets no work until it accepts it.
    unauthorized: str | None = None
    # The served model ("" when unknown) for which the replica answered /v1/embeddings with FastAPI's 404 (a
    # generation model has no such route); forgotten once it serves another model.
    no_embeddings_model: str | None = None
    # Set when the calibration profile does not match this replica: it gets no work until it does.
    refused: str | None = None
    metrics_at: float = 0.0
    metrics_from: float = 0.0  # monotonic time that scrape began: what it shows is at least as recent
    # Dispatches counted here since start, and their value when the last scrape began: the difference is
    # work the scraped numbers cannot show yet.
    dispatches: int = 0
    dispatches_at_scrape: int = 0
    # Whether its /metrics/ answers the gateway's series alone (FILTERED_METRICS; None: not asked yet).
    metrics_filtered: bool | None = None

    def metrics_fresh(self, now: float, staleness: float) -> bool:
        return self.metrics_at > 0 and now - self.metrics_at <= staleness

    def take_engine(self, engine: ReplicaEngine) -> None:
        """Its engine's slots (maxNumSeqs, else the learned ones) and the gateway's capacity there: the slots and
        the queue allowance beyond them (None: saturation.maxConcurrency, until slots are known)."""
        self.engine = engine
        if engine.maxNumSeqs is not None:
            self.max_num_seqs = engine.maxNumSeqs
        else:
            self.max_num_seqs = self.learned_slots if engine.learnMaxNumSeqs else None
        self.capacity = None if self.max_num_seqs is None else self.max_num_seqs + engine.queueAllowance

    def serves_no_embeddings(self) -> bool:
        return self.no_embeddings_model is not None and self.no_embeddings_model == (self.model or "")


class ReplicaPool:
    """The configured replicas, checked and scraped in the background."""

    def __init__(self, urls: list[str], *, on_change: Callable[[], None] = lambda: None):
        self.replicas: list[Replica] = [Replica(url) for url in urls]
        self.on_change = on_change
        # Called once a replica's identity is known, and again when its KV pool is (the calibration check hooks in
        # here).
        self.on_identify: Callable[[Replica], None] = lambda replica: None
        # The setting the key sent to a replica comes from (None: no key is sent), named in the log line of a
        # replica that refuses it; the gateway points it at the running config. The key itself is put on each
        # call by the session (gateway.app.upstream_session).
        self.key_source: Callable[[str], str | None] = lambda url: None
        # The engine settings of a replica URL (gateway.settings.EngineSettings.of), stamped on each replica.
        self.engine_of: Callable[[str], ReplicaEngine] | None = None
        self.health_interval = 1.0
        self.health_timeout = 2.0
        self.failures_to_down = 2
        self.scrape_interval = 0.25
        self._session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task] = []

    # -- membership -----------------------------------------------------------------------------------------
    def set_urls(self, urls: list[str]) -> None:
        """Keep the replicas whose URL stays (with their state), add new ones as not yet healthy."""
        by_url = {r.url: r for r in self.replicas}
        self.replicas = [by_url.get(url) or Replica(url) for url in urls]
        for replica in self.replicas:
            self.apply_engine(replica)
        self.on_change()

    def apply_engine(self, replica: Replica) -> None:
        """Its engine's slots (maxNumSeqs) and the gateway's capacity there (with the queue allowance)."""
        if self.engine_of is None:
            return
        replica.take_engine(self.engine_of(replica.url))

    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas if r.healthy and r.refused is None]

    def mark_down(self, replica: Replica, reason: str) -> None:
        """Take a replica out at once (its port refused a connection, or it died before answering)."""
        replica.failures = max(replica.failures, self.failures_to_down)
        replica.identified = False  # it may come back restarted, with another model or key
        replica.forget_slots()  # ... and other engine flags
        replica.metrics_filtered = None  # ... or as another server
        if replica.healthy:
            replica.healthy = False
            log_event(logger, "replica_down", level=logging.WARNING, replica=replica.url, reason=reason)
            self.on_change()

    def mark_unauthorized(self, replica: Replica, path: str, status: int) -> None:
        """The replica answered 401/403: out until it accepts the gateway's key; one log line says which key
        and how to set it."""
        source = self.key_source(replica.url)
        if source is None:
            reason = (f"{path} answered {status}: the replica wants an API key (vLLM --api-key) and the gateway "
                      f"sends none")
            hint = (f"set upstream.apiKey (every replica), upstream.replicaKeys[{replica.url!r}] (this one) or "
                    f"${UPSTREAM_KEY_ENV} to the replica's --api-key, then reload the gateway (SIGHUP)")
        else:
            reason = f"{path} answered {status}: the replica rejects the key from {source}"
            hint = f"set {source} to the replica's --api-key, then reload the gateway (SIGHUP)"
        if replica.unauthorized != reason:  # once, and again only when a reload changed the key
            log_event(logger, "replica_unauthorized", level=logging.ERROR, replica=replica.url, status=status,
                      reason=reason, hint=hint)
        replica.unauthorized = reason
        replica.identified = False
        if replica.healthy:
            replica.healthy = False
            self.on_change()

    # -- background checks ----------------------------------------------------------------------------------
    async def start(self, session: aiohttp.ClientSession) -> None:
        """First health check inline (so the gateway does not serve 503s at start), then run in background."""
        self._session = session
        await self.check_all()
        await self.scrape_all()
        self._tasks = [asyncio.create_task(self._health_loop(), name="gateway-health"),
                       asyncio.create_task(self._scrape_loop(), name="gateway-scrape")]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval)
            try:
                await self.check_all()
            except Exception:  # a bug here must not stop health checking for good
                logger.exception("health_check_failed")

    async def _scrape_loop(self) -> None:
        while True:
            await asyncio.sleep(self.scrape_interval)
            try:
                await self.scrape_all()
            except Exception:
                logger.exception("metrics_scrape_failed")

    async def check_all(self) -> None:
        await asyncio.gather(*(self._check(r) for r in list(self.replicas)))

    async def scrape_all(self) -> None:
        await asyncio.gather(*(self._scrape(r) for r in list(self.replicas) if r.healthy))
        self.on_change()

    async def _check(self, replica: Replica) -> None:
        assert self._session is not None
        ok, reason, refused = False, "", False
        try:
            timeout = aiohttp.ClientTimeout(total=self.health_timeout)
            async with self._session.get(replica.url + "/health", timeout=timeout) as resp:
                await resp.read()
                if resp.status in UNAUTHORIZED:
                    self.mark_unauthorized(replica, "/health", resp.status)
                    return
                ok = resp.status < 300
                reason = f"HTTP {resp.status}"
        except aiohttp.ClientConnectorError as exc:
            reason, refused = f"connect: {exc.os_error or exc}", True
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            reason = f"{type(exc).__name__}: {exc}"
        if ok:
            replica.failures = 0
            if not replica.identified:
                # Before it takes work: a replica that wants another key must not answer callers 401.
                await self._identify(replica)
            if replica.unauthorized is not None:
                return
            if not replica.healthy:
                replica.healthy = True
                log_event(logger, "replica_up", replica=replica.url, model=replica.model)
                self.on_change()
            return
        replica.failures += 1
        if replica.healthy and (refused or replica.failures >= self.failures_to_down):
            replica.healthy = False
            replica.identified = False
            replica.forget_slots()
            replica.metrics_filtered = None
            log_event(logger, "replica_down", level=logging.WARNING, replica=replica.url, reason=reason,
                      failures=replica.failures)
            self.on_change()

    async def _identify(self, replica: Replica) -> None:
        """Model, context limit and runtime version, for the context check and the calibration profile; asked
        until it is known, then not again until the replica was down."""
        assert self._session is not None
        timeout = aiohttp.ClientTimeout(total=max(1.0, self.scrape_interval * 4))
        answers = []
        try:
            for path in ("/v1/models", "/version"):
                async with self._session.get(replica.url + path, timeout=timeout) as resp:
                    if resp.status in UNAUTHORIZED:
                        self.mark_unauthorized(replica, path, resp.status)
                        return
                    answers.append(await resp.json() if resp.status < 300 else {})
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
            return
        if replica.unauthorized is not None:
            log_event(logger, "replica_authorized", replica=replica.url)
            replica.unauthorized = None
        models, version = answers
        data = models.get("data") if isinstance(models, dict) else None
        if not data or not isinstance(data[0], dict):
            return
        first = data[0]
        replica.max_model_len = first.get("max_model_len")
        replica.runtime_version = str(version.get("version")) if isinstance(version, dict) else None
        replica.model = str(first.get("id") or first.get("root"))  # what callers name in `model`
        replica.model_root = str(first["root"]) if first.get("root") else None
        replica.listed = tuple((str(card["id"]), str(card["parent"]) if card.get("parent") else None)
                               for card in data if isinstance(card, dict) and card.get("id"))
        replica.no_embeddings_model = None  # it may have come back with an embedding model: ask it again
        replica.identified = True
        self.on_identify(replica)

    async def _scrape(self, replica: Replica) -> None:
        assert self._session is not None
        timeout = aiohttp.ClientTimeout(total=max(1.0, self.scrape_interval * 4))
        try:
            dispatches_before, began = replica.dispatches, time.monotonic()
            replica.scrape_began()
            filtered = replica.metrics_filtered is not False
            path = FILTERED_METRICS if filtered else "/metrics"
            async with self._session.get(replica.url + path, headers=METRICS_HEADERS, timeout=timeout) as resp:
                if resp.status in UNAUTHORIZED:
                    self.mark_unauthorized(replica, "/metrics", resp.status)
                    return
                if resp.status >= 300:
                    if filtered and replica.metrics_filtered is None and resp.status in (404, 405):
                        replica.metrics_filtered = False  # no such route: the whole /metrics from the next scrape
                    return
                text = await resp.text()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, UnicodeDecodeError) as exc:
            log_event(logger, "replica_scrape_failed", level=logging.DEBUG, replica=replica.url,
                      error=type(exc).__name__, timeout_s=timeout.total)
            return
        values = parse_vllm_metrics(text)
        if "vllm:kv_cache_usage_perc" not in values and "vllm:num_requests_waiting" not in values:
            if filtered and replica.metrics_filtered is None:
                replica.metrics_filtered = False  # it answered something else there
            return
        replica.metrics_filtered = filtered
        pool_before = (replica.num_gpu_blocks, replica.kv_block_size, replica.kv_cache_size_tokens)
        replica.kv_usage = values.get("vllm:kv_cache_usage_perc")
        replica.kv_usage_max = values.get("kv_cache_usage_max")
        replica.waiting = values.get("vllm:num_requests_waiting")
        replica.running = values.get("vllm:num_requests_running")
        if replica.see_slots(time.monotonic()) and replica.slots_learned:
            log_event(logger, "replica_slots_learned", replica=replica.url, slots=replica.learned_slots,
                      running=replica.running, waiting=replica.waiting, kv_usage=replica.kv_usage_max)
        if "num_gpu_blocks" in values:
            replica.num_gpu_blocks = int(values["num_gpu_blocks"])
        if "block_size" in values:
            replica.kv_block_size = int(values["block_size"])
        if "kv_cache_size_tokens" in values:
            replica.kv_cache_size_tokens = int(values["kv_cache_size_tokens"])
        if "enable_prefix_caching" in values:
            replica.prefix_caching = values["enable_prefix_caching"] == 1.0
        if replica.identified and pool_before != (replica.num_gpu_blocks, replica.kv_block_size,
                                                  replica.kv_cache_size_tokens):
            self.on_identify(replica)  # its KV pool is known (or changed): the growth-room check reads it
        replica.metrics_at, replica.metrics_from = time.monotonic(), began
        replica.dispatches_at_scrape = dispatches_before
