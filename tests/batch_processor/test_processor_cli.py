"""`holdback processor` run the operator's way: several at once on one database, the sync mode
against the simulator, metrics, readiness while its gateway is down and back, and a clean stop on SIGTERM."""

from __future__ import annotations

import json
import signal
import time

import httpx
import pytest
from sqlalchemy import select

from holdback.models import Attempt
from tests.batch_processor.test_processor_support import Harness, StandInGateway, chat, harness, jsonl  # noqa: F401
from tests.support import Processes, free_port, poll, wait_http


def _wait(predicate, timeout: float, what: str, procs: Processes | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    logs = procs.log("processor") if procs else ""
    raise AssertionError(f"timed out waiting for {what}\n{logs}")


def _listening_port(log_file, child, procs: Processes) -> int:
    """The metrics port a processor started with `--metrics-port 0` logged (`metrics_listening`)."""
    found: list[int] = []

    def listening() -> bool:
        if child.poll() is not None:
            raise AssertionError(f"the processor exited with {child.returncode}\n{procs.log('processor')}")
        text = log_file.read_text(errors="replace") if log_file.exists() else ""
        found[:] = [e["port"] for e in _events(text, "metrics_listening")]
        return bool(found)

    _wait(listening, 30, f"{log_file.name}'s metrics_listening event", procs)
    return found[0]


def _events(text: str, event: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("event") == event:
            out.append(record)
    return out


def _metric(scrape: str, sample: str) -> float:
    for line in scrape.splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[-1])
    return 0.0


def test_two_processor_processes_expand_each_batch_once(harness: Harness, tmp_path):
    batches = [harness.submit(jsonl([chat(i) for i in range(300)]), tenant=f"t{n}") for n in range(6)]
    # The gateway only answers /health (a processor claims only while it reaches one): its lines' models are
    # taken as served (HOLDBACK_VALIDATE_MODELS=0).
    gateway = StandInGateway(free_port()).start()
    env = {**harness.backend.env, "HOLDBACK_VALIDATE_MODELS": "0", "HOLDBACK_GATEWAY_URL": gateway.url}
    with Processes(env=env, log_dir=tmp_path) as procs:
        common = ["--poll-interval", "0.05", "--window", "20"]
        # Port 0: each processor binds a port the system picks and logs it, so no other suite can take it first.
        children = [procs.start("processor", "--id", f"proc-{n}", "--metrics-port", "0", *common,
                                name="processor") for n in range(2)]
        ports = [_listening_port(tmp_path / f"processor-{n}.log", child, procs) for n, child in enumerate(children)]
        _wait(lambda: all(harness.batch(b_id).status == "in_progress" for b_id in batches), 30,
              "every batch in_progress", procs)
        _wait(lambda: len(harness.queued_job_ids()) == 6 * 20, 10, "every first window queued", procs)
        scrapes = [httpx.get(f"http://127.0.0.1:{port}/metrics").text for port in ports]
        for port in ports:  # the metrics port also answers the probes: its loop turns, its database, Redis and
            ready = httpx.get(f"http://127.0.0.1:{port}/readyz")  # gateway answer
            assert ready.status_code == 200, ready.text
            assert ready.json()["checks"] == {"main_loop": "ok", "database": "ok", "redis": "ok", "gateway": "ok"}
        for child in children:
            procs.stop(child, signal.SIGTERM)
            assert child.returncode == 0
        logs = procs.log("processor")
    gateway.stop()

    expanded = [e["batch_id"] for e in _events(logs, "batch_expanded")]
    assert sorted(expanded) == sorted(batches)
    queue = harness.queued_job_ids()
    assert len(queue) == len(set(queue)) == 120
    for batch_id in batches:
        rows = harness.rows(batch_id)
        assert len(rows) == 300 and sum(r.status == "queued" for r in rows) == 20
        assert harness.batch(batch_id).claimed_by is None  # SIGTERM handed the leases back
    transitions = 'holdback_processor_batch_transitions_total{status="in_progress"}'
    assert sum(_metric(s, transitions) for s in scrapes) == 6
    assert sum(_metric(s, 'holdback_processor_rows_enqueued_total{dispatch="async"}') for s in scrapes) == 120


def test_sync_mode_completes_a_batch_through_429s(harness: Harness, tmp_path):
    sim_port = free_port()
    batch_id = harness.submit(jsonl([chat(i, model="sim-model", max_tokens=4) for i in range(40)]))
    env = {**harness.backend.env, "HOLDBACK_GATEWAY_URL": f"http://127.0.0.1:{sim_port}"}
    with Processes(env=env, log_dir=tmp_path) as procs:
        sim = procs.start("sim", "--port", str(sim_port), "--zero-latency", "--model", "sim-model",
                          "--fault-429-rate", "0.3", "--seed", "7", name="sim")
        wait_http(f"http://127.0.0.1:{sim_port}/health", proc=sim)
        procs.start("processor", "--id", "syncer", "--dispatch", "sync", "--sync-concurrency", "8",
                    "--poll-interval", "0.05", "--backoff-base", "0.05", "--backoff-cap", "0.2", name="processor")
        _wait(lambda: harness.batch(batch_id).status == "completed", 45, "the batch to complete", procs)

    batch = harness.batch(batch_id)
    assert (batch.total, batch.completed, batch.failed) == (40, 40, 0)
    assert batch.error_file_id is None
    output = harness.read_file(batch.output_file_id)
    assert sorted(line["custom_id"] for line in output) == sorted(f"req-{i}" for i in range(40))
    assert all(line["response"]["status_code"] == 200 for line in output)
    with harness.factory() as s:
        attempts = list(s.scalars(select(Attempt).where(Attempt.batch_id == batch_id)))
    outcomes = [a.outcome for a in attempts]
    assert outcomes.count("success") == 40
    assert outcomes.count("rejected") >= 1  # the simulator's 429s were retried, not failed
    assert {a.worker for a in attempts} == {"syncer/sync"}
    assert all(a.ended_at is not None for a in attempts)


def test_a_processor_whose_gateway_is_down_is_unready_naming_it_and_claims_once_it_starts(harness: Harness, tmp_path):
    gateway_port = free_port()
    gateway_url = f"http://127.0.0.1:{gateway_port}"
    batch_id = harness.submit(jsonl([chat(i) for i in range(20)]))
    env = {**harness.backend.env, "HOLDBACK_VALIDATE_MODELS": "0", "HOLDBACK_GATEWAY_URL": gateway_url}
    with Processes(env=env, log_dir=tmp_path) as procs:
        child = procs.start("processor", "--metrics-port", "0", "--poll-interval", "0.05", name="processor")
        readyz = f"http://127.0.0.1:{_listening_port(tmp_path / 'processor-0.log', child, procs)}/readyz"
        unready = poll(lambda: (r := httpx.get(readyz)).status_code == 503 and r.json(), 30,
                       "/readyz failing on the gateway", lambda: procs.log("processor"))
        reason = unready["checks"]["gateway"]
        assert gateway_url in reason and "ConnectError" in reason, unready
        assert unready["checks"]["database"] == unready["checks"]["redis"] == "ok"
        assert harness.batch(batch_id).claimed_by is None

        # The real gateway starts on that port (no healthy replica is needed to answer /health).
        gw = procs.start("gateway", "--port", str(gateway_port), "--replicas", "http://127.0.0.1:9", name="gateway")
        wait_http(f"{gateway_url}/health", timeout=60, proc=gw)
        _wait(lambda: harness.batch(batch_id).status == "in_progress", 30, "the batch claimed and expanded", procs)
        ready = httpx.get(readyz)
        assert ready.status_code == 200 and ready.json()["checks"]["gateway"] == "ok", ready.text
        logs = procs.log("processor")
    (down,) = _events(logs, "gateway_unreachable")
    assert down["url"] == gateway_url and "ConnectError" in down["reason"]
    assert [e["url"] for e in _events(logs, "gateway_reachable")] == [gateway_url]


@pytest.mark.parametrize("argv", [["--window", "0"], ["--sync-concurrency", "0"]])
def test_bad_settings_are_refused_with_exit_code_2(argv, capsys):
    from batch_processor.cli import main

    assert main(argv) == 2
    assert "must be at least 1" in capsys.readouterr().err
