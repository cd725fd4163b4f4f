"""Validation and expansion of batch input files by the processor, against the real DB and Redis."""

from __future__ import annotations

import json
import re
import threading
import time

import pytest

from batch_processor.ingest import expand_batch
from tests.batch_processor.test_processor_support import (  # noqa: F401
    ENDPOINT, Harness, ReadHooks, chat, harness, jsonl,
)


def _ok(i: int) -> dict:
    return chat(i)


BAD_INPUTS = {
    "invalid_json_line": ([_ok(1), '{"custom_id": "req-2", "method": ', _ok(3)], 2, None),
    "json_not_an_object": ([_ok(1), _ok(2), "[1, 2, 3]"], 3, None),
    "missing_custom_id": ([_ok(1), {k: v for k, v in _ok(2).items() if k != "custom_id"}], 2, "custom_id"),
    "duplicate_custom_id": ([_ok(1), _ok(2), _ok(1)], 3, "custom_id"),
    "invalid_method": ([{**_ok(1), "method": "GET"}], 1, "method"),
    "url_mismatch": ([_ok(1), {**_ok(2), "url": "/v1/embeddings"}], 2, "url"),
    "invalid_body": ([{**_ok(1), "body": "say hello"}], 1, "body"),
    "missing_model": ([_ok(1), {**_ok(2), "body": {"messages": []}}], 2, "body.model"),
    "model_mismatch": ([_ok(1), _ok(2), chat(3, model="m2")], 3, "body.model"),
    "streaming_unsupported": ([chat(1, stream=True)], 1, "body.stream"),
    "gateway_owned_priority": ([_ok(1), chat(2, priority=-100)], 2, "body.priority"),
    "gateway_owned_cache_salt": ([chat(1, cache_salt="tenant:someone-else")], 1, "body.cache_salt"),
}
EXPECTED_CODE = {"json_not_an_object": "invalid_json_line", "gateway_owned_priority": "gateway_owned_field",
                 "gateway_owned_cache_salt": "gateway_owned_field"}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_fails_the_batch_with_code_line_and_param(harness: Harness, case: str):
    lines, line, param = BAD_INPUTS[case]
    batch_id = harness.submit(jsonl(lines))
    input_file = harness.batch(batch_id).input_file_id
    before = harness.file_digest(input_file)

    done = harness.processor().tick()

    assert done.failed_validation == [batch_id]
    batch = harness.batch(batch_id)
    assert batch.status == "failed" and batch.failed_at is not None and batch.in_progress_at is None
    assert batch.claimed_by is None  # the lease goes with the terminal transition
    error = batch.errors[0]
    assert (error["code"], error["line"], error["param"]) == (EXPECTED_CODE.get(case, case), line, param)
    assert len(error["message"]) > 20
    assert harness.rows(batch_id) == []  # nothing half-expanded is left behind
    assert harness.file_digest(input_file) == before


def test_empty_file_and_blank_lines_only(harness: Harness):
    empty, blank = harness.submit(b""), harness.submit(b"\n  \n\n")
    harness.processor().tick()
    for batch_id in (empty, blank):
        batch = harness.batch(batch_id)
        assert batch.status == "failed"
        assert [(e["code"], e["line"]) for e in batch.errors] == [("empty_file", None)]


def test_too_many_tasks_names_the_first_line_over_the_limit(backend):
    h = Harness(backend, max_batch_requests=3)
    try:
        batch_id = h.submit(jsonl([_ok(i) for i in range(5)]))
        h.processor().tick()
        batch = h.batch(batch_id)
        assert batch.status == "failed"
        assert [(e["code"], e["line"]) for e in batch.errors] == [("too_many_tasks", 4)]
        assert "3" in batch.errors[0]["message"]
        assert h.rows(batch_id) == []
    finally:
        h.close()


def test_every_bad_line_is_reported_up_to_a_cap(harness: Harness):
    lines = [_ok(0)] + [{**_ok(i), "method": "PUT"} for i in range(1, 151)] + [_ok(151)]
    batch_id = harness.submit(jsonl(lines))
    harness.processor().tick()
    errors = harness.batch(batch_id).errors
    assert len(errors) == 100
    assert [e["line"] for e in errors[:3]] == [2, 3, 4]
    assert {e["code"] for e in errors} == {"invalid_method"}


