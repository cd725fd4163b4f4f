"""Every message between a relay and flow control, and the codec that puts them on the wire.

A message's body is one JSON document: `[VERSION, {"kind": ..., ...}]`; on the wire it is framed by a 4-byte
big-endian length and sealed by a MAC (gateway/relays/handshake.py). Each message is a
frozen dataclass whose `kind` names it; decoding validates the whole frame against the message's fields and types
(pydantic: a value of the wrong type, an unknown kind, a missing field or a NaN time), so a frame from a peer that is
buggy, older or hostile is refused with `Malformed` and never becomes a half-read object. Non-finite floats (a
request with no deadline) travel as JSON's `Infinity`. Nothing here runs code named by the peer (no pickle).

Either way: ChannelHeartbeat (so that a silent peer is noticed), Call (a question with an id) and Answer (its
reply).
Relay → flow control: Hello, Holding, Submit, Withdraw, Revise, Started, Finished, MidStream, Fallbacks, MarkDown,
MarkUnauthorized, TokenizerReport, Draining. Flow control → relay: Configure, PoolView, Dispatched, Rejected, Evict; each of Configure and the decisions carries
`token`, the fencing token of the leader that sent it (0 without a lease), and a relay refuses one older than the
newest it has seen.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from typing import Annotated, Literal, Union

from pydantic import AfterValidator, ConfigDict, Field, JsonValue, TypeAdapter, ValidationError

from gateway.flow.request import Ask, DropReason
from gateway.settings import LoadedConfig

# The protocol's version: a frame of another version is refused (across hosts, the version says which end to
# upgrade). 2: the handshake and a MAC on every frame; Hello says where the relay runs; ChannelHeartbeat. 3: every
# decision carries the leader's fencing token; Holding re-registers what a relay holds with a new leader.
VERSION = 3
# No message is near this (the largest are a config and a /metrics exposition): a longer frame is refused.
MAX_FRAME = 16 * 1024 * 1024
LENGTH = struct.Struct(">I")


class Malformed(ValueError):
    """A frame that is not a message of this protocol: the error says what was wrong with it."""


def _finite_or_infinite(value: float) -> float:
    if math.isnan(value):
        raise ValueError("NaN is not a time or a count")
    return value


def _ask_without_nan(ask: Ask) -> Ask:
    for name in ("arrived", "expires_at", "deadline", "prefix_share"):
        _finite_or_infinite(getattr(ask, name))
    return ask


Number = Annotated[float, AfterValidator(_finite_or_infinite)]
_FROZEN = dict(frozen=True, slots=True, kw_only=True)

# -- relay → flow control ------------------------------------------------------------------------------------


@dataclass(**_FROZEN)
class Hello:
    """A relay's first message: who it is (`index`: its slot under `--workers N`; None for a relay run alone),
    on which host, and the client-facing address it serves."""
    kind: Literal["hello"] = "hello"
    pid: int
    index: int | None
    host: str
    listen: str


@dataclass(**_FROZEN)
class HeldRequest:
    """A request a relay holds, as it reports it to a new leader: waiting for a decision (`url` None) or running
    on replica `url` with `output_tokens` relayed so far (its reservation's `traffic_class`, if it has one)."""
    rid: int
    ask: Annotated[Ask, AfterValidator(_ask_without_nan)]
    url: str | None = None
    traffic_class: str | None = None
    output_tokens: int = 0
    streaming: bool = False


@dataclass(**_FROZEN)
class Holding:
    """Sent right after Hello: everything the relay holds, for a leader that did not decide it to count."""
    kind: Literal["holding"] = "holding"
    requests: tuple[HeldRequest, ...]


@dataclass(**_FROZEN)
class Submit:
    """A request to decide: the relay's id for it (`rid`) and what it asks."""
    kind: Literal["submit"] = "submit"
    rid: int
    ask: Annotated[Ask, AfterValidator(_ask_without_nan)]


@dataclass(**_FROZEN)
class Withdraw:
    """The caller left before the relay learned the decision, or the relay refused it (`reason`: at its drain
    deadline, `rejected-shutting-down`)."""
    kind: Literal["withdraw"] = "withdraw"
    rid: int
    at: Number
    reason: str = DropReason.CONTEXT_CANCELLED.value


@dataclass(**_FROZEN)
class Revise:
    """Output relayed so far (`done`: the generation ended)."""
    kind: Literal["revise"] = "revise"
    rid: int
    output_tokens: int
    done: bool


@dataclass(**_FROZEN)
class Started:
    """The response's first body chunk went out."""
    kind: Literal["started"] = "started"
    rid: int


@dataclass(**_FROZEN)
class Finished:
    """The dispatched request let go of its replica: `cause` (gateway/flow/request.py `End`) seen at
    `event_at`; an evicted one's upstream closed at `closed_at`."""
    kind: Literal["finish"] = "finish"
    rid: int
    cause: Literal["end", "cancel", "disconnect", "error", "evict"]
    event_at: Number | None = None
    closed_at: Number | None = None


@dataclass(**_FROZEN)
class MidStream:
    """An eviction cut a stream that had begun (counted by the pool's flow control)."""
    kind: Literal["mid_stream"] = "mid_stream"
    pool: str


@dataclass(**_FROZEN)
class Fallbacks:
    """Prompts counted from characters because no tokenizer answered."""
    kind: Literal["fallbacks"] = "fallbacks"
    count: int


@dataclass(**_FROZEN)
class MarkDown:
    """A replica refused a connection."""
    kind: Literal["mark_down"] = "mark_down"
    url: str
    reason: str


@dataclass(**_FROZEN)
class MarkUnauthorized:
    """A replica refused the gateway's key."""
    kind: Literal["mark_unauthorized"] = "mark_unauthorized"
    url: str
    path: str
    status: int


@dataclass(**_FROZEN)
class TokenizerReport:
    """What the relay's prompt counter knows (for /admin/state)."""
    kind: Literal["tokenizer"] = "tokenizer"
    state: dict[str, JsonValue]

# -- flow control → relay ------------------------------------------------------------------------------------


@dataclass(**_FROZEN)
class Draining:
    """The relay was asked to stop: it is not ready, stops accepting after its grace, and cuts what still runs at
    `deadline` (Unix time). Added within version 3: a flow control of before it logs and skips it."""
    kind: Literal["draining"] = "draining"
    deadline: Number


@dataclass(**_FROZEN)
class LedgerSettings:
    block_tokens: int
    safety_factor: Number
    window: Number


@dataclass(**_FROZEN)
class PoolConfig:
    name: str
    loaded: LoadedConfig
    ledger: LedgerSettings


@dataclass(**_FROZEN)
class Configure:
    """The gateway's config and each pool's (its own config and its ledger's settings)."""
    kind: Literal["config"] = "config"
    token: int
    loaded: LoadedConfig
    pools: tuple[PoolConfig, ...]


@dataclass(**_FROZEN)
class ReplicaFacts:
    """What a relay needs of a replica: whether it takes work, and what it serves (for prompt counting)."""
    url: str
    healthy: bool
    refused: str | None
    model: str | None
    model_root: str | None
    runtime_version: str | None
    max_model_len: int | None
    pool: str | None
    listed: tuple[tuple[str, str | None], ...]


@dataclass(**_FROZEN)
class PoolView:
    """The replicas, and the pools' routing description (gateway/pools.py `describe`)."""
    kind: Literal["pool"] = "pool"
    replicas: tuple[ReplicaFacts, ...]
    routing: tuple[dict[str, JsonValue], ...]


@dataclass(**_FROZEN)
class Dispatched:
    """Flow control dispatched request `rid` to `url`; `traffic_class` is set when it holds a KV reservation
    (the relay keeps a mirror of it)."""
    kind: Literal["dispatched"] = "dispatched"
    rid: int
    token: int
    url: str
    dispatched_at: Number
    enqueued_at: Number
    traffic_class: str | None = None


@dataclass(**_FROZEN)
class Rejected:
    kind: Literal["rejected"] = "rejected"
    rid: int
    token: int
    reason: str
    message: str | None = None


@dataclass(**_FROZEN)
class Evict:
    """Flow control evicted request `rid`: the relay cancels its proxy task."""
    kind: Literal["evict"] = "evict"
    rid: int
    token: int

# -- both ways -----------------------------------------------------------------------------------------------


@dataclass(**_FROZEN)
class ChannelHeartbeat:
    """Sent every `every` seconds by each end; a peer silent for three of them is closed (channel.py)."""
    kind: Literal["heartbeat"] = "heartbeat"
    every: Annotated[float, Field(gt=0, allow_inf_nan=False)]

# -- calls, both ways ----------------------------------------------------------------------------------------

CallName = Literal["state", "metrics", "rollback", "reassign", "collect"]



@dataclass(**_FROZEN)
class Call:
    """A question that wants an answer: `state`, `metrics`, `rollback` (args: [lower watermark or null]),
    `reassign` (args: [rid]) to flow control; `collect` (the relay's metric families) to a relay."""
    kind: Literal["call"] = "call"
    call_id: int
    name: CallName
    args: tuple[JsonValue, ...] = field(default=())


@dataclass(**_FROZEN)
class Answer:
    kind: Literal["reply"] = "reply"
    call_id: int
    value: JsonValue = None


Message = Union[Hello, Holding, Submit, Withdraw, Revise, Started, Finished, MidStream, Fallbacks, MarkDown,
                MarkUnauthorized, TokenizerReport, Draining, Configure, PoolView, Dispatched, Rejected, Evict, ChannelHeartbeat,
                Call, Answer]


# A frame's JSON: [the protocol version, the message].
_FRAMES = TypeAdapter(tuple[int, Annotated[Message, Field(discriminator="kind")]],
                      config=ConfigDict(ser_json_inf_nan="constants"))


def dump(message: Message) -> bytes:
    """A message's body: `[VERSION, message]` as JSON."""
    data = _FRAMES.dump_json((VERSION, message), by_alias=True)
    if len(data) > MAX_FRAME:
        raise Malformed(f"a {message.kind} message of {len(data)} bytes is over the {MAX_FRAME}-byte frame limit")
    return data


def encode(message: Message) -> bytes:
    """An unsealed frame: its length, then the message as JSON."""
    data = dump(message)
    return LENGTH.pack(len(data)) + data


def frame_length(header: bytes, limit: int = MAX_FRAME) -> int:
    """The length a frame's 4-byte header announces; `Malformed` when it is over `limit`."""
    (size,) = LENGTH.unpack(header)
    if size > limit:
        raise Malformed(f"a frame of {size} bytes announced: over the {limit}-byte limit")
    return size


def decode(data: bytes) -> Message:
    """The message in one frame's body; `Malformed` when it is not one this version knows."""
    try:
        version, message = _FRAMES.validate_json(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = first["loc"][1:] if first["loc"][:1] == (1,) else first["loc"]  # (1, kind, field): the message's
        where = ".".join(str(p) for p in loc) or "(frame)"
        raise Malformed(f"{where}: {first['msg']}") from None
    except ValueError as exc:
        raise Malformed(str(exc)) from None
    if version != VERSION:
        raise Malformed(f"protocol version {version}; this gateway speaks {VERSION}: run one version of holdback "
                        f"on both ends")
    return message
