"""vLLM-named Prometheus metrics of one replica, in a registry of its own.

The names, label names and buckets are vLLM 0.32's (its Prometheus stat logger): every series carries
`engine="0"` (a replica is one vLLM server with one engine) and `model_name`, counters end in `_total` beside a
`_created`, and `vllm:cache_config_info` carries the KV cache settings with `engine` and no `model_name`.
Gauges and counters are read from the scheduler at scrape time, so /metrics always agrees with /admin/state;
histograms are observed as steps finish. Series vLLM exports that the simulator has nothing for (the
multi-modal cache, admission rejections, FLOPs estimates) are exported at 0; the `sim:` series are the simulator's own.
"""

from __future__ import annotations

import time
from typing import Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from model_sim.config import EngineConfig
from model_sim.engine import EngineCore, StepResult
from model_sim.request import Request

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
ENGINE = "0"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
REQUEST_NUM_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
CACHE_HIT_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")
ADMISSION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")


def request_tokens_buckets(max_model_len: int) -> list[int]:
    """vLLM's 1-2-5 series up to max_model_len, for the per-request token-count histograms."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return out
            out.append(m * scale)
        scale *= 10


def cache_config_labels(cfg: EngineConfig) -> dict[str, str]:
    """The labels of vllm:cache_config_info: vLLM's CacheConfig fields, with the simulator's values where it has
    them and vLLM's defaults for the rest (the names are what a scraper matches on)."""
    offload = cfg.offload_blocks or None
    return {
        "_block_size_resolved": "True", "block_size": str(cfg.block_size), "cache_dtype": "auto",
        "cache_hit_alignment_tokens": "None", "effective_attention_block_size": str(cfg.block_size),
        "enable_mamba_shared_prefix_checkpoint": "False", "enable_prefix_caching": str(cfg.enable_prefix_caching),
        "engine": ENGINE, "gpu_memory_utilization": "0.92", "hash_block_size": "None", "is_attention_free": "False",
        "kv_cache_dtype_skip_layers": "[]", "kv_cache_layout": "None",
        "kv_cache_max_concurrency": str(cfg.num_blocks * cfg.block_size / cfg.max_model_len),
        "kv_cache_memory_bytes": "None", "kv_cache_size_tokens": str(cfg.num_blocks * cfg.block_size),
        "kv_offloading_backend": "native", "kv_offloading_size": "None", "kv_sharing_fast_prefill": "False",
        "mamba_block_size": "None", "mamba_cache_dtype": "auto", "mamba_cache_mode": "none",
        "mamba_page_size_padded": "None", "mamba_ssm_cache_dtype": "float32", "num_cpu_blocks": str(offload),
        "num_gpu_blocks": str(cfg.num_blocks), "num_gpu_blocks_override": "None",
        "prefix_cache_retention_interval": "0", "prefix_caching_hash_algo": "sha256", "prefix_match_unit": "None",
        "replayssm_buffer_len": "16", "skip_page_size_padded": "None", "sliding_window": "None",
        "swa_bounded_replay": "True", "use_kda_recoverssm": "False", "use_replayssm": "False",
        "user_specified_block_size": "True",
    }