def test_valid_file_becomes_pending_rows_with_stable_ids(harness: Harness):
    lines = [_ok(i) for i in range(1, 6)] + [""] + [_ok(i) for i in range(6, 11)]
    batch_id = harness.submit(jsonl(lines))
    p = harness.processor(window=4)

    done = p.tick()

    assert done.expanded == [batch_id]
    batch = harness.batch(batch_id)
    assert (batch.status, batch.total, batch.model) == ("in_progress", 10, "m1")
    assert batch.in_progress_at is not None and batch.claimed_by == "p0"
    rows = harness.rows(batch_id)
    assert [r.custom_id for r in rows] == [f"req-{i}" for i in range(1, 11)]
    assert [r.line for r in rows] == [1, 2, 3, 4, 5, 7, 8, 9, 10, 11]  # line numbers count the blank line
    assert json.loads(rows[0].body) == _ok(1)["body"] and rows[0].url == ENDPOINT
    assert all(r.id.startswith("batch_req_") for r in rows)
    assert [r.status for r in rows].count("queued") == 4 and [r.status for r in rows].count("pending") == 6

    ids = [r.id for r in rows]
    p.tick()
    # A second expansion of the same batch (a processor re-running a step) changes nothing.
    assert expand_batch(harness.factory, harness.store, batch_id, max_requests=50_000).status == "skipped"
    assert [r.id for r in harness.rows(batch_id)] == ids


def test_rows_of_a_large_file_get_distinct_random_ids_and_bodies_as_sent(harness: Harness):
    # More lines than one draw of random id digits (1,024), and than one insert chunk.
    lines = [chat(i, temperature=0.7, top_p=1.5e-05, user="e-mail ünï") for i in range(1, 2501)]
    batch_id = harness.submit(jsonl(lines))
    assert expand_batch(harness.factory, harness.store, batch_id, max_requests=50_000, chunk_rows=1000).total == 2500
    rows = harness.rows(batch_id)
    assert len({r.id for r in rows}) == 2500
    assert all(re.fullmatch(r"batch_req_[0-9a-f]{24}", r.id) for r in rows)
    # The stored body is json.dumps's compact text of the line's body, what the workers send.
    assert [r.body for r in rows] == [json.dumps(line["body"], separators=(",", ":"), ensure_ascii=False)
                                      for line in lines]


def test_two_processors_never_expand_the_same_batch(harness: Harness):
    batches = [harness.submit(jsonl([_ok(i) for i in range(400)]), tenant=f"t{n % 2}") for n in range(8)]
    # Each may hold 4 batches, so both must work; a broken lease would show as a batch expanded twice.
    procs = [harness.processor(name=name, claim_per_round=3, max_batches=4) for name in ("alpha", "beta")]
    expanded: dict[str, list[str]] = {"alpha": [], "beta": []}
    start = threading.Barrier(2)

    def run(p):
        start.wait()
        for _ in range(6):
            expanded[p.config.name] += p.tick().expanded

    threads = [threading.Thread(target=run, args=(p,)) for p in procs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)

    everything = expanded["alpha"] + expanded["beta"]
    assert sorted(everything) == sorted(batches)  # each batch expanded exactly once, by one of them
    assert len(expanded["alpha"]) == len(expanded["beta"]) == 4
    for batch_id in batches:
        rows = harness.rows(batch_id)
        assert len(rows) == 400 and len({r.custom_id for r in rows}) == 400
        assert harness.batch(batch_id).claimed_by in ("alpha", "beta")


def test_an_expired_lease_is_taken_over(harness: Harness):
    batch_id = harness.submit(jsonl([_ok(i) for i in range(3)]))
    dead = harness.processor(name="dead", lease_seconds=1.0, poll_interval=0.1)
    dead.lease.claim(10)  # claims, then never renews: it "died"
    heir = harness.processor(name="heir")
    assert heir.tick().claimed == []  # the lease still holds

    harness.set_batch(batch_id, lease_until=0.0)  # time passes: the lease ran out
    done = heir.tick()
    assert done.claimed == [batch_id] and done.expanded == [batch_id]
    assert harness.batch(batch_id).claimed_by == "heir"
    assert dead.lease.renew({batch_id}) == set()  # the dead one cannot take it back



def test_another_tenants_write_goes_through_while_a_batch_is_validated(harness: Harness):
    # SQLite has one write lock, which the other tenants' workers need to record results: the expansion
    # must not hold it while it reads and checks the file (it did, for the whole file).
    batch_id = harness.submit(jsonl([_ok(i) for i in range(1, 301)]))
    other = harness.submit(jsonl([_ok(1)]), tenant="t2")
    wrote: list[bool] = []

    def write_other_batch() -> None:
        writer = threading.Thread(target=harness.set_batch, args=(other,),
                                  kwargs={"expires_at": int(time.time()) + 5000})
        writer.start()
        writer.join(20)
        wrote.append(not writer.is_alive())

    store = ReadHooks(harness, {150: write_other_batch})
    result = expand_batch(harness.factory, store, batch_id, max_requests=50_000, chunk_rows=100)
    assert wrote == [True], "the other tenant's write waited for the expansion's lock"
    assert result.status == "in_progress" and len(harness.rows(batch_id)) == 300
    assert harness.batch(other).expires_at > time.time() + 4000
