"""The gateway's configuration: one YAML file, validated into typed models, identified by its sha256 digest.

Read once at the edge (`load_config`) and passed in; key values named by `key_env` are resolved here (the key
entries and their resolution: gateway/keys.py), so nothing deeper reads the environment. A bad file raises
`ConfigError` with a message that names the key.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Mapping

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from gateway.config_yaml import load_yaml
from gateway.keys import UPSTREAM_KEY_ENV, AdminKey, Anonymous, ApiKey, KeyEntry, ReplicaKey, resolve_keys
from gateway.engine_config import Engine, ReplicaEngine, by_replica_url  # noqa: F401  (the config's own keys)
from gateway.pool_config import PoolSettings, check_pools, pool_config, replica_urls
from holdback.contract import BATCH_OBJECTIVE, REALTIME_OBJECTIVE, STANDARD_OBJECTIVE

DEFAULT_CONFIG_PATH = Path(__file__).with_name("default.yaml")


class ConfigError(ValueError):
    """The configuration file cannot be used; the message says which key to change."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True)


TrafficClass = Literal["interactive", "batch", "critical"]


class Objective(_Model):
    priority: int = 0
    # Budget class for KV quotas; unset: `batch` below priority 0, else `interactive`.
    trafficClass: TrafficClass | None = None

    def traffic_class(self) -> str:
        return self.trafficClass or ("batch" if self.priority < 0 else "interactive")


class BandSettings(_Model):
    """Settings of one priority band; every field left unset falls back to `flowControl.defaultBand`."""

    priority: int | None = None
    maxRequests: int | None = Field(default=None, ge=0)
    ttl: float | None = Field(default=None, ge=0)
    ceiling: float | None = Field(default=None, ge=0, le=1)
    fairness: Literal["global-strict", "round-robin"] | None = None
    ordering: Literal["fcfs", "edf"] | None = None


class FlowControl(_Model):
    defaultRequestTTL: float = Field(default=60.0, ge=0)
    maxRequests: int = Field(default=0, ge=0)
    defaultBand: BandSettings = BandSettings(maxRequests=5000, fairness="global-strict", ordering="fcfs")
    bands: list[BandSettings] = []
    tickSeconds: float = Field(default=0.05, gt=0, le=1)
    # The share of the pool's request capacity that batch work at risk of missing its window may hold under
    # saturation (gateway/flow/floor.py); 0: none.
    atRiskFloor: float = Field(default=0.1, ge=0, le=0.5)

    @field_validator("bands")
    @classmethod
    def _bands_have_priorities(cls, bands: list[BandSettings]) -> list[BandSettings]:
        seen: set[int] = set()
        for band in bands:
            if band.priority is None:
                raise ValueError("every entry of flowControl.bands needs a `priority`")
            if band.priority in seen:
                raise ValueError(f"flowControl.bands lists priority {band.priority} twice")
            seen.add(band.priority)
        return bands


class Saturation(_Model):
    detector: Literal["concurrency", "utilization"] = "concurrency"
    maxConcurrency: int = Field(default=48, gt=0)
    headroom: float = Field(default=0.0, ge=0)
    queueDepthThreshold: float = Field(default=5.0, gt=0)
    kvCacheUtilThreshold: float = Field(default=0.8, gt=0, le=1)
    metricsStalenessSeconds: float = Field(default=2.0, gt=0)


class AdaptiveReserve(_Model):
    """How `adaptive-reserve` forecasts protected demand; its ceilings stay within usageLimit.min/maxCeiling."""

    # Bands at or above this priority are the demand the reserve protects; bands below are limited.
    protectedPriority: int = 0
    # Pool share kept free above the forecast. The defaults are the simulator study's (docs/study/full): eviction
    # covers the forecast's error, so a short window and a small margin lend batch more.
    margin: float = Field(default=0.05, ge=0, lt=1)
    halfLifeSeconds: float = Field(default=5.0, gt=0)
    peakWindowSeconds: float = Field(default=5.0, ge=0)


