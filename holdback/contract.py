"""Every name two holdback processes must agree on, spelled once: HTTP headers, the inference endpoints and
their traits, objective names, drop reasons, Redis queue/channel/key names (all under `HOLDBACK_REDIS_NAMESPACE`)
and the RQ job function path.

Pure constants and tiny pure functions with no imports of ours, so the gateway and the simulator can use it
without pulling in the database or Redis clients.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

# --- HTTP headers: worker → gateway → replica --------------------------------------------------------------

REQUEST_ID_HEADER = "x-request-id"  # the request row id, stable across attempts
OBJECTIVE_HEADER = "x-llm-d-inference-objective"
FAIRNESS_HEADER = "x-llm-d-inference-fairness-id"
# The Gateway API Inference Extension's spellings: its endpoint picker and older llm-d read only these, so the
# workers send both spellings and the gateway accepts either.
OBJECTIVE_HEADER_ALIASES = ("x-gateway-inference-objective",)
FAIRNESS_HEADER_ALIASES = ("x-gateway-inference-fairness-id",)
TTL_HEADER = "x-holdback-ttl"  # seconds a request may wait in the gateway queue
# llm-d defines no TTL header; this was our earlier name for it. Accepted for one release, then removed.
TTL_HEADER_ALIASES = ("x-llm-d-inference-ttl",)
DEADLINE_HEADER = "x-holdback-deadline"  # the batch's expires_at, unix seconds
RESUMABLE_HEADER = "x-holdback-resumable"  # "1": the caller resumes from partial output if evicted
# "1": the request's batch will not finish inside its window at its pace so far (holdback.risk); honoured by the
# gateway only from a trusted relay's key (the workers'), for sheddable work: it may use the at-risk floor.
AT_RISK_HEADER = "x-holdback-at-risk"

# --- HTTP headers: gateway → worker ------------------------------------------------------------------------

DROP_REASON_HEADER = "x-llm-d-request-dropped-reason"
REPLICA_HEADER = "x-holdback-replica"  # which replica served the answer (the gateway sets it)
SIM_REPLICA_HEADER = "x-sim-replica"  # the simulator's own name for itself, when called directly
QUEUE_MS_HEADER = "x-holdback-queue-ms"  # arrival → dispatch inside the gateway, when the request waited
# Where an answer names its replica, in order of trust: ours, the simulator's, then llm-d's.
REPLICA_HEADERS = (REPLICA_HEADER, SIM_REPLICA_HEADER, "x-gateway-destination-endpoint")

# Request body fields the gateway owns: the order in the replica's queue (vLLM's priority scheduling) and the
# prefix-cache scope. The gateway removes a caller's priority and sets the salt; a batch line naming either is
# refused at validation.
PRIORITY_FIELD = "priority"
CACHE_SALT_FIELD = "cache_salt"
GATEWAY_OWNED_FIELDS = (PRIORITY_FIELD, CACHE_SALT_FIELD)

# --- inference endpoints: what each path is to every process that handles it --------------------------------


@dataclass(frozen=True)
class InferenceEndpoint:
    """One OpenAI-compatible inference path, with the traits the processes that handle it act on."""

    path: str
    # It generates output tokens: vLLM serves it with `--runner generate` (else with `--runner pooling`, as
    # embeddings: no output, no output limit).
    generates: bool
    # It reaches vLLM's prefix cache, so it takes a `cache_salt`: the gateway sets the caller's scope on it.
    salted: bool
    # A cut stream of it can continue from its partial output (holdback.attempts.resume).
    resumable: bool
    # Its body is not a chat, but vLLM renders it to one (Responses: instructions and input), so its prompt is
    # counted as that chat.
    rendered_as_chat: bool
    # The body fields that cap its output, in vLLM's order of precedence (the first one set counts).
    limit_params: tuple[str, ...]


CHAT_ENDPOINT = InferenceEndpoint("/v1/chat/completions", generates=True, salted=True, resumable=True,
                                  rendered_as_chat=False, limit_params=("max_completion_tokens", "max_tokens"))
COMPLETIONS_ENDPOINT = InferenceEndpoint("/v1/completions", generates=True, salted=True, resumable=True,
                                         rendered_as_chat=False, limit_params=("max_tokens",))
EMBEDDINGS_ENDPOINT = InferenceEndpoint("/v1/embeddings", generates=False, salted=True, resumable=False,
                                        rendered_as_chat=False, limit_params=())
RESPONSES_ENDPOINT = InferenceEndpoint("/v1/responses", generates=True, salted=True, resumable=False,
                                       rendered_as_chat=True, limit_params=("max_output_tokens",))
# Every inference path, each served by the gateway and accepted as a batch's endpoint, in this order.
INFERENCE_ENDPOINTS = (CHAT_ENDPOINT, COMPLETIONS_ENDPOINT, EMBEDDINGS_ENDPOINT, RESPONSES_ENDPOINT)
INFERENCE_PATHS = tuple(e.path for e in INFERENCE_ENDPOINTS)
_BY_PATH = {e.path: e for e in INFERENCE_ENDPOINTS}


def inference_endpoint(path: str) -> InferenceEndpoint | None:
    """The endpoint at `path`, or None when it is not an inference path."""
    return _BY_PATH.get(path)


# --- objectives (the gateway maps each to a priority) ------------------------------------------------------

REALTIME_OBJECTIVE = "realtime"
STANDARD_OBJECTIVE = "standard"
BATCH_OBJECTIVE = "batch"


# --- drop reasons ------------------------------------------------------------------------------------------


class DropReason(str, enum.Enum):
    """Values of the drop-reason header. llm-d's own reasons plus ours for KV admission and quota."""

    EVICTED = "evicted"
    SATURATED = "rejected-saturated"
    TTL_EXPIRED = "rejected-ttl-expired"
    NO_ENDPOINTS = "rejected-no-endpoints"
    CONTEXT_CANCELLED = "rejected-context-cancelled"
    KV_CAPACITY = "rejected-kv-capacity"
    # Needs more KV than a replica may ever give it (its pool times the cap of its class): retrying cannot help.
    KV_NEVER_FITS = "rejected-kv-capacity-never-fits"
    QUOTA = "rejected-quota"
    CONTEXT_LENGTH = "rejected-context-length"
    SHUTTING_DOWN = "rejected-shutting-down"  # still queued when its gateway process's drain deadline came


