"""What holdback's workers rely on when llm-d's gateway schedules (way (b) of docs/llm-d.md), pinned to the llm-d
source each value was read from, and checked against holdback's own constants and the workers' own attempt code.

Read (not copied) from llm-d/llm-d-router at ebab687 (2026-08-22: the current llm-d, renamed from the inference
scheduler) and, for the spellings older releases read, llm-d/llm-d-inference-scheduler at 520af47 (2026-05-17).
Line numbers are those commits'. When llm-d changes a value, change its pin and source here together, then holdback.

The answers of llm-d are played by a stand-in that answers as llm-d's gateway does (status, drop-reason header,
its plain-text body, no Retry-After); the workers' attempt runner (holdback.attempts, what every worker process
runs for each request) sends to it and records on a real database, so what is checked is what a worker does.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
import yaml
from aiohttp import web
from aiohttp.test_utils import TestServer

from holdback import contract
from holdback.attempts import InFlight, RetryPolicy, Runtime, run_attempt
from holdback.db import make_engine, make_sessionmaker, transaction
from holdback.models import Attempt, Batch, RequestRow, Tenant
from holdback.schema import upgrade
from tests.deploy.deploy_files import K8S

ROUTER = "llm-d/llm-d-router@ebab687"
SCHEDULER = "llm-d/llm-d-inference-scheduler@520af47"
LLM_D = K8S / "overlays" / "llm-d"


@dataclass(frozen=True)
class Pin:
    """One value llm-d defines, and where: `repository@commit path Lline`."""

    value: object
    source: str


# --- request headers llm-d reads --------------------------------------------------------------------------
OBJECTIVE_HEADER = Pin("x-llm-d-inference-objective", f"{ROUTER} pkg/epp/metadata/consts.go L42 ObjectiveKey")
OLD_OBJECTIVE_HEADER = Pin("x-gateway-inference-objective",
                           f"{ROUTER} pkg/epp/metadata/consts.go L44 OldObjectiveKey; "
                           f"{SCHEDULER} pkg/epp/metadata/consts.go L34 ObjectiveKey (the only one it reads)")
FAIRNESS_HEADER = Pin("x-llm-d-inference-fairness-id", f"{ROUTER} pkg/epp/metadata/consts.go L38 FlowFairnessIDKey")
OLD_FAIRNESS_HEADER = Pin("x-gateway-inference-fairness-id",
                          f"{ROUTER} pkg/epp/metadata/consts.go L40 OldFlowFairnessIDKey; "
                          f"{SCHEDULER} pkg/epp/metadata/consts.go L32 FlowFairnessIDKey")
REQUEST_ID_HEADER = Pin("x-request-id", f"{ROUTER} pkg/common/request/constants.go L20 RequestIDHeaderKey; the "
                        "per-request state key, pkg/epp/handlers/server.go L442-448")

# --- what llm-d answers with ------------------------------------------------------------------------------
DROP_REASON_HEADER = Pin("x-llm-d-request-dropped-reason",
                         f"{ROUTER} pkg/common/error/error.go L30 RequestDroppedReasonHeaderKey")
TOO_MANY_REQUESTS = Pin(429, f"{ROUTER} pkg/common/error/error.go L102-103 (ResourceExhausted)")
UNAVAILABLE = Pin(503, f"{ROUTER} pkg/common/error/error.go L106-107 (ServiceUnavailable)")
SATURATED = Pin("rejected-saturated", f"{ROUTER} pkg/common/error/error.go L37")
NO_ENDPOINTS = Pin("rejected-no-endpoints", f"{ROUTER} pkg/common/error/error.go L38")
TTL_EXPIRED = Pin("rejected-ttl-expired", f"{ROUTER} pkg/common/error/error.go L39")
CONTEXT_CANCELLED = Pin("rejected-context-cancelled", f"{ROUTER} pkg/common/error/error.go L40")
SHUTTING_DOWN = Pin("rejected-shutting-down", f"{ROUTER} pkg/common/error/error.go L41")
EVICTED = Pin("evicted", f"{ROUTER} pkg/common/error/error.go L46; set by "
              "pkg/epp/flowcontrol/eviction/evictor.go L82")
EVICTED_QUEUE_PRESSURE = Pin("evicted-queue-pressure", f"{ROUTER} pkg/common/error/error.go L47 (not sent yet)")
EVICTED_PRIORITY = Pin("evicted-priority", f"{ROUTER} pkg/common/error/error.go L48 (not sent yet)")
# llm-d's error answers carry only the drop reason: BuildErrResponse sets the error's own headers
# (pkg/common/error/error.go L122-135), each outcome gives only that one (pkg/epp/requestcontrol/admission.go
# L255-274), and the eviction answer sets only it too (pkg/epp/handlers/server.go L691-701).
NO_RETRY_AFTER = Pin(None, f"{ROUTER} pkg/common/error/error.go L122-135; pkg/epp/handlers/server.go L691-701")


@dataclass(frozen=True)
class Answer:
    """One answer llm-d's gateway gives a request, with the llm-d code that gives it."""

    status: Pin
    reason: Pin | None  # the drop-reason header's value; None: no header
    body: str  # llm-d's ImmediateResponse body: the error's text, not JSON
    source: str


