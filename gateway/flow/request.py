"""A request as flow control sees it: what was asked (`Ask`), where it runs once dispatched (`Lease`), its status.

The ask is fixed at arrival: the caller's classification, its counted prompt and output limit, what it allows
(resume, stream). A relay sends it to flow control as it is (gateway/relays/messages.py). The lease is set by
the dispatch move and names the replica, the KV reservation and the slot's flags. Status moves only forward:
NEW → QUEUED → DISPATCHED → FINISHED, or it ends early as REJECTED, WITHDRAWN (client left while queued) or
EVICTED; `gateway/flow/moves.py` is its only writer, one named move per transition.
"""

from __future__ import annotations

import asyncio
import enum
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from holdback.contract import DropReason  # noqa: F401  (the gateway's modules take it from here)

if TYPE_CHECKING:
    from gateway.flow.ledger import Reservation
    from gateway.replicas import Replica


class Cancellable(Protocol):
    """What proxies a request: its task in this process, or a relay's stand-in that cancels it there."""

    def cancel(self) -> object: ...


class Status(enum.Enum):
    NEW = "new"
    QUEUED = "queued"
    DISPATCHED = "dispatched"
    FINISHED = "finished"
    REJECTED = "rejected"
    WITHDRAWN = "withdrawn"
    EVICTED = "evicted"


class End(enum.Enum):
    """Why a dispatched request let go of its replica (the `cause` label of the KV release metric)."""

    END = "end"  # its answer was relayed to the end
    CANCEL = "cancel"  # the caller left after its answer began
    DISCONNECT = "disconnect"  # the caller (or its relay) left before
    ERROR = "error"  # the replica failed it
    EVICT = "evict"  # flow control evicted it


class Trigger(enum.Enum):
    """What made flow control evict a running request (gateway/flow/triggers.py runs one object per trigger)."""

    BLOCKED_BAND = "blocked-band"
    KV_HARD_WATERMARK = "kv-hard-watermark"
    KV_WAIT = "kv-wait"
    WAITING_IN_REPLICA = "waiting-in-replica"
    REPLICA_QUEUE = "replica-queue"


@dataclass(frozen=True, slots=True, kw_only=True)
class Ask:
    """What the caller asked, as classified and counted at arrival. Immutable: a relay sends it as it is."""

    request_id: str
    objective: str
    priority: int
    fairness_id: str
    tenant: str
    # Monotonic time of arrival (on the host that received it).
    arrived: float
    # The model pool it was routed to (gateway/pools.py), by its body's `model`.
    pool: str = "default"
    # Monotonic time after which it may no longer wait in a queue (inf: no limit); flow control may lower it.
    expires_at: float = math.inf
    # Requested deadline (monotonic), used by earliest-deadline ordering; inf when none.
    deadline: float = math.inf
    # KV admission: exact (or estimated) prompt tokens and the output limit.
    prompt_tokens: int = 0
    max_new_tokens: int = 0
    # The body field the output limit came from (None: vLLM's default applies) and the sequences generated
    # (n, or best_of when larger): each sequence holds its own KV.
    limit_param: str | None = None
    sequences: int = 1
    # prompt_tokens came from the model's tokenizer (False: estimated from characters, when counting failed).
    prompt_exact: bool = True
    # The caller can resume it (the resumable header): an eviction costs it only the refill.
    resumable: bool = False
    # The body asked for a stream: once it runs in an engine slot its first chunk comes within a step, so one
    # that has not answered yet is (as far as the gateway can tell) waiting in the replica's queue.
    streamed: bool = False
    # Its batch will miss its window at its pace so far (the workers' `x-holdback-at-risk`).
    at_risk: bool = False
    # The replica it must run on, none other: the one that stores the response it continues (a /v1/responses
    # `previous_response_id`, gateway/stored_responses.py). None: any.
    home: str | None = None
    # The prompt's leading blocks as chained hashes under its cache salt (gateway/bodies.py `prefix_blocks`), for
    # the prefix-affinity picker, cached-first dispatch and KV admission; () when none is on for it or the body
    # renders no prompt.
    prefix: tuple[int, ...] = ()
    # The share of the prompt's characters the prefix blocks cover: of prompt_tokens, that share is what a prompt
    # sharing the prefix with a running one shares with it in KV (gateway/flow/ledger.py). Added within version 3
    # of the relays' protocol.
    prefix_share: float = 0.0

    @property
    def sheddable(self) -> bool:
        return self.priority < 0