def _in_family(reason: object, family: DropReason) -> bool:
    # A family is the reason itself or any refinement of it: llm-d may send `evicted-<why>`. A reason can come
    # from an error event's `code`, which vLLM sends as the HTTP status (an int): never a drop reason.
    if not isinstance(reason, str) or not reason:
        return False
    reason = reason.strip().lower()
    return reason == family.value or reason.startswith(family.value + "-")


def is_eviction(reason: object) -> bool:
    """True for `evicted` and every `evicted-*` reason."""
    return _in_family(reason, DropReason.EVICTED)


def is_no_endpoints(reason: object) -> bool:
    """True for `rejected-no-endpoints` (and refinements): no healthy replica, the path is down."""
    return _in_family(reason, DropReason.NO_ENDPOINTS)


# --- error codes of rows closed before they ran to an answer (the processor writes them in the error file,
# `holdback submit` counts them apart from failed requests) --------------------------------------------------

CANCELLED_CODE = "batch_cancelled"  # a cancel closed the row
EXPIRED_CODE = "batch_expired"  # the completion window ended first


# --- Redis names: every key lives under the namespace ------------------------------------------------------

JOB_FUNCTION = "async_processor.job.run_request"  # args (row_id, batch_id); job id = row id


def requests_queue_name(namespace: str) -> str:
    """The RQ queue holding one job per request row."""
    return f"{namespace}-requests"


def queue_name_prefix(namespace: str) -> str:
    """Every RQ queue of this namespace starts with this."""
    return f"{namespace}-"


def cancel_channel(namespace: str) -> str:
    """Pub/sub channel: the processor publishes a batch id, workers abort its in-flight requests."""
    return f"{namespace}:cancel"


def work_channel(namespace: str) -> str:
    """Pub/sub channel: the processor pushed jobs on the request queue; idle workers claim at once instead of at
    their next idle poll (up to a quarter of a second later)."""
    return f"{namespace}:work"


def wake_channel(namespace: str) -> str:
    """Pub/sub channel: a batch to act on now (the API: created or cancelled; a worker: its last row final). The
    processors take their next round at once instead of at their next poll."""
    return f"{namespace}:processor:wake"


def circuit_key(namespace: str) -> str:
    """Why the workers' gateway circuit is open; absent while it is closed."""
    return f"{namespace}:circuit:gateway"


def at_risk_key(namespace: str) -> str:
    """Sorted set: the batches at risk of missing their window, each scored with the time its mark lapses (the
    processor that owns the batch renews it every round while the batch stays at risk)."""
    return f"{namespace}:batches:at-risk"


def pause_key(namespace: str, queue_name: str) -> str:
    """Present while dispatch from `queue_name` is paused."""
    return f"{namespace}:paused:{queue_name}"


def dashboard_samples_key(namespace: str) -> str:
    return f"{namespace}:dash:samples"


def dashboard_slot_key(namespace: str, slot: int) -> str:
    return f"{namespace}:dash:slot:{slot}"


def worker_name(namespace: str, host: str, pid: int) -> str:
    """Default name of a worker process in RQ's registry."""
    return f"{namespace}.{host}.{pid}"