ANSWERS = {
    "saturated": Answer(TOO_MANY_REQUESTS, SATURATED, "inference error: ResourceExhausted - queue full",
                        f"{ROUTER} pkg/epp/requestcontrol/admission.go L255-256 (RejectedCapacity)"),
    "ttl-expired": Answer(TOO_MANY_REQUESTS, TTL_EXPIRED, "inference error: ResourceExhausted - timed out in queue",
                          f"{ROUTER} pkg/epp/requestcontrol/admission.go L264-268 (EvictedTTL, pool not empty)"),
    "no-endpoints": Answer(UNAVAILABLE, NO_ENDPOINTS, "inference error: ServiceUnavailable - no endpoints",
                           f"{ROUTER} pkg/epp/requestcontrol/admission.go L257-266"),
    "context-cancelled": Answer(UNAVAILABLE, CONTEXT_CANCELLED, "inference error: ServiceUnavailable - client left",
                                f"{ROUTER} pkg/epp/requestcontrol/admission.go L269-270"),
    "shutting-down": Answer(UNAVAILABLE, SHUTTING_DOWN, "inference error: ServiceUnavailable - shutting down",
                            f"{ROUTER} pkg/epp/requestcontrol/admission.go L273-274"),
    "evicted": Answer(TOO_MANY_REQUESTS, EVICTED, "request evicted by flow control",
                      f"{ROUTER} pkg/epp/handlers/server.go L682-701 (before the response headers)"),
    "evicted-queue-pressure": Answer(TOO_MANY_REQUESTS, EVICTED_QUEUE_PRESSURE, "request evicted by flow control",
                                     EVICTED_QUEUE_PRESSURE.source),
    "evicted-priority": Answer(TOO_MANY_REQUESTS, EVICTED_PRIORITY, "request evicted by flow control",
                               EVICTED_PRIORITY.source),
    # Flow control off (llm-d's default): a sheddable request while the pool is saturated, with no drop reason.
    "legacy-shed": Answer(TOO_MANY_REQUESTS, None, "inference error: ResourceExhausted - system saturated",
                          f"{ROUTER} pkg/epp/requestcontrol/admission.go L74-81"),
}

# --- the objects llm-d reads ------------------------------------------------------------------------------
OBJECTIVE_API = Pin("llm-d.ai/v1alpha2", f"{ROUTER} apix/v1alpha2/zz_generated.register.go L15, L18")
LEGACY_OBJECTIVE_API = Pin("inference.networking.x-k8s.io/v1alpha2",
                           f"{SCHEDULER} apix/v1alpha2/zz_generated.register.go L15, L18")
