"""`holdback up` as a newcomer runs it: start, complete a batch with the official client, stop cleanly."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil
import pytest
from openai import OpenAI

from tests.support import REPO, free_port, free_ports, wait_http

pytestmark = pytest.mark.e2e


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def test_up_completes_a_batch_and_stops_without_orphans(backend):
    data_dir = Path(tempfile.mkdtemp(prefix="hbup-"))
    api, gateway, sim = free_port(), free_port(), free_ports(2)
    env = {**os.environ, "HOLDBACK_DATA_DIR": str(data_dir), "PYTHONUNBUFFERED": "1"}
    # The services pass points `up` at PostgreSQL and the machine's Redis; the embedded pass uses its defaults.
    for var in ("DATABASE_URL", "REDIS_URL", "HOLDBACK_ADMIN_KEY"):
        env.pop(var, None)
    if backend.kind == "services":
        env.update(DATABASE_URL=backend.database_url, REDIS_URL=backend.redis_url,
                   HOLDBACK_REDIS_NAMESPACE=backend.namespace)
    log = open(data_dir / "up.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "holdback.cli", "up", "--api-port", str(api), "--gateway-port", str(gateway),
         "--sim-port", str(sim), "--sim-arg=--decode-base-ms=1", "--worker-concurrency", "16"],
        cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        wait_http(f"http://127.0.0.1:{api}/readyz", timeout=90, proc=proc)
        wait_http(f"http://127.0.0.1:{gateway}/health", timeout=60, proc=proc)
        keys = json.loads((data_dir / "local-keys.json").read_text())
        assert (data_dir / "local-keys.json").stat().st_mode & 0o077 == 0, "keys file must be owner-only"

        client = OpenAI(base_url=f"http://127.0.0.1:{api}/v1", api_key=keys["tenant"], max_retries=0)
        lines = "".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                                    "body": {"model": "sim-model", "max_tokens": 8,
                                             "messages": [{"role": "user", "content": f"hello {i}"}]}}) + "\n"
                        for i in range(40))
        f = client.files.create(file=("up.jsonl", io.BytesIO(lines.encode())), purpose="batch")
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="1h")
        deadline = time.monotonic() + 120
        while batch.status not in ("completed", "failed", "expired", "cancelled"):
            assert time.monotonic() < deadline, f"batch stuck in {batch.status}: {batch.request_counts}"
            time.sleep(0.5)
            batch = client.batches.retrieve(batch.id)
        assert batch.status == "completed", batch
        assert (batch.request_counts.total, batch.request_counts.completed) == (40, 40)
        out = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
        assert sorted(x["custom_id"] for x in out) == sorted(f"r{i}" for i in range(40))

        # KV admission is on under `holdback up`, the gateway's admin state needs the admin key, and the
        # batch went through the ledger (every reservation released at the end).
        gw_url = f"http://127.0.0.1:{gateway}"
        assert httpx.get(gw_url + "/admin/state", timeout=5).status_code == 401
        state = httpx.get(gw_url + "/admin/state", headers={"Authorization": f"Bearer {keys['admin']}"},
                          timeout=5).json()
        assert state["kv"]["enabled"] and state["kv"]["tenants"] == {}
        assert sum(r["total_blocks"] for r in state["kv"]["replicas"].values()) > 0
        assert httpx.get(f"http://127.0.0.1:{sim}/admin/faults", timeout=5).status_code == 401

        children = _descendants(proc.pid)
        assert len(children) >= 5, f"expected sim, gateway, api, processor and worker, got {children}"
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        log.close()
    output = (data_dir / "up.log").read_text(errors="replace")
    assert code == 0, output[-3000:]
    time.sleep(0.5)
    alive = [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"orphans after shutdown: {alive}"
    if backend.kind == "embedded":
        assert "stopped child=embedded-redis" in output
