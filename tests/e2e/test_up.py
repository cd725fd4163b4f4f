"""`holdback up` as a newcomer runs it: start, complete a batch with the official client, stop cleanly;
and as an unlucky operator runs it: in the background of a script (SIGINT ignored), twice on one data
dir, killed outright, or beside a leftover process holding a port.
"""

from __future__ import annotations

import http.server
import io
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import httpx
import psutil
import pytest
from openai import OpenAI

from bench.lib import forkserver
from holdback.cli.instance_lock import InstanceLock
from holdback.cli.supervisor import Child, Supervisor
from tests.deploy.dashboard_names import dashboard_expressions, exported_names, rule_expressions, unknown_names
from tests.support import REPO, free_port, free_ports, poll, wait_http

pytestmark = pytest.mark.e2e

ENV_ADMIN_KEY = "hb-admin-chosen-in-the-environment"
BANNER_END = "Ctrl-C or SIGTERM stops everything"


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def banner_command(banner: str, after: str) -> list[str]:
    """The command on the line after the banner's line that starts with `after`."""
    lines = banner.splitlines()
    index = next((i for i, line in enumerate(lines) if line.startswith(after)), None)
    assert index is not None, f"no line starting {after!r} in the banner:\n{banner}"
    return shlex.split(lines[index + 1])