POOL_GROUP = Pin("inference.networking.k8s.io", f"{ROUTER} apix/v1alpha2/shared_types.go L137 (poolRef default)")
POOL_KIND = Pin("InferencePool", f"{ROUTER} apix/v1alpha2/shared_types.go L143 (poolRef default)")
# Sheddable (held back and evictable) is priority < 0.
SHEDDABLE_BELOW = Pin(0, f"{ROUTER} pkg/epp/util/request/sheddable.go L20-21")
EPP_CONFIG_API = Pin("llm-d.ai/v1alpha1", f"{ROUTER} apix/config/v1alpha1/zz_generated.register.go L15, L18")
FLOW_CONTROL_GATE = Pin("flowControl", f"{ROUTER} pkg/epp/flowcontrol/config.go L27")
PLUGINS = "pkg/epp/framework/plugins/flowcontrol"
CONCURRENCY_DETECTOR = Pin("concurrency-detector", f"{ROUTER} {PLUGINS}/saturationdetector/concurrency/detector.go L40")
MAX_CONCURRENCY = Pin("maxConcurrency", f"{ROUTER} {PLUGINS}/saturationdetector/concurrency/config.go L41")
HOLDBACK_POLICY = Pin("priority-holdback-policy",
                      f"{ROUTER} {PLUGINS}/usagelimits/priorityholdback/priority_holdback.go L36")
MIN_CEILING = Pin("minCeiling", f"{ROUTER} {PLUGINS}/usagelimits/priorityholdback/config.go L65")
FLOW_CONTROL_KEYS = Pin({"saturationDetector", "usageLimitPolicyPluginRef", "enableEviction"},
                        f"{ROUTER} apix/config/v1alpha1/endpointpickerconfig_types.go L457, L462, L470")


def _pinned(pin: Pin, actual: object) -> None:
    assert actual == pin.value, f"llm-d defines {pin.value!r} ({pin.source}); holdback has {actual!r}"


# --- the names holdback spells once -----------------------------------------------------------------------


def test_holdbacks_header_names_are_llm_ds():
    _pinned(OBJECTIVE_HEADER, contract.OBJECTIVE_HEADER)
    _pinned(FAIRNESS_HEADER, contract.FAIRNESS_HEADER)
    _pinned(REQUEST_ID_HEADER, contract.REQUEST_ID_HEADER)
    _pinned(DROP_REASON_HEADER, contract.DROP_REASON_HEADER)
    assert OLD_OBJECTIVE_HEADER.value in contract.OBJECTIVE_HEADER_ALIASES, OLD_OBJECTIVE_HEADER.source
    assert OLD_FAIRNESS_HEADER.value in contract.FAIRNESS_HEADER_ALIASES, OLD_FAIRNESS_HEADER.source


def test_every_drop_reason_llm_d_sends_with_a_429_is_one_holdback_knows():
    """A 429's reason decides evicted (resume at once) or rejected (back off): holdback must know each by name,
    or, for the `evicted-*` refinements, by family."""
    ours = {r.value for r in contract.DropReason}
    for name, answer in ANSWERS.items():
        if answer.status.value != 429 or answer.reason is None:
            continue
        reason = answer.reason.value
        assert reason in ours or contract.is_eviction(reason), f"{name}: {reason!r} ({answer.reason.source})"
    # The reasons holdback's own gateway shares with llm-d are spelled as llm-d spells them.
    for pin in (SATURATED, NO_ENDPOINTS, TTL_EXPIRED, CONTEXT_CANCELLED, EVICTED):
        assert pin.value in ours, pin.source
    assert contract.is_eviction(EVICTED.value) and not contract.is_eviction(SATURATED.value)
    assert contract.is_no_endpoints(NO_ENDPOINTS.value)


