"""One attempt of one request row, for every caller: the async workers and the processor's sync mode.

An attempt opens in the database (`transactions.open_attempt`), goes to the gateway (plain or streamed and
resumable: `send`, `stream`, `resume`), and its answer is classed (`outcomes`) and recorded as exactly one
row move: final, retry (`retry`: backoff and budget), or left for the batch's expiry. `runner.run_attempt`
does all three on database lanes (`lanes`, with SQLite's write lock taken by `write_lock`).

This module is the public surface callers import; tests may reach into the modules themselves. The runner's
names are loaded when first asked for: the runner sends (aiohttp), and a caller that only needs the retry policy
(the processor in its default async mode) should not import an HTTP client to start.
"""

from holdback.attempts.outcomes import ReplyClass, Reply, classify, is_path_failure
from holdback.attempts.retry import Jitter, RetryPolicy
from holdback.attempts.transactions import Disposition, OpenAttempt, Recorded, Skip

_RUNNER = ("BATCH_CONTEXTS", "AttemptResult", "InFlight", "Runtime", "run_attempt")


def __getattr__(name: str):  # noqa: ANN202 - PEP 562: a runner name, imported on first use
    if name not in _RUNNER:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from holdback.attempts import runner

    value = globals()[name] = getattr(runner, name)
    return value

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