def terminal_env() -> dict[str, str]:
    """Another terminal: none of the variables a test gives `holdback up`."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith("HOLDBACK_") and k not in ("DATABASE_URL", "REDIS_URL")}


def up_env(backend, data_dir: Path) -> dict[str, str]:
    env = {**os.environ, "HOLDBACK_DATA_DIR": str(data_dir), "PYTHONUNBUFFERED": "1"}
    # The services pass points `up` at PostgreSQL and the machine's Redis; the embedded pass uses its defaults.
    for var in ("DATABASE_URL", "REDIS_URL", "HOLDBACK_ADMIN_KEY"):
        env.pop(var, None)
    if backend.kind == "services":
        env.update(DATABASE_URL=backend.database_url, REDIS_URL=backend.redis_url,
                   HOLDBACK_REDIS_NAMESPACE=backend.namespace)
    return env


def start_up(env: dict[str, str], log_path: Path, *args: str, ignore_sigint: bool = False,
             cwd: Path = REPO) -> subprocess.Popen:
    def background_job() -> None:  # what a shell script does to `cmd &`: SIGINT arrives ignored
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    script = Path(sys.executable).with_name("holdback")  # the console script a user runs, where installed
    command = [str(script)] if script.exists() else [sys.executable, "-P", "-m", "holdback.cli"]
    return subprocess.Popen([*command, "up", *args], cwd=cwd, env=env, stdout=open(log_path, "wb"),
                            stderr=subprocess.STDOUT, preexec_fn=background_job if ignore_sigint else None)


def test_up_completes_a_batch_and_stops_without_orphans(backend):
    data_dir = Path(tempfile.mkdtemp(prefix="hbup-"))
    api, gateway, sim = free_port(), free_port(), free_ports(2)
    env = up_env(backend, data_dir)
    # A platform started before with another admin key: the key from the environment must win and be stored.
    made = forkserver.run([sys.executable, "-m", "holdback.cli", "keys", "create", "--tenant", "default", "--create"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    (data_dir / "local-keys.json").write_text(json.dumps(
        {"admin": "hb-admin-stored-before", "tenant": made.stdout.strip(), "realtime": "hb-rt-x",
         "standard": "hb-std-x", "batch_gateway": "hb-bw-x"}))
    env["HOLDBACK_ADMIN_KEY"] = ENV_ADMIN_KEY
    processor_metrics, worker_metrics = free_port(), free_port()
    ports = ["--api-port", str(api), "--gateway-port", str(gateway), "--sim-port", str(sim),
             "--processor-metrics-port", str(processor_metrics), "--worker-metrics-port", str(worker_metrics)]
    # Run from a folder that holds directories named as our packages (a checkout's parent holds `holdback/`): the
    # children must still import the installed ones.
    shadowing = data_dir / "parent-of-a-checkout"
    for name in ("holdback", "gateway", "model_sim"):
        (shadowing / name).mkdir(parents=True)
    proc = start_up(env, data_dir / "up.log", *ports, "--sim-arg=--decode-base-ms=1", "--worker-concurrency", "16",
                     ignore_sigint=True, cwd=shadowing)
    try:
        wait_http(f"http://127.0.0.1:{api}/readyz", timeout=90, proc=proc)
        wait_http(f"http://127.0.0.1:{gateway}/health", timeout=60, proc=proc)
        # Every component's metrics and probes are on by default, and the banner says where.
        log = data_dir / "up.log"
        banner = poll(lambda: BANNER_END in log.read_text(errors="replace") and log.read_text(
            errors="replace"), timeout=120, what="the banner", detail=lambda: log.read_text(errors="replace"))
        for port, metric in ((processor_metrics, "holdback_processor_"), (worker_metrics, "holdback_worker_"),
                             (gateway, "holdback_gateway_"), (api, "holdback_api_")):
            assert f"http://127.0.0.1:{port}/metrics" in banner
            assert metric in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
            for probe in ("/healthz", "/readyz"):
                assert httpx.get(f"http://127.0.0.1:{port}{probe}", timeout=10).status_code == 200, (port, probe)
        keys = json.loads((data_dir / "local-keys.json").read_text())
        assert (data_dir / "local-keys.json").stat().st_mode & 0o077 == 0, "keys file must be owner-only"
        assert keys["admin"] == ENV_ADMIN_KEY, "HOLDBACK_ADMIN_KEY is stored over the earlier key"
        chosen = httpx.post(f"http://127.0.0.1:{api}/admin/keys", json={"tenant": "acme"}, timeout=10,
                            headers={"Authorization": f"Bearer {ENV_ADMIN_KEY}"})
        assert chosen.status_code == 201, chosen.text
        stale = httpx.post(f"http://127.0.0.1:{api}/admin/keys", json={"tenant": "acme"}, timeout=10,
                           headers={"Authorization": "Bearer hb-admin-stored-before"})
        assert stale.status_code == 401

        client = OpenAI(base_url=f"http://127.0.0.1:{api}/v1", api_key=keys["tenant"], max_retries=0)
        lines = "".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                                    "body": {"model": "sim-model", "max_tokens": 8,
                                             "messages": [{"role": "user", "content": f"hello {i}"}]}}) + "\n"
                        for i in range(40))
        f = client.files.create(file=("up.jsonl", io.BytesIO(lines.encode())), purpose="batch")
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="1h")
        batch = poll(lambda: (b := client.batches.retrieve(batch.id)).status in
                     ("completed", "failed", "expired", "cancelled") and b, 120, "the batch to finish")
        assert batch.status == "completed", batch
        assert (batch.request_counts.total, batch.request_counts.completed) == (40, 40)
        out = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
        assert sorted(x["custom_id"] for x in out) == sorted(f"r{i}" for i in range(40))

        # KV admission is on under `holdback up`, the gateway's admin state needs the admin key, and the
        # batch went through the ledger (every reservation released at the end).
        gw_url = f"http://127.0.0.1:{gateway}"
        assert httpx.get(gw_url + "/admin/state").status_code == 401
        state = httpx.get(gw_url + "/admin/state", headers={"Authorization": f"Bearer {keys['admin']}"}).json()
        assert state["kv"]["enabled"] and state["kv"]["tenants"] == {}
        assert sum(r["total_blocks"] for r in state["kv"]["replicas"].values()) > 0
        assert httpx.get(f"http://127.0.0.1:{sim}/admin/faults").status_code == 401

        children = _descendants(proc.pid)
        assert len(children) >= 5, f"expected sim, gateway, api, processor and worker, got {children}"

        # The banner's commands work as printed, from another terminal without our variables.
        official = subprocess.run(banner_command(banner, "The example requests with the official openai client"),
                                  cwd=REPO, env=terminal_env(), capture_output=True, text=True, timeout=300)
        assert official.returncode == 0, official.stdout + official.stderr
        assert len(re.findall(r"^/v1/\S+: batch_\w+ completed .*failed=0", official.stdout, re.M)) == 3, official.stdout
        _readme_snippet_runs(api, keys["tenant"])
        demo = subprocess.run([*banner_command(banner, "See what holdback is for"), "--help"], cwd=REPO,
                              env=terminal_env(), capture_output=True, text=True, timeout=60)
        assert demo.returncode == 0 and "no controls" in demo.stdout, demo.stdout + demo.stderr  # runs: test_demo.py
        realtime = httpx.post(f"{gw_url}/v1/chat/completions", timeout=60, headers={
            "Authorization": f"Bearer {keys['realtime']}"}, json={"model": "sim-model", "stream": True, "max_tokens": 4,
                                                                   "messages": [{"role": "user", "content": "hi"}]})
        assert realtime.status_code == 200 and "[DONE]" in realtime.text, realtime.text
        _dashboard_reads_only_exported_metrics([api, gateway, processor_metrics, worker_metrics, sim, sim + 1])

        # A second `holdback up` on the same data dir refuses at once, naming the live one.
        other = [str(p) for p in (free_port(), free_port(), free_ports(2), free_port(), free_port())]
        second = forkserver.run([sys.executable, "-m", "holdback.cli", "up", "--api-port", other[0],
                                 "--gateway-port", other[1], "--sim-port", other[2],
                                 "--processor-metrics-port", other[3], "--worker-metrics-port", other[4]],
                                cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
        assert second.returncode == 1 and f"pid {proc.pid}" in second.stdout, second.stdout + second.stderr
        assert "already running" in second.stdout
    finally:
        code = stop_up(proc, signal.SIGINT)  # ignored by inheritance, handled by `holdback up` all the same
    output = (data_dir / "up.log").read_text(errors="replace")
    assert code == 0, output[-3000:]
    poll(lambda: not _alive(children), 30, "every child to exit", lambda: _alive(children))
    if backend.kind == "embedded":
        assert "stopped child=embedded-redis" in output


def stop_up(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> int:
    """Stop a `holdback up` as an operator does and return its exit code; one that takes over 60 s is killed."""
    proc.send_signal(sig)
    try:
        return proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise


def _dashboard_reads_only_exported_metrics(ports: list[int]) -> None:
    """Every metric name in the Grafana dashboard and the alert rules is served by a running component (its
    `/metrics` page, after a batch and a realtime stream went through)."""
    exported: set[str] = set()
    for port in ports:
        exported |= exported_names(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text)
    assert unknown_names(dashboard_expressions() + rule_expressions(), exported) == {}


def _readme_snippet_runs(api: int, tenant_key: str) -> None:
    """The README's Python snippet, as printed (its key and address filled in), polls until the batch has ended and
    downloads the output file."""
    readme = (REPO / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", readme[readme.index("## Submit a batch"):], re.S).group(1)
    code = code.replace('api_key="hb-..."', f'api_key="{tenant_key}"').replace("127.0.0.1:8000", f"127.0.0.1:{api}")
    work = Path(tempfile.mkdtemp(prefix="hbreadme-"))
    (work / "examples").symlink_to(REPO / "examples")
    ran = subprocess.run([sys.executable, "-c", code], cwd=work, env=terminal_env(), capture_output=True, text=True,
                         timeout=300)
    assert ran.returncode == 0 and ran.stdout.splitlines()[-1].startswith("completed "), ran.stdout + ran.stderr
    out = [json.loads(x) for x in (work / "output.jsonl").read_text().splitlines()]
    assert sorted(x["custom_id"] for x in out) == ["chat-0", "chat-1", "chat-2"]
    assert not (work / "errors.jsonl").exists(), "no request failed, so there is no error file"


def test_a_killed_up_takes_its_children_with_it_and_frees_its_lock(backend):
    data_dir = Path(tempfile.mkdtemp(prefix="hbup-"))
    api, gateway, sim = free_port(), free_port(), free_ports(1)
    proc = start_up(up_env(backend, data_dir), data_dir / "up.log", "--api-port", str(api), "--gateway-port",
                     str(gateway), "--sim-port", str(sim), "--sim-replicas", "1", "--worker-concurrency", "4",
                     "--processor-metrics-port", str(free_port()), "--worker-metrics-port", str(free_port()))
    children: list[psutil.Process] = []
    try:
        wait_http(f"http://127.0.0.1:{api}/readyz", timeout=90, proc=proc)
        expected = 6 if backend.kind == "embedded" else 5  # + the embedded Redis
        children = poll(lambda: (c := _descendants(proc.pid)) and len(c) >= expected and c, 60,
                        "every child to start", lambda: _descendants(proc.pid))
    finally:
        proc.kill()  # SIGKILL: no handler runs; the kernel tells each child its parent died
        proc.wait(10)
    poll(lambda: not _alive(children), 60, "the children of a killed holdback up to exit", lambda: _alive(children))
    lock = InstanceLock.acquire(data_dir)  # the dead holder's lock is free, not stale
    lock.release()


def test_a_port_answered_by_another_process_fails_start_up(tmp_path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    port = server.server_address[1]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        # Readiness: the URL answers 200, but from this test process, not from the child `up` started.
        child = Child("api", [], ready_url=f"http://127.0.0.1:{port}/")
        child.proc = subprocess.Popen(["sleep", "60"])
        try:
            with pytest.raises(RuntimeError, match=f"answered by pid {os.getpid()}"):
                Supervisor([child], {}, tmp_path).wait_ready(child, timeout=20)
        finally:
            child.proc.kill()
            child.proc.wait()
        # And `holdback up` checks its ports before starting anything.
        env = {**os.environ, "HOLDBACK_DATA_DIR": str(tmp_path / "data")}
        refused = forkserver.run([sys.executable, "-m", "holdback.cli", "up", "--api-port", str(port)],
                                 cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
        assert refused.returncode == 1
        assert f"api port {port} is in use (pid {os.getpid()})" in refused.stdout, refused.stdout
    finally:
        server.shutdown()


def _redis_server(up_pid: int) -> psutil.Process | None:
    return next((p for p in _alive(_descendants(up_pid)) if "redis-server" in " ".join(p.cmdline())), None)


def test_the_embedded_redis_killed_mid_batch_is_restarted_and_the_batch_completes(backend):
    if backend.kind != "embedded":
        pytest.skip("the services pass points holdback up at the machine's Redis; the embedded pass runs this")
    data_dir = Path(tempfile.mkdtemp(prefix="hbup-"))
    api, gateway, sim = free_port(), free_port(), free_ports(1)
    proc = start_up(up_env(backend, data_dir), data_dir / "up.log", "--api-port", str(api), "--gateway-port",
                     str(gateway), "--sim-port", str(sim), "--sim-replicas", "1", "--worker-concurrency", "8",
                     "--sim-arg=--decode-base-ms=5", "--processor-metrics-port", str(free_port()),
                     "--worker-metrics-port", str(free_port()))
    log = data_dir / "up.log"
    try:
        wait_http(f"http://127.0.0.1:{api}/readyz", timeout=90, proc=proc)
        keys = poll(lambda: (data_dir / "local-keys.json").exists() and json.loads(
            (data_dir / "local-keys.json").read_text()), 30, "the local keys")
        client = OpenAI(base_url=f"http://127.0.0.1:{api}/v1", api_key=keys["tenant"], max_retries=5)
        total = 300
        lines = "".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                                    "body": {"model": "sim-model", "max_tokens": 16,
                                             "messages": [{"role": "user", "content": f"hello {i}"}]}}) + "\n"
                        for i in range(total))
        f = client.files.create(file=("up.jsonl", io.BytesIO(lines.encode())), purpose="batch")
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="1h")
        poll(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 20, 120, "the batch to start",
             lambda: log.read_text(errors="replace")[-3000:])
        first = _redis_server(proc.pid)
        assert first is not None, _descendants(proc.pid)
        first.kill()  # kill -9, mid-batch
        again = poll(lambda: (p := _redis_server(proc.pid)) is not None and p.pid != first.pid and p, 60,
                     "holdback up to start the embedded Redis again", lambda: log.read_text(errors="replace")[-3000:])
        assert "child exited, restarting child=redis" in log.read_text(errors="replace")
        done = poll(lambda: (b := client.batches.retrieve(batch.id)).status in
                    ("completed", "failed", "expired", "cancelled") and b, 240, "the batch to finish",
                    lambda: log.read_text(errors="replace")[-3000:])
        assert done.status == "completed" and done.request_counts.completed == total, done
        out = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
        assert sorted(x["custom_id"] for x in out) == sorted(f"r{i}" for i in range(total)), "one line per request"
        assert again.is_running() and proc.poll() is None, "no restart of holdback up was needed"
    finally:
        code = stop_up(proc)
    assert code == 0, log.read_text(errors="replace")[-3000:]