def test_the_objectives_make_batch_sheddable_for_llm_d_and_nothing_else():
    docs = [d for d in yaml.safe_load_all((LLM_D / "inference-objectives.yaml").read_text()) if d]
    assert {d["apiVersion"] for d in docs} == {OBJECTIVE_API.value}, OBJECTIVE_API.source
    assert {(d["spec"]["poolRef"]["group"], d["spec"]["poolRef"]["kind"]) for d in docs} == {
        (POOL_GROUP.value, POOL_KIND.value)}, (POOL_GROUP.source, POOL_KIND.source)
    priorities = {d["metadata"]["name"]: d["spec"]["priority"] for d in docs}
    # The workers' objective is sheddable: llm-d holds it back and may evict it.
    assert priorities[contract.BATCH_OBJECTIVE] < SHEDDABLE_BELOW.value, SHEDDABLE_BELOW.source
    # Realtime and standard are not: llm-d never evicts them.
    for name in (contract.REALTIME_OBJECTIVE, contract.STANDARD_OBJECTIVE):
        assert priorities[name] >= SHEDDABLE_BELOW.value, (name, SHEDDABLE_BELOW.source)
    assert priorities[contract.REALTIME_OBJECTIVE] > priorities[contract.STANDARD_OBJECTIVE]
    legacy = [d for d in yaml.safe_load_all((LLM_D / "inference-objectives-legacy.yaml").read_text()) if d]
    assert {d["apiVersion"] for d in legacy} == {LEGACY_OBJECTIVE_API.value}, LEGACY_OBJECTIVE_API.source
    assert {d["metadata"]["name"]: d["spec"]["priority"] for d in legacy} == priorities


def test_the_endpoint_picker_config_names_what_llm_d_defines():
    config = yaml.safe_load((LLM_D / "epp-config.yaml").read_text())
    assert (config["apiVersion"], config["kind"]) == (EPP_CONFIG_API.value, "EndpointPickerConfig"), \
        EPP_CONFIG_API.source
    assert FLOW_CONTROL_GATE.value in config["featureGates"], FLOW_CONTROL_GATE.source
    plugins = {p.get("name", p["type"]): p for p in config["plugins"]}
    assert {p["type"] for p in plugins.values()} == {CONCURRENCY_DETECTOR.value, HOLDBACK_POLICY.value}, \
        (CONCURRENCY_DETECTOR.source, HOLDBACK_POLICY.source)
    flow = config["flowControl"]
    assert set(flow) == FLOW_CONTROL_KEYS.value, FLOW_CONTROL_KEYS.source
    detector = plugins[flow["saturationDetector"]["pluginRef"]]
    policy = plugins[flow["usageLimitPolicyPluginRef"]]
    assert (detector["type"], policy["type"]) == (CONCURRENCY_DETECTOR.value, HOLDBACK_POLICY.value)
    assert set(detector["parameters"]) == {MAX_CONCURRENCY.value}, MAX_CONCURRENCY.source
    assert isinstance(detector["parameters"][MAX_CONCURRENCY.value], int) and detector["parameters"][
        MAX_CONCURRENCY.value] > 0
    assert set(policy["parameters"]) == {MIN_CEILING.value}, MIN_CEILING.source
    assert 0.0 <= policy["parameters"][MIN_CEILING.value] < 1.0
    assert flow["enableEviction"] is True, "without it llm-d never evicts a running batch request"


# --- the workers' attempt code against a stand-in llm-d ---------------------------------------------------


class StandIn:
    """Answers as llm-d's gateway does; each request's headers and body are kept. `script` is what the next
    requests get, in order: an Answer, "cut-after-output", "cut-before-output" or "complete"."""

    PARTIAL = "The first half of the answer"
    REST = " and the second half."

    def __init__(self, script: list[object]):
        self.script = list(script)
        self.seen: list[tuple[dict[str, str], dict]] = []
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.answer)
        self.server = TestServer(app)

    async def answer(self, request: web.Request) -> web.StreamResponse:
        self.seen.append(({k.lower(): v for k, v in request.headers.items()}, await request.json()))
        step = self.script.pop(0)
        if isinstance(step, Answer):
            headers = {} if step.reason is None else {DROP_REASON_HEADER.value: str(step.reason.value)}
            return web.Response(status=int(step.status.value), text=step.body, headers=headers)
        stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await stream.prepare(request)
        if step == "cut-before-output":
            # Evicted after vLLM sent the stream's headers, before its first token: Envoy resets the stream.
            request.transport.abort()
            return stream
        await stream.write(_event({"role": "assistant", "content": self.PARTIAL if step != "complete" else
                                   self.REST}))
        if step == "cut-after-output":
            # Evicted mid-answer: llm-d's 429 comes after the 200, so Envoy resets the stream
            # (pkg/epp/handlers/server.go L682-701).
            request.transport.abort()
            return stream
        await stream.write(_event({}, finish="stop"))
        usage = {"prompt_tokens": 9, "completion_tokens": 5, "total_tokens": 14}
        await stream.write(b"data: " + json.dumps({"id": "c", "object": "chat.completion.chunk", "created": 1,
                                                   "model": "m", "choices": [], "usage": usage}).encode() + b"\n\n")
        await stream.write(b"data: [DONE]\n\n")
        return stream