class _EngineStateCollector(Collector):
    def __init__(self, engine: EngineCore, model_name: str):
        self.engine = engine
        self.model_name = model_name
        self.created = time.time()

    def describe(self) -> list[Metric]:
        """Its series' names, so the registry can answer a `name[]` filter with them (as vLLM's does)."""
        return list(self.collect())

    def collect(self) -> Iterator[Metric]:
        sched = self.engine.scheduler
        stats = sched.stats
        labels = ["engine", "model_name"]
        value = [ENGINE, self.model_name]

        def gauge(name: str, doc: str, v: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(value, v)
            return g

        def counter(name: str, doc: str, v: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(value, v, created=self.created)
            return c

        def by_label(kind, name: str, doc: str, label: str, values: dict[str, float]):
            m = kind(name, doc, labels=[*labels, label])
            for key, v in values.items():
                if kind is CounterMetricFamily:
                    m.add_metric([*value, key], v, created=self.created)
                else:
                    m.add_metric([*value, key], v)
            return m

        waiting = len(sched.waiting)
        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", len(sched.running))
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", waiting)
        yield by_label(GaugeMetricFamily, "vllm:num_requests_waiting_by_reason",
                       "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling "
                       "capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked "
                       "status). Sum of all reasons equals vllm:num_requests_waiting.", "reason",
                       {"capacity": waiting, "deferred": 0})
        yield by_label(GaugeMetricFamily, "vllm:engine_sleep_state",
                       "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; "
                       "weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
                       "sleep_state", {"awake": 1, "weights_offloaded": 0, "discard_all": 0})
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", sched.kv.usage())
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                      stats.prefix_cache_queries)
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                      stats.prefix_cache_hits)
        yield counter("vllm:external_prefix_cache_queries",
                      "External prefix cache queries from KV connector cross-instance cache sharing, in terms of "
                      "number of queried tokens.", stats.offload_queries)
        yield counter("vllm:external_prefix_cache_hits",
                      "External prefix cache hits from KV connector cross-instance cache sharing, in terms of "
                      "number of cached tokens.", stats.offload_hits)
        yield counter("vllm:mm_cache_queries", "Multi-modal cache queries, in terms of number of queried items.", 0)
        yield counter("vllm:mm_cache_hits", "Multi-modal cache hits, in terms of number of cached items.", 0)
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                      stats.num_preemptions)
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", stats.prompt_tokens)
        cached, loaded = stats.prompt_tokens_cached, stats.prompt_tokens_loaded
        yield by_label(CounterMetricFamily, "vllm:prompt_tokens_by_source", "Number of prompt tokens by source.",
                       "source", {"local_compute": stats.prompt_tokens - cached, "local_cache_hit": cached - loaded,
                                  "external_kv_transfer": loaded})
        yield counter("vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external).", cached)
        yield by_label(CounterMetricFamily, "vllm:prompt_tokens_cached_by_source",
                       "Prefix-cache hit tokens by the cache tier that supplied them.", "source",
                       {s: {"device": cached - loaded, "host": loaded}.get(s, 0) for s in CACHE_HIT_SOURCES})
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.", stats.generation_tokens)
        yield by_label(CounterMetricFamily, "vllm:request_success", "Count of successfully processed requests.",
                       "finished_reason", {r: stats.finished.get(r, 0) for r in FINISH_REASONS})
        rejections = CounterMetricFamily("vllm:admission_rejections",
                                         "Number of admission attempts rejected by a queue limit, by reason.",
                                         labels=["model_name", "reason"])
        for reason in ADMISSION_REASONS:
            rejections.add_metric([self.model_name, reason], 0, created=self.created)
        yield rejections
        # vLLM's model-FLOPs estimates: nothing to estimate for a simulated model.
        for what in ("flops", "read_bytes", "write_bytes"):
            yield counter(f"vllm:estimated_{what}_per_gpu", f"Estimated number of {what.replace('_', ' ')} per GPU "
                          "(for Model Flops Utilization calculations).", 0)
        # Not vLLM metrics: the simulator's own count of computed work thrown away by aborts, and of OOMs.
        yield counter("sim:aborted_computed_tokens", "Prompt and output tokens computed for requests later aborted.",
                      stats.aborted_tokens)
        yield counter("sim:kv_oom", "Steps that ran out of KV memory with nothing preemptible (preemption off).",
                      stats.kv_oom)
        yield counter("sim:kv_oom_failed_requests", "Requests failed by those out-of-memory steps.",
                      stats.kv_oom_failed_requests)
        info_labels = cache_config_labels(sched.config)
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                 labels=list(info_labels))
        info.add_metric(list(info_labels.values()), 1)
        yield info