@dataclass(slots=True, eq=False)
class Lease:
    """Where a dispatched request runs: set by the dispatch move, moved by a reassignment."""

    replica: Replica
    dispatched_at: float
    # Its KV reservation in the ledger (None when admission is off).
    reservation: Reservation | None = None
    # Dispatched into the at-risk floor (gateway/flow/floor.py): it is no eviction victim.
    in_floor: bool = False
    # Its request slot was handed on when it was chosen as a victim (before its connection closed).
    slot_released: bool = False
    # Non-sheddable, seen waiting inside its replica for an engine slot, and a batch request was evicted there
    # to free one for it: it is not counted as waiting again.
    slot_freed: bool = False
    # The response's first body chunk went out: evicting it now cuts a stream.
    streaming_started: bool = False
    # Output tokens relayed so far, counted on every chunk by the relay in this process (gateway/stream_tokens.py;
    # with admission on). A relay in another process reports only at KV block boundaries: there it stays 0 and
    # the reservation's count is what is known.
    tokens_relayed: int = 0


@dataclass(eq=False)
class FlowRequest:
    """One proxied inference request from arrival to its outcome: its ask, its lease once dispatched, and
    flow control's bookkeeping."""

    ask: Ask
    status: Status = Status.NEW
    lease: Lease | None = None
    seq: int = 0
    # Its place in line (ordering keys start with it): its own arrival seq, or, for the retry of an evicted
    # request, the evicted attempt's place.
    place: int = 0
    # The retry of an evicted request: the replica its evicted attempt ran on, where its prompt and kept output
    # are cached (GPU prefix cache or a host-memory offload tier). The picker prefers it while it has room.
    affinity: str | None = None
    # How often this request id was evicted before (remembered with its place): victims are the least-evicted first.
    evictions: int = 0
    # When it may wait in a queue until: the ask's, lowered by its band's TTL or a KV wait.
    expires_at: float = math.nan
    traffic_class: str = "interactive"
    enqueued_at: float = 0.0
    drop_reason: DropReason | None = None
    drop_message: str | None = None
    # KV admission: set the first time the request waits for KV room.
    kv_wait_deadline: float = math.inf
    evicted_at: float = 0.0
    # Non-sheddable and queued for a request slot at arrival (no room): its wait for a released slot is measured.
    blocked_on_arrival: bool = False
    # Times a request behind it in its flow went first because its prefix was cached (gateway/flow/cached_first.py).
    passed_over: int = 0
    # The task proxying this request; eviction cancels it so the upstream connection closes.
    task: Cancellable | None = None
    waiter: asyncio.Future | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if math.isnan(self.expires_at):
            self.expires_at = self.ask.expires_at

    # -- the ask, read through -------------------------------------------------------------------------------
    @property
    def request_id(self) -> str:
        return self.ask.request_id

    @property
    def objective(self) -> str:
        return self.ask.objective

    @property
    def priority(self) -> int:
        return self.ask.priority

    @property
    def fairness_id(self) -> str:
        return self.ask.fairness_id

    @property
    def tenant(self) -> str:
        return self.ask.tenant

    @property
    def arrived(self) -> float:
        return self.ask.arrived

    @property
    def pool(self) -> str:
        return self.ask.pool

    @property
    def deadline(self) -> float:
        return self.ask.deadline

    @property
    def prompt_tokens(self) -> int:
        return self.ask.prompt_tokens

    @property
    def max_new_tokens(self) -> int:
        return self.ask.max_new_tokens

    @property
    def limit_param(self) -> str | None:
        return self.ask.limit_param

    @property
    def sequences(self) -> int:
        return self.ask.sequences

    @property
    def prompt_exact(self) -> bool:
        return self.ask.prompt_exact

    @property
    def prefix_tokens(self) -> int:
        """Of its prompt tokens, those its prefix blocks cover (estimated from characters)."""
        return math.floor(self.ask.prompt_tokens * self.ask.prefix_share) if self.ask.prefix else 0

    @property
    def resumable(self) -> bool:
        return self.ask.resumable

    @property
    def streamed(self) -> bool:
        return self.ask.streamed

    @property
    def at_risk(self) -> bool:
        return self.ask.at_risk

    @property
    def sheddable(self) -> bool:
        return self.ask.priority < 0

    # -- the lease, read through (None / zero / False before dispatch) ---------------------------------------
    @property
    def replica(self) -> Replica | None:
        return self.lease.replica if self.lease is not None else None

    @property
    def reservation(self) -> Reservation | None:
        return self.lease.reservation if self.lease is not None else None

    @property
    def dispatched_at(self) -> float:
        return self.lease.dispatched_at if self.lease is not None else 0.0

    @property
    def in_floor(self) -> bool:
        return self.lease is not None and self.lease.in_floor

    @property
    def slot_released(self) -> bool:
        return self.lease is not None and self.lease.slot_released

    @property
    def slot_freed(self) -> bool:
        return self.lease is not None and self.lease.slot_freed

    @property
    def streaming_started(self) -> bool:
        return self.lease is not None and self.lease.streaming_started

    def leased(self) -> Lease:
        """Its lease; only a dispatched request (or one that ended after dispatch) has one."""
        if self.lease is None:
            raise RuntimeError(f"request {self.ask.request_id} was never dispatched: it has no replica")
        return self.lease

    @property
    def queue_wait(self) -> float:
        return self.dispatched_at - self.arrived if self.lease is not None else 0.0