def _event(delta: dict, finish: str | None = None) -> bytes:
    chunk = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
             "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


@pytest.fixture
def sessions(tmp_path: Path):
    engine = make_engine(f"sqlite:///{tmp_path / 'holdback.db'}")
    upgrade(engine)
    yield make_sessionmaker(engine)
    engine.dispose()


def _row(sessions) -> tuple[str, str]:  # noqa: ANN001
    """One queued chat row of an in-progress batch; (row id, tenant id)."""
    with transaction(sessions) as s:
        tenant = Tenant(name=f"t{time.time_ns()}")
        s.add(tenant)
        s.flush()
        batch = Batch(tenant_id=tenant.id, endpoint="/v1/chat/completions", input_file_id="file-x",
                      completion_window="24h", window_seconds=86400, status="in_progress", total=1,
                      expires_at=int(time.time() + 3600))
        s.add(batch)
        s.flush()
        body = {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "Tell me both halves."}]}
        row = RequestRow(batch_id=batch.id, tenant_id=tenant.id, line=1, custom_id="c0", url="/v1/chat/completions",
                         body=json.dumps(body), status="queued")
        s.add(row)
        s.flush()
        return row.id, tenant.id


POLICY = RetryPolicy(base=2.0, cap=60.0, transient_budget=3)


def _attempts(sessions, row_id: str, script: list[object]):  # noqa: ANN001, ANN202
    """Run one attempt per step of `script` through the workers' attempt runner; (results, stand-in)."""
    stand_in = StandIn(script)

    async def run():  # noqa: ANN202
        await stand_in.server.start_server()
        rt = Runtime.over(sessions, gateway_url=str(stand_in.server.make_url("/")), gateway_key="vllm-api-key",
                          policy=POLICY, worker_name="w-llm-d", request_timeout=30.0, owns_engine=False)
        try:
            async with aiohttp.ClientSession() as http:
                return [await run_attempt(rt, http, InFlight(row_id)) for _ in script]
        finally:
            rt.close()
            await stand_in.server.close()

    return asyncio.run(run()), stand_in


def _row_state(sessions, row_id: str) -> tuple[str, int, int]:  # noqa: ANN001
    with sessions() as s:
        row = s.get(RequestRow, row_id)
        return row.status, row.evictions, row.transient_failures


def test_every_attempt_carries_the_headers_llm_d_reads(sessions):
    row_id, tenant_id = _row(sessions)
    _, stand_in = _attempts(sessions, row_id, [ANSWERS["evicted"], "complete"])
    assert len(stand_in.seen) == 2
    for headers, _body in stand_in.seen:
        for pin, value in ((OBJECTIVE_HEADER, contract.BATCH_OBJECTIVE),
                           (OLD_OBJECTIVE_HEADER, contract.BATCH_OBJECTIVE), (FAIRNESS_HEADER, tenant_id),
                           (OLD_FAIRNESS_HEADER, tenant_id), (REQUEST_ID_HEADER, row_id)):
            assert headers.get(pin.value) == value, f"{pin.value} ({pin.source}): {headers.get(pin.value)!r}"
        assert headers["authorization"] == "Bearer vllm-api-key"  # passed through llm-d to vLLM's --api-key


