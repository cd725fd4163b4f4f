"""/v1/responses batch lines: what validation refuses in them, and that an evicted one starts again from the
caller's own body (the Responses API's input is its own format: nothing is resumed from a partial answer)."""

from __future__ import annotations

import json

import pytest

from batch_processor.validation import InputValidator
from holdback.attempts.resume import Carryover, plan_attempt, resumable
from holdback.attempts.transactions import OpenAttempt

RESPONSES = "/v1/responses"


def _line(i: int, **body) -> bytes:
    return json.dumps({"custom_id": f"r{i}", "method": "POST", "url": RESPONSES,
                       "body": {"model": "m", **body}}).encode()


def test_a_responses_line_with_input_is_accepted_as_sent():
    v = InputValidator(RESPONSES, 10)
    given = {"input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
             "instructions": "be brief", "max_output_tokens": 30}
    request = v.check(1, _line(1, **given))
    assert request is not None and v.ok
    assert json.loads(request.body) == {"model": "m", **given} and request.url == RESPONSES
    assert v.check(2, _line(2, input="a plain string", stream=False)) is not None and v.ok


@pytest.mark.parametrize("body, code, param", [
    ({}, "missing_input", "body.input"),
    ({"input": ""}, "missing_input", "body.input"),
    ({"input": []}, "missing_input", "body.input"),
    ({"input": 42}, "missing_input", "body.input"),
    ({"input": "hi", "stream": True}, "streaming_unsupported", "body.stream"),
    ({"input": "hi", "background": True}, "background_unsupported", "body.background"),
    ({"input": "hi", "priority": -5}, "gateway_owned_field", "body.priority"),
    ({"input": "hi", "cache_salt": "someone-else"}, "gateway_owned_field", "body.cache_salt"),
])
def test_a_responses_line_is_refused_saying_what_to_change(body, code, param):
    v = InputValidator(RESPONSES, 10)
    assert v.check(1, _line(0, input="fine")) is not None  # the fast path knows the model now
    assert v.check(2, _line(1, **body)) is None
    (error,) = v.errors
    assert (error.code, error.line, error.param) == (code, 2, param)
    assert param.removeprefix("body.") in error.message and len(error.message) > 40


def test_an_evicted_responses_request_restarts_with_the_callers_body():
    body = {"model": "m", "input": "write a long story", "max_output_tokens": 400}
    assert not resumable(RESPONSES, body)
    attempt = OpenAttempt(request_id="r1", batch_id="b1", tenant_id="t1", custom_id="c1", url=RESPONSES,
                          body=json.dumps(body), deadline=None, attempt_id=2, number=2, transient_failures=0)
    # Even with output kept from a cut attempt, the next one is the caller's request as it came, not streamed.
    plan = plan_attempt(attempt, Carryover(text=" Once upon a time", tokens=4, computed=20), resume=True)
    assert not plan.streamed and not plan.resumed
    assert json.loads(plan.body) == body
