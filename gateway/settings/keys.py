"""The config's keys: callers' API keys (tenant, objectives, prefix-cache scope), the anonymous caller, the admin
keys, and the keys the gateway sends to its replicas (`upstream.apiKey`, `upstream.replicaKeys`).

An entry gives its key either in the file (`key`) or by the environment variable that holds it (`key_env`);
`resolve_keys` reads those variables once, when a config is loaded (gateway/settings/loading.py), and an entry whose
variable is unset is skipped (and named, so the gateway can log it) until a reload finds it set.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

from pydantic import Field, model_validator

from gateway.settings.base import SettingsModel

if TYPE_CHECKING:
    from gateway.settings.document import GatewayConfig

# The environment variable `upstream.apiKey_env` names unless set: what a `--upstream-api-key` flag of
# `holdback gateway` would be read from (holdback.env_flags), so the key never has to be in the file.
UPSTREAM_KEY_ENV = "HOLDBACK_GATEWAY_UPSTREAM_API_KEY"


class ReplicaKey(SettingsModel):
    """One replica's own key (its vLLM `--api-key`), for `upstream.replicaKeys`."""

    key: str | None = None
    key_env: str | None = Field(default=None, alias="keyEnv")

    @model_validator(mode="after")
    def _one_source(self) -> "ReplicaKey":
        if (self.key is None) == (self.key_env is None):
            raise ValueError("an upstream.replicaKeys entry needs exactly one of `key` or `key_env`")
        return self


class KeyEntry(SettingsModel):
    key: str | None = None
    key_env: str | None = Field(default=None, alias="keyEnv")
    tenant: str
    objectives: list[str] = ["*"]
    defaultObjective: str | None = None
    # Prefix-cache scope (gateway.cache_salt): private to the tenant unless its prompts are public.
    sharePublicPrompts: bool = False
    permissionVersion: int = Field(default=1, ge=1)
    # A trusted relay (the Batch API workers' key): its requests name the tenant they carry in the fairness
    # header, and that tenant's fairness share, KV quota and prefix-cache scope apply. Every other key is pinned
    # to its own tenant, whatever header it sends.
    relaysTenants: bool = False

    @model_validator(mode="after")
    def _one_source(self) -> "KeyEntry":
        if (self.key is None) == (self.key_env is None):
            raise ValueError(f"key entry for tenant {self.tenant!r} needs exactly one of `key` or `key_env`")
        return self


class AdminKey(SettingsModel):
    key: str | None = None
    key_env: str | None = Field(default=None, alias="keyEnv")

    @model_validator(mode="after")
    def _one_source(self) -> "AdminKey":
        if (self.key is None) == (self.key_env is None):
            raise ValueError("an adminKeys entry needs exactly one of `key` or `key_env`")
        return self


class Anonymous(SettingsModel):
    enabled: bool = True
    tenant: str = "anonymous"
    objectives: list[str] = ["*"]
    defaultObjective: str | None = None
    # As a key's `relaysTenants`: only for a gateway no untrusted caller can reach (a bench's or a drill's own).
    relaysTenants: bool = False


@dataclass(frozen=True)
class CallerKey:
    key: str
    tenant: str
    objectives: frozenset[str]
    default_objective: str | None
    share_public_prompts: bool = False
    permission_version: int = 1
    relays_tenants: bool = False


@dataclass(frozen=True)
class ResolvedKeys:
    """Every key of a config with its `key_env` read."""

    callers: tuple[CallerKey, ...]
    # The key for every replica and where it came from ("upstream.apiKey", "$VAR").
    upstream: str | None
    upstream_source: str | None
    # (url, key, where from) per replica with its own key (upstream.replicaKeys).
    replicas: tuple[tuple[str, str, str], ...]
    admin: frozenset[str]
    # Variables named by an entry but unset: the entry is skipped.
    skipped_envs: tuple[str, ...]


def resolve_keys(config: GatewayConfig, env: Mapping[str, str]) -> ResolvedKeys:
    keys: list[CallerKey] = []
    skipped: list[str] = []
    for entry in config.keys:
        value = entry.key
        if entry.key_env is not None:
            value = env.get(entry.key_env) or None
            if value is None:
                skipped.append(entry.key_env)
                continue
        keys.append(CallerKey(value, entry.tenant, frozenset(entry.objectives), entry.defaultObjective,
                           entry.sharePublicPrompts, entry.permissionVersion, entry.relaysTenants))
    up = config.upstream
    upstream_key, upstream_source = up.apiKey, "upstream.apiKey" if up.apiKey else None
    if up.apiKey_env and env.get(up.apiKey_env):
        upstream_key, upstream_source = env[up.apiKey_env], f"${up.apiKey_env}"
    replica_keys = []
    for url, replica in up.replicaKeys.items():
        value = replica.key if replica.key_env is None else env.get(replica.key_env) or None
        if value is None:
            skipped.append(replica.key_env or "")
            continue
        where = f"${replica.key_env}" if replica.key_env else "key"
        replica_keys.append((url, value, f"upstream.replicaKeys[{url!r}] ({where})"))
    admin_keys = set()
    for admin in config.adminKeys:
        value = admin.key if admin.key_env is None else env.get(admin.key_env) or None
        if value is None:
            skipped.append(admin.key_env or "")
            continue
        admin_keys.add(value)
    return ResolvedKeys(tuple(keys), upstream_key, upstream_source, tuple(replica_keys), frozenset(admin_keys),
                        tuple(skipped))
