"""One simulated vLLM replica: an engine, its metrics and faults, served over HTTP on one port.

Several replicas can share a process and an event loop; each has its own Prometheus registry.
The aiohttp server runs with handler cancellation on, so a client that disconnects cancels its
handler, and the handler aborts the engine request (freeing its KV blocks) on the way out.
"""

from __future__ import annotations

import time

from aiohttp import web

from holdback.sim_tokenizer import Tokenizer
from model_sim.config import SimConfig
from model_sim.engine import EngineCore
from model_sim.faults import FaultInjector
from model_sim.generation import OutputLengthSampler
from model_sim.kv_usage import KvUsageHistory
from model_sim.metrics import ReplicaMetrics
from model_sim.server import build_app


# What /admin/state shows of the KV usage history unless `history_since` asks for more.
DEFAULT_HISTORY_SECONDS = 60.0


class SimReplica:
    """One replica as vLLM's server is one: the engine, its metrics and faults, and the HTTP app over them."""

    def __init__(self, config: SimConfig, index: int = 0, name: str | None = None):
        config.validate()
        self.config = config
        self.index = index
        self.name = name if name is not None else str(index)
        seed = config.seed * 1000 + index
        self.tokenizer = Tokenizer()
        self.engine = EngineCore(
            config.engine,
            config.timing,
            OutputLengthSampler(config.output_length_mode, seed),
            seed=seed,
            id_prefix=f"r{index}",
            spin_seconds=config.timer_spin_ms / 1000.0,
        )
        self.metrics = ReplicaMetrics(self.engine, config.model)
        self.faults = FaultInjector(config.faults, seed)
        self.kv_usage = KvUsageHistory(self.engine.scheduler.kv.usage)
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Start the engine loop and the HTTP server; returns the bound port."""
        self.engine.start()
        self.kv_usage.start()
        self._runner = web.AppRunner(build_app(self), handler_cancellation=True, access_log=None,
                                     shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, backlog=4096, reuse_address=True)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self.port

    async def stop(self) -> None:
        await self.kv_usage.stop()
        await self.engine.stop()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def state(self, include_blocks: bool = False, history_since: float | None = None) -> dict:
        """What /admin/state returns: queues, blocks, counters and each live request."""
        sched = self.engine.scheduler
        pool = sched.kv.pool
        stats = sched.stats

        def describe(request) -> dict:
            item = {
                "id": request.request_id,
                "external_id": request.external_id,
                "status": request.status.value,
                "priority": request.priority,
                "arrival_time": request.arrival_time,
                "num_prompt_tokens": request.num_prompt_tokens,
                "num_output_tokens": request.num_output_tokens,
                "max_tokens": request.max_tokens,
                "target_output_tokens": request.target_output_tokens,
                "num_computed_tokens": request.num_computed_tokens,
                "num_cached_tokens": max(request.num_cached_tokens, 0),
                "num_blocks": sched.kv.num_blocks_of(request.request_id),
                "num_preemptions": request.num_preemptions,
            }
            if include_blocks:
                item["block_ids"] = sched.kv.block_ids(request.request_id)
            return item

        return {
            "replica": self.name,
            "model": self.config.model,
            "running": len(sched.running),
            "waiting": len(sched.waiting),
            "kv": {
                "num_blocks": pool.num_blocks,
                "block_size": sched.kv.block_size,
                "used": pool.num_used,
                "free": pool.num_free,
                "cached_free": pool.num_cached_free,
                "usage": pool.usage(),
                "prefix_caching": sched.kv.enable_prefix_caching,
                "offload": None if sched.kv.offload is None else {
                    "num_blocks": sched.kv.offload.num_blocks, "used": len(sched.kv.offload),
                    "stored": sched.kv.offload.stored, "evicted": sched.kv.offload.evicted},
            },
            "num_preemptions": stats.num_preemptions,
            "prefix_cache_queries": stats.prefix_cache_queries,
            "prefix_cache_hits": stats.prefix_cache_hits,
            "offload_queries": stats.offload_queries,
            "offload_hits": stats.offload_hits,
            "prompt_tokens": stats.prompt_tokens,
            "generation_tokens": stats.generation_tokens,
            "aborted_computed_tokens": stats.aborted_tokens,
            "finished": dict(stats.finished),
            "preemption": sched.config.preemption,
            "kv_oom": stats.kv_oom,
            "kv_oom_failed_requests": stats.kv_oom_failed_requests,
            "kv_usage_history": self.kv_usage.as_list(
                history_since if history_since is not None else time.time() - DEFAULT_HISTORY_SECONDS),
            "num_steps": stats.num_steps,
            "scheduling_policy": sched.policy.value,
            "running_requests": [describe(r) for r in sched.running],
            # In the order they would be admitted.
            "waiting_requests": [describe(r) for r in sched.waiting],
            "faults": self.faults.as_dict(),
        }