class UsageLimit(_Model):
    policy: Literal["priority-holdback", "static", "adaptive-reserve"] = "static"
    minCeiling: float = Field(default=0.5, ge=0, lt=1)
    maxCeiling: float = Field(default=1.0, gt=0, le=1)
    domain: Literal["rank", "value"] = "rank"
    threshold: float = Field(default=1.0, ge=0, le=1)
    adaptive: AdaptiveReserve | None = None

    @model_validator(mode="after")
    def _ordered(self) -> "UsageLimit":
        if self.minCeiling > self.maxCeiling:
            raise ValueError(f"usageLimit.minCeiling {self.minCeiling} is above maxCeiling {self.maxCeiling}")
        if self.adaptive is not None and self.policy != "adaptive-reserve":
            raise ValueError(f"usageLimit.adaptive only applies to policy adaptive-reserve (policy is "
                             f"{self.policy!r}); set usageLimit.policy: adaptive-reserve or remove usageLimit.adaptive")
        return self

    def reserve(self) -> AdaptiveReserve:
        return self.adaptive or AdaptiveReserve()


class Eviction(_Model):
    # Victim order by name from the registry in gateway/policies/victims.py; `none` is the no-op evictor.
    policy: str = "newest-first"
    # Kept for older configs: `enabled: false` means `policy: none`.
    enabled: bool = True
    maxPerDecision: int = Field(default=2, ge=1)
    confirmationTimeoutSeconds: float = Field(default=10.0, gt=0)
    graceSeconds: float | None = Field(default=None, ge=0)

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, name: str) -> str:
        from gateway.policies.victims import POLICIES  # the registry lives beside the policies
        if name not in POLICIES:
            raise ValueError(f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}")
        return name

    def policy_name(self) -> str:
        return self.policy if self.enabled else "none"


class Quota(_Model):
    """Limits for one fairness id or one traffic class; unset means unlimited."""

    maxReservedTokens: int | None = Field(default=None, gt=0)
    maxActiveSequences: int | None = Field(default=None, gt=0)
    maxContextTokens: int | None = Field(default=None, gt=0)
    # Occupied token-seconds (tokens held in KV × seconds held) over `tokenSecondsWindowSeconds`.
    maxTokenSeconds: float | None = Field(default=None, gt=0)


