"""The sync mode: the AIMD limit, a cancel that reaches requests in flight at the simulator, and the wake-up its
last row sends."""

from __future__ import annotations

import time

import httpx
from sqlalchemy import select

from batch_processor.sync_handoff import Aimd
from holdback.models import Attempt
from tests.batch_processor.test_processor_support import Harness, chat, jsonl
from tests.support import Processes, WakeListener, free_port, wait_http


def test_aimd_halves_once_per_round_trip_and_adds_one_per_success():
    aimd = Aimd(8)
    sent_early = time.monotonic()
    assert aimd.on_overload(time.monotonic()) and aimd.limit == 4
    assert not aimd.on_overload(sent_early) and aimd.limit == 4  # that request was sent before the halving
    for _ in range(3):
        aimd.on_overload(time.monotonic())
    assert aimd.limit == 1  # never below one
    for _ in range(3):
        aimd.on_success()
    assert aimd.limit == 4
    for _ in range(10):
        aimd.on_success()
    assert aimd.limit == 8  # never above --sync-concurrency


def _sim_state(url: str) -> dict:
    return httpx.get(f"{url}/admin/state").json()


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_cancel_aborts_sync_requests_in_flight_at_the_simulator(backend, tmp_path):
    sim_url = f"http://127.0.0.1:{free_port()}"
    with Processes(env=backend.env, log_dir=tmp_path) as procs:
        # Every decode step takes 200 ms and each request wants 300 tokens: a minute if nobody aborts it.
        sim = procs.start("sim", "--port", sim_url.rsplit(":", 1)[1], "--model", "sim-model",
                          "--decode-base-ms", "200", "--step-overhead-ms", "0", name="sim")
        wait_http(f"{sim_url}/health", proc=sim)
        harness = Harness(backend, gateway_url=sim_url)
        try:
            batch_id = harness.submit(jsonl([chat(i, model="sim-model", max_tokens=300, ignore_eos=True)
                                             for i in range(6)]))
            p = harness.processor(dispatch="sync", sync_concurrency=4, window=6)
            p.tick()
            _wait(lambda: _sim_state(sim_url)["running"] == 4, 20, "four requests running at the simulator")
            assert p.handoff.in_flight == 6  # four sent, two waiting for a slot

            harness.set_batch(batch_id, status="cancelling", cancelling_at=int(time.time()))
            assert p.tick().finished == {batch_id: "cancelled"}

            _wait(lambda: _sim_state(sim_url)["running"] + _sim_state(sim_url)["waiting"] == 0, 20,
                  "the simulator to abort the requests")
            _wait(lambda: p.handoff.in_flight == 0, 20, "the sync hand-off to let go of the batch")
            with harness.factory() as s:
                attempts = list(s.scalars(select(Attempt).where(Attempt.batch_id == batch_id)))
            assert len(attempts) == 4
            assert {a.outcome for a in attempts} == {"cancelled"} and all(a.ended_at for a in attempts)
            batch = harness.batch(batch_id)
            assert (batch.status, batch.total, batch.completed, batch.failed) == ("cancelled", 6, 0, 6)
            assert {r.status for r in harness.rows(batch_id)} == {"cancelled"}
        finally:
            harness.close()


def test_the_sync_hand_off_that_ends_a_batch_s_last_row_wakes_the_processors(backend, tmp_path):
    sim_url = f"http://127.0.0.1:{free_port()}"
    with Processes(env=backend.env, log_dir=tmp_path) as procs:
        sim = procs.start("sim", "--port", sim_url.rsplit(":", 1)[1], "--model", "sim-model",
                          "--decode-base-ms", "1", "--step-overhead-ms", "0", name="sim")
        wait_http(f"{sim_url}/health", proc=sim)
        harness = Harness(backend, gateway_url=sim_url)
        wakes = WakeListener(harness.redis, backend.namespace)
        try:
            batch_id = harness.submit(jsonl([chat(i, model="sim-model", max_tokens=4) for i in range(3)]))
            p = harness.processor(dispatch="sync", sync_concurrency=4, window=6)
            p.tick()  # expands the batch and sends its three rows
            wakes.wait_for(batch_id, 30, "a wake-up naming the batch once its last row ended")
            assert {r.status for r in harness.rows(batch_id)} == {"succeeded"}
        finally:
            wakes.close()
            harness.close()
