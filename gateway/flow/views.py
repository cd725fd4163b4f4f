"""Read-only views: what a policy (gateway/policies/) may know of flow control's state, and nothing it could change.

As llm-d's flow-control plugins see accessors rather than the framework's queues, our policies see these
protocols: a queued request, one flow's queue, a priority band, a replica and the KV ledger. Flow control's own
objects (`FlowRequest`, `FlowQueue`, `PriorityBand`, `Replica`, `KvLedger`) satisfy them as they are, so a view
costs nothing on the dispatch path; a policy only ever reads through them. This module imports nothing of ours,
so a policy importing it never imports the mutable types (no band ↔ fairness import circle).
"""

from __future__ import annotations

from typing import Mapping, Protocol


class RequestView(Protocol):
    """A queued request, as an ordering policy reads it; times are monotonic seconds."""

    @property
    def fairness_id(self) -> str: ...

    @property
    def priority(self) -> int: ...

    @property
    def arrived(self) -> float: ...

    @property
    def deadline(self) -> float: ...

    @property
    def expires_at(self) -> float: ...

    # Its place in line (an evicted request's retry keeps the evicted attempt's), and its arrival sequence.
    @property
    def place(self) -> int: ...

    @property
    def seq(self) -> int: ...


class QueueView(Protocol):
    """One flow's queue within a band: the queued requests of one fairness id, in the band's ordering."""

    @property
    def fairness_id(self) -> str: ...

    @property
    def count(self) -> int: ...

    def head(self) -> tuple[tuple, RequestView] | None:
        """(ordering key, request) of the request this flow would dispatch next; None when it is empty."""


class BandView(Protocol):
    """One priority band: its counts and its flows' queues."""

    @property
    def priority(self) -> int: ...

    @property
    def queued(self) -> int: ...

    @property
    def in_flight(self) -> int: ...

    @property
    def flows(self) -> Mapping[str, QueueView]: ...


class ReplicaView(Protocol):
    """One replica as the saturation detectors, the picker and KV admission read it (gateway/replicas.py)."""

    @property
    def url(self) -> str: ...

    @property
    def healthy(self) -> bool: ...

    # Requests the gateway has dispatched there and not yet seen finish, and how many it may (None: the
    # detector's saturation.maxConcurrency).
    @property
    def in_flight(self) -> int: ...

    @property
    def capacity(self) -> int | None: ...

    # Scraped: vllm:kv_cache_usage_perc, vllm:num_requests_waiting.
    @property
    def kv_usage(self) -> float | None: ...

    @property
    def waiting(self) -> float | None: ...

    # Dispatches since start, and their count when the last scrape began (what the scrape cannot show yet).
    @property
    def dispatches(self) -> int: ...

    @property
    def dispatches_at_scrape(self) -> int: ...

    # Its KV pool (vllm:cache_config_info) and context, None when it reports none.
    @property
    def num_gpu_blocks(self) -> int | None: ...

    @property
    def kv_cache_size_tokens(self) -> int | None: ...

    @property
    def kv_block_size(self) -> int | None: ...

    @property
    def max_model_len(self) -> int | None: ...

    @property
    def prefix_caching(self) -> bool | None: ...

    def metrics_fresh(self, now: float, staleness: float) -> bool: ...

    # Monotonic time its last good scrape began (0: never): what it reported is at least as recent.
    @property
    def metrics_from(self) -> float: ...


class TotalsView(Protocol):
    """The ledger's totals for one fairness id or one traffic class."""

    @property
    def kv_tokens(self) -> int: ...

    @property
    def reserved_tokens(self) -> int: ...

    @property
    def active(self) -> int: ...


class ReservationView(Protocol):
    """One KV reservation, as admission reads it (flow/ledger.py `Reservation`)."""

    @property
    def replica(self) -> str: ...

    @property
    def block_size(self) -> int: ...

    @property
    def kv_tokens(self) -> int: ...

    @property
    def prefix(self) -> tuple[int, ...]: ...


class LedgerView(Protocol):
    """The KV ledger as admission reads it: sizes, and what is reserved per replica, tenant and class."""

    @property
    def batch_kv_tokens(self) -> Mapping[str, int]: ...

    def kv_tokens_for(self, prompt_tokens: int, max_new_tokens: int, block_size: int | None = None) -> int: ...

    def kv_tokens_on(self, replica: str) -> int: ...

    def shared_on(self, replica: str, block_size: int, prefix: tuple[int, ...], prefix_tokens: int,
                  traffic_class: str | None = None) -> int: ...

    def unshared(self, res: ReservationView, tokens: int) -> int: ...

    def tenant(self, fairness_id: str) -> TotalsView: ...

    def traffic_class(self, name: str) -> TotalsView: ...

    def token_seconds(self, *, fairness_id: str | None = None, traffic_class: str | None = None,
                      now: float, accrued: bool = False) -> float: ...
