"""Continuous batching in the shape of vLLM v1's scheduler.

`schedule()` first gives each running request its next tokens (a prefill chunk or one decode
token) within the step's token budget, preempting by recompute when the KV cache cannot hold
them; then, only if nothing was preempted, admits waiting requests while the budget, the
sequence limit and the KV cache allow. `update_from_output()` applies the finished step:
progress, new tokens, finished requests. Every status change of a request happens here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from model_sim.config import EngineConfig
from model_sim.generation import output_token_id
from model_sim.kv_cache import KVCacheManager
from model_sim.request import Request, RequestStatus
from model_sim.request_queue import SchedulingPolicy, make_queue


@dataclass
class SchedulerOutput:
    """What one step computes: (request, tokens computed for it) in batch order."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decode_seqs: int = 0
    # Requests whose prompt (or a chunk of it) this step computes.
    num_prefill_seqs: int = 0
    # Prompt tokens whose KV is copied back from the offload tier for requests admitted in this step.
    num_loaded_tokens: int = 0
    preempted: list[Request] = field(default_factory=list)
    # Requests failed by an out-of-memory in this step (preemption off): their streams end with an error.
    failed: list[Request] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class StepOutcome:
    new_token: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)


@dataclass
class SchedulerStats:
    """Monotonic counters, read by /metrics and /admin/state."""

    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # The offload tier (vLLM's `external_prefix_cache_*`): tokens looked up there, and found and loaded.
    offload_queries: int = 0
    offload_hits: int = 0
    prompt_tokens: int = 0
    # Of those, the ones not computed (vLLM's vllm:prompt_tokens_cached), and of these the ones loaded from the
    # offload tier; both counted when a request's first token is out, as prompt_tokens is.
    prompt_tokens_cached: int = 0
    prompt_tokens_loaded: int = 0
    generation_tokens: int = 0
    num_steps: int = 0
    # Prompt and output tokens already computed for requests that were then aborted (client gone,
    # e.g. a gateway eviction): work a retry has to do again.
    aborted_tokens: int = 0
    finished: dict[str, int] = field(default_factory=lambda: {"stop": 0, "length": 0, "abort": 0})
    # Steps in which running sequences needed more KV blocks than the cache had, with nothing preemptible,
    # and the requests those out-of-memory failures took down.
    kv_oom: int = 0
    kv_oom_failed_requests: int = 0


