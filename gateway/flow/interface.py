"""The interface between the proxy and flow control: `FlowControl`, and the `Outcome` of a submit.

The proxy (gateway/proxy.py) is written against this protocol only. Two classes implement it: the in-process
`FlowController` (gateway/flow/controller.py), the single writer, and in a relay of `--workers N` the
`RemoteFlowController` (gateway/relays/remote_flow.py), which asks the flow-control process. Every call the
proxy makes is here, so a change to what the proxy needs is a change to both, and to nothing else.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Callable, Protocol

from gateway.flow.request import DropReason, End

if TYPE_CHECKING:
    from gateway.settings import LoadedConfig
    from gateway.pools import PoolRouting
    from gateway.flow.ledger import KvLedger
    from gateway.flow.request import FlowRequest
    from gateway.replicas import Replica


class Outcome(enum.Enum):
    """What `submit` did with a request; QUEUED: await `req.waiter` for DISPATCHED or REJECTED."""

    DISPATCHED = "dispatched"
    QUEUED = "queued"
    REJECTED = "rejected"


class Replicas(Protocol):
    """The replica pool as the proxy sees it: who can take work, and what the proxy found out about a replica."""

    def healthy(self) -> list[Replica]: ...

    def mark_down(self, replica: Replica, reason: str) -> None: ...

    def mark_unauthorized(self, replica: Replica, path: str, status: int) -> None: ...


class FlowControl(Protocol):
    """Admission, queueing, the replica and the end of every proxied request; the proxy's only way in."""

    pool: Replicas
    # The ledger the proxy asks when a streamed response's reservation is due for a revision (None: admission off).
    ledger: KvLedger | None
    # How prompts are counted (the proxy's PromptCounter.state), for /admin/state.
    tokenizer_state: Callable[[], dict]

    @property
    def loaded(self) -> LoadedConfig:
        """The running config (keys, replica keys, the admission settings the prompt counter follows)."""

    @property
    def admission_enabled(self) -> bool:
        """KV admission is on: the proxy counts each request's prompt and output limit before `submit`."""

    def submit(self, req: FlowRequest) -> Outcome:
        """Dispatch `req` now, reject it, or queue it (then await `req.waiter`)."""

    def withdraw(self, req: FlowRequest, reason: DropReason = DropReason.CONTEXT_CANCELLED) -> None:
        """The caller left while `req` was queued (or its relay refused it with `reason`)."""

    def finish(self, req: FlowRequest, cause: End = End.END, event_at: float | None = None) -> None:
        """A dispatched request is over (`cause`, seen at `event_at`)."""

    async def reassign(self, req: FlowRequest) -> Replica | None:
        """Move a dispatched request, nothing of whose answer went out, off its failed replica; None: no other."""

    def revise(self, req: FlowRequest, output_tokens: int, done: bool = False) -> None:
        """Relayed output so far (`done`: the generation finished)."""

    def started_streaming(self, req: FlowRequest) -> None:
        """The first body chunk of the answer went out."""

    def count_mid_stream_eviction(self) -> None: ...

    def count_tokenizer_fallback(self) -> None:
        """A prompt was estimated from its characters: nothing could count it."""


class FlowPools(Protocol):
    """The model pools as the proxy sees them: which pool a request's `model` goes to, and each pool's
    `FlowControl` (gateway/pools.py in one process; the relays' mirror in gateway/relays/remote_flow.py)."""

    # Every replica, whatever its pool (the proxy reports failures here).
    replicas: Replicas
    # How prompts are counted (the proxy's PromptCounter.state), for /admin/state.
    tokenizer_state: Callable[[], dict]

    @property
    def loaded(self) -> LoadedConfig:
        """The running config as written (keys, replica keys, the prompt counter's admission settings)."""

    def routing(self) -> PoolRouting:
        """Each pool's served model names, for routing a request by its `model`."""

    def flow(self, name: str) -> FlowControl:
        """The flow control of pool `name`."""

    def flows(self) -> list[FlowControl]:
        """Every pool's flow control, the default pool's first."""

    def refuse_waiting(self, reason: DropReason) -> int:
        """Refuse every request still waiting for a decision with `reason`; how many."""
