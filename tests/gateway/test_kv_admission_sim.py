"""KV admission over real HTTP: the gateway and `holdback sim` replicas run as subprocesses.

The simulator has 1000 KV blocks of 16 tokens (its own block size, from vllm:cache_config_info) and a
16000-token context; its tokenizer makes "a a a ..." one token per word, so a request's reservation is known
exactly: ceil((prompt + max_tokens) / 16) blocks. Long `max_tokens` with `ignore_eos` keep a reservation held
until the test closes the stream.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import httpx
import pytest

from bench.lib import forkserver
from tests.gateway.conftest import sim_state
from tests.gateway.test_gateway_sim import wait_until

# 30 ms per decode step: a request holding its reservation keeps it for seconds even on a busy machine.
SIM_ARGS = ("--num-blocks", "1000", "--max-model-len", "16000", "--decode-base-ms", "30")
AUTO = """
saturation: {maxConcurrency: 16}
usageLimit: {policy: static}
metrics: {scrapeIntervalSeconds: 0.1}
anonymous: {relaysTenants: true}  # keyless callers name their tenants here: this gateway is the test's own
admission:
  longRequestTokens: 1600
  tenantMaxShare: 1.0
  tenantSoftShare: 1.0
  queueDeadlineMs: 30000
"""
# Counted by the simulator's tokenizer in process: exact on a loaded machine too (auto may ask /tokenize,
# which past tokenizeTimeoutMs gives way to the characters / 4 estimate).
BASE = AUTO + "  tokenizer: simulator\n"


def prompt(n: int) -> str:
    return "a" + " a" * (n - 1)


def blocks_body(blocks: int, max_tokens: int = 8000, stream: bool = True) -> dict:
    """A completion whose reservation is exactly `blocks` blocks (prompt + max_tokens = 16 x blocks)."""
    assert blocks * 16 - max_tokens >= 1, "the prompt needs at least one token"
    return {"model": "sim-model", "prompt": prompt(blocks * 16 - max_tokens), "max_tokens": max_tokens,
            "ignore_eos": True, "stream": stream}


def hdr(objective: str, fid: str | None = None) -> dict:
    h = {"x-llm-d-inference-objective": objective}
    if fid:
        h["x-llm-d-inference-fairness-id"] = fid
    return h


class Held:
    """A streamed request kept open: its reservation stays until `close()`."""

    def __init__(self, client: httpx.AsyncClient, body: dict, headers: dict):
        self.status: int | None = None
        self.chunks: list[bytes] = []
        self.task = asyncio.create_task(self._run(client, body, headers))

    async def _run(self, client, body, headers):
        async with client.stream("POST", "/v1/completions", json=body, headers=headers) as r:
            self.status = r.status_code
            self.headers = r.headers
            async for chunk in r.aiter_bytes():
                self.chunks.append(chunk)

    async def close(self):
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)

    @property
    def text(self) -> str:
        return b"".join(self.chunks).decode()


def kv(gw, url: str) -> dict:
    return gw.state()["kv"]["replicas"][url]


def release_count(gw, cause: str) -> float:
    for line in httpx.get(gw.url + "/metrics").text.splitlines():
        if line.startswith(f'holdback_gateway_kv_release_seconds_count{{cause="{cause}",pool="default"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_watermark_ladder_and_the_three_outcomes(stack):
    [sim] = stack.sim(1, *SIM_ARGS)
    gw = stack.gateway([sim], BASE)

    async def main():
        async with httpx.AsyncClient(base_url=gw.url, timeout=60) as client:
            await wait_until(lambda: kv(gw, sim)["total_blocks"] == 1000)  # the pool comes from the replica
            base = Held(client, blocks_body(790), hdr("realtime", "a"))
            await wait_until(lambda: kv(gw, sim)["reserved_blocks"] == 790)
            short_std = Held(client, blocks_body(20, 300), hdr("standard", "b"))     # 810 <= 920: runs
            await wait_until(lambda: kv(gw, sim)["reserved_blocks"] == 810)
            assert kv(gw, sim)["level"] == "normal"
            long_std = Held(client, blocks_body(100, 1000), hdr("standard", "c"))    # long: 910 > 820 waits
            await wait_until(lambda: gw.band(0)["queued"] == 1)
            long_rt = Held(client, blocks_body(100, 1000), hdr("realtime", "d"))     # realtime: 910 <= 920 runs
            await wait_until(lambda: kv(gw, sim)["reserved_blocks"] == 910)
            assert kv(gw, sim)["level"] == "pause-batch"
            batch = Held(client, blocks_body(5, 40), hdr("batch", "e"))              # batch: 915 > 880 waits
            await wait_until(lambda: gw.band(-10)["queued"] == 1)
            rt_over = Held(client, blocks_body(15, 100), hdr("realtime", "f"))      # 925 > 920 waits
            await wait_until(lambda: gw.band(100)["queued"] == 1)
            assert kv(gw, sim)["reserved_blocks"] == 910 and gw.state()["kv"]["waiting_by_priority"] == {
                "100": 1, "0": 1, "-10": 1}
            # Rejected at once: could never fit a replica (more than the hard watermark of 1000 blocks).
            r = await client.post("/v1/completions", json=blocks_body(930, 1000, stream=False),
                                  headers=hdr("realtime", "g"))
            assert r.status_code == 400, r.text  # retrying cannot help
            assert r.headers["x-llm-d-request-dropped-reason"] == "rejected-kv-capacity-never-fits"
            assert "Retry-After" not in r.headers
            assert "930 KV blocks" in r.json()["error"]["message"] and "lower max_tokens" in r.json()["error"]["message"]
            await base.close()  # 790 blocks back: everything waiting runs
            await wait_until(lambda: [gw.band(p)["queued"] for p in (100, 0, -10)] == [0, 0, 0])
            for held in (short_std, long_std, long_rt, batch, rt_over):
                await wait_until(lambda: held.status is not None)  # headers come with the first token
                assert held.status == 200
            assert "x-holdback-queue-ms" in long_std.headers and "x-holdback-queue-ms" not in long_rt.headers
            for held in (short_std, long_std, long_rt, batch, rt_over):
                await held.close()
            await wait_until(lambda: kv(gw, sim)["reserved_blocks"] == 0)
            assert gw.state()["kv"]["rejected_tokens"] == {"rejected-kv-capacity-never-fits": 930 * 16}

    asyncio.run(main())


def test_queued_request_is_rejected_when_its_kv_deadline_passes(stack):
    [sim] = stack.sim(1, *SIM_ARGS)
    gw = stack.gateway([sim], BASE.replace("queueDeadlineMs: 30000", "queueDeadlineMs: 300"))

    async def main():
        async with httpx.AsyncClient(base_url=gw.url, timeout=60) as client:
            await wait_until(lambda: kv(gw, sim)["total_blocks"] == 1000)
            base = Held(client, blocks_body(900), hdr("realtime"))
            await wait_until(lambda: kv(gw, sim)["reserved_blocks"] == 900)
            # A completion without max_tokens gets vLLM's 16 output tokens: 288 + 16 is 19 blocks, 919 <= 920.
            r = await client.post("/v1/completions", json={"model": "sim-model", "prompt": prompt(288)},
                                  headers=hdr("realtime"))
            assert r.status_code == 200, r.text
            r = await client.post("/v1/completions", json=blocks_body(40, 100, stream=False), headers=hdr("realtime"))
            assert r.status_code == 429 and r.headers["x-llm-d-request-dropped-reason"] == "rejected-kv-capacity"
            assert "queueDeadlineMs (300 ms)" in r.json()["error"]["message"]
            await base.close()

    asyncio.run(main())


def test_batch_is_evicted_when_the_replica_passes_the_hard_watermark(stack):
    """Load the gateway does not see (a direct request to the replica) pushes KV usage over 0.92."""
    [sim] = stack.sim(1, *SIM_ARGS)
    gw = stack.gateway([sim], BASE)

    async def main():
        async with httpx.AsyncClient(base_url=gw.url, timeout=60) as client, \
                httpx.AsyncClient(base_url=sim, timeout=60) as direct:
            await wait_until(lambda: kv(gw, sim)["total_blocks"] == 1000)
            batch = Held(client, blocks_body(60, 900), hdr("batch"))
            await wait_until(lambda: batch.chunks)
            outside = asyncio.create_task(direct.post("/v1/completions", json={
                "model": "sim-model", "prompt": prompt(15000), "max_tokens": 900, "ignore_eos": True}))
            await wait_until(lambda: batch.task.done(), timeout=60)
            assert batch.status == 200 and '"code": "evicted"' in batch.text  # cut mid-stream, told why
            state = gw.state()
            assert state["totals"]["evictions"]["issued"] == 1
            assert state["kv"]["replicas"][sim]["reserved_blocks"] == 0
            assert release_count(gw, "evict") == 1
            outside.cancel()
            await asyncio.gather(outside, return_exceptions=True)

    asyncio.run(main())


def test_realtime_waiting_for_kv_evicts_the_batch_work_holding_it(stack):
    """Batch holds 700 of 1000 blocks (under its 750); a realtime request of 300 would take the replica past the
    hard watermark (920), so KV admission queues it, and it evicts the batch request (trigger kv-wait) rather
    than wait for it to end."""
    [sim] = stack.sim(1, *SIM_ARGS)
    gw = stack.gateway([sim], BASE)

    async def main():
        async with httpx.AsyncClient(base_url=gw.url, timeout=60) as client:
            await wait_until(lambda: kv(gw, sim)["total_blocks"] == 1000)
            batch = Held(client, blocks_body(700, 3000), hdr("batch", "bulk"))
            await wait_until(lambda: batch.chunks)
            rt = await client.post("/v1/completions", json=blocks_body(300, 20, stream=False),
                                   headers=hdr("realtime", "app"))
            assert rt.status_code == 200, rt.text
            await wait_until(lambda: batch.task.done(), timeout=60)
            assert batch.status == 200 and '"code": "evicted"' in batch.text  # cut mid-stream, told why
            assert gw.state()["totals"]["evictions"]["issued"] == 1
            assert '"trigger":"kv-wait"' in gw.log()

    asyncio.run(main())


def test_release_on_finish_cancel_and_disconnect(stack):
    [sim] = stack.sim(1, *SIM_ARGS)
    gw = stack.gateway([sim], BASE)

    async def main():
        async with httpx.AsyncClient(base_url=gw.url, timeout=60) as client:
            await wait_until(lambda: kv(gw, sim)["total_blocks"] == 1000)
            r = await client.post("/v1/completions", json=blocks_body(10, 20, stream=False), headers=hdr("standard"))
            assert r.status_code == 200
            assert kv(gw, sim)["reserved_blocks"] == 0 and release_count(gw, "end") == 1
            # cancel: the caller closes a stream that has begun
            held = Held(client, blocks_body(300, 3000), hdr("standard"))
            await wait_until(lambda: held.chunks)
            assert kv(gw, sim)["reserved_blocks"] == 300
            assert kv(gw, sim)["used_blocks"] >= (300 * 16 - 3000) // 16  # the prompt, at least
            closed = time.time()
            await held.close()
            await wait_until(lambda: kv(gw, sim)["reserved_blocks"] == 0)
            await wait_until(lambda: release_count(gw, "cancel") == 1)
            # /admin/state records when each release happened: an outside observer times the cancel with it.
            [cancel] = [r for r in gw.state()["kv"]["recent_releases"] if r["cause"] == "cancel"]
            assert closed <= cancel["at"] <= time.time()
            assert 0 <= cancel["seconds_after_cause"] <= cancel["at"] - closed
            await wait_until(lambda: sim_state(sim)["running"] == 0)  # the replica aborted it too
            # disconnect: the caller leaves before any byte of a non-streamed answer
            task = asyncio.create_task(client.post("/v1/completions", json=blocks_body(300, 3000, stream=False),
                                                   headers=hdr("standard")))
            await wait_until(lambda: kv(gw, sim)["reserved_blocks"] == 300)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await wait_until(lambda: kv(gw, sim)["reserved_blocks"] == 0)
            await wait_until(lambda: release_count(gw, "disconnect") == 1)
            await wait_until(lambda: sim_state(sim)["running"] == 0)

    asyncio.run(main())


def test_by_default_prompts_are_counted_in_the_gateway_once_its_tokenizer_agrees_with_the_replica(stack):
    [sim] = stack.sim(1, *SIM_ARGS)
    gw = stack.gateway([sim], AUTO)  # no admission.tokenizer: the default, auto

    def counted(source: str) -> float:
        for line in httpx.get(gw.url + "/metrics").text.splitlines():
            if line.startswith(f'holdback_gateway_prompt_counts_total{{source="{source}"}}'):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    async def main():
        async with httpx.AsyncClient(base_url=gw.url, timeout=60) as client:
            await wait_until(lambda: kv(gw, sim)["total_blocks"] == 1000)
            r = await client.post("/v1/completions", json=blocks_body(2, 8, stream=False), headers=hdr("standard"))
            assert r.status_code == 200
            await wait_until(lambda: gw.state()["kv"]["tokenizer"]["replicas"].get(sim))
            assert gw.state()["kv"]["tokenizer"]["replicas"][sim] == {
                "model": "sim-model", "in_process": "simulator", "chat_in_process": True}
            before = counted("simulator")
            held = Held(client, blocks_body(300, 3000), hdr("standard"))
            await wait_until(lambda: held.chunks)
            assert kv(gw, sim)["reserved_blocks"] == 300  # the in-process count is the replica's, exactly
            assert counted("simulator") == before + 1
            await held.close()
            await wait_until(lambda: kv(gw, sim)["reserved_blocks"] == 0)
            assert gw.state()["kv"]["tokenizer_fallbacks"] == 0

    asyncio.run(main())


def test_streamed_tokens_revise_the_reservation(stack):
    [sim] = stack.sim(1, *SIM_ARGS)
    gw = stack.gateway([sim], BASE)

    async def main():
        async with httpx.AsyncClient(base_url=gw.url, timeout=60) as client:
            await wait_until(lambda: kv(gw, sim)["total_blocks"] == 1000)
            held = Held(client, blocks_body(20, 300), hdr("standard"))  # prompt 20 tokens: 2 blocks used at start
            await wait_until(lambda: kv(gw, sim)["used_blocks"] >= 5)   # output grew past 3 more blocks
            assert kv(gw, sim)["reserved_blocks"] == 20                 # the worst case is still held (9 s run)
            await wait_until(lambda: held.task.done(), timeout=60)
            assert kv(gw, sim)["reserved_blocks"] == 0

    asyncio.run(main())


def test_context_limits_reject_with_400(stack):
    [sim] = stack.sim(1, *SIM_ARGS)
    gw = stack.gateway([sim], BASE + "  tenants:\n    short: {maxContextTokens: 500}\n")

    async def main():
        async with httpx.AsyncClient(base_url=gw.url, timeout=60) as client:
            await wait_until(lambda: kv(gw, sim)["total_blocks"] == 1000)
            # A prompt that fills the context leaves no room for output: 400, as vLLM answers it.
            r = await client.post("/v1/completions", json={"model": "sim-model", "prompt": prompt(16000),
                                                           "max_tokens": 1}, headers=hdr("realtime"))
            assert r.status_code == 400 and r.headers["x-llm-d-request-dropped-reason"] == "rejected-context-length"
            message = r.json()["error"]["message"]
            assert "maximum context length is 16000 tokens" in message and "16000 input tokens" in message
            # An explicit limit over the context is vLLM's 400 too, answered by the gateway: the proxy tells flow
            # control which field the limit came from (a default limit is clamped instead).
            r = await client.post("/v1/completions", json={"model": "sim-model", "prompt": prompt(100),
                                                           "max_tokens": 16001}, headers=hdr("realtime"))
            assert r.status_code == 400 and r.headers["x-llm-d-request-dropped-reason"] == "rejected-context-length"
            assert "max_tokens=16001" in r.json()["error"]["message"]
            r = await client.post("/v1/completions", json={"model": "sim-model", "prompt": prompt(400),
                                                           "max_tokens": 101}, headers=hdr("realtime", "short"))
            assert r.status_code == 400 and "maxContextTokens of tenant 'short': limit 500" in r.json()["error"]["message"]
            assert sim_state(sim)["running"] == 0 and gw.state()["kv"]["tokenizer_fallbacks"] == 0

    asyncio.run(main())


def test_an_estimated_prompt_over_the_context_goes_to_the_replica_which_decides(stack):
    [sim] = stack.sim(1, "--num-blocks", "2000", *SIM_ARGS[2:])  # "a a a": 17,999 by characters, 9,000 counted
    gw = stack.gateway([sim], AUTO + "  tokenizer: estimate\n  charsPerToken: 1\n")

    async def main():
        async with httpx.AsyncClient(base_url=gw.url, timeout=60) as client:
            await wait_until(lambda: kv(gw, sim)["total_blocks"] == 2000)
            r = await client.post("/v1/completions", json={"model": "sim-model", "prompt": prompt(9000),
                                                           "max_tokens": 4}, headers=hdr("realtime"))
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens"] == 9000 and gw.state()["kv"]["tokenizer_fallbacks"] >= 1

    asyncio.run(main())


QUOTAS = BASE.replace("tenantMaxShare: 1.0", "tenantMaxShare: 0.3").replace("tenantSoftShare: 1.0",
                                                                               "tenantSoftShare: 0.2") + """
  tokenSecondsWindowSeconds: 60
  tenants:
    seqs: {maxActiveSequences: 1}
    toks: {maxReservedTokens: 2000}
    ts: {maxTokenSeconds: 3000}
  classes:
    batch: {maxActiveSequences: 1}
