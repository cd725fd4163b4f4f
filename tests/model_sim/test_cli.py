"""`holdback sim` as an operator runs it: several replicas on consecutive ports, clean stop on SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys

import httpx

from tests.support import REPO, Processes, free_ports, wait_http


def test_replicas_on_consecutive_ports_and_clean_sigterm(tmp_path):
    port = free_ports(2)
    with Processes(log_dir=tmp_path) as procs:
        proc = procs.start("sim", "--port", str(port), "--replicas", "2", "--model", "m1", "--zero-latency",
                           "--fault-503-rate", "0", "--num-blocks", "512", name="sim")
        for i in range(2):
            wait_http(f"http://127.0.0.1:{port + i}/health", proc=proc)
        for i in range(2):
            r = httpx.post(f"http://127.0.0.1:{port + i}/v1/chat/completions",
                           json={"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
            assert r.status_code == 200 and r.headers["x-sim-replica"] == str(i)
            assert r.json()["usage"]["completion_tokens"] == 4
            state = httpx.get(f"http://127.0.0.1:{port + i}/admin/state").json()
            assert state["replica"] == str(i) and state["kv"]["num_blocks"] == 512
        # Separate registries: each replica counts only its own tokens.
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        assert 'vllm:generation_tokens_total{engine="0",model_name="m1"} 4.0' in metrics

        with httpx.Client(timeout=30) as client, client.stream(
                "POST", f"http://127.0.0.1:{port}/v1/completions",
                json={"model": "m1", "prompt": "x", "max_tokens": 8000, "stream": True}) as stream:
            lines = stream.iter_lines()
            next(lines)
            procs.stop(proc, signal.SIGTERM)
        assert proc.returncode == 0, procs.log("sim")


def test_help_and_bad_arguments():
    run = [sys.executable, "-m", "holdback.cli", "sim"]
    out = subprocess.run([*run, "--help"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    for flag in ("--replicas", "--scheduling-policy", "--enable-prefix-caching", "--zero-latency",
                 "--output-length-mode", "--fault-429-rate", "--decode-ms-per-seq", "--kv-offload-blocks",
                 "--load-ms-per-token", "--runner", "--api-key", "--enable-prompt-tokens-details"):
        assert flag in out.stdout
    bad = subprocess.run([*run, "--port", "1", "--fault-429-rate", "0.7", "--fault-500-rate", "0.7"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "at most 1" in bad.stderr
    no_cache = subprocess.run([*run, "--port", "1", "--kv-offload-blocks", "100"], cwd=REPO, capture_output=True,
                              text=True, timeout=60)
    assert no_cache.returncode == 2 and "add --enable-prefix-caching" in no_cache.stderr