# What each answer must be to the worker (docs/llm-d.md): the attempt's outcome, whether it is an eviction, a
# failing path (waited out, and what the workers' circuit reacts to), and whether it waits for the backoff.
EXPECTED = {
    "saturated": ("rejected", False, False, True),
    "ttl-expired": ("rejected", False, False, True),
    "legacy-shed": ("rejected", False, False, True),
    "no-endpoints": ("server_error", False, True, True),
    "context-cancelled": ("server_error", False, True, True),
    "shutting-down": ("server_error", False, True, True),
    "evicted": ("evicted", True, False, False),
    "evicted-queue-pressure": ("evicted", True, False, False),
    "evicted-priority": ("evicted", True, False, False),
}


def test_every_llm_d_answer_has_an_expectation():
    assert set(EXPECTED) == set(ANSWERS)


@pytest.mark.parametrize("name", sorted(ANSWERS))
def test_the_worker_retries_each_llm_d_answer_as_llm_d_means_it_never_failing_the_request(sessions, name):
    answer = ANSWERS[name]
    outcome, evicted, path_failure, backs_off = EXPECTED[name]
    row_id, _ = _row(sessions)
    # More answers in a row than the transient budget allows: none of them may spend it.
    tries = POLICY.transient_budget + 2
    results, _ = _attempts(sessions, row_id, [answer] * tries)
    first = results[0].recorded
    where = f"{name}: {answer.status.value} {answer.reason and answer.reason.value} ({answer.source})"
    assert first.outcome.kind.value == outcome, where
    assert (first.outcome.evicted, first.outcome.path_failure, first.outcome.transient) == (
        evicted, path_failure, False), where
    assert first.outcome.retry_after is None, NO_RETRY_AFTER.source
    if backs_off:
        assert POLICY.base / 2 <= first.delay < POLICY.base, (where, first.delay)
    else:  # an eviction is llm-d's scheduling: back in line at once
        assert first.delay == 0.0, (where, first.delay)
    assert all(r.recorded.disposition.value == "retry" for r in results), where
    assert _row_state(sessions, row_id) == ("retry_wait", tries if evicted else 0, 0), where
    with sessions() as s:
        recorded = [(a.outcome, a.status_code, a.drop_reason) for a in
                    s.query(Attempt).filter_by(request_id=row_id).order_by(Attempt.number)]
    assert recorded == [(outcome, answer.status.value, answer.reason and answer.reason.value)] * tries, where


def test_a_stream_llm_d_cuts_after_output_is_resumed_from_that_output(sessions):
    """An eviction after the response began reaches the worker as a reset (Envoy's, on llm-d's 429): the next
    attempt continues the answer instead of starting it again, and nothing is counted against the request."""
    row_id, _ = _row(sessions)
    results, stand_in = _attempts(sessions, row_id, ["cut-after-output", "complete"])
    cut, done = (r.recorded for r in results)
    assert cut.disposition.value == "retry" and cut.outcome.kind.value == "transport_error"
    assert cut.outcome.cut_after_output and not cut.outcome.transient
    resumed = stand_in.seen[1][1]
    assert resumed["messages"][-1] == {"role": "assistant", "content": StandIn.PARTIAL}
    assert (resumed["continue_final_message"], resumed["add_generation_prompt"]) == (True, False)
    assert done.disposition.value == "final" and done.final_status.value == "succeeded"
    with sessions() as s:
        row = s.get(RequestRow, row_id)
        answer = json.loads(row.response_body)["choices"][0]["message"]["content"]
        assert (row.status, row.transient_failures) == ("succeeded", 0)
    assert answer == StandIn.PARTIAL + StandIn.REST


@pytest.mark.xfail(strict=True, reason="known gap (docs/llm-d.md): an llm-d eviction after vLLM sent the stream's "
                                       "headers but before its first token reaches the worker as a bare reset, "
                                       "which it counts as a transient failure")
def test_a_stream_llm_d_cuts_before_any_output_is_not_counted_against_the_request(sessions):
    row_id, _ = _row(sessions)
    _attempts(sessions, row_id, ["cut-before-output"])
    assert _row_state(sessions, row_id) == ("retry_wait", 0, 0)
