"""The answer of flow control's one dispatch decision (`FlowController._place`): whether a request may run now,
and where."""

from __future__ import annotations

import enum
from typing import NamedTuple

from gateway.policies.admission import Decision
from gateway.replicas import Replica


class Verdict(enum.Enum):
    """Whether a request may run now."""

    RUN = "run"  # on the placement's replica
    REJECT = "reject"  # KV admission refused it: the placement's `kv` says why
    WAIT_KV = "wait-kv"  # no replica has KV room for it yet
    BLOCKED = "blocked"  # its band's ceiling is reached, or no replica has room


class Placement(NamedTuple):
    verdict: Verdict
    replica: Replica | None = None
    kv: Decision | None = None


BLOCKED = Placement(Verdict.BLOCKED)
WAIT_KV = Placement(Verdict.WAIT_KV)