class Scheduler:
    def __init__(self, config: EngineConfig):
        config.validate()
        self.config = config
        self.policy = SchedulingPolicy(config.scheduling_policy)
        self.kv = KVCacheManager(config.num_blocks, config.block_size, config.enable_prefix_caching,
                                 config.offload_blocks)
        self.waiting = make_queue(self.policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()

    # -- admission and abort ------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def abort_request(self, request_id: str, now: float) -> Request | None:
        """Remove a request wherever it is and free its blocks now."""
        request = self.requests.get(request_id)
        if request is None or request.status.is_finished:
            return None
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.stats.aborted_tokens += request.num_computed_tokens
        self._finish(request, RequestStatus.FINISHED_ABORTED, now)
        return request

    def has_unfinished(self) -> bool:
        return bool(self.running) or bool(self.waiting)

    # -- one step -------------------------------------------------------------------------------

    def schedule(self, now: float) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}

        for request in list(self.running):
            if budget <= 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self.config.preemption and not self.kv.allocate_slots(request, n):
                out.failed = self._out_of_memory(request, n, now)
                num_scheduled.clear()
                break
            while not self.kv.allocate_slots(request, n):
                victim = self._pick_victim()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim.request_id in num_scheduled:
                    budget += num_scheduled.pop(victim.request_id)
                if victim is request:
                    break
            if request.status is RequestStatus.RUNNING:
                num_scheduled[request.request_id] = n
                budget -= n

        if not out.preempted and not out.failed:
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                request = self.waiting.peek()
                hits = self.kv.get_computed_blocks(request)
                num_hit = len(hits) * self.config.block_size
                # Past the GPU hit, the offload tier may hold the prefix's next blocks: loaded, not computed.
                loaded = self.kv.get_offloaded_blocks(request, len(hits)) * self.config.block_size
                n = min(request.num_tokens - num_hit - loaded, budget)
                if not self.kv.allocate_slots(request, loaded + n, hits):
                    break  # head of line waits for blocks, as in vLLM
                self.waiting.pop()
                if request.num_cached_tokens < 0:
                    # As vLLM counts it: every token not computed at the first admission, loaded ones included.
                    request.num_cached_tokens = num_hit + loaded
                    request.num_loaded_tokens = loaded
                    self.stats.prefix_cache_queries += request.num_tokens if self.kv.enable_prefix_caching else 0
                    self.stats.prefix_cache_hits += num_hit
                if self.kv.offload is not None:
                    self.stats.offload_queries += request.num_tokens - num_hit
                    self.stats.offload_hits += loaded
                out.num_loaded_tokens += loaded
                request.num_computed_tokens = num_hit + loaded
                if request.first_scheduled_time is None:
                    request.first_scheduled_time = now
                request.status = RequestStatus.RUNNING
                self.running.append(request)
                num_scheduled[request.request_id] = n
                budget -= n

        for request in self.running:
            n = num_scheduled.get(request.request_id)
            if n is None:
                continue
            if request.is_decoding:
                out.num_decode_seqs += 1
            else:
                out.num_prefill_tokens += n
                out.num_prefill_seqs += 1
            out.scheduled.append((request, n))
        return out

    def _out_of_memory(self, request: Request, n: int, now: float) -> list[Request]:
        """A real runtime's forward pass fails as a whole when it runs out of memory: every running request fails."""
        need = self.kv.blocks_for_tokens(request.num_computed_tokens + n) - self.kv.num_blocks_of(request.request_id)
        message = (f"CUDA out of memory: sequence {request.request_id} needed {need} more KV blocks, "
                   f"{self.kv.pool.num_free} of {self.kv.num_blocks} were free and preemption is off.")
        failed = list(self.running)
        self.running.clear()
        for victim in failed:
            victim.error = message
            self._finish(victim, RequestStatus.FINISHED_ABORTED, now)
        self.stats.kv_oom += 1
        self.stats.kv_oom_failed_requests += len(failed)
        return failed

    def _pick_victim(self) -> Request:
        if self.policy is SchedulingPolicy.PRIORITY:
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.prepend(request)

    def update_from_output(self, out: SchedulerOutput, now: float) -> StepOutcome:
        outcome = StepOutcome()
        self.stats.num_steps += 1
        for request, n in out.scheduled:
            if request.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            request.num_computed_tokens += n
            if request.num_computed_tokens < request.num_tokens:
                continue  # a prefill chunk; no token yet
            if request.first_token_time is None:
                request.first_token_time = now
                self.stats.prompt_tokens += request.num_prompt_tokens
                self.stats.prompt_tokens_cached += max(request.num_cached_tokens, 0)
                self.stats.prompt_tokens_loaded += request.num_loaded_tokens
            request.output_token_ids.append(output_token_id(request.output_offset + request.num_output_tokens))
            if request.last_token_time is not None:
                request.token_gap = now - request.last_token_time
            request.last_token_time = now
            self.stats.generation_tokens += 1
            outcome.new_token.append(request)
            if request.num_output_tokens >= request.target_output_tokens:
                self.running.remove(request)
                reached_max = request.num_output_tokens >= request.max_tokens
                status = RequestStatus.FINISHED_LENGTH if reached_max else RequestStatus.FINISHED_STOPPED
                self._finish(request, status, now)
                outcome.finished.append(request)
        return outcome

    def _finish(self, request: Request, status: RequestStatus, now: float) -> None:
        request.status = status
        request.finished_time = now
        self.kv.free(request)
        self.requests.pop(request.request_id, None)
        self.stats.finished[status.finish_reason] += 1
