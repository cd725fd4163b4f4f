"""The sections of the gateway's config (flowControl, saturation, usageLimit, eviction, admission, picker, health,
metrics, upstream, objectives): typed models with their defaults and the checks that need only their own keys."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from gateway.settings.base import SettingsModel
from gateway.settings.engine import by_replica_url
from gateway.settings.keys import UPSTREAM_KEY_ENV, ReplicaKey
from gateway.settings.names import (DetectorName, EvictionName, FairnessName, OrderingName, PickerName,
                                    UsageLimitName)

TrafficClass = Literal["interactive", "batch", "critical"]


class Objective(SettingsModel):
    priority: int = 0
    # Budget class for KV quotas; unset: `batch` below priority 0, else `interactive`.
    trafficClass: TrafficClass | None = None

    def traffic_class(self) -> str:
        return self.trafficClass or ("batch" if self.priority < 0 else "interactive")


class BandSettings(SettingsModel):
    """Settings of one priority band; every field left unset falls back to `flowControl.defaultBand`."""

    priority: int | None = None
    maxRequests: int | None = Field(default=None, ge=0)
    ttl: float | None = Field(default=None, ge=0)
    ceiling: float | None = Field(default=None, ge=0, le=1)
    fairness: FairnessName | None = None
    ordering: OrderingName | None = None


class FlowControlSettings(SettingsModel):
    defaultRequestTTL: float = Field(default=60.0, ge=0)
    maxRequests: int = Field(default=0, ge=0)
    defaultBand: BandSettings = BandSettings(maxRequests=5000, fairness="global-strict", ordering="fcfs")
    bands: list[BandSettings] = []
    tickSeconds: float = Field(default=0.05, gt=0, le=1)
    # The share of the pool's request capacity that batch work at risk of missing its window may hold under
    # saturation (gateway/flow/floor.py); 0: none.
    atRiskFloor: float = Field(default=0.1, ge=0, le=0.5)
    # Cached-first dispatch (gateway/flow/cached_first.py): how far down the queue of the flow whose turn it is a
    # batch band looks for a request whose prefix is cached on the replica with room; 0: off, strict order.
    cachedFirstLookahead: int = Field(default=64, ge=0, le=1024)
    # How often flow control and each relay send each other a heartbeat on their channel; a peer silent for three
    # of them is cut off (gateway/relays/channel.py). The top level's applies; a pool's is not read.
    heartbeatSeconds: float = Field(default=1.0, ge=0.05, le=60)

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


class Saturation(SettingsModel):
    detector: DetectorName = "concurrency"
    maxConcurrency: int = Field(default=48, gt=0)
    headroom: float = Field(default=0.0, ge=0)
    queueDepthThreshold: float = Field(default=5.0, gt=0)
    kvCacheUtilThreshold: float = Field(default=0.8, gt=0, le=1)
    metricsStalenessSeconds: float = Field(default=2.0, gt=0)


class AdaptiveReserve(SettingsModel):
    """How `adaptive-reserve` forecasts protected demand; its ceilings stay within usageLimit.min/maxCeiling."""

    # Bands at or above this priority are the demand the reserve protects; bands below are limited.
    protectedPriority: int = 0
    # Pool share kept free above the forecast. The defaults are the simulator study's (docs/study/full): eviction
    # covers the forecast's error, so a short window and a small margin lend batch more.
    margin: float = Field(default=0.05, ge=0, lt=1)
    halfLifeSeconds: float = Field(default=5.0, gt=0)
    peakWindowSeconds: float = Field(default=5.0, ge=0)


class UsageLimit(SettingsModel):
    policy: UsageLimitName = "static"
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


class Eviction(SettingsModel):
    # Victim order by name (gateway/policies/victims.py); `none` is the no-op evictor.
    policy: EvictionName = "least-refill"
    # Kept for older configs: `enabled: false` means `policy: none`.
    enabled: bool = True
    maxPerDecision: int = Field(default=2, ge=1)
    confirmationTimeoutSeconds: float = Field(default=10.0, gt=0)
    graceSeconds: float | None = Field(default=None, ge=0)

    def policy_name(self) -> str:
        return self.policy if self.enabled else "none"


class Quota(SettingsModel):
    """Limits for one fairness id or one traffic class; unset means unlimited."""

    maxReservedTokens: int | None = Field(default=None, gt=0)
    maxActiveSequences: int | None = Field(default=None, gt=0)
    maxContextTokens: int | None = Field(default=None, gt=0)
    # Occupied token-seconds (tokens held in KV × seconds held) over `tokenSecondsWindowSeconds`.
    maxTokenSeconds: float | None = Field(default=None, gt=0)


class Admission(SettingsModel):
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


class Picker(SettingsModel):
    # Replica scorer by name (gateway/policies/picker.py): least-loaded | kv-headroom | prefix-affinity (where the
    # prompt's leading blocks were sent before, unless much busier: gateway/policies/prefix_affinity.py).
    policy: PickerName = "least-loaded"
    inFlightWeight: float = Field(default=1.0, ge=0)
    kvUsageWeight: float = Field(default=1.0, ge=0)
    # An evicted request's retry goes back to the replica its attempt ran on (where its blocks are cached)
    # whenever that replica has room; false: it is scored like any new request.
    evictedAffinity: bool = True


class Health(SettingsModel):
    intervalSeconds: float = Field(default=1.0, gt=0)
    timeoutSeconds: float = Field(default=2.0, gt=0)
    failuresToDown: int = Field(default=2, ge=1)


class Metrics(SettingsModel):
    scrapeIntervalSeconds: float = Field(default=0.25, gt=0)


class Upstream(SettingsModel):
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


class ResponsesSettings(SettingsModel):
    """Stored responses (vLLM with VLLM_ENABLE_RESPONSES_API_STORE=1): gateway/stored_responses.py."""

    # `background: true` is counted (its slot and KV reservation) until its replica reports it ended; false: the
    # gateway refuses it (400, param `background`).
    allowBackground: bool = True
    # How long, and how many, response ids the gateway remembers with the replica that stored them; an id it does
    # not remember (forgotten, or made before a restart) is looked for by asking the replicas.
    rememberSeconds: float = Field(default=86400.0, gt=0)
    rememberMax: int = Field(default=100_000, ge=1)
    # How often a background response's replica is asked whether it ended.
    pollSeconds: float = Field(default=1.0, gt=0, le=60)
