"""A request as flow control sees it: its classification, its life-cycle status and its final outcome.

Status moves only forward: QUEUED → DISPATCHED → FINISHED, or it ends early as REJECTED, WITHDRAWN
(client left while queued) or EVICTED. The flow controller owns every transition.
"""

from __future__ import annotations

import asyncio
import enum
import math
from dataclasses import dataclass, field

from holdback.contract import DropReason  # noqa: F401  (the gateway's modules take it from here)


class Status(enum.Enum):
    NEW = "new"
    QUEUED = "queued"
    DISPATCHED = "dispatched"
    FINISHED = "finished"
    REJECTED = "rejected"
    WITHDRAWN = "withdrawn"
    EVICTED = "evicted"


@dataclass(eq=False)
class FlowRequest:
    """One proxied inference request from arrival to its outcome."""

    request_id: str
    objective: str
    priority: int
    fairness_id: str
    tenant: str
    arrived: float
    # The model pool it was routed to (gateway/pools.py), by its body's `model`.
    pool: str = "default"
    # Monotonic time after which the request may no longer wait in a queue (inf: no limit).
    expires_at: float = math.inf
    # Requested deadline (monotonic), used by earliest-deadline ordering; inf when none.
    deadline: float = math.inf
    # KV admission: exact (or estimated) prompt tokens, the output limit, the budget class, whether the
    # caller can resume it (the resumable header), and the ledger's reservation once dispatched.
    prompt_tokens: int = 0
    max_new_tokens: int = 0
    # The body field the output limit came from (None: vLLM's default applies) and the sequences generated
    # (n, or best_of when larger): each sequence holds its own KV.
    limit_param: str | None = None
    sequences: int = 1
    # prompt_tokens came from the model's tokenizer (False: estimated from characters, when counting failed).
    prompt_exact: bool = True
    traffic_class: str = "interactive"
    resumable: bool = False
    # The body asked for a stream: once it runs in an engine slot its first chunk comes within a step, so one
    # that has not answered yet is (as far as the gateway can tell) waiting in the replica's queue.
    streamed: bool = False
    streaming_started: bool = False
    reservation: object | None = None
    seq: int = 0
    # Its place in line (ordering keys start with it): its own arrival seq, or, for the retry of an evicted
    # request, the evicted attempt's place.
    place: int = 0
    # The retry of an evicted request: the replica its evicted attempt ran on, where its prompt and kept output
    # are cached (GPU prefix cache or a host-memory offload tier). The picker prefers it while it has room.
    affinity: str | None = None
    # How often this request id was evicted before (remembered with its place): victims are the least-evicted first.
    evictions: int = 0
    # Its batch will miss its window at its pace so far (the workers' `x-holdback-at-risk`); dispatched into the
    # at-risk floor (gateway/flow/floor.py), it is no eviction victim.
    at_risk: bool = False
    in_floor: bool = False
    status: Status = Status.NEW
    enqueued_at: float = 0.0
    dispatched_at: float = 0.0
    replica: object | None = None
    drop_reason: DropReason | None = None
    drop_message: str | None = None
    # KV admission: set the first time the request waits for KV room.
    kv_wait_deadline: float = math.inf
    evicted_at: float = 0.0
    # Non-sheddable and queued for a request slot at arrival (no room): its wait for a released slot is measured.
    blocked_on_arrival: bool = False
    # Its request slot was handed on when it was chosen as a victim (before its connection closed).
    slot_released: bool = False
    # Non-sheddable, seen waiting inside its replica for an engine slot, and a batch request was evicted there
    # to free one for it: it is not counted as waiting again.
    slot_freed: bool = False
    # The task proxying this request; eviction cancels it so the upstream connection closes.
    task: asyncio.Task | None = None
    waiter: asyncio.Future | None = field(default=None, repr=False)

    @property
    def sheddable(self) -> bool:
        return self.priority < 0

    @property
    def queue_wait(self) -> float:
        return self.dispatched_at - self.arrived if self.dispatched_at else 0.0
