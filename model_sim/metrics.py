"""vLLM-named Prometheus metrics of one replica, in a registry of its own.

Gauges and counters are read from the scheduler at scrape time, so /metrics always agrees with
/admin/state; latency histograms are observed as steps finish. Every series carries the
`model_name` label, as vLLM's do.
"""

from __future__ import annotations

from typing import Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from model_sim.engine import Engine, StepResult

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)


class _EngineStateCollector(Collector):
    def __init__(self, engine: Engine, model_name: str):
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        sched = self.engine.scheduler
        stats = sched.stats
        labels = ["model_name"]
        value = [self.model_name]

        def gauge(name: str, doc: str, v: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(value, v)
            return g

        def counter(name: str, doc: str, v: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(value, v)
            return c

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", len(sched.running))
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", len(sched.waiting))
        usage = sched.kv.usage()
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage)
        yield gauge("vllm:gpu_cache_usage_perc", "KV-cache usage (legacy name). 1 means 100 percent usage.", usage)
        yield counter("vllm:num_preemptions", "Cumulative number of preemptions.", stats.num_preemptions)
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in queried tokens.", stats.prefix_cache_queries)
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in cached tokens.", stats.prefix_cache_hits)
        yield counter("vllm:external_prefix_cache_queries",
                      "External (offload tier) prefix cache queries, in queried tokens.", stats.offload_queries)
        yield counter("vllm:external_prefix_cache_hits",
                      "External (offload tier) prefix cache hits, in loaded tokens.", stats.offload_hits)
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", stats.prompt_tokens)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.", stats.generation_tokens)
        # Not a vLLM metric: the simulator's own count of computed work thrown away by aborts.
        yield counter("sim:aborted_computed_tokens", "Prompt and output tokens computed for requests later aborted.",
                      stats.aborted_tokens)
        yield counter("sim:kv_oom", "Steps that ran out of KV memory with nothing preemptible (preemption off).",
                      stats.kv_oom)
        yield counter("sim:kv_oom_failed_requests", "Requests failed by those out-of-memory steps.",
                      stats.kv_oom_failed_requests)
        success = CounterMetricFamily(
            "vllm:request_success", "Count of finished requests by finish reason.", labels=["model_name", "finished_reason"]
        )
        for reason, count in stats.finished.items():
            success.add_metric([self.model_name, reason], count)
        yield success
        cfg = sched.config
        info = GaugeMetricFamily(
            "vllm:cache_config_info", "Information of the KV cache configuration.",
            labels=["model_name", "block_size", "num_gpu_blocks", "enable_prefix_caching"],
        )
        info.add_metric([self.model_name, str(cfg.block_size), str(cfg.num_blocks), str(cfg.enable_prefix_caching)], 1)
        yield info


class ReplicaMetrics:
    def __init__(self, engine: Engine, model_name: str):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_EngineStateCollector(engine, model_name))
        reg = self.registry
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              ["model_name"], buckets=TTFT_BUCKETS, registry=reg).labels(model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             ["model_name"], buckets=ITL_BUCKETS, registry=reg).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.",
                             ["model_name"], buckets=REQUEST_BUCKETS, registry=reg).labels(model_name)
        self.queue = Histogram("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase.",
                               ["model_name"], buckets=REQUEST_BUCKETS, registry=reg).labels(model_name)
        engine.step_listeners.append(self.observe_step)

    def observe_step(self, result: StepResult) -> None:
        now = result.ended
        for request in result.outcome.new_token:
            if request.num_output_tokens == 1:
                self.ttft.observe(now - request.arrival_time)
                if request.first_scheduled_time is not None:
                    self.queue.observe(request.first_scheduled_time - request.arrival_time)
            elif request.token_gap is not None:
                self.itl.observe(request.token_gap)
        for request in result.outcome.finished:
            self.e2e.observe(now - request.arrival_time)

    def render(self) -> bytes:
        return generate_latest(self.registry)