"""


def test_each_quota_rejects_naming_its_limit_and_usage(stack):
    [sim] = stack.sim(1, *SIM_ARGS)
    gw = stack.gateway([sim], QUOTAS)

    async def refused(client, body, headers, *words):
        r = await client.post("/v1/completions", json=body, headers=headers)
        assert r.status_code == 429, r.text
        assert r.headers["x-llm-d-request-dropped-reason"] == "rejected-quota"
        message = r.json()["error"]["message"]
        for word in words:
            assert word in message, message

    async def main():
        async with httpx.AsyncClient(base_url=gw.url, timeout=60) as client:
            await wait_until(lambda: kv(gw, sim)["total_blocks"] == 1000)
            # hard share: 0.3 of 1000 blocks
            big = Held(client, blocks_body(250, 3000), hdr("realtime", "big"))
            await wait_until(lambda: gw.state()["kv"]["tenants"].get("big", {}).get("reserved_kv_tokens") == 4000)
            assert gw.state()["kv"]["tenants"]["big"]["share"] == 0.25
            await refused(client, blocks_body(60, 100, False), hdr("realtime", "big"), "tenantMaxShare",
                          "0.30", "4000 KV tokens reserved + 960 asked")
            # active sequences
            one = Held(client, blocks_body(70, 1000), hdr("realtime", "seqs"))
            await wait_until(lambda: gw.state()["kv"]["tenants"].get("seqs", {}).get("active_sequences") == 1)
            await refused(client, blocks_body(2, 10, False), hdr("realtime", "seqs"), "maxActiveSequences",
                          "limit 1 sequences", "1 active")
            # reserved tokens
            toks = Held(client, blocks_body(100, 1000), hdr("realtime", "toks"))
            await wait_until(lambda: gw.state()["kv"]["tenants"].get("toks", {}).get("reserved_tokens") == 1600)
            await refused(client, blocks_body(30, 100, False), hdr("realtime", "toks"), "maxReservedTokens",
                          "limit 2000 tokens", "1600 reserved + 480 asked")
            # per traffic class: batch may run one sequence, whoever sends it
            b1 = Held(client, blocks_body(70, 1000), hdr("batch", "x"))
            await wait_until(lambda: gw.state()["kv"]["classes"].get("batch", {}).get("active_sequences") == 1)
            await refused(client, blocks_body(2, 10, False), hdr("batch", "y"), "class 'batch'",
                          "maxActiveSequences")
            # token-seconds: 1600 tokens held for 2 s pass 3000
            ts = Held(client, blocks_body(100, 400), hdr("realtime", "ts"))
            await wait_until(lambda: gw.state()["kv"]["tenants"].get("ts", {}).get("token_seconds", 0) > 3000)
            await refused(client, blocks_body(2, 10, False), hdr("realtime", "ts"), "maxTokenSeconds",
                          "3000 token-seconds per 60 s")
            for held in (big, one, toks, b1, ts):
                await wait_until(lambda: held.status is not None)
                assert held.status == 200
                await held.close()
            await wait_until(lambda: kv(gw, sim)["reserved_blocks"] == 0)
            assert gw.state()["kv"]["rejected_tokens"]["rejected-quota"] > 0

    asyncio.run(main())


def test_soft_quota_waits_only_under_pressure(stack):
    [sim] = stack.sim(1, *SIM_ARGS)
    gw = stack.gateway([sim], QUOTAS)

    async def main():
        async with httpx.AsyncClient(base_url=gw.url, timeout=60) as client:
            await wait_until(lambda: kv(gw, sim)["total_blocks"] == 1000)
            soft = Held(client, blocks_body(250, 3000), hdr("realtime", "soft"))   # 0.25: over its soft 0.2
            await wait_until(lambda: kv(gw, sim)["reserved_blocks"] == 250)
            more = Held(client, blocks_body(30, 400), hdr("standard", "soft"))  # pool calm: runs anyway
            await wait_until(lambda: kv(gw, sim)["reserved_blocks"] == 280)
            fill = [Held(client, blocks_body(270, 3000), hdr("realtime", f"fill{i}")) for i in range(2)]
            await wait_until(lambda: kv(gw, sim)["reserved_blocks"] == 820)
            # 840 > 820 for a tenant over its soft share (0.30 after it: still within the hard 0.30)
            late = Held(client, blocks_body(20, 300), hdr("standard", "soft"))
            await wait_until(lambda: gw.band(0)["queued"] == 1)
            calm = Held(client, blocks_body(20, 300), hdr("realtime", "calm"))  # a calm tenant still runs
            await wait_until(lambda: gw.state()["kv"]["tenants"].get("calm", {}).get("reserved_kv_tokens") == 320)
            assert gw.band(0)["queued"] == 1
            await fill[0].close()
            await wait_until(lambda: gw.band(0)["queued"] == 0)
            for held in (soft, more, fill[1], late, calm):
                await wait_until(lambda: held.status is not None)
                assert held.status == 200
                await held.close()

    asyncio.run(main())


def test_calibration_profile_mismatch_refuses_the_replica(stack, tmp_path):
    [sim] = stack.sim(1, *SIM_ARGS)
    good = tmp_path / "profile.json"
    out = forkserver.run([sys.executable, "-m", "holdback.cli", "gateway", "calibrate", "--replica", sim,
                          "--gpu", "H100-80GB", "--out", str(good)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    profile = json.loads(good.read_text())
    assert (profile["model"], profile["num_gpu_blocks"], profile["block_size"], profile["gpu_sku"]) == (
        "sim-model", 1000, 16, "H100-80GB")
    # The probe: the simulator holds what the tokens need, give or take the blocks of tokens streamed meanwhile.
    assert 1.0 <= profile["safety_factor"] <= 1.3, profile
    stale = tmp_path / "stale.json"
    stale.write_text(json.dumps({**profile, "runtime_version": "vllm-0.4.0"}))
    gw = stack.gateway([sim], BASE + f"  calibrationProfile: {stale}\n")
    refused = httpx.post(gw.url + "/v1/completions", json=blocks_body(2, 10, False), timeout=30)
    assert refused.status_code == 503
    replica = next(r for r in gw.state()["replicas"] if r["url"] == sim)
    assert "runtime 'model_sim' differs from the profile's 'vllm-0.4.0'" in replica["refused"]
    assert '"event":"calibration_refused"' in gw.log()
    # A profile measured on this replica is accepted (reload it in place).
    gw.config_path.write_text(BASE + f"  calibrationProfile: {good}\n")
    gw.reload()

    def served():
        return httpx.post(gw.url + "/v1/completions", json=blocks_body(2, 10, False), timeout=30).status_code == 200
    asyncio.run(wait_until(served))


def test_rollback_returns_to_the_previous_digest_keeping_the_lower_watermark(stack):
    [sim] = stack.sim(1, *SIM_ARGS)
    keys = "adminKeys: [{key: admin-k}]\nkeys: [{key: rt-k, tenant: rt}]\n"
    first = keys + BASE.replace("queueDeadlineMs: 30000", "queueDeadlineMs: 30000\n  admissionWatermark: 0.85")
    gw = stack.gateway([sim], first)
    admin = {"Authorization": "Bearer admin-k"}

    def state():
        return httpx.get(gw.url + "/admin/state", headers=admin).json()
    first_digest = state()["config"]["digest"]
    gw.config_path.write_text(keys + BASE.replace("queueDeadlineMs: 30000", "queueDeadlineMs: 1234\n"
                                                  "  admissionWatermark: 0.8"))
    gw.reload()
    asyncio.run(wait_until(lambda: state()["config"]["digest"] != first_digest))
    second_digest = state()["config"]["digest"]
    assert httpx.post(gw.url + "/admin/rollback").status_code == 401
    assert httpx.post(gw.url + "/admin/rollback", headers={"Authorization": "Bearer rt-k"}).status_code == 403
    out = forkserver.run([sys.executable, "-m", "holdback.cli", "gateway", "rollback", "--url", gw.url,
                          "--key", "admin-k"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    answer = json.loads(out.stdout)
    assert (answer["from_digest"], answer["to_digest"], answer["admissionWatermark"]) == (
        second_digest, first_digest, 0.8)
    s = state()
    assert s["admission"]["queueDeadlineMs"] == 30000 and s["admission"]["admissionWatermark"] == 0.8
    assert s["kv"]["enabled"] and [h["digest"] for h in s["config"]["history"]][:2] == [first_digest, second_digest]
    assert '"event":"config_rolled_back"' in gw.log() and first_digest in gw.log()
    bad = httpx.post(gw.url + "/admin/rollback", headers=admin, json={"admissionWatermark": 2})
    assert bad.status_code == 400 and "admissionWatermark" in bad.json()["error"]["message"]


@pytest.mark.parametrize("authorization", ["Basic dXNlcjpwYXNz", "Bearer", "Token rt-k"])
def test_malformed_authorization_is_401_when_keys_are_configured(stack, authorization):
    [sim] = stack.sim(1, *SIM_ARGS)
    gw = stack.gateway([sim], "keys: [{key: rt-k, tenant: rt}]\n")
    r = httpx.post(gw.url + "/v1/completions", json=blocks_body(2, 5, False),
                   headers={"Authorization": authorization}, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] in ("invalid_authorization", "missing_api_key")


def test_admin_routes_need_an_admin_key_and_anonymous_callers_get_batch_only(stack):
    [sim] = stack.sim(1, *SIM_ARGS)
    from gateway.settings import DEFAULT_CONFIG_PATH
    gw = stack.gateway([sim], DEFAULT_CONFIG_PATH.read_text(),
                       env={"HOLDBACK_ADMIN_KEY": "adm", "HOLDBACK_GATEWAY_REALTIME_KEY": "rt"})
    assert httpx.get(gw.url + "/admin/state").status_code == 401
    assert httpx.get(gw.url + "/admin/state", headers={"Authorization": "Bearer rt"}).status_code == 403
    assert httpx.get(gw.url + "/admin/state", headers={"Authorization": "Bearer adm"}).status_code == 200
    anon_rt = httpx.post(gw.url + "/v1/completions", json=blocks_body(2, 5, False), headers=hdr("realtime"), timeout=10)
    assert anon_rt.status_code == 403
    anon = httpx.post(gw.url + "/v1/completions", json=blocks_body(2, 5, False), timeout=30)
    assert anon.status_code == 200  # served, as batch
    metrics = httpx.get(gw.url + "/metrics").text
    assert 'holdback_gateway_dispatches_total{band="-10",path="inline",pool="default"} 1.0' in metrics


def test_simulator_faults_need_its_admin_key_when_one_is_set(stack):
    [sim] = stack.sim(1, "--admin-key", "sim-adm")
    assert httpx.get(sim + "/admin/faults").status_code == 401
    assert httpx.post(sim + "/admin/faults", json={"rate_503": 1.0}).status_code == 401
    wrong = {"Authorization": "Bearer wrong"}
    assert httpx.post(sim + "/admin/faults", json={"rate_503": 0.0}, headers=wrong).status_code == 401
    ok = httpx.post(sim + "/admin/faults", json={"rate_503": 0.0}, headers={"Authorization": "Bearer sim-adm"})
    assert ok.status_code == 200


def test_a_replica_whose_real_pool_leaves_no_growth_room_is_reported(stack):
    # The config passes its load-time check against the configured pool (52 GiB); this replica has 200 blocks:
    # 8 % of 200 = 16 blocks above the hard watermark, less than 48 sequences x 1 block.
    [sim] = stack.sim(1, "--num-blocks", "200")
    gw = stack.gateway([sim], "saturation: {maxConcurrency: 48}\n")
    asyncio.run(wait_until(lambda: '"event":"kv_growth_room_short"' in gw.log()))
    assert '"pool_blocks":200' in gw.log() and '"room_blocks":16' in gw.log()
