"""A vLLM started with `--api-key`: the gateway sends the key on every call it makes to the replica, so the
replica is identified (served model, context) and serves batches; without the key the replica is out of the
pool with a log line that says which key is missing, and no row fails for good.
"""

from __future__ import annotations

from typing import Iterator

import httpx
import pytest

from tests.real_vllm.conftest import FIRST_CPU, VllmServer
from tests.real_vllm.stack import RealStack, chat
from tests.support import poll

pytestmark = pytest.mark.e2e

REPLICA_KEY = "hb-real-replica-key"


@pytest.fixture(scope="module")
def keyed_vllm(engine_logs) -> Iterator[VllmServer]:
    server = VllmServer(engine_logs / "api-key.log", api_key=REPLICA_KEY, cpu=FIRST_CPU).start()
    try:
        yield server.wait_ready()
    finally:
        server.stop()


def test_vllm_itself_refuses_a_call_without_the_key(keyed_vllm):
    assert httpx.get(f"{keyed_vllm.url}/v1/models", timeout=10).status_code == 401
    assert httpx.get(f"{keyed_vllm.url}/v1/models", headers=keyed_vllm.headers(), timeout=10).status_code == 200


def test_with_the_key_the_replica_is_identified_and_serves_a_batch(backend, tmp_path, keyed_vllm):
    s = RealStack(backend, tmp_path, [keyed_vllm.url],
                  gateway_env={"HOLDBACK_GATEWAY_UPSTREAM_API_KEY": REPLICA_KEY})
    try:
        replicas = s.wait_identified()
        assert replicas[0]["model"] == "tiny"
        batch = s.wait(s.submit([chat(f"k-{i}", f"keyed question {i}", max_tokens=6) for i in range(8)]))
        assert batch.status == "completed" and batch.request_counts.completed == 8, (batch, s.logs())
        r = s.realtime("/v1/chat/completions", {"model": "tiny", "max_tokens": 4,
                                                 "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text
    finally:
        s.close()


def test_without_the_key_the_replica_is_out_of_the_pool_and_the_log_says_which_key(backend, tmp_path, keyed_vllm):
    s = RealStack(backend, tmp_path, [keyed_vllm.url])
    try:
        batch_id = s.submit([chat(f"n-{i}", f"question {i}", max_tokens=6) for i in range(4)])
        poll(lambda: "upstream.apiKey" in s.procs.log("gateway"), 60, "the gateway's log line on the missing key",
             s.logs)
        state = s.state()["replicas"][0]
        assert state["healthy"] is False, state
        assert keyed_vllm.url in next(line for line in s.procs.log("gateway").splitlines() if "upstream.apiKey" in line)
        batch = s.client.batches.retrieve(batch_id)
        assert batch.request_counts.failed == 0, "rows wait for a usable replica, they do not fail for good"
    finally:
        s.close()
