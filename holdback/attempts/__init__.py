"""One attempt of one request row, for every caller: the async workers and the processor's sync mode.

An attempt opens in the database (`transactions.open_attempt`), goes to the gateway (plain or streamed and
resumable: `send`, `stream`, `resume`), and its answer is classed (`outcomes`) and recorded as exactly one
row move: final, retry (`retry`: backoff and budget), or left for the batch's expiry. `runner.run_attempt`
does all three on database lanes (`lanes`, with SQLite's write lock taken by `write_lock`).

This module is the public surface callers import; tests may reach into the modules themselves.
"""

from holdback.attempts.outcomes import ReplyClass, Reply, classify, is_path_failure
from holdback.attempts.retry import Jitter, RetryPolicy
from holdback.attempts.runner import BATCH_CONTEXTS, AttemptResult, InFlight, Runtime, run_attempt
from holdback.attempts.transactions import Disposition, OpenAttempt, Recorded, Skip

__all__ = [
    "BATCH_CONTEXTS",
    "AttemptResult",
    "Disposition",
    "InFlight",
    "Jitter",
    "OpenAttempt",
    "ReplyClass",
    "Recorded",
    "Reply",
    "RetryPolicy",
    "Runtime",
    "Skip",
    "classify",
    "is_path_failure",
    "run_attempt",
]
