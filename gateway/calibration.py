"""Calibration profiles: a replica's measured KV pool, tied to the model, runtime version and GPU SKU.

`holdback gateway calibrate` reads a running, idle replica (its model from /v1/models, runtime from /version and
KV geometry from `vllm:cache_config_info`), then measures one probe request: the KV blocks the replica reports
in use while it streams against ceil(tokens ÷ block size), whose ratio (never below 1) becomes the profile's
`safety_factor`. The gateway reserves with the larger of that and `admission.safetyFactor`. The gateway uses the profile's pool size for
replicas that do not export their own, and refuses any replica whose model or runtime differs from the
profile's: an estimate measured on another model or runtime is false headroom. A replica started with
`--api-key` is measured with that key (every call carries it).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from gateway.replicas import Replica
from gateway.settings import ConfigError
from holdback.contract import COMPLETIONS_ENDPOINT
from gateway.vllm_metrics import parse_vllm_metrics

if TYPE_CHECKING:  # only `holdback gateway calibrate` measures; a serving gateway reads profiles and never loads httpx
    import httpx


@dataclass(frozen=True)
class Profile:
    model: str  # the served name (vLLM's `id` in /v1/models)
    runtime_version: str
    gpu_sku: str
    num_gpu_blocks: int
    block_size: int
    max_model_len: int | None
    measured_at: float
    # Observed ÷ computed blocks of the probe, at least 1.0 (1.0 when no probe ran).
    safety_factor: float = 1.0
    # Where the model's weights came from (vLLM's `root`: a path or a hub name).
    model_root: str | None = None

    def mismatch(self, replica: Replica) -> str | None:
        """Why this profile must not be used for `replica`, or None when it matches."""
        # Profiles written before the served name was recorded hold the root instead.
        if self.model not in (replica.model, replica.model_root if self.model_root is None else None):
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


def measure(replica_url: str, gpu_sku: str, probe_tokens: int = 512, timeout: float = 30.0,
            api_key: str | None = None) -> Profile:
    """Read a running replica's identity and KV pool geometry, then measure one probe (0: no probe).
    `api_key`: the replica's `--api-key`, sent on every call."""
    import httpx

    url = replica_url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(timeout=timeout, headers=headers, event_hooks={"response": [_refused_key(api_key)]}) as client:
        models = client.get(url + "/v1/models").raise_for_status().json()["data"][0]
        version = client.get(url + "/version").raise_for_status().json().get("version")
        metrics = parse_vllm_metrics(client.get(url + "/metrics").raise_for_status().text)
        if "num_gpu_blocks" not in metrics or "block_size" not in metrics:
            raise RuntimeError(f"{url}/metrics exports no vllm:cache_config_info with num_gpu_blocks and block_size")
        model = str(models["id"])
        blocks, block_size = int(metrics["num_gpu_blocks"]), int(metrics["block_size"])
        factor = _probe(client, url, model, blocks, block_size, probe_tokens) if probe_tokens else 1.0
    return Profile(model=model, runtime_version=str(version), gpu_sku=gpu_sku,
                   num_gpu_blocks=blocks, block_size=block_size, max_model_len=models.get("max_model_len"),
                   measured_at=time.time(), safety_factor=factor,
                   model_root=str(models["root"]) if models.get("root") else None)


def _refused_key(api_key: str | None):  # noqa: ANN202 - an httpx response hook
    def check(response: httpx.Response) -> None:
        if response.status_code in (401, 403):
            what = "rejects the given key" if api_key else "wants an API key (vLLM --api-key) and none was given"
            raise RuntimeError(f"{response.request.url} answered {response.status_code}: the replica {what}; "
                               "pass the replica's --api-key to `holdback gateway calibrate --api-key`")
    return check


def _usage(client: httpx.Client, url: str) -> float:
    return parse_vllm_metrics(client.get(url + "/metrics").raise_for_status().text).get("vllm:kv_cache_usage_perc", 0.0)


def _probe(client: httpx.Client, url: str, model: str, blocks: int, block_size: int, tokens: int) -> float:
    """Stream one request of a known size; blocks the replica reports in use ÷ the blocks its tokens need."""
    text = " ".join(["calibration"] * tokens)
    prompt_tokens = int(client.post(url + "/tokenize", json={"model": model, "prompt": text})
                        .raise_for_status().json()["count"])
    before = _usage(client, url)
    body = {"model": model, "prompt": text, "max_tokens": 64, "ignore_eos": True, "stream": True}
    observed = produced = 0
    with client.stream("POST", url + COMPLETIONS_ENDPOINT.path, json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                produced += 1
            if produced >= 32:
                observed = round((_usage(client, url) - before) * blocks)
                break
    if observed <= 0:
        raise RuntimeError(f"{url} reported no KV usage for the probe; calibrate an idle replica")
    expected = math.ceil((prompt_tokens + produced) / block_size)
    return max(1.0, round(observed / expected, 3))


def write_profile(profile: Profile, path: str | Path) -> None:
    Path(path).write_text(json.dumps(asdict(profile), indent=2) + "\n")
