"""Typed settings of one simulated replica, built once by the CLI (or a test) and passed in."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from holdback.contract import InferenceEndpoint
from model_sim.faults import FaultSettings
from model_sim.generation import OutputLengthMode
from model_sim.request_queue import SchedulingPolicy
from model_sim.timing import TimingModel


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    # 32768 blocks x 16 tokens = 512Ki tokens: 256 sequences of 2048 tokens.
    num_blocks: int = 32768
    block_size: int = 16
    max_model_len: int = 8192
    scheduling_policy: SchedulingPolicy = SchedulingPolicy.FCFS
    enable_prefix_caching: bool = False
    # Blocks of the host-memory offload tier (vLLM's CPU offloading connector); 0: none. Needs prefix caching.
    offload_blocks: int = 0
    # False models a runtime that cannot preempt: a running sequence that cannot grow is an out-of-memory
    # failure of the whole step's batch instead of a recompute preemption.
    preemption: bool = True

    def validate(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "num_blocks", "block_size", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.offload_blocks < 0:
            raise ValueError(f"offload_blocks must not be negative, got {self.offload_blocks}")
        if self.offload_blocks and not self.enable_prefix_caching:
            raise ValueError("an offload tier (--kv-offload-blocks) keeps blocks by prefix hash: "
                             "add --enable-prefix-caching")
        SchedulingPolicy(self.scheduling_policy)


class Runner(str, enum.Enum):
    """What a replica serves, after vLLM's `--runner`: a generation server has no /v1/embeddings and a pooling
    server no generation (both answer FastAPI's 404). `both` is the simulator's own: one replica for all."""

    GENERATE = "generate"
    POOLING = "pooling"
    BOTH = "both"

    @property
    def generates(self) -> bool:
        return self is not Runner.POOLING

    @property
    def pools(self) -> bool:
        return self is not Runner.GENERATE

    def serves(self, endpoint: InferenceEndpoint) -> bool:
        return self.generates if endpoint.generates else self.pools


@dataclass(frozen=True)
class SimConfig:
    model: str = "sim-model"
    engine: EngineConfig = field(default_factory=EngineConfig)
    timing: TimingModel = field(default_factory=TimingModel)
    faults: FaultSettings = field(default_factory=FaultSettings)
    # The cap of a request that sets none (chat: neither max_tokens nor max_completion_tokens); None: vLLM's,
    # i.e. chat may use the rest of the context and completions get 16.
    default_max_tokens: int | None = None
    output_length_mode: OutputLengthMode = OutputLengthMode.FIXED
    embedding_dim: int = 384
    seed: int = 0
    # Last part of each step waited by yielding instead of a timer, for sub-millisecond accuracy.
    timer_spin_ms: float = 1.5
    # When set, GET/POST /admin/faults need `Authorization: Bearer <admin_key>`.
    admin_key: str | None = None
    # vLLM's --api-key: when set, every /v1/* route needs `Authorization: Bearer <api_key>` (401 otherwise).
    api_key: str | None = None
    # vLLM's --enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens; off, it is null.
    enable_prompt_tokens_details: bool = False
    runner: Runner = Runner.BOTH
    # vLLM's VLLM_ENABLE_RESPONSES_API_STORE=1: /v1/responses answers are stored in memory (GET, cancel,
    # previous_response_id, background); off, `store` is ignored and `background` refused (model_sim/responses_api.py).
    responses_store: bool = False

    def validate(self) -> None:
        self.engine.validate()
        self.timing.validate()
        self.faults.validate()
        if self.default_max_tokens is not None and self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be at least 1, got {self.default_max_tokens}")
        if self.timer_spin_ms < 0:
            raise ValueError(f"timer_spin_ms must not be negative, got {self.timer_spin_ms}")
        if self.embedding_dim < 1:
            raise ValueError(f"embedding_dim must be at least 1, got {self.embedding_dim}")
        OutputLengthMode(self.output_length_mode)
        Runner(self.runner)
