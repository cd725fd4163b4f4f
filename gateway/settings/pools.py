"""The `pools` entries of the gateway's config: each pool's keys, the checks that keep pools apart, and the config
one pool's flow control runs with (its own sections merged over the top-level ones). gateway/settings/document.py
holds the rest of the config and validates `pools` with these.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

from pydantic import AfterValidator, Field, ValidationError, field_validator
from pydantic_core import PydanticCustomError

from gateway.settings.base import SettingsModel
from holdback.contract import INFERENCE_PATHS

if TYPE_CHECKING:
    from gateway.settings.document import GatewayConfig


# The sections a pool may set for itself (pools[].saturation, ...): each key it sets replaces the top-level one.
POOL_SECTIONS = ("flowControl", "saturation", "usageLimit", "eviction", "admission", "picker", "engine")


def _inference_path(path: str) -> str:
    if path not in INFERENCE_PATHS:
        raise PydanticCustomError("inference_path", "Input should be one of the inference paths {paths}",
                                  {"paths": ", ".join(INFERENCE_PATHS)})
    return path


Endpoint = Annotated[str, AfterValidator(_inference_path)]


class PoolSettings(SettingsModel):
    """pools[]: the replicas of some model names, with their own flow control. A section left out is the
    top-level one; a section given is merged key by key over it."""

    name: str = Field(min_length=1)
    # What callers put in `model`: vLLM's --served-model-name aliases; LoRA adapters the replicas list in
    # /v1/models with one of these as `parent` are served by the pool too.
    models: list[str] = Field(min_length=1)
    replicas: list[str] = []
    # The inference paths the pool serves; unset: every one (embeddings as the replicas show they serve them).
    endpoints: list[Endpoint] | None = None
    flowControl: dict | None = None
    saturation: dict | None = None
    usageLimit: dict | None = None
    eviction: dict | None = None
    admission: dict | None = None
    picker: dict | None = None
    engine: dict | None = None

    @field_validator("replicas")
    @classmethod
    def _urls(cls, urls: list[str]) -> list[str]:
        return replica_urls(urls)


def replica_urls(urls: list[str]) -> list[str]:
    """Replica base URLs, checked, without their trailing slash, each once."""
    out = []
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"replica {url!r} must be an http:// or https:// URL")
        out.append(url.rstrip("/"))
    if len(set(out)) != len(out):
        raise ValueError("replicas lists the same URL twice")
    return out


def check_pools(cfg: GatewayConfig) -> None:
    """Each pool name, model name and replica in one pool only; every pool's own sections valid."""
    names: set[str] = set()
    model_pool: dict[str, str] = {}
    replica_pool: dict[str, str] = {}
    for pool in cfg.pools:
        if pool.name in names:
            raise ValueError(f"two pools are named {pool.name!r}; give each pool its own name")
        names.add(pool.name)
        for model in pool.models:
            if model in model_pool:
                raise ValueError(f"model {model!r} is in pools {model_pool[model]!r} and {pool.name!r}: a model "
                                 f"name must pick one pool; remove it from one of them")
            model_pool[model] = pool.name
        for url in pool.replicas:
            if url in replica_pool:
                raise ValueError(f"replica {url!r} is in pools {replica_pool[url]!r} and {pool.name!r}: a replica "
                                 f"serves one pool; list it in one of them")
            replica_pool[url] = pool.name
    for url in cfg.replicas:
        if url in replica_pool:
            raise ValueError(f"replica {url!r} is listed in `replicas` and in pools {replica_pool[url]!r}; list it "
                             f"once (replicas only in `replicas` are grouped by the model they report)")
    for pool in cfg.pools:
        pool_config(cfg, pool)  # raises on a bad key in the pool's own sections


def pool_config(cfg: GatewayConfig, pool: PoolSettings | None) -> GatewayConfig:
    """The config of one pool's flow control: its sections over `cfg`'s, its replicas (None: `cfg` without
    pools, for replicas grouped by model)."""
    if pool is None:
        return cfg.model_copy(update={"pools": []})
    raw = cfg.model_dump(by_alias=True, exclude={"pools"})
    for section in POOL_SECTIONS:
        own = getattr(pool, section)
        if own is not None:
            raw[section] = {**raw[section], **own}
    raw["replicas"] = pool.replicas
    try:
        return type(cfg).model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in err['loc']) or '(top)'}: {err['msg']}"
                             for err in exc.errors())
        raise ValueError(f"pools[{pool.name!r}]: {problems}") from None
