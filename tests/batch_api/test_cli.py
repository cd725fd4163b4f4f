"""`holdback api` as an operator starts it: a subprocess on a port, logging JSON lines."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import httpx
from openai import OpenAI

from tests.support import REPO, Processes, free_port, wait_http

# A fresh `holdback api` imports FastAPI, SQLAlchemy and the app (about 3 s of CPU): on two cores shared with
# other suites that has taken 30 s of wall time.
START_TIMEOUT = 120


def test_holdback_api_serves_the_sdk_and_logs_json_lines(backend, tmp_path):
    port = free_port()
    with Processes(env=backend.env, log_dir=tmp_path / "logs") as procs:
        proc = procs.start("api", "--port", str(port), name="api")
        wait_http(f"http://127.0.0.1:{port}/readyz", timeout=START_TIMEOUT, proc=proc)
        key = httpx.post(
            f"http://127.0.0.1:{port}/admin/keys",
            json={"tenant": "acme"},
            headers={"authorization": f"Bearer {backend.admin_key}"},
        ).json()["key"]
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0)
        f = client.files.create(file=("in.jsonl", io.BytesIO(b"{}\n")), purpose="batch")
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")
        procs.stop(proc)
        # uvicorn re-raises SIGTERM after its graceful shutdown; "api.stopped" below proves the shutdown ran.
        assert proc.returncode in (0, -15)
        log = procs.log("api")

    events = [json.loads(line) for line in log.splitlines() if line.strip()]
    names = [e["event"] for e in events]
    assert "api.started" in names and "api.stopped" in names
    created = next(e for e in events if e["event"] == "batch.created")
    assert created["batch_id"] == batch.id and created["input_file_id"] == f.id
    requests = [e for e in events if e["event"] == "http.request"]
    assert any(e["route"] == "/v1/batches" and e["status"] == 200 and e["request_id"].startswith("req_") for e in requests)


def test_cli_help():
    for args in (["-m", "holdback.cli", "api", "--help"], [str(REPO / "bench" / "upload_memory.py"), "--help"]):
        out = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=REPO, timeout=60)
        assert out.returncode == 0, out.stderr
        assert "--port" in out.stdout or "--size-mb" in out.stdout


def _wrong_logins(port: int, forwarded: list[str]) -> list[int]:
    return [httpx.post(f"http://127.0.0.1:{port}/dashboard/login", data={"admin_key": "wrong", "next": "/dashboard"},
                       headers={"x-forwarded-for": ip}, timeout=30).status_code for ip in forwarded]


def test_forwarded_addresses_are_believed_only_from_trusted_proxies(backend, tmp_path):
    fresh = [f"203.0.113.{i}" for i in range(8)]  # a new X-Forwarded-For each time
    with Processes(env=backend.env, log_dir=tmp_path / "logs") as procs:
        # Default: no proxy is trusted, so the throttle counts the address that connected, whatever it says.
        port = free_port()
        wait_http(f"http://127.0.0.1:{port}/readyz", timeout=START_TIMEOUT,
                  proc=procs.start("api", "--port", str(port), name="api"))
        codes = _wrong_logins(port, fresh)
        assert codes[:5] == [401] * 5 and set(codes[5:]) == {429}, codes
        # Behind a trusted proxy the forwarded client is the one counted: eight clients, none throttled, and
        # one client sending too many wrong keys is throttled all the same.
        port = free_port()
        env = {"HOLDBACK_TRUSTED_PROXIES": "127.0.0.1", "HOLDBACK_REDIS_NAMESPACE": f"{backend.namespace}-proxied"}
        wait_http(f"http://127.0.0.1:{port}/readyz", timeout=START_TIMEOUT,
                  proc=procs.start("api", "--port", str(port), name="api-proxied", env=env))
        assert set(_wrong_logins(port, fresh)) == {401}
        assert _wrong_logins(port, ["198.51.100.7"] * 6)[-1] == 429
