"""Poison input never wedges a batch: a line nothing can parse or store becomes that line's error in one round,
with nothing logged, on SQLite and PostgreSQL; a batch whose validation keeps raising fails after a few rounds
with one traceback in the log, not one per round."""

from __future__ import annotations

import json
import logging

import pytest

import batch_processor.processor as processor_module
from tests.batch_processor.test_processor_support import Harness, chat, harness, jsonl  # noqa: F401

DEEP = "[" * 1000 + "]" * 1000


def _line(custom_id: str = "req-2", model: str = "m1", **body) -> str:
    """A line written by hand, so `\\u0000` and lone surrogates reach the file as JSON escapes."""
    extra = "".join(f', "{k}": {v}' for k, v in body.items())
    return (f'{{"custom_id": "{custom_id}", "method": "POST", "url": "/v1/chat/completions", '
            f'"body": {{"model": "{model}", "messages": [{{"role": "user", "content": "hi"}}]{extra}}}}}')


POISON = {
    "deep_line": (DEEP, "invalid_json_line", None),
    "deep_body": (_line(tools=DEEP), "invalid_json_line", None),
    "nul_custom_id": (_line(custom_id="req\\u0000x"), "missing_custom_id", "custom_id"),
    "nul_model": (_line(model="m1\\u0000"), "missing_model", "body.model"),
    "surrogate_custom_id": (_line(custom_id="req\\ud800"), "missing_custom_id", "custom_id"),
    # A surrogate written as its own UTF-8 bytes, not as an escape: Python's json reads it too.
    "raw_surrogate_custom_id": (_line(custom_id="req\udc80").encode("utf-8", "surrogatepass"), "missing_custom_id",
                                "custom_id"),
    # Python's json reads these; no replica or output-file reader would.
    "nan_in_body": (_line(temperature="NaN"), "invalid_json_line", None),
    "infinity_in_body": (_line(temperature="-Infinity"), "invalid_json_line", None),
    # Python's json turns this into infinity and would store it as Infinity.
    "overflowing_number_in_body": (_line(temperature="1e400"), "invalid_json_line", None),
}


@pytest.mark.parametrize("case", sorted(POISON))
def test_a_poison_line_fails_the_batch_in_one_quiet_round(harness: Harness, caplog, case: str):
    line, code, param = POISON[case]
    batch_id = harness.submit(jsonl([chat(1), line, chat(3)]))
    with caplog.at_level(logging.INFO):
        done = harness.processor().tick()
    assert done.failed_validation == [batch_id]
    batch = harness.batch(batch_id)
    assert batch.status == "failed"
    assert [(e["code"], e["line"], e["param"]) for e in batch.errors] == [(code, 2, param)]
    assert "\x00" not in json.dumps(batch.errors) and "traceback" not in caplog.text.lower()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert harness.rows(batch_id) == []


def test_nul_and_lone_surrogates_inside_a_body_are_stored_escaped_and_kept(harness: Harness):
    text = _line(custom_id="req-1", temperature=0, user='"a\\u0000b\\udc80c"')
    batch_id = harness.submit(jsonl([text]))
    harness.processor().tick()
    assert harness.batch(batch_id).status == "in_progress"
    (row,) = harness.rows(batch_id)
    assert "\x00" not in row.body and json.loads(row.body)["user"] == "a\x00b\udc80c"


def test_a_surrogate_written_as_raw_bytes_inside_a_body_is_stored_escaped(harness: Harness):
    text = _line(custom_id="req-1", user='"a\udc80b"').encode("utf-8", "surrogatepass")
    batch_id = harness.submit(jsonl([text]))
    harness.processor().tick()
    assert harness.batch(batch_id).status == "in_progress"
    (row,) = harness.rows(batch_id)
    assert "\\udc80" in row.body and json.loads(row.body)["user"] == "a\udc80b"


def test_a_batch_whose_validation_keeps_raising_fails_with_one_traceback(harness: Harness, caplog, monkeypatch):
    def raising(*_args, **_kwargs):
        raise ValueError("unexpected \x00 in the input")

    monkeypatch.setattr(processor_module, "expand_batch", raising)
    batch_id = harness.submit(jsonl([chat(1)]))
    processor = harness.processor()
    with caplog.at_level(logging.INFO):
        rounds = 0
        while harness.batch(batch_id).status == "validating":
            rounds += 1
            assert rounds <= 5, "the batch is still validating after five rounds"
            processor.tick()
    batch = harness.batch(batch_id)
    assert batch.status == "failed" and rounds == 3
    (error,) = batch.errors
    assert error["code"] == "processing_failed" and "ValueError: unexpected \\u0000" in error["message"]
    assert len([r for r in caplog.records if r.exc_info]) == 1


def test_an_overflowing_number_says_why(harness: Harness):
    batch_id = harness.submit(jsonl([chat(1), _line(temperature="-2.5e999")]))
    harness.processor().tick()
    (error,) = harness.batch(batch_id).errors
    assert "-2.5e999" in error["message"] and "64-bit float" in error["message"], error