class Admission(_Model):
    enabled: bool = True
    # How prompt tokens are counted (gateway/tokenization.py): `auto` (in the gateway with a tokenizer whose counts
    # agree with the replica's POST /tokenize on probe texts: tokenizerFile, the model's tokenizer.json found on
    # this host, or the simulator's for `holdback sim` replicas; else /tokenize), `replica` (its POST /tokenize,
    # cached by prompt hash), `simulator` (the simulator's tokenizer and chat template, in process, unchecked),
    # `local` (tokenizerFile in process for completion prompts, unchecked; chat still goes to the replica, which
    # owns the chat template), or `estimate` (characters / charsPerToken only).
    tokenizer: Literal["auto", "replica", "simulator", "local", "estimate"] = "auto"
    tokenizerFile: str | None = None
    # auto: every Nth in-process count is checked against /tokenize in the background (0: never).
    tokenizerCheckEvery: int = Field(default=1000, ge=0)
    tokenizeTimeoutMs: int = Field(default=500, gt=0)
    tokenCacheSize: int = Field(default=8192, ge=0)
    charsPerToken: float = Field(default=4.0, gt=0)
    kvPoolGiB: float = Field(default=52.0, gt=0)
    bytesPerToken: int = Field(default=131072, gt=0)
    kvPoolBlocks: int | None = Field(default=None, gt=0)
    # Tokens per KV block only for a replica that reports no block size (vllm:cache_config_info block_size)
    # and has no calibration profile, and the unit of kvPoolBlocks. A replica's own block size always wins:
    # vLLM's differs per attention backend (16, 32, 64, 128, more for hybrid models).
    blockTokens: int = Field(default=16, gt=0)
    safetyFactor: float = Field(default=1.0, ge=1.0, le=4.0)
    admissionWatermark: float = Field(default=0.82, gt=0, le=1)
    batchPauseWatermark: float = Field(default=0.88, gt=0, le=1)
    hardWatermark: float = Field(default=0.92, gt=0, le=1)
    interactiveReserve: float = Field(default=0.25, ge=0, lt=1)
    # prompt + n × max new tokens at or above this is "long" for the admission-watermark step.
    longRequestTokens: int = Field(default=4096, gt=0)
    tenantMaxShare: float = Field(default=0.15, gt=0, le=1)
    tenantSoftShare: float = Field(default=0.10, gt=0, le=1)
    queueDeadlineMs: int = Field(default=8000, ge=0)
    # The output of a chat without max_tokens/max_completion_tokens when the replica's context is unknown (with
    # it known, vLLM generates to the context's end, and that is counted); /v1/completions default to 16, as vLLM.
    maxNewTokensDefault: int = Field(default=1024, gt=0)
    # The model's context limit; unset: the replica's reported max_model_len.
    maxContextTokens: int | None = Field(default=None, gt=0)
    # Sequences one replica may run at once, for the growth-room check; unset: saturation.maxConcurrency.
    maxRunningSequences: int | None = Field(default=None, gt=0)
    tokenSecondsWindowSeconds: float = Field(default=60.0, gt=0)
    tenantQuota: Quota = Quota()
    tenants: dict[str, Quota] = {}
    classes: dict[TrafficClass, Quota] = {}
    calibrationProfile: str | None = None

    @model_validator(mode="after")
    def _ordered(self) -> "Admission":
        ladder = [("admissionWatermark", self.admissionWatermark),
                  ("batchPauseWatermark", self.batchPauseWatermark), ("hardWatermark", self.hardWatermark)]
        for (lo_name, lo), (hi_name, hi) in zip(ladder, ladder[1:]):
            if lo > hi:
                raise ValueError(f"admission.{lo_name} ({lo}) must not exceed admission.{hi_name} ({hi})")
        if self.tokenizer == "local" and not self.tokenizerFile:
            raise ValueError("admission.tokenizer `local` needs admission.tokenizerFile (a tokenizer.json path)")
        if self.tenantSoftShare > self.tenantMaxShare:
            raise ValueError(f"admission.tenantSoftShare ({self.tenantSoftShare}) must not exceed "
                             f"admission.tenantMaxShare ({self.tenantMaxShare})")
        return self

    def growth_room(self, pool_blocks: int) -> int:
        """Blocks of a pool above the hard watermark: what one scheduling cycle may grow into."""
        return int((1.0 - self.hardWatermark) * pool_blocks + 1e-9)

    def default_pool_tokens(self) -> int:
        """The KV pool, in tokens, of a replica that reports none and has no calibration profile."""
        if self.kvPoolBlocks:
            return self.kvPoolBlocks * self.blockTokens
        return int(self.kvPoolGiB * 2**30 // self.bytesPerToken)

    def default_pool_blocks(self) -> int:
        return self.default_pool_tokens() // self.blockTokens


class Picker(_Model):
    # Replica scorer by name (gateway/policies/picker.py): least-loaded | kv-headroom.
    policy: Literal["least-loaded", "kv-headroom"] = "least-loaded"
    inFlightWeight: float = Field(default=1.0, ge=0)
    kvUsageWeight: float = Field(default=1.0, ge=0)
    # An evicted request's retry goes back to the replica its attempt ran on (where its blocks are cached)
    # whenever that replica has room; false: it is scored like any new request.
    evictedAffinity: bool = True


class Health(_Model):
    intervalSeconds: float = Field(default=1.0, gt=0)
    timeoutSeconds: float = Field(default=2.0, gt=0)
    failuresToDown: int = Field(default=2, ge=1)


class Metrics(_Model):
    scrapeIntervalSeconds: float = Field(default=0.25, gt=0)


class Upstream(_Model):
    connectTimeoutSeconds: float = Field(default=5.0, gt=0)
    timeoutSeconds: float = Field(default=0.0, ge=0)
    connectionLimit: int = Field(default=0, ge=0)
    # Sent as `Authorization: Bearer` on every call to a replica (inference, /v1/models, /version, /tokenize,
    # /metrics, /health): the key vLLM was started with (`--api-key`). The variable apiKey_env names wins
    # over apiKey when it is set.
    apiKey: str | None = None
    apiKey_env: str | None = Field(default=UPSTREAM_KEY_ENV, alias="apiKeyEnv")
    # Replica base URL -> its own key, for replicas started with different keys; it replaces apiKey there.
    replicaKeys: dict[str, ReplicaKey] = {}

    @field_validator("replicaKeys")
    @classmethod
    def _replica_urls(cls, keys: dict[str, ReplicaKey]) -> dict[str, ReplicaKey]:
        return by_replica_url("upstream.replicaKeys", keys)


class GatewayConfig(_Model):
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
    flowControl: FlowControl = FlowControl()
    saturation: Saturation = Saturation()
    usageLimit: UsageLimit = UsageLimit()
    eviction: Eviction = Eviction()
    admission: Admission = Admission()
    picker: Picker = Picker()
    health: Health = Health()
    metrics: Metrics = Metrics()
    upstream: Upstream = Upstream()
    engine: Engine = Engine()

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


@dataclass(frozen=True)
class LoadedConfig:
    """A validated config plus where it came from, its digest and its resolved API keys."""

    config: GatewayConfig
    digest: str
    source: str
    keys: tuple[ApiKey, ...]
    upstream_api_key: str | None
    skipped_key_envs: tuple[str, ...]
    admin_keys: frozenset[str] = frozenset()
    # Where upstream_api_key came from ("upstream.apiKey", "$VAR"), and (url, key, where from) per replica with
    # its own key (upstream.replicaKeys).
    upstream_key_source: str | None = None
    replica_keys: tuple[tuple[str, str, str], ...] = ()

    def replica_key(self, url: str) -> str | None:
        """The key to send to the replica at `url` (its base URL, or any URL under it): its own, else the one
        for all replicas."""
        own = self._own_key(url)
        return own[1] if own else self.upstream_api_key

    def replica_key_source(self, url: str) -> str | None:
        """Which setting `replica_key(url)` comes from, for the log line of a replica that refuses it."""
        own = self._own_key(url)
        return own[2] if own else self.upstream_key_source

    def _own_key(self, url: str) -> tuple[str, str, str] | None:
        for entry in self.replica_keys:
            if url == entry[0] or url.startswith(entry[0] + "/"):
                return entry
        return None


def parse_config(text: str, source: str, env: Mapping[str, str] | None = None) -> LoadedConfig:
    """Validate YAML text; raise ConfigError naming the offending key."""
    env = os.environ if env is None else env
    try:
        raw = load_yaml(text) if text.strip() else {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {exc}") from exc
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of keys, got {type(raw).__name__}")
    try:
        config = GatewayConfig.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '(top)'}: {err['msg']}" for err in exc.errors()
        )
        raise ConfigError(f"{source}: {problems}") from exc
    keys = resolve_keys(config, env)
    if len({k.key for k in keys.callers}) != len(keys.callers):
        raise ConfigError(f"{source}: two keys entries have the same key value")
    digest = "sha256:" + hashlib.sha256(text.encode()).hexdigest()
    return LoadedConfig(config, digest, source, keys.callers, keys.upstream, keys.skipped_envs, keys.admin,
                        keys.upstream_source, keys.replicas)


