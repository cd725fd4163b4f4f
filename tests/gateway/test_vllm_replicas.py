"""The gateway against the bytes real vLLM 0.32.0 sends (tests/fixtures/vllm/): its /metrics, its model list,
its errors, and what it does when a replica needs a key or dies.

The replicas here are small aiohttp apps in this process that answer with those bytes, so every test is fast
and unit; the real-engine tier (`make test-vllm`) checks the same behaviours against a live vLLM.
"""

from __future__ import annotations

from pathlib import Path

from gateway.replicas import Replica, parse_vllm_metrics

FIXTURES = Path(__file__).parent.parent / "fixtures" / "vllm"
METRICS = (FIXTURES / "metrics.prom").read_text()


def data_parallel(text: str, usages: list[float]) -> str:
    """`text` as vLLM 0.32 writes it with one engine per entry of `usages`: one series per engine, and every
    cache_config_info series from the front end's one CacheConfig, whose num_gpu_blocks it summed over the
    engines (vllm/v1/engine/core_client.py `_apply_ready_response`) and whose kv_cache_size_tokens is one
    engine's."""
    out = []
    for line in text.splitlines():
        if 'engine="0"' not in line:
            out.append(line)
            continue
        for engine, usage in enumerate(usages):
            series = line.replace('engine="0"', f'engine="{engine}"')
            if series.startswith("vllm:kv_cache_usage_perc{"):
                series = series.rsplit(" ", 1)[0] + f" {usage}"
            elif series.startswith("vllm:cache_config_info{"):
                series = series.replace('num_gpu_blocks="16384"', f'num_gpu_blocks="{16384 * len(usages)}"')
            out.append(series)
    return "\n".join(out) + "\n"


# -- item: the KV pool and usage of /metrics ----------------------------------------------------------------
def test_real_vllm_metrics_give_the_block_size_blocks_and_kv_tokens():
    values = parse_vllm_metrics(METRICS)
    assert values["block_size"] == 128  # not effective_attention_block_size, mamba_block_size, ...
    assert values["num_gpu_blocks"] == 16384
    assert values["kv_cache_size_tokens"] == 2_097_152
    assert values["vllm:kv_cache_usage_perc"] == 0.0 and values["kv_cache_usage_max"] == 0.0


def test_data_parallel_engines_add_their_kv_tokens_once_and_usage_is_averaged_and_maxed():
    values = parse_vllm_metrics(data_parallel(METRICS, [0.2, 0.6]))
    assert values["num_gpu_blocks"] == 32768  # the replica's total, carried by each engine's series
    assert values["kv_cache_size_tokens"] == 2 * 2_097_152 == values["num_gpu_blocks"] * values["block_size"]
    assert values["vllm:kv_cache_usage_perc"] == 0.4
    assert values["kv_cache_usage_max"] == 0.6
    assert values["vllm:num_requests_running"] == 0.0


def test_the_simulators_cache_info_without_kv_tokens_gives_blocks_times_block_size():
    text = 'vllm:cache_config_info{model_name="sim",block_size="16",num_gpu_blocks="1000"} 1.0\n' \
           'vllm:kv_cache_usage_perc{model_name="sim"} 0.25\n'
    values = parse_vllm_metrics(text)
    assert (values["num_gpu_blocks"], values["block_size"], values["kv_cache_size_tokens"]) == (1000, 16, 16000)


def test_the_pools_old_name_reads_and_sets_num_gpu_blocks():
    r = Replica("http://r")
    assert (r.num_gpu_blocks, r.kv_cache_size_tokens, r.kv_block_size, r.kv_usage_max) == (None,) * 4
    r.kv_blocks_total = 1000  # flow_control.py and admission.py still read it by this name
    assert r.num_gpu_blocks == 1000 == r.kv_blocks_total