class ReplicaMetrics:
    def __init__(self, engine: EngineCore, model_name: str):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_EngineStateCollector(engine, model_name))
        token_buckets = request_tokens_buckets(engine.config.max_model_len)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, ["engine", "model_name"], buckets=buckets,
                             registry=self.registry).labels(ENGINE, model_name)

        self.prompt_tokens = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                       token_buckets)
        self.generation_tokens = histogram("vllm:request_generation_tokens", "Number of generation tokens processed.",
                                           token_buckets)
        self.iteration_tokens = histogram("vllm:iteration_tokens_total",
                                          "Histogram of number of tokens per engine_step.", ITERATION_TOKENS_BUCKETS)
        self.max_generation_tokens = histogram("vllm:request_max_num_generation_tokens",
                                               "Histogram of maximum number of requested generation tokens.",
                                               token_buckets)
        self.params_n = histogram("vllm:request_params_n", "Histogram of the n request parameter.",
                                  REQUEST_PARAMS_N_BUCKETS)
        self.params_max_tokens = histogram("vllm:request_params_max_tokens",
                                           "Histogram of the max_tokens request parameter.", token_buckets)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             ITL_BUCKETS)
        self.tpot = histogram("vllm:request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             REQUEST_BUCKETS)
        self.queue = histogram("vllm:request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.", REQUEST_BUCKETS)
        self.inference = histogram("vllm:request_inference_time_seconds",
                                   "Histogram of time spent in RUNNING phase for request.", REQUEST_BUCKETS)
        self.prefill = histogram("vllm:request_prefill_time_seconds",
                                 "Histogram of time spent in PREFILL phase for request.", REQUEST_BUCKETS)
        self.decode = histogram("vllm:request_decode_time_seconds",
                                "Histogram of time spent in DECODE phase for request.", REQUEST_BUCKETS)
        self.num_preemptions = histogram("vllm:request_num_preemptions",
                                         "Histogram of the number of times a request was preempted.",
                                         REQUEST_NUM_PREEMPTIONS_BUCKETS)
        self.prefill_computed = histogram("vllm:request_prefill_kv_computed_tokens",
                                          "Histogram of new KV tokens computed during prefill (excluding cached "
                                          "tokens).", token_buckets)
        engine.step_listeners.append(self.observe_step)

    def observe_step(self, result: StepResult) -> None:
        now = result.ended
        if not result.output.is_empty:
            self.iteration_tokens.observe(result.output.num_prefill_tokens + len(result.outcome.new_token))
        for request in result.outcome.new_token:
            if request.num_output_tokens == 1:
                self.ttft.observe(now - request.arrival_time)
            elif request.token_gap is not None:
                self.itl.observe(request.token_gap)
        for request in result.outcome.finished:
            self._observe_finished(request, now)

    def _observe_finished(self, r: Request, now: float) -> None:
        scheduled = r.first_scheduled_time if r.first_scheduled_time is not None else now
        first = r.first_token_time if r.first_token_time is not None else now
        self.e2e.observe(now - r.arrival_time)
        self.queue.observe(scheduled - r.arrival_time)
        self.inference.observe(now - scheduled)
        self.prefill.observe(first - scheduled)
        self.decode.observe(now - first)
        self.tpot.observe((now - first) / (r.num_output_tokens - 1) if r.num_output_tokens > 1 else 0.0)
        self.num_preemptions.observe(r.num_preemptions)
        self.prefill_computed.observe(r.num_prompt_tokens - max(r.num_cached_tokens, 0))
        self.prompt_tokens.observe(r.num_prompt_tokens)
        self.generation_tokens.observe(r.num_output_tokens)
        self.params_max_tokens.observe(r.max_tokens)
        if r.choice_index == 0:  # once per body, as vLLM counts its parent request
            self.params_n.observe(r.n)
            self.max_generation_tokens.observe(r.max_tokens)

    def render(self, names: list[str] | None = None) -> bytes:
        """The exposition; `names`: those series alone, as vLLM's prometheus_client app answers `name[]=`."""
        return generate_latest(self.registry.restricted_registry(names) if names else self.registry)
