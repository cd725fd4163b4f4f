"""Calibration profiles: a replica's measured KV pool, tied to the model, runtime version and GPU SKU.

`holdback gateway calibrate` reads a running replica (its model from /v1/models, runtime from /version and
KV geometry from `vllm:cache_config_info`) and writes a profile. The gateway uses the profile's pool size for
replicas that do not export their own, and refuses any replica whose model or runtime differs from the
profile's: an estimate measured on another model or runtime is false headroom.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from gateway.config import ConfigError
from gateway.replicas import Replica, parse_vllm_metrics


@dataclass(frozen=True)
class Profile:
    model: str
    runtime_version: str
    gpu_sku: str
    num_gpu_blocks: int
    block_size: int
    max_model_len: int | None
    measured_at: float

    def mismatch(self, replica: Replica) -> str | None:
        """Why this profile must not be used for `replica`, or None when it matches."""
        if replica.model != self.model:
            return f"model {replica.model!r} differs from the profile's {self.model!r}"
        if replica.runtime_version != self.runtime_version:
            return f"runtime {replica.runtime_version!r} differs from the profile's {self.runtime_version!r}"
        return None


def load_profile(path: str | Path) -> Profile:
    try:
        raw = json.loads(Path(path).read_text())
        return Profile(**raw)
    except OSError as exc:
        raise ConfigError(f"admission.calibrationProfile: cannot read {path}: {exc.strerror or exc}") from exc
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"admission.calibrationProfile: {path} is not a profile written by "
                          f"`holdback gateway calibrate`: {exc}") from exc


def measure(replica_url: str, gpu_sku: str, timeout: float = 5.0) -> Profile:
    """Read a running replica's identity and KV pool geometry."""
    url = replica_url.rstrip("/")
    with httpx.Client(timeout=timeout) as client:
        models = client.get(url + "/v1/models").raise_for_status().json()["data"][0]
        version = client.get(url + "/version").raise_for_status().json().get("version")
        metrics = parse_vllm_metrics(client.get(url + "/metrics").raise_for_status().text)
    if "num_gpu_blocks" not in metrics or "block_size" not in metrics:
        raise RuntimeError(f"{url}/metrics exports no vllm:cache_config_info with num_gpu_blocks and block_size")
    return Profile(model=str(models.get("root") or models["id"]), runtime_version=str(version), gpu_sku=gpu_sku,
                   num_gpu_blocks=int(metrics["num_gpu_blocks"]), block_size=int(metrics["block_size"]),
                   max_model_len=models.get("max_model_len"), measured_at=time.time())


def write_profile(profile: Profile, path: str | Path) -> None:
    Path(path).write_text(json.dumps(asdict(profile), indent=2) + "\n")