def load_config(path: str | Path | None, env: Mapping[str, str] | None = None) -> LoadedConfig:
    """Load `path`, or the shipped default config when path is None."""
    file = Path(path) if path is not None else DEFAULT_CONFIG_PATH
    try:
        text = file.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {file}: {exc.strerror or exc}") from exc
    return parse_config(text, str(file), env)


def with_replicas(loaded: LoadedConfig, replicas: list[str]) -> LoadedConfig:
    """The same config with its replica list replaced (the `--replicas` flag wins over the file)."""
    try:
        config = GatewayConfig.model_validate({**loaded.config.model_dump(by_alias=True), "replicas": replicas})
    except ValidationError as exc:
        raise ConfigError(f"--replicas: {exc.errors()[0]['msg']}") from exc
    return dataclasses.replace(loaded, config=config)


def with_admission(loaded: LoadedConfig, **changes: object) -> LoadedConfig:
    """The same config with admission keys changed (rollback); the digest names the resulting document."""
    raw = loaded.config.model_dump(by_alias=True)
    raw["admission"] = {**raw["admission"], **changes}
    # A pool's own admission keys override the top level's: the rollback's keys go there too, and a watermark
    # the pool already kept lower stays lower.
    for pool in raw.get("pools") or ():
        own = pool.get("admission")
        if own is None:
            continue
        pool["admission"] = {**own, **changes}
        if "admissionWatermark" in changes and "admissionWatermark" in own:
            pool["admission"]["admissionWatermark"] = min(own["admissionWatermark"], changes["admissionWatermark"])
    config = GatewayConfig.model_validate(raw)
    text = json.dumps(config.model_dump(by_alias=True), sort_keys=True)
    digest = "sha256:" + hashlib.sha256(text.encode()).hexdigest()
    return dataclasses.replace(loaded, config=config, digest=digest, source=f"rollback of {loaded.source}")
