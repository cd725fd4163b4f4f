"""A config as the gateway runs it: the validated document, where it came from, its digest and its resolved keys.

Read once at the edge (`load_config`) and passed in; key values named by `key_env` are resolved here (the key
entries and their resolution: gateway/settings/keys.py), so nothing deeper reads the environment. A bad file
raises `ConfigError` with a message that names the key.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import yaml
from pydantic import ValidationError

from gateway.settings.base import ConfigError
from gateway.settings.document import GatewayConfig
from gateway.settings.keys import CallerKey, resolve_keys
from gateway.settings.strict_yaml import load_yaml

DEFAULT_CONFIG_PATH = Path(__file__).resolve().parent.parent / "default.yaml"


@dataclass(frozen=True)
class LoadedConfig:
    """A validated config plus where it came from, its digest and its resolved API keys."""

    config: GatewayConfig
    digest: str
    source: str
    keys: tuple[CallerKey, ...]
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
