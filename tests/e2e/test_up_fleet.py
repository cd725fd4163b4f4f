"""`holdback up --gateway-relays 2 --gateway-standby`: the gateway's fleet shape on one machine (two relays sharing
the gateway's port, two flow controls electing a leader through up's own Redis) completes a batch, and killing the
leading flow control mid-batch (SIGKILL) loses and duplicates nothing: the standby takes over, the relays keep
their streams, and the supervisor restarts the killed one, which stands by."""

from __future__ import annotations

import io
import json
import signal
import tempfile
import time
from pathlib import Path

import httpx
import psutil
import pytest
from openai import OpenAI

from tests.e2e.test_up import BANNER_END, start_up, stop_up, up_env
from tests.support import free_port, free_ports, poll, wait_http

pytestmark = pytest.mark.e2e

ROWS = 80


def _leadership(gateway: str, admin: str) -> dict | None:
    try:
        answer = httpx.get(gateway + "/admin/state", headers={"Authorization": f"Bearer {admin}"})
    except httpx.HTTPError:
        return None
    return answer.json().get("leadership") if answer.status_code == 200 else None


def _children(up_pid: int, role: str) -> list[psutil.Process]:
    found = []
    for child in psutil.Process(up_pid).children(recursive=True):
        try:
            if role in child.cmdline():
                found.append(child)
        except psutil.NoSuchProcess:
            pass
    return found


def test_up_runs_the_gateway_fleet_and_a_killed_leader_loses_no_row(backend):
    data_dir = Path(tempfile.mkdtemp(prefix="hbfleet-"))
    api, gateway, sim, flow = free_port(), free_port(), free_ports(2), free_ports(2)
    ports = ["--api-port", str(api), "--gateway-port", str(gateway), "--sim-port", str(sim), "--gateway-flow-port",
             str(flow), "--processor-metrics-port", str(free_port()), "--worker-metrics-port", str(free_port())]
    # A lease of 3 s: the standby takes over a killed leader within that and a third of it.
    env = {**up_env(backend, data_dir), "HOLDBACK_GATEWAY_LEASE_SECONDS": "3"}
    proc = start_up(env, data_dir / "up.log", *ports, "--gateway-relays", "2", "--gateway-standby",
                    "--sim-arg=--decode-base-ms=25", "--worker-concurrency", "8")
    log = data_dir / "up.log"
    try:
        wait_http(f"http://127.0.0.1:{api}/readyz", timeout=120, proc=proc)
        poll(lambda: BANNER_END in log.read_text(errors="replace"), 120, "the banner",
             lambda: log.read_text(errors="replace"))
        assert "2 relays on its port" in log.read_text()
        gw = f"http://127.0.0.1:{gateway}"
        keys = json.loads((data_dir / "local-keys.json").read_text())
        assert len(_children(proc.pid, "relay")) == 2 and len(_children(proc.pid, "flow-control")) == 2
        lead = poll(lambda: (s := _leadership(gw, keys["admin"])) and s["leading"] and s, 60, "a leader")

        client = OpenAI(base_url=f"http://127.0.0.1:{api}/v1", api_key=keys["tenant"], max_retries=0)
        lines = "".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                                    "body": {"model": "sim-model", "max_tokens": 48,
                                             "messages": [{"role": "user", "content": f"hello {i}"}]}}) + "\n"
                        for i in range(ROWS))
        f = client.files.create(file=("fleet.jsonl", io.BytesIO(lines.encode())), purpose="batch")
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="1h")
        poll(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 8, 60, "the batch to be under way")
        leader = int(lead["holder"].split(":")[-2])
        assert client.batches.retrieve(batch.id).request_counts.completed < ROWS, "the batch ended before the kill"
        psutil.Process(leader).send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        new = poll(lambda: (s := _leadership(gw, keys["admin"])) and s["leading"] and s["token"] > lead["token"] and s,
                   60, "the standby to lead", lambda: log.read_text(errors="replace")[-3000:])
        assert int(new["holder"].split(":")[-2]) != leader and time.monotonic() - killed_at < 30
        batch = poll(lambda: (b := client.batches.retrieve(batch.id)).status in
                     ("completed", "failed", "expired", "cancelled") and b, 120, "the batch to finish")
        assert batch.status == "completed", batch
        assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == \
            (ROWS, ROWS, 0)
        out = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
        assert sorted(x["custom_id"] for x in out) == sorted(f"r{i}" for i in range(ROWS))  # none lost, none twice
        # The supervisor restarted the killed flow control; one of the two leads (the lease lapsed, no notice: the
        # standby, trying every second, or the restarted one, trying at its start, took it), the other stands by.
        assert "child exited, restarting child=gateway-flow-" in log.read_text()
        poll(lambda: len(_children(proc.pid, "flow-control")) == 2, 60, "the killed flow control to be restarted")
    finally:
        code = stop_up(proc)
    assert code == 0, log.read_text(errors="replace")[-3000:]
