"""The gateway config's `engine` section: what each replica's vLLM was started with that it does not report
(`--scheduling-policy`, `--max-num-seqs`) and the queue the gateway may keep inside it (gateway/README.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from gateway.settings.base import SettingsModel


def by_replica_url(where: str, entries: dict) -> dict:
    """A mapping keyed by replica base URLs, each checked and without its trailing slash."""
    for url in entries:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"{where}: {url!r} must be a replica's http:// or https:// URL")
    return {url.rstrip("/"): value for url, value in entries.items()}


class ReplicaEngine(SettingsModel):
    """What a replica's vLLM was started with that it does not report and the gateway must know (vLLM's flags)."""

    # --scheduling-policy. `priority`: every request goes with the gateway's priority (X-Vllm-Priority: the
    # objective's, negated, since vLLM runs lower values first), so requests that wait inside vLLM wait in the
    # gateway's order. Never sent to an `fcfs` replica, where a nonzero priority is an error.
    schedulingPolicy: Literal["fcfs", "priority"] = "fcfs"
    # --max-num-seqs: the requests it runs at once. Set, it is the replica's concurrency (replacing
    # saturation.maxConcurrency there), and a realtime request the gateway sees waiting inside vLLM for a slot
    # evicts a running batch one on that replica.
    maxNumSeqs: int | None = Field(default=None, gt=0)
    # With maxNumSeqs unset: learn it from the replica's metrics, which vLLM does not report as such. A replica
    # that keeps requests waiting for 2 s while its free KV blocks hold their prompts (those the gateway sent that
    # have not answered; untold, while its KV is at most half used) and the same number, its most, run is running
    # all it may: that number is its slots (gateway/README.md, "Engine slots learned").
    learnMaxNumSeqs: bool = True
    # Requests beyond maxNumSeqs (or the learned slots, once learned) the gateway may keep waiting inside vLLM
    # (its queue, priority-ordered there under `priority`): a freed slot is filled within the engine's next step
    # instead of a relay's round trip.
    queueAllowance: int = Field(default=0, ge=0)


class ReplicaEngineOverride(SettingsModel):
    """engine.replicas[url]: the keys of `engine` that differ for that replica."""

    schedulingPolicy: Literal["fcfs", "priority"] | None = None
    maxNumSeqs: int | None = Field(default=None, gt=0)
    learnMaxNumSeqs: bool | None = None
    queueAllowance: int | None = Field(default=None, ge=0)


class EngineSettings(ReplicaEngine):
    # Replica base URL -> its own settings, over the ones above.
    replicas: dict[str, ReplicaEngineOverride] = {}

    @field_validator("replicas")
    @classmethod
    def _replica_urls(cls, own: dict[str, ReplicaEngineOverride]) -> dict[str, ReplicaEngineOverride]:
        return by_replica_url("engine.replicas", own)

    @model_validator(mode="after")
    def _allowance_needs_slots(self) -> "EngineSettings":
        for where, settings in [("engine", self), *((f"engine.replicas[{u!r}]", self.of(u)) for u in self.replicas)]:
            if settings.queueAllowance and settings.maxNumSeqs is None and not settings.learnMaxNumSeqs:
                raise ValueError(f"{where}.queueAllowance counts requests beyond the replica's slots, and with "
                                 f"learnMaxNumSeqs off they are unknown: set {where}.maxNumSeqs to the replica's "
                                 f"--max-num-seqs, or turn learnMaxNumSeqs back on")
        return self

    def priority_scheduling(self, url: str) -> bool:
        """Whether the replica at `url` runs vLLM's priority policy (the dispatch path asks, per request)."""
        own = self.replicas.get(url)
        policy = own.schedulingPolicy if own is not None and own.schedulingPolicy else self.schedulingPolicy
        return policy == "priority"

    def of(self, url: str) -> ReplicaEngine:
        """The settings of the replica at `url`: its own over the common ones."""
        base = {k: getattr(self, k) for k in ReplicaEngine.model_fields}
        own = self.replicas.get(url.rstrip("/"))
        if own is not None:
            base.update({k: v for k, v in own.model_dump().items() if v is not None})
        return ReplicaEngine(**base)
