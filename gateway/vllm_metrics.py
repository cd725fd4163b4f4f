"""What the gateway reads from a vLLM replica's Prometheus /metrics: the series it asks for and how it asks for them
alone, and `parse_vllm_metrics`, which reads their samples into a replica's numbers (KV usage, requests waiting
and running, the KV pool). `ReplicaPool` (gateway/replicas.py) scrapes with them; calibration reads them once.
"""

from __future__ import annotations

import math
import re

# The gauges the gateway reads from a replica's /metrics, and how it asks for them alone. vLLM's GET /metrics (a
# prometheus-fastapi-instrumentator route) answers the whole exposition, about 50 KB of histograms built by its API
# server, which shares the host's CPU with the engine, at every scrape; its /metrics/ mount is prometheus_client's
# own app, which answers `name[]=` with those series alone. A replica that does not serve that (a 404, or no
# gauge in the answer) is scraped at /metrics from then on, until it goes down (ReplicaPool, gateway/replicas.py).
GAUGES = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "vllm:num_requests_waiting",
          "vllm:num_requests_running")
METRICS_QUERY = "?" + "&".join(f"name[]={name}" for name in (*GAUGES, "vllm:cache_config_info"))
FILTERED_METRICS = "/metrics/" + METRICS_QUERY
METRICS_HEADERS = {"Accept-Encoding": "identity"}  # prometheus_client's app gzips for a client that accepts it
_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)')
_ENGINE = re.compile(r'[{,]engine="([^"]*)"')
# `(?<![a-z_])`: `block_size` must not match inside `mamba_block_size` or `user_specified_block_size`.
_CACHE_INFO = {name: re.compile(rf'(?<![a-z_]){name}="(\d+)"')
               for name in ("num_gpu_blocks", "block_size", "kv_cache_size_tokens")}
_PREFIX_CACHING = re.compile(r'[{,]enable_prefix_caching="([^"]*)"')


def parse_vllm_metrics(text: str) -> dict[str, float]:
    """The vLLM gauges we use, summed over their label sets, and the KV pool of `vllm:cache_config_info`.

    Keys: the gauge names (`vllm:kv_cache_usage_perc` is the engines' average; `kv_cache_usage_max` the fullest
    engine's), and `num_gpu_blocks`, `block_size`, `kv_cache_size_tokens`, `enable_prefix_caching` (1 or 0) when
    exported. vLLM writes one
    cache_config_info series per data-parallel engine from the front end's one CacheConfig, in which it has
    summed `num_gpu_blocks` over the engines and kept `kv_cache_size_tokens` per engine
    (vLLM's engine client, `_apply_ready_response`): so the blocks are read once, the tokens summed
    over the engines. Without `kv_cache_size_tokens` (the simulator, older vLLM) it is blocks x block size."""
    wanted = GAUGES
    out: dict[str, float] = {}
    counts: dict[str, int] = {}
    peaks: dict[str, float] = {}
    engines: dict[str, dict[str, float]] = {}  # engine label -> its cache_config_info values
    for line in text.splitlines():
        if not line or line[0] == "#" or not line.startswith("vllm:"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        name = m.group(1)
        if name == "vllm:cache_config_info":
            labels = m.group(2) or ""
            engine = _ENGINE.search(labels)
            info = engines.setdefault(engine.group(1) if engine else "", {})
            for key, pattern in _CACHE_INFO.items():
                found = pattern.search(labels)
                if found:
                    info[key] = float(found.group(1))
            caching = _PREFIX_CACHING.search(labels)
            if caching:
                info["enable_prefix_caching"] = 1.0 if caching.group(1) == "True" else 0.0
            continue
        if name not in wanted:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        if math.isnan(value):
            continue
        out[name] = out.get(name, 0.0) + value
        counts[name] = counts.get(name, 0) + 1
        peaks[name] = max(peaks.get(name, value), value)
    # KV usage is a fraction per engine: average it over label sets (data-parallel ranks) instead of summing.
    for name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
        if name in out:
            out[name] /= counts[name]
    usage = "vllm:kv_cache_usage_perc" if "vllm:kv_cache_usage_perc" in out else "vllm:gpu_cache_usage_perc"
    if usage in out:
        out["vllm:kv_cache_usage_perc"] = out[usage]
        out["kv_cache_usage_max"] = peaks[usage]
    blocks = [e["num_gpu_blocks"] for e in engines.values() if "num_gpu_blocks" in e]
    sizes = [e["block_size"] for e in engines.values() if "block_size" in e]
    tokens = [e["kv_cache_size_tokens"] for e in engines.values() if "kv_cache_size_tokens" in e]
    if blocks:
        out["num_gpu_blocks"] = max(blocks)  # every engine's series carries the replica's total
    if sizes:
        out["block_size"] = max(sizes)
    caching = [e["enable_prefix_caching"] for e in engines.values() if "enable_prefix_caching" in e]
    if caching:
        out["enable_prefix_caching"] = min(caching)  # on only where every engine has it on
    if tokens:
        out["kv_cache_size_tokens"] = sum(tokens)
    elif blocks and sizes:
        out["kv_cache_size_tokens"] = out["num_gpu_blocks"] * out["block_size"]
    return out
